"""``python -m gateway``: the command line of ``gateway.process.main``."""

import sys

from gateway.process.main import main

sys.exit(main())
