from shardcheck.cli import main

raise SystemExit(main())
