from sidecar.cli import main

raise SystemExit(main())
