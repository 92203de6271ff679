"""The JVM listener's sender without Spark, as a child process the tests speak to line by
line (``tests/jvm/SenderHarness.java``): the conformance tests and the runtime tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import spark_bridge
from spark_bridge.handle import SenderStats
from tests.services import REPO_ROOT, TEST_JVM_OPTIONS


def compile_harness(out: Path) -> str:
    """Compile the harness against the listener jar into ``out``; the class path to run it
    (the jar, the harness, slf4j-api from pyspark's jars: no Spark)."""
    import pyspark

    jar = spark_bridge.listener_jar()
    jars = Path(pyspark.__file__).parent / "jars"
    slf4j = next(jars.glob("slf4j-api-*.jar"))
    subprocess.run(
        [
            "javac",
            "--release",
            "8",
            "-Xlint:-options",
            "-cp",
            f"{jar}:{slf4j}",
            "-d",
            str(out),
            str(REPO_ROOT / "tests" / "jvm" / "SenderHarness.java"),
        ],
        check=True,
    )
    return f"{jar}:{out}:{slf4j}"


class JavaClient:
    """The JVM sender in a child JVM (no Spark), one command per line."""

    def __init__(
        self, classpath: str, settings: dict[str, str], log_path: Path, java: str = "java"
    ) -> None:
        """``java``: the JVM to run it on (default: the one on PATH)."""
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [
                java,
                *TEST_JVM_OPTIONS,
                "-cp",
                classpath,
                "io.checkpointsidecar.SenderHarness",
                *(f"{k}={v}" for k, v in settings.items()),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )

    def call(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise AssertionError(f"the harness exited with {self.proc.wait(5)}")
        return answer.strip()

    def offer(self, query_id: str, data: bytes) -> None:
        assert self.call(f"offer {query_id} {data.decode()}") == "ok"

    def flush(self, timeout_s: float) -> bool:
        return self.call(f"flush {int(timeout_s * 1000)}") == "true"

    def stats(self) -> SenderStats:
        return SenderStats.from_mapping(json.loads(self.call("stats")))

    def close(self, timeout_s: float) -> bool:
        try:
            if self.proc.poll() is not None:
                return False
            done = self.call(f"close {int(timeout_s * 1000)}") == "true"
            self.proc.wait(10)
            return done
        finally:
            self.release()

    def release(self) -> None:
        """Kill the JVM if still running and close the pipes and the log."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()
