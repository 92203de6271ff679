"""The command line: ``checkpoint-sidecar`` (``main``: parsing, logging, signals, exit codes;
``commands``: the commands that need the daemon's dependencies, imported when used).

May import: anything of the sidecar, and ``spark_bridge`` (``listener-jar``). ``main`` imports
only the base install's modules at import time, so a Spark driver without the ``daemon``
extra still runs ``checkpoint-sidecar listener-jar``.
"""
