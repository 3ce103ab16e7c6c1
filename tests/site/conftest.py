"""The site's tests import the MkDocs hooks (``docs/hooks/*.py``) as MkDocs does: from their
folder on ``sys.path`` (they are modules of the docs build, not of the package)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "docs" / "hooks"))
