"""``python -m opd_literate.experiment``: the experiment's command line."""

import sys

from .cli import main

if __name__ == "__main__":  # the spawned workers import this module too: run only as a script
    sys.exit(main())
