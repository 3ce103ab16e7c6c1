"""The teacher cache (``opd_literate.experiment._cache``): atomic, verified, locked.
"""

import pathlib

import pytest
import torch

from opd_literate.experiment import run
from opd_literate.experiment import tinylm as lm
from tests.experiment._tiny import TINY


# ---------------------------------------------------------------------------------------------
# The teacher cache: atomic, verified, locked
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def data():
    train_pairs, _ = run._split(TINY)
    return train_pairs, lm.answer_tokens(train_pairs)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                   b.state_dict().values()))


def _leftovers(folder):
    """Files in the cache folder other than the cache files and their locks."""
    return [p.name for p in folder.iterdir() if not p.name.endswith((".pt", ".pt.lock"))]


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_a_damaged_cache_file_is_reported_in_one_line_and_rebuilt(cache, data, capsys, damage):
    first, loaded = run.train_teacher(TINY, *data)
    assert not loaded
    path = run.teacher_cache_path(TINY)
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":  # the same length, one byte of the weights changed
        flipped = bytearray(blob)
        flipped[len(blob) - 600] ^= 0x40
        path.write_bytes(bytes(flipped))
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint")
    else:
        path.write_bytes(b"")
    capsys.readouterr()
    second, loaded = run.train_teacher(TINY, *data)
    err = capsys.readouterr().err
    assert not loaded and err.count("\n") == 1
    assert err.startswith(f"opd-experiment: warning: teacher cache {path} is unusable (")
    assert _same_weights(first, second)  # retrained to the same weights...
    third, loaded = run.train_teacher(TINY, *data)  # ...and the file is whole again
    assert loaded and capsys.readouterr().err == "" and _same_weights(first, third)
    assert _leftovers(cache) == []


def test_refresh_rewrites_a_corrupt_cache_without_reading_it(cache, data, capsys):
    path = run.teacher_cache_path(TINY)
    cache.mkdir()
    path.write_bytes(b"corrupt")
    _, loaded = run.train_teacher(TINY, *data, cache="refresh")
    assert not loaded and capsys.readouterr().err == ""
    _, loaded = run.train_teacher(TINY, *data)
    assert loaded and capsys.readouterr().err == ""


def test_cache_off_touches_no_file(cache, data):
    _, loaded = run.train_teacher(TINY, *data, cache="off")
    assert not loaded and not cache.exists()
    with pytest.raises(ValueError, match="cache must be one of read, refresh, off"):
        run.train_teacher(TINY, *data, cache=False)


def test_an_interrupted_write_leaves_neither_a_partial_cache_nor_a_temporary(cache, data,
                                                                             monkeypatch):
    def save_half_then_stop(obj, path):
        pathlib.Path(path).write_bytes(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", save_half_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run.train_teacher(TINY, *data)
    assert not run.teacher_cache_path(TINY).exists() and _leftovers(cache) == []


def test_two_concurrent_runs_train_the_teacher_once(cache, data, monkeypatch):
    """Two threads ask for the same teacher at once: the lock lets one train while the other
    waits, then loads the file. Without it both would find no file and both would train."""
    import threading
    import time

    real_supervised, trainings = run._supervised, []

    def slow_supervised(*args, **kwargs):
        trainings.append(threading.get_ident())
        time.sleep(0.3)  # long enough for the other thread to reach the cache
        return real_supervised(*args, **kwargs)

    monkeypatch.setattr(run, "_supervised", slow_supervised)
    start, outcomes = threading.Barrier(2), []

    def worker():
        start.wait()
        outcomes.append(run.train_teacher(TINY, *data))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(trainings) == 1
    assert sorted(loaded for _, loaded in outcomes) == [False, True]
    assert _same_weights(outcomes[0][0], outcomes[1][0])
    assert _leftovers(cache) == []
