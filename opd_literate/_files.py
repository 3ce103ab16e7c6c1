"""Files written whole: a new file beside the target, renamed over it.

The one home of atomic replacement, shared by the infrastructure that writes files others read
while it runs: the experiment's teacher cache and records, and the grader's reports (``grade
--json``, Gradescope's ``results.json``). Standard library only.
"""

from __future__ import annotations

import os
import uuid

__all__ = ["replace_atomically"]


def replace_atomically(path, write):
    """Call ``write(tmp)`` for a new file ``tmp`` beside ``path``, then rename it over ``path``.

    The rename is atomic within a folder: a reader sees the old file or the new one, never
    half of one, and an interrupted write leaves no partial ``path``. A symbolic link at
    ``path`` is replaced by the file, not followed.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
