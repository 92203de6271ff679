"""``python -m sidecar``: the CLI (``checkpoint-sidecar``)."""

from sidecar.cli.main import main

# Guarded: a worker process (the snapshot cut's) loads the parent's main module again under
# another name, and must not run the CLI.
if __name__ == "__main__":
    raise SystemExit(main())
