"""``python3 -m spark_bridge listener-jar``: the bundled listener jar's path, for ``spark-submit
--jars`` (the daemon's CLI has the same command; this one needs only this package)."""

from __future__ import annotations

import sys

from spark_bridge.handle import BridgeError
from spark_bridge.jvm import listener_jar

USAGE = "usage: python3 -m spark_bridge listener-jar"


def main(argv: list[str]) -> int:
    if argv != ["listener-jar"]:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        print(listener_jar())
    except BridgeError as exc:
        print(f"spark_bridge: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
