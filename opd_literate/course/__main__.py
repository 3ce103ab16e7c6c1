"""``python -m opd_literate.course``: write lab handouts, or grade them.

``python -m`` puts the current folder first on ``sys.path``; graded from inside a student's
folder (or a folder of submissions), a ``numpy.py`` or ``json.py`` there would be imported by
the grader itself. The folder is dropped before anything else is imported, as ``python -P``
(3.11) does. (A folder named ``opd_literate`` there would still be this package: the console
script ``opd-handout``, whose ``sys.path`` starts at its own folder, has no such exposure.)
"""

import os
import sys

if not sys.flags.safe_path:
    _here = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", _here)]

from .cli import main  # noqa: E402 (after the path is safe)

if __name__ == "__main__":
    sys.exit(main())
