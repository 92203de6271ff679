"""`make run`: the daemon with a throw-away local redis-server and Azurite, in the foreground.

Starts redis-server and Azurite on free ports in temp dirs, runs `checkpoint-sidecar run`
against them (socket at $SIDECAR_SOCKET_PATH or /tmp/checkpoint-sidecar.sock, admin endpoint
on $SIDECAR_METRICS_PORT or 9400; other SIDECAR_* variables pass through), says when it is
ready (GET /readyz answers 200), and stops everything on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: in no installed package
from tests.services import Azurite, DaemonProcess, RedisServer, ServiceError


def main() -> int:
    with RedisServer() as redis, Azurite() as azurite:
        settings = {k: v for k, v in os.environ.items() if k.startswith("SIDECAR_")}
        settings.setdefault("SIDECAR_NAMESPACE", "local")
        settings.setdefault("SIDECAR_METRICS_PORT", "9400")
        settings["SIDECAR_REDIS_URL"] = redis.url
        settings["AZURE_STORAGE_CONNECTION_STRING"] = azurite.connection_string
        print(f"[run] redis-server on {redis.url} (data in {redis.dir})", flush=True)
        print(
            f"[run] Azurite blob service on {azurite.blob_endpoint} (data in {azurite.dir})",
            flush=True,
        )
        daemon = DaemonProcess(settings)  # its log goes to this terminal
        stopping: list[int] = []

        def forward(sig: int, _frame: FrameType | None) -> None:
            # The daemon runs in its own session, so a Ctrl-C reaches it only from here:
            # once per press (a second one forces its exit).
            stopping.append(sig)
            daemon.signal(sig)

        daemon.start(wait=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, forward)
        try:
            daemon.wait_ready()
        except ServiceError as exc:
            if not stopping:
                print(f"[run] {exc}", file=sys.stderr, flush=True)
        else:
            print(f"[run] ready: {daemon.admin_url}/readyz answers 200", flush=True)
            print(
                f'[run] try: printf \'{{"op":"ping","id":1}}\\n\' | nc -U {daemon.socket_path}',
                flush=True,
            )
        code = daemon.wait(None)
        print(f"[run] daemon exited with {code}; stopping redis-server and Azurite", flush=True)
        return code


if __name__ == "__main__":
    raise SystemExit(main())
