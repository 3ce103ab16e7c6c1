"""What must hold on every CPU: no doctest states a float to more digits than rounding allows.

numpy and torch choose their elementwise and reduction kernels for the CPU at run time (AVX-512,
AVX2, a baseline), and the thread count changes the order of sums, so the last bits of a float
differ between machines. doctest's NUMBER option compares a float to the precision it is
written with: a value stated to 6 significant digits moves only if it lies within about 1e-16
of a rounding boundary. A doctest that printed 15 digits would hold on one machine only.
"""

import doctest
import importlib
import pathlib
import re

import pytest

import opd_literate

PACKAGE = pathlib.Path(opd_literate.__file__).parent
MAX_DIGITS = 6
"""The most significant digits a doctest may state for a float."""

FLOAT = re.compile(r"(?<![\w.])-?(\d+\.\d+)(?:e[-+]?\d+)?")


def significant_digits(literal: str) -> int:
    """Significant digits of a decimal literal: ``0.0390625`` has 6, ``12.50`` has 4."""
    return len(literal.replace(".", "").lstrip("0"))


def _modules():
    return sorted(".".join(("opd_literate",) + p.relative_to(PACKAGE).with_suffix("").parts)
                  for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__"))


def test_significant_digits_counts_as_a_reader_would():
    assert [significant_digits(x) for x in ("0.390625", "1.5625", "12.50", "0.0")] == [6, 5, 4, 0]


@pytest.mark.parametrize("module", _modules())
def test_no_doctest_states_a_float_beyond_rounding(module):
    found = []
    for test in doctest.DocTestFinder().find(importlib.import_module(module)):
        for example in test.examples:
            found += [(test.name, m[1]) for m in FLOAT.finditer(example.want)
                      if significant_digits(m[1]) > MAX_DIGITS]
    assert not found, f"floats stated to more than {MAX_DIGITS} digits: {found}"


def test_a_many_digit_doctest_would_be_reported():
    want = "0.007489419896113135\n"
    assert [m[1] for m in FLOAT.finditer(want) if significant_digits(m[1]) > MAX_DIGITS]
