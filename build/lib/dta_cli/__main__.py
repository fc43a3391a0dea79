import sys

from dta_cli.main import main

sys.exit(main())
