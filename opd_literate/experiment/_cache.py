"""The teacher cache's file handling: verified loads, atomic writes, a lock for concurrent runs.

Private: [opd_literate.experiment.run.train_teacher][] says what is cached and when; this module
only makes the file safe to share. ``OPD_LITERATE_CACHE`` names the folder (by default
``~/.cache/opd_literate``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys

import filelock
import torch

from .._files import replace_atomically


def cache_dir():
    return pathlib.Path(os.environ.get("OPD_LITERATE_CACHE",
                                       pathlib.Path.home() / ".cache" / "opd_literate"))


def cache_key(settings):
    """A short hex digest of a dictionary of settings (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def state_digest(state):
    """SHA-256 of a state dict's names, shapes, dtypes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def load_verified(path, model):
    """Load ``path`` into ``model``; return None, or why the file is unusable (one line)."""
    try:
        saved = torch.load(path, weights_only=True)
        if not isinstance(saved, dict) or set(saved) != {"state_dict", "sha256"}:
            return "not a teacher cache file of this version"
        if state_digest(saved["state_dict"]) != saved["sha256"]:
            return "checksum mismatch"
        model.load_state_dict(saved["state_dict"])
    except Exception as error:  # a truncated or foreign file fails in many ways; all mean rebuild
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return None


def load_or_train(path, cache, empty, train):
    """``(model, loaded_from_cache)``: the model cached at ``path``, or ``train()``'s, cached.

    ``cache`` is ``"read"`` (load a valid file, else train and write it), ``"refresh"`` (train
    and write) or ``"off"`` (train, touch no file); the caller has checked it. ``empty()`` makes
    the model a cached state is loaded into. A file that does not load or does not match its
    checksum is reported in one line on stderr and rebuilt. The lock beside the file lets
    concurrent runs share it: the first trains and writes, the others wait and then load.
    """
    if cache == "off":
        return train(), False
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{path}.lock"):
        if cache == "read" and path.exists():
            cached = empty()
            problem = load_verified(path, cached)
            if problem is None:
                return cached.eval(), True
            print(f"opd-experiment: warning: teacher cache {path} is unusable ({problem}); "
                  "retraining the teacher and rewriting it", file=sys.stderr)
        model = train()
        state = model.state_dict()
        replace_atomically(path, lambda tmp: torch.save(
            {"state_dict": state, "sha256": state_digest(state)}, tmp))
    return model, False
