from fp8conf.tools.pipeline_check import main

raise SystemExit(main())
