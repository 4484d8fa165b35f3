"""`python -m simengine [OPTIONS]`: the simulated engine's own entry (the engine pool starts it so, without the
gateway's command line); the same options as `kvgate sim-engine`."""

import sys

from simengine.cli import main

sys.exit(main(sys.argv[1:]))
