from moechat.app.cli import main

raise SystemExit(main())
