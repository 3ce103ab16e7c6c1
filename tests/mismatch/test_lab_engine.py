"""The engine lab's tests: top-p as the exact rule and as three frameworks compute it, and the
kept mass.

This file is also the test file of the generated lab handout (``opd_literate.course.handouts``),
where it imports from the lab folder; each test is marked with the task it checks and calls
that task's functions only. Expected values come from hand sums, brute force over the top sets,
torch's own float32 arithmetic (the frameworks' samplers are torch code) and closed forms.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from opd_literate.mismatch.engine import (
    NUCLEUS_TOLERANCE,
    _cut_exact,
    _cut_framework,
    _log_kept,
    _mass_above,
)

BOUNDARY = [0.5, 0.3, 0.15, 0.05]  # at top_p = 0.8 the first two carry 0.8 exactly


def random_rows(seed, rows=40, V=6):
    """Distributions with well-separated entries (no two within 1e-6 of each other)."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(V), size=rows)
    return probs, np.argsort(-probs, axis=-1, kind="stable")


@pytest.mark.task(1)
def test_mass_above_by_hand():
    probs = np.array([[0.15, 0.5, 0.05, 0.3]])
    order = np.array([[1, 3, 0, 2]])  # 0.5, 0.3, 0.15, 0.05
    np.testing.assert_allclose(_mass_above(probs, order), [[0.0, 0.5, 0.8, 0.95]], rtol=1e-15,
                               atol=1e-16)


@pytest.mark.task(1)
def test_mass_above_sums_what_is_ranked_before():
    probs, order = random_rows(0)
    expected = np.zeros_like(probs)
    for row in range(len(probs)):
        for rank in range(probs.shape[1]):
            expected[row, rank] = sum(probs[row, order[row, r]] for r in range(rank))
    np.testing.assert_allclose(_mass_above(probs, order), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.task(1)
@pytest.mark.parametrize("top_p, count", [(0.8, 2), (0.81, 3), (0.5, 1), (0.500000001, 2),
                                          (0.01, 1), (1e-13, 1)])
def test_cut_exact_at_the_boundary(top_p, count):
    # BOUNDARY ranked: the mass above each token is 0, 0.5, 0.8, 0.95; a mass equal to top_p
    # (within NUCLEUS_TOLERANCE) has reached it, and the first token always stays (at a top_p
    # below the tolerance too, where no mass is "less than top_p" by more than it)
    above = np.array([[0.0, 0.5, 0.8, 0.95]])
    kept = [rank < count for rank in range(4)]
    assert _cut_exact(above, top_p).tolist() == [kept]
    assert _cut_exact(above.T.copy(), top_p, axis=0).tolist() == [[k] for k in kept]


@pytest.mark.task(1)
def test_cut_exact_keeps_the_smallest_top_set_that_reaches_top_p():
    probs, order = random_rows(1)
    ranked = np.take_along_axis(probs, order, axis=-1)
    above = np.cumsum(ranked, axis=-1) - ranked  # the reference statistic
    for top_p in (0.3, 0.6, 0.9, 0.99):
        kept = _cut_exact(above, top_p)
        for row in range(len(probs)):
            # brute force: the fewest top-ranked tokens whose mass reaches top_p
            n = next(n for n in itertools.count(1) if ranked[row, :n].sum() >= top_p
                     - NUCLEUS_TOLERANCE)
            assert kept[row].tolist() == [r < n for r in range(probs.shape[1])], (row, top_p)


def torch_reference(sums, top_p, sampler):
    """The cut as the framework's torch code writes it, on the float32 statistic."""
    s = torch.from_numpy(np.asarray(sums, dtype=np.float32))  # CPU by design: numpy's
    if sampler == "sglang":  # probs_sort[(probs_sum - probs_sort) > top_ps] = 0
        return ~(s > s.new_tensor(top_p))
    if sampler == "vllm":  # top_p_mask = probs_sum <= 1 - p, p a float32 tensor
        cut = s <= 1 - s.new_tensor(top_p)
    else:  # transformers: sorted_indices_to_remove = cumulative_probs <= (1 - top_p)
        cut = s <= (1 - top_p)
    cut[..., -1] = False  # at least one token: the largest logit
    return ~cut


@pytest.mark.task(2)
@pytest.mark.parametrize("sampler, count", [("vllm", 3), ("transformers", 2), ("sglang", 2)])
def test_cut_framework_at_the_boundary_by_hand(sampler, count):
    # BOUNDARY at top_p = 0.8 in float32. vLLM and transformers sort ascending: the cumulative
    # sums are float32(0.05), float32(0.2) = 0.20000000298, 0.5, 1. vLLM cuts at
    # 1 - float32(0.8) = 0.19999998808 (0.15 stays); transformers at float32(0.2) (it goes).
    # SGLang sorts descending; the mass above 0.15 is 0.80000004172 > float32(0.8): it goes.
    p32 = np.array(BOUNDARY, dtype=np.float32)
    ranked = p32[::-1].copy() if sampler != "sglang" else p32
    sums = np.cumsum(ranked, dtype=float).astype(np.float32)
    if sampler == "sglang":
        sums = sums - ranked
    kept = _cut_framework(sums, 0.8, sampler)
    assert kept.dtype == bool and int(kept.sum()) == count
    assert kept.tolist() == torch_reference(sums, 0.8, sampler).tolist()


@pytest.mark.task(2)
@pytest.mark.parametrize("sampler, kept_rank", [("vllm", -1), ("transformers", -1),
                                               ("sglang", 0)])
def test_cut_framework_keeps_one_token_at_a_tiny_top_p(sampler, kept_rank):
    # 1 - float32(1e-8) is 1 in float32: every cumulative sum is <= it, and only the
    # "at least one" rule keeps the largest logit (last in vLLM's and transformers' ascending
    # order); SGLang keeps its first, whose mass above is 0
    p32 = np.array([0.05, 0.15, 0.3, 0.5], dtype=np.float32)
    ranked = p32[::-1].copy() if sampler == "sglang" else p32
    sums = np.cumsum(ranked, dtype=float).astype(np.float32)
    if sampler == "sglang":
        sums = sums - ranked
    kept = _cut_framework(sums, 1e-8, sampler)
    assert kept.tolist() == [rank == kept_rank % 4 for rank in range(4)]
    assert kept.tolist() == torch_reference(sums, 1e-8, sampler).tolist()


@pytest.mark.task(2)
def test_cut_framework_sglang_keeps_a_mass_above_equal_to_top_p():
    # (1/2, 1/4, 1/8, 1/8), dyadic: the mass above the third token is exactly 0.75 in float32,
    # and SGLang cuts only where it exceeds top_p, so at 0.75 it keeps three
    ranked = np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32)
    sums = np.cumsum(ranked, dtype=float).astype(np.float32) - ranked
    assert sums.tolist() == [0.0, 0.5, 0.75, 0.875]
    assert _cut_framework(sums, 0.75, "sglang").tolist() == [True, True, True, False]


@pytest.mark.task(2)
@pytest.mark.parametrize("sampler", ["vllm", "transformers", "sglang"])
def test_cut_framework_is_the_frameworks_float32_arithmetic(sampler):
    probs, _ = random_rows(2, rows=200, V=5)
    p32 = probs.astype(np.float32)
    order = np.argsort(-p32 if sampler == "sglang" else p32, axis=-1, kind="stable")
    ranked = np.take_along_axis(p32, order, axis=-1)
    sums = torch.cumsum(torch.from_numpy(ranked), dim=-1).numpy()
    if sampler == "sglang":
        sums = sums - ranked
    for top_p in (0.2, 0.5, 0.75, 0.9, 0.95):
        kept = _cut_framework(sums, top_p, sampler)
        assert np.array_equal(kept, torch_reference(sums, top_p, sampler).numpy()), top_p
        kept_t = _cut_framework(sums.T.copy(), top_p, sampler, axis=0)
        assert np.array_equal(kept_t, kept.T), top_p


@pytest.mark.task(3)
def test_log_kept_mass():
    logits = np.array([[2.0, 0.5, -1.0, 0.0], [0.3, 0.3, 0.3, 0.3]])
    kept = np.array([[True, False, True, False], [False, True, True, True]])
    p = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    expected = [math.log(p[0, 0] + p[0, 2]), math.log(0.75)]
    np.testing.assert_allclose(_log_kept(logits, kept), expected, rtol=1e-12)


@pytest.mark.task(3)
def test_log_kept_mass_of_every_token_is_zero():
    logits = np.random.default_rng(3).normal(size=(5, 7)) * 4
    np.testing.assert_allclose(_log_kept(logits, np.ones(logits.shape, dtype=bool)), 0.0,
                               atol=1e-15)


@pytest.mark.task(3)
def test_log_kept_mass_does_not_underflow():
    # the kept tokens carry e^{-800} of the mass: a softmax in float64 would give log 0 = -inf
    logits = np.array([[0.0, -800.0, -801.0]])
    kept = np.array([[False, True, True]])
    expected = -800.0 + math.log1p(math.exp(-1.0))  # the total's log-sum-exp is 0 + 1e-348
    np.testing.assert_allclose(_log_kept(logits, kept), [expected], rtol=1e-14)
    # and with huge logits, where exp(z) itself overflows
    np.testing.assert_allclose(_log_kept(logits + 1000.0, kept), [expected], rtol=1e-12)
