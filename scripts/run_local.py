"""`make run`: the daemon with a throw-away local redis-server and Azurite, in the foreground.

Starts redis-server and Azurite on free ports in temp dirs, runs `checkpoint-sidecar run`
against them (socket at $SIDECAR_SOCKET_PATH or /tmp/checkpoint-sidecar.sock, metrics on
$SIDECAR_METRICS_PORT or 9400), and stops everything on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from sidecar.devservices import Azurite, RedisServer


def main() -> int:
    with RedisServer() as redis, Azurite() as azurite:
        env = {
            **os.environ,
            "SIDECAR_REDIS_URL": redis.url,
            "AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string,
        }
        env.setdefault("SIDECAR_NAMESPACE", "local")
        socket_path = env.get("SIDECAR_SOCKET_PATH", "/tmp/checkpoint-sidecar.sock")
        print(f"[run] redis-server on {redis.url} (data in {redis.dir})", flush=True)
        print(
            f"[run] Azurite blob service on {azurite.blob_endpoint} (data in {azurite.dir})",
            flush=True,
        )
        print(f'[run] try: printf \'{{"op":"ping","id":1}}\\n\' | nc -U {socket_path}', flush=True)
        daemon = subprocess.Popen([sys.executable, "-m", "sidecar", "run"], env=env)
        # Forward stop signals to the daemon; it stops gracefully and exits 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: daemon.send_signal(s))
        code = daemon.wait()
        print(f"[run] daemon exited with {code}; stopping redis-server and Azurite", flush=True)
        return code


if __name__ == "__main__":
    raise SystemExit(main())
