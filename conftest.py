"""Shared pytest set-up for the tests and the doctests of ``opd_literate``.

Fixing the print options here keeps doctest output stable across numpy and torch versions:
the doctests show values a reader can check, so their reprs must not drift.
"""

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _stable_numerics(doctest_namespace):
    np.set_printoptions(precision=4, suppress=True, legacy=False)
    torch.set_printoptions(precision=4, sci_mode=False)
    # The doctests seed their own draws; this only guards against a forgotten seed.
    torch.manual_seed(0)
    doctest_namespace["np"] = np
    doctest_namespace["torch"] = torch
    yield
