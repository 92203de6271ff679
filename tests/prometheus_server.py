"""A real Prometheus server for the tests: Debian's binary, a temp dir, a free port.

Never the Debian package's system service: this one scrapes what the test names, every second,
loads the rule files the test names, and answers PromQL over its HTTP API.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.services import _NO_PROXY, ServiceError, _Process


def prometheus_binary(name: str) -> str:
    """``promtool`` or ``prometheus``: from ``PROMTOOL_BIN`` / ``PROMETHEUS_BIN``, else PATH or
    /usr/bin (Debian's `prometheus` package, which `make setup` installs)."""
    found = (
        os.environ.get(f"{name.upper()}_BIN")
        or shutil.which(name)
        or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    )
    if not found:
        raise ServiceError(
            f"{name} not found: run `make setup` (installs Debian's prometheus package) or set "
            f"{name.upper()}_BIN"
        )
    return found


class PrometheusServer(_Process):
    """Prometheus scraping ``targets`` (``host:port``, job ``job``, with ``labels`` as target
    labels) every ``interval_s``, evaluating ``rule_files`` as often."""

    name = "prometheus"

    def __init__(
        self,
        targets: Sequence[str],
        *,
        job: str = "checkpoint-sidecar",
        labels: Mapping[str, str] | None = None,
        rule_files: Sequence[Path] = (),
        interval_s: float = 1.0,
    ) -> None:
        self.binary = prometheus_binary("prometheus")
        super().__init__()
        every = f"{round(interval_s * 1000)}ms"
        config = {
            "global": {"scrape_interval": every, "evaluation_interval": every},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [{"targets": list(targets), "labels": dict(labels or {})}],
                }
            ],
        }
        # JSON is YAML: no YAML writer needed.
        (self.dir / "prometheus.yml").write_text(json.dumps(config, indent=2))

    def _command(self) -> list[str]:
        return [
            self.binary,
            f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]

    def start(self) -> None:
        """Start and wait until ``/-/ready`` answers 200 (the port opens before the TSDB and
        the rules are loaded)."""
        super().start()
        deadline = time.monotonic() + 30
        while True:
            try:
                with _NO_PROXY.open(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if not self.running or time.monotonic() > deadline:
                raise ServiceError(f"prometheus is not ready; see {self.log_path}")
            time.sleep(0.05)

    def api(self, path: str, **params: str) -> dict[str, Any]:
        """GET ``/api/v1/<path>``: the decoded answer, also for an error status (the API
        answers errors, e.g. a PromQL parse error, as JSON with ``status: error``)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with _NO_PROXY.open(url, timeout=10) as resp:
                answer: dict[str, Any] = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            answer = json.loads(err.read())
        return answer

    def query(self, expr: str) -> dict[str, Any]:
        """An instant query: ``{"status": ..., "data": {"resultType": ..., "result": [...]}}``
        or ``{"status": "error", "error": ...}``."""
        return self.api("query", query=expr)

    def series(self, selector: str) -> list[dict[str, str]]:
        """The label sets of the series ``selector`` matches over the last 5 minutes."""
        answer = self.api("series", **{"match[]": selector})
        assert answer["status"] == "success", f"{selector}: {answer.get('error')}"
        result: list[dict[str, str]] = answer["data"]
        return result
