"""One rule for comparing what a test computes with what a committed file holds.

A float recomputed on this machine and a float written to a JSON record, a fixture or a docs
data file on another may differ in their last bits: numpy and torch choose their ``exp``, ``log``
and reduction kernels for the CPU at run time (AVX-512, AVX2 or a baseline), and the BLAS and the
thread count change the order of sums. So every such comparison goes through
:func:`assert_matches_committed`, with a tolerance and the reason for it; integers, strings,
booleans and counts stay exact (an integer that differs is a real change, not rounding).
``tests/package/test_committed_floats.py`` fails on any other comparison of a computed value with
loaded data (``==``, ``np.testing.assert_array_equal``, ``pytest.approx``...).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

# The tolerance of a value computed by a few hundred float64 operations (a sum over enumerated
# answers, a moment of a toy): each operation's rounding is at most half an ulp (1.1e-16), and
# two kernels that differ round differently, so a relative 1e-12 leaves about four orders of
# magnitude for error growth and still catches any change of the computation itself.
FLOAT64_SUMS = 1e-12


def assert_matches_committed(computed, committed, *, rtol, atol=0.0, why, where="value"):
    """Assert that ``computed`` equals the ``committed`` value up to a float tolerance.

    Parameters
    ----------
    computed, committed
        Numbers, numpy arrays (or torch tensors), or (nested) lists, tuples and dicts of them.
        Floats are compared with ``|computed - committed| <= atol + rtol * |committed|`` (NaN
        equals NaN, an infinity only itself); integers, booleans, strings and ``None`` exactly,
        and so are integer arrays; containers by their length or keys, then item by item.
    rtol, atol
        The tolerance. There is no default: it comes with ``why``. ``atol`` may also be an array
        that broadcasts against ``committed`` (a tolerance for each element, such as a number
        of its ulps: ``16 * np.spacing(np.abs(committed))``).
    why
        Why the tolerance is what it is (which computation, which kernels may differ).
    where
        The path of the item compared, for the failure message.
    """
    if not isinstance(why, str) or not why.strip():
        raise ValueError("assert_matches_committed needs the reason for its tolerance (why=...)")
    atol_values = np.asarray(atol, dtype=np.float64)
    if not (np.ndim(rtol) == 0 and rtol >= 0 and np.all(atol_values >= 0)):
        raise ValueError(f"rtol and atol must be >= 0, rtol a number; got rtol={rtol!r}, "
                         f"atol={atol!r}")
    _compare(computed, committed, float(rtol), atol_values if atol_values.ndim else float(atol),
             why, where)


def _is_float(value):
    return isinstance(value, (float, np.floating)) and not isinstance(value, bool)


def _plain(value):
    """A torch tensor as a numpy array (the helper itself does not import torch)."""
    if type(value).__module__.split(".", 1)[0] == "torch" and hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return value


def _compare(computed, committed, rtol, atol, why, where):
    computed, committed = _plain(computed), _plain(committed)
    if isinstance(committed, dict):
        assert isinstance(computed, dict), f"{where}: a dict was committed, got {computed!r}"
        assert set(computed) == set(committed), (
            f"{where}: keys {sorted(map(str, computed))} against {sorted(map(str, committed))}")
        for key in committed:
            _compare(computed[key], committed[key], rtol, atol, why, f"{where}[{key!r}]")
        return
    if isinstance(committed, np.ndarray) or isinstance(computed, np.ndarray):
        got, want = np.asarray(computed), np.asarray(committed)
        assert got.shape == want.shape, f"{where}: shape {got.shape} against {want.shape}"
        if got.dtype.kind not in "biuf" or want.dtype.kind not in "biuf":
            # None, strings or mixed items: item by item (np.ndim(atol) > 0 needs numbers)
            assert np.ndim(atol) == 0, f"{where}: an array of tolerances needs numeric arrays"
            _compare(got.tolist(), want.tolist(), rtol, atol, why, where)
        elif want.dtype.kind == "f" or got.dtype.kind == "f":
            got64, want64 = got.astype(np.float64), want.astype(np.float64)
            bad = ~_close(got64, want64, rtol, atol)
            if bad.any():
                first = tuple(np.argwhere(bad)[0])
                with np.errstate(invalid="ignore"):
                    error = np.abs(got64 - want64)
                raise AssertionError(
                    f"{where}: {int(bad.sum())} of {bad.size} elements differ by more than "
                    f"rtol={rtol}, atol={_atol_text(atol)} ({why}); the largest difference "
                    f"{np.nanmax(np.where(bad, error, 0.0)):.3g}; first at "
                    f"{[int(i) for i in first]}: {float(got64[first])!r} against the committed "
                    f"{float(want64[first])!r}")
        else:
            assert np.ndim(atol) == 0, f"{where}: an array of tolerances for integer arrays"
            assert np.array_equal(got, want), (
                f"{where}: the integer arrays differ at {int((got != want).sum())} elements; "
                f"first at {np.argwhere(got != want)[0].tolist()}")
        return
    assert np.ndim(atol) == 0, f"{where}: an array of tolerances needs an array to compare"
    if isinstance(committed, (list, tuple)):
        assert isinstance(computed, (list, tuple)), (
            f"{where}: a list was committed, got {computed!r}")
        assert len(computed) == len(committed), (
            f"{where}: {len(computed)} items against {len(committed)}")
        for i, (got, want) in enumerate(zip(computed, committed)):
            _compare(got, want, rtol, atol, why, f"{where}[{i}]")
        return
    if _is_float(committed) or _is_float(computed):
        for value, side in ((computed, "computed"), (committed, "committed")):
            assert isinstance(value, numbers.Real) and not isinstance(value, bool), (
                f"{where}: a number against {value!r} ({side})")
        got, want = float(computed), float(committed)
        if math.isnan(want) or math.isnan(got):
            assert math.isnan(want) and math.isnan(got), f"{where}: {got!r} against {want!r}"
            return
        assert _close(np.float64(got), np.float64(want), rtol, atol), (
            f"{where}: {got!r} against the committed {want!r}, a difference of "
            f"{abs(got - want):.3g} beyond rtol={rtol}, atol={atol} ({why})")
        return
    assert computed == committed, f"{where}: {computed!r} against the committed {committed!r}"


def _atol_text(atol):
    return f"{atol}" if np.ndim(atol) == 0 else f"(per element, up to {np.max(atol):.3g})"


def _close(got, want, rtol, atol):
    same = (np.isinf(want) & (got == want)) | (np.isnan(want) & np.isnan(got))
    with np.errstate(invalid="ignore"):
        return same | (np.abs(got - want) <= atol + rtol * np.abs(want))
