"""Shared pytest set-up for the tests and the doctests of ``opd_literate``.

It also registers the Hypothesis profiles (below).

Fixing the print options here keeps doctest output stable across numpy and torch versions:
the doctests show values a reader can check, so their reprs must not drift.
"""

import os

import numpy as np
import pytest
from hypothesis import settings

# pytest-xdist runs one worker process a core: one intra-op thread each, so that the workers do
# not fight over the same cores (on 2 cores the fast tier took 50 s with torch's default of a
# thread a core, 44 s like this). The suite passes with either (README, "What repeats exactly").
# torch is imported where tests run (the workers), not in pytest-xdist's controller, which only
# hands out files: importing it there delayed the workers' start by about 2 s.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)

# pytest.approx is given Python floats, numbers or numpy arrays, never torch tensors: how approx
# treats an object it does not know is pytest's internal business (pytest 9.2 iterates over the
# expected value, and a 0-d tensor cannot be iterated). This guard makes such a test fail on every
# pytest release, with the fix in its message, not only on the newest one.
_pytest_approx = pytest.approx


def _approx_of_plain_values(expected, *args, **kwargs):
    def is_tensor(value):
        return type(value).__module__.split(".", 1)[0] == "torch"

    values = expected.values() if isinstance(expected, dict) else (
        expected if isinstance(expected, (list, tuple)) else [expected])
    if any(is_tensor(v) for v in values):
        raise TypeError("pytest.approx was given a torch tensor: pass float(tensor) or "
                        "tensor.tolist(), or compare tensors with torch.testing.assert_close")
    return _pytest_approx(expected, *args, **kwargs)


pytest.approx = _approx_of_plain_values

# Hypothesis profiles for the property tests that take their example count from the profile
# (marker `properties`, tests/opd/test_properties.py): "fast" for the normal suite, "ci" for the
# separate CI run `pytest -m properties --hypothesis-profile=ci` (1,000 examples a property).
# derandomize: the same examples on every run, so a failure reproduces; no example database.
settings.register_profile("fast", max_examples=25, deadline=None, derandomize=True, database=None)
settings.register_profile("ci", max_examples=1000, deadline=None, derandomize=True, database=None)
settings.load_profile("fast")  # --hypothesis-profile=ci, if given, is loaded after this


@pytest.fixture(autouse=True)
def _stable_numerics(doctest_namespace):
    import torch

    np.set_printoptions(precision=4, suppress=True, legacy=False)
    torch.set_printoptions(precision=4, sci_mode=False)
    # The doctests seed their own draws; this only guards against a forgotten seed.
    torch.manual_seed(0)
    doctest_namespace["np"] = np
    doctest_namespace["torch"] = torch
    yield


# The two longest test files of the fast tier (on 2 cores: the one-chapter site build and the
# browser, about 14 s; the snippets, 9 s) go first, so that pytest-xdist, which hands out the
# files in collection order (--dist loadfile --no-loadscope-reorder, in pyproject.toml), starts
# them on different workers and fills both with the rest after. Only the order changes.
_LONG_FIRST = ("tests/site/test_site.py", "tests/course/test_lift.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return _LONG_FIRST.index(path) if path in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: the order within each file is kept
