from stepdoctor.cli import main

raise SystemExit(main())
