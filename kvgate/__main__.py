"""`python -m kvgate COMMAND ...`: as the installed `kvgate` script."""

import sys

from kvgate.cli import main

sys.exit(main())
