"""`python -m corral.supervisor.ctl`: the `corral` command (supervisor/ctl/__init__.py)."""

import sys

from corral.supervisor.ctl import main

sys.exit(main())
