"""`make run`: the daemon with a throw-away local redis-server, in the foreground.

Starts redis-server on a free port in a temp dir, runs `checkpoint-sidecar run` against it
(socket at $SIDECAR_SOCKET_PATH or /tmp/checkpoint-sidecar.sock, metrics on
$SIDECAR_METRICS_PORT or 9400), and stops both on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from sidecar.devservices import RedisServer


def main() -> int:
    with RedisServer() as redis:
        env = {**os.environ, "SIDECAR_REDIS_URL": redis.url}
        env.setdefault("SIDECAR_NAMESPACE", "local")
        print(f"[run] redis-server on {redis.url} (data in {redis.dir})", flush=True)
        print(
            f'[run] try: printf \'{{"op":"ping","id":1}}\\n\' | '
            f"nc -U {env.get('SIDECAR_SOCKET_PATH', '/tmp/checkpoint-sidecar.sock')}",
            flush=True,
        )
        daemon = subprocess.Popen([sys.executable, "-m", "sidecar", "run"], env=env)
        # Forward stop signals to the daemon; it stops gracefully and exits 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: daemon.send_signal(s))
        code = daemon.wait()
        print(f"[run] daemon exited with {code}; stopping redis-server", flush=True)
        return code


if __name__ == "__main__":
    raise SystemExit(main())
