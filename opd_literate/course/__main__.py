"""``python -m opd_literate.course``: write lab handouts, or grade them."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
