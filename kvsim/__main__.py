from kvsim.cli.main import main

raise SystemExit(main())
