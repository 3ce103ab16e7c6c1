"""The engine's cuts (opd_literate.mismatch.engine) on small rows derived by hand: ties on a
row longer than a sort's insertion-sort threshold, a batch cut row by row, min-p with and
against the other cuts in each framework's order, top-p = 1, and the refusals of top_p_kept.

Every expectation is the documented rule worked out on exact decimals or uniform rows, where
float32 rounding is at least 1e-3 away from deciding anything (each test says why)."""

import itertools

import numpy as np
import pytest

from opd_literate.mismatch import engine
from opd_literate.mismatch.engine import SAMPLERS, processed_log_probs, top_p_kept
from opd_literate.mismatch.toy import log_softmax

FLOAT32_SAMPLERS = ("vllm", "transformers", "sglang")


def kept_tokens(logits, sampler, **cuts):
    return np.flatnonzero(np.isfinite(processed_log_probs(logits, sampler=sampler, **cuts)))


# ---------------------------------------------------------------------------------------------
# Ties on a long row: every sampler ranks them by index, at any length (module docstring)
# ---------------------------------------------------------------------------------------------
# Twenty tokens, 1/30 at the even indices and 2/30 at the odd ones: ten-way ties, on a row
# longer than the 16 entries up to which a quicksort falls back to a stable insertion sort.
LONG_TIES = np.array([1, 2] * 10) / 30
ODD = list(range(1, 20, 2))


@pytest.mark.parametrize("sampler, expected", [
    # exact and SGLang rank the 2/30 first, lower index first; the r-th of them (from 0) has
    # 2r/30 above it: kept while 2r/30 < 0.5 (exact) or not > 0.5 (SGLang), r = 0..7, the
    # nearest masses 14/30 and 16/30 a 1/30 from the cut
    ("exact", ODD[:8]), ("sglang", ODD[:8]),
    # vLLM and transformers sum from below in ascending order, lower index first: the ten 1/30
    # (10/30), then 2/30 at indices 1, 3, 5, ...; cut while the sum is <= 1 - 0.5, that is
    # 12/30 and 14/30 (indices 1 and 3), and 16/30 > 0.5 keeps index 5 on
    ("vllm", ODD[2:]), ("transformers", ODD[2:]),
])
def test_ties_on_a_long_row_are_ranked_by_index(sampler, expected):
    assert np.flatnonzero(top_p_kept(LONG_TIES, 0.5, sampler)).tolist() == expected
    assert kept_tokens(np.log(LONG_TIES), sampler, top_p=0.5).tolist() == expected


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_top_k_on_a_long_row_of_ties(sampler):
    """Ten tokens tie for the top: the exact rule and vLLM's and transformers' top-k keep every
    token tied with the k-th largest; SGLang's keeps exactly k, the lowest indices first."""
    expected = ODD[:3] if sampler == "sglang" else ODD
    assert kept_tokens(np.log(LONG_TIES), sampler, top_k=3).tolist() == expected
    # and its top-p on the full distribution after that cut (SGLang) or on the renormalised
    # survivors (the others): among ten ties of 1/10 renormalised, the mass above the r-th is
    # r/10 < 0.25 for r <= 2 (exact); from below, 0.1 .. 0.7 are <= 1 - 0.25 and cut the
    # first seven (vLLM, transformers); SGLang's three carry 2/30 each, 4/30 above the third
    expected = {"exact": ODD[:3], "vllm": ODD[7:], "transformers": ODD[7:], "sglang": ODD[:3]}
    assert kept_tokens(np.log(LONG_TIES), sampler, top_k=3, top_p=0.25).tolist() == (
        expected[sampler])


# ---------------------------------------------------------------------------------------------
# A batch is cut row by row (each row of the last axis is one position)
# ---------------------------------------------------------------------------------------------
# Rows of different maxima, k-th values and masses: a cut read across rows would move.
BATCH = np.log(np.array([[0.5, 0.3, 0.15, 0.05],
                         [0.1, 0.2, 0.3, 0.4],
                         [0.05, 0.05, 0.1, 0.8],
                         [0.3, 0.05, 0.3, 0.35]]))
CUTS = [dict(top_k=2), dict(min_p=0.3), dict(top_p=0.7), dict(temperature=0.7, top_k=3),
        dict(top_k=3, top_p=0.6, min_p=0.2), dict(min_p=0.5, top_p=0.9)]


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("cuts", CUTS, ids=[",".join(c) for c in CUTS])
def test_a_batch_is_cut_row_by_row(sampler, cuts):
    batch = processed_log_probs(BATCH, sampler=sampler, **cuts)
    assert batch.shape == BATCH.shape
    for logits, row in zip(BATCH, batch):
        alone = processed_log_probs(logits, sampler=sampler, **cuts)
        np.testing.assert_array_equal(np.isfinite(row), np.isfinite(alone))
        # the same float64 operations on the same row: equal up to the reductions' order
        np.testing.assert_allclose(row, alone, rtol=1e-15, atol=0)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_top_p_kept_cuts_a_batch_row_by_row(sampler):
    probs = np.exp(BATCH)
    for top_p in (0.3, 0.6, 0.75, 0.9):
        batch = top_p_kept(probs, top_p, sampler)
        assert batch.dtype == bool and batch.shape == probs.shape
        for row, kept in zip(probs, batch):
            np.testing.assert_array_equal(kept, top_p_kept(row, top_p, sampler))
    # by hand, the first row at 0.6: 0.5 above 0.3 (< 0.6, kept), 0.8 above 0.15 (cut)
    assert batch[0].tolist() == [True, True, True, False]  # top_p = 0.9: 0.8 above 0.15
    assert top_p_kept(probs, 0.6, sampler)[0].tolist() == [True, True, False, False]


# ---------------------------------------------------------------------------------------------
# min-p: mu(v) < min_p * max mu is cut, equality kept; each framework in its order
# ---------------------------------------------------------------------------------------------
DECIMALS = np.log([0.5, 0.3, 0.12, 0.08])  # min_p 0.2 cuts below 0.1, min_p 0.5 below 0.25


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_min_p_alone_in_every_sampler(sampler):
    assert kept_tokens(DECIMALS, sampler, min_p=0.2).tolist() == [0, 1, 2]
    assert kept_tokens(DECIMALS, sampler, min_p=0.5).tolist() == [0, 1]
    # a row of ties is exactly at the threshold at min_p = 1: nothing is below it
    assert kept_tokens(np.zeros(4), sampler, min_p=1.0).tolist() == [0, 1, 2, 3]
    out = processed_log_probs(np.zeros((2, 4)), min_p=1.0, sampler=sampler)
    np.testing.assert_allclose(np.exp(out), 0.25, rtol=1e-15, atol=0)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_min_p_does_not_undo_the_other_cuts(sampler):
    # top-k 1 keeps 0.5 alone; min-p 0.2 would keep three, and does not bring them back
    assert kept_tokens(DECIMALS, sampler, top_k=1, min_p=0.2).tolist() == [0]
    # top-p 0.7 keeps 0.5 and 0.3 (0.8 above 0.12); min-p 0.2 keeps them
    assert kept_tokens(DECIMALS, sampler, top_p=0.7, min_p=0.2).tolist() == [0, 1]
    # min-p 0.5 keeps two, fewer than top-k 3: vLLM's top-k then sees two survivors and cuts
    # nothing more (its k-th largest survivor is a cut token's -inf); the others cut to three
    # first and min-p leaves two
    assert kept_tokens(DECIMALS, sampler, top_k=3, min_p=0.5).tolist() == [0, 1]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_min_p_too_small_to_cut_keeps_what_top_k_kept(sampler):
    """min_p = 1e-45 (a float32 subnormal): min_p * max mu rounds to 0 in float32, so min-p
    drops nothing, and the tokens top-k cut stay cut (transformers reads min-p after top-k on
    the renormalised survivors, where the cut ones have probability 0)."""
    logits = np.array([0.0, 0.0, 0.0, -1.0, -1.0])
    assert kept_tokens(logits, sampler, top_k=3, min_p=1e-45).tolist() == [0, 1, 2]
    # top-p 0.5 on 0.268 (three ties) and 0.098 (two): the exact rule and SGLang keep the first
    # two ties (0.536 above the third), vLLM and transformers the last two (cut while the sum
    # from below, 0.098, 0.197, 0.465, is <= 0.5)
    expected = [1, 2] if sampler in ("vllm", "transformers") else [0, 1]
    assert kept_tokens(logits, sampler, top_p=0.5, min_p=1e-45).tolist() == expected


# ---------------------------------------------------------------------------------------------
# top_p = 1 is no cut, even of a token whose float32 probability is 0
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_top_p_one_cuts_no_token_even_one_of_float32_probability_zero(sampler):
    logits = np.array([[0.0, -200.0], [-200.0, 0.0]])  # exp(-200) ~ 1e-87: 0 in float32
    assert np.float32(np.exp(-200.0)) == 0
    out = processed_log_probs(logits, sampler=sampler)
    np.testing.assert_array_equal(out, log_softmax(logits))  # float64: log-prob -200, finite
    assert top_p_kept([[1.0, 0.0], [0.5, 0.5]], 1.0, sampler).tolist() == [[True, True]] * 2


def test_top_p_one_keeps_every_token_as_a_bool_array_of_the_shape_of_probs():
    probs = np.array([[0.5, 0.5, 0.0]] * 2)
    kept = top_p_kept(probs, 1.0)
    assert kept.dtype == bool and kept.shape == (2, 3) and kept.all()
    # below 1 the token of probability 0 has everything above it: cut (exact rule)
    assert top_p_kept(probs, 0.9).tolist() == [[True, True, False]] * 2


# ---------------------------------------------------------------------------------------------
# top_p_kept's refusals: the first bad entry, the first bad row
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("probs, message", [
    ([0.75, 0.5, -0.25], r"probs must lie in \[0, 1\], got -0.25"),  # sums to 1
    ([1.25, 0.0], r"probs must lie in \[0, 1\], got 1.25"),
    # the first entry outside [0, 1] in index order; 0 and 1 themselves are inside
    ([[0.0, 1.0, 0.0], [0.5, 1.5, -1.0]], r"probs must lie in \[0, 1\], got 1.5"),
    ([[0.5, 0.5], [0.5, 0.4]], "each row of probs must sum to 1 .* got a row summing to 0.9$"),
    ([[0.5, 0.5], [0.25, 0.25], [0.5, 0.25]], "got a row summing to 0.5$"),
])
def test_top_p_kept_names_the_first_bad_entry_or_row(probs, message):
    with pytest.raises(ValueError, match=message):
        top_p_kept(probs, 0.5)


def test_a_temperature_that_overflows_float64_is_named_with_the_remedy():
    with pytest.raises(ValueError, match=r"^logits / temperature overflows float64 at "
                                         r"temperature=1e-310 \(largest \|logits\| 1e\+10\); "
                                         r"use a larger temperature$"):
        processed_log_probs(np.array([1e10, 0.0]), temperature=1e-310)


# ---------------------------------------------------------------------------------------------
# The rows nucleus_disagreement enumerates
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("V, resolution", [(2, 5), (3, 7), (4, 9)])
def test_the_compositions_are_every_row_of_positive_integers_in_order(V, resolution):
    counts = engine._compositions(V, resolution)
    expected = [c for c in itertools.product(range(1, resolution), repeat=V)
                if sum(c) == resolution]  # lexicographic: product's own order
    assert counts.tolist() == [list(c) for c in expected]
    assert np.issubdtype(counts.dtype, np.integer)  # counts, compared exactly with j


def test_vllm_reads_min_p_once_on_the_full_distribution():
    """vLLM's min-p runs before top-k and top-p, on the full softmax, and never again. On this
    row, with min_p the ratio of token 4's float32 probability to the largest, token 4 sits
    exactly on the threshold (kept: only a probability below it is cut); renormalised over the
    survivors the same comparison rounds the other way, so a second reading would cut it."""
    z = np.array([-0.6677563797627329, -0.5493705607570516, -0.5320653277786109,
                  -1.3493172462579026, -0.5915748828912161])
    f32 = np.float32

    def float32_softmax(logits, keep):
        # the module's framework probabilities: the float64 softmax of the float32 logits,
        # rounded once; every value here is at least 4e-9 (relative) from a float32 rounding
        # tie, far beyond the float64 softmax's error (~1e-16), so it is the same on any CPU
        x = np.where(keep, logits.astype(f32).astype(float), -np.inf)
        e = np.exp(x - x.max())
        return (e / e.sum()).astype(f32)

    p = float32_softmax(z, np.ones(5, dtype=bool))
    min_p = float(p[4]) / float(p[2])  # token 2 is the largest
    assert p.argmax() == 2 and p[4] == p[2] * f32(min_p)  # on the threshold: kept
    survivors = p >= p[2] * f32(min_p)
    assert survivors.tolist() == [False, True, True, False, True]
    again = float32_softmax(z, survivors)
    assert again[4] < again[2] * f32(min_p)  # a second reading would cut token 4
    # top-p 0.7 then cuts nothing: the smallest survivor renormalised, 0.322, is above 1 - 0.7
    assert again.min(where=survivors, initial=1.0) > 0.3 + 0.02
    assert kept_tokens(z, "vllm", top_p=0.7, min_p=min_p).tolist() == [1, 2, 4]
