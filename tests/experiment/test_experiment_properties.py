"""Property tests (Hypothesis) of three modules of the experiment: ``quantized`` (the quantizer,
the ranks, the per-token mismatch), ``stats`` (the bootstrap, the headline, the ratios) and
``mismatch_training`` (the corrected loss, the summary).

Each property is read against an independent computation: the quantizer's error bound in exact
rationals, the ranks by counting, the headline's first hits and ratios by a loop over the
curves, the summary's paired differences seed by seed. The example count comes from the
Hypothesis profile (conftest.py): "fast" (25) in the normal run, ``--hypothesis-profile=ci``
(1,000) in .ci/run.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.experiment import mismatch_training as MT
from opd_literate.experiment import stats
from opd_literate.experiment.quantized import (
    average_ranks,
    quantize_per_channel,
    rank_correlation,
    token_mismatch,
)

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
HALF = (torch.bfloat16, torch.float16)
# decades of the row magnitudes whose scale max|W| / q_max is a normal number of the compute
# dtype (the docstring's condition); float16's own range is 6e-8 to 65504
DECADES = {torch.float64: (-290, 290), torch.float32: (-30, 30), torch.bfloat16: (-30, 30),
           torch.float16: (-4, 4)}
UNIT = {torch.float64: Fraction(1, 2 ** 53)}  # the others compute in float32: 2^-24


# ---------------------------------------------------------------------------------------------
# quantized: the quantizer
# ---------------------------------------------------------------------------------------------
@st.composite
def weights(draw):
    """(out, in) weights of a dtype: rows of random magnitude, of ties (integer multiples of
    half a step), of zeros and at the largest finite number; out or in may be 0."""
    dtype = draw(st.sampled_from(DTYPES))
    bits = draw(st.integers(2, 8))
    out, n_in = draw(st.integers(0, 4)), draw(st.integers(0, 6))
    g = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    low, high = DECADES[dtype]
    q_max = 2 ** (bits - 1) - 1
    rows = []
    for _ in range(out):
        kind = draw(st.sampled_from(["random", "random", "ties", "zeros", "largest"]))
        magnitude = 10.0 ** draw(st.integers(low, high))
        if kind == "random":
            row = g.standard_normal(n_in) * magnitude
        elif kind == "ties":
            row = g.integers(-2 * q_max, 2 * q_max + 1, n_in) * 0.5 * magnitude / q_max
            row[:1] = magnitude  # the channel's largest entry: a step of magnitude / q_max
        elif kind == "zeros":
            row = np.zeros(n_in)
        else:
            row = g.choice([-1.0, 1.0, 1 / 3, -0.5], n_in) * float(torch.finfo(dtype).max)
        rows.append(row)
    w = torch.tensor(np.array(rows).reshape(out, n_in), dtype=torch.float64).to(dtype)
    return w, bits


def _bound_holds(w, w_hat, bits, u):
    """|W - W_hat| <= s_o / 2 + 3 u max_i |W_oi| for every entry, in exact rationals."""
    q_max = 2 ** (bits - 1) - 1
    for row, row_hat in zip(w.double().tolist(), w_hat.double().tolist()):
        m = max((abs(Fraction(x)) for x in row), default=Fraction(0))
        bound = m / q_max / 2 + 3 * u * m
        if any(abs(Fraction(x) - Fraction(y)) > bound for x, y in zip(row, row_hat)):
            return False
    return True


@pytest.mark.properties
@given(weights())
def test_the_quantizer_keeps_its_bound_dtype_grid_and_device(case):
    w, bits = case
    wide = torch.float64 if w.dtype == torch.float64 else torch.float32
    with torch.device("meta"):  # a tensor created without device= would land on meta
        w_hat = quantize_per_channel(w, bits)
    assert w_hat.device.type == "cpu" and w_hat.dtype == wide and w_hat.shape == w.shape
    assert torch.isfinite(w_hat).all()
    assert _bound_holds(w, w_hat, bits, UNIT.get(w.dtype, Fraction(1, 2 ** 24)))
    assert (w.double() * w_hat.double() >= 0).all()  # a code has the sign of its entry, or is 0
    assert (w_hat[(w == 0).all(dim=1)] == 0).all()  # a row of zeros stays zeros
    if w.numel():
        # on the grid: W_hat is s q (rounded, clamped to the finite range), |q| <= q_max
        q_max = 2 ** (bits - 1) - 1
        scale = w.to(wide).abs().amax(dim=1, keepdim=True) / q_max
        codes = torch.where(scale > 0, w_hat / torch.where(scale > 0, scale, 1.0), 0.0).round()
        assert (codes.abs() <= q_max).all()
        top = torch.finfo(wide).max
        assert torch.equal(torch.clamp(codes * scale, -top, top), w_hat)
    if w.dtype in HALF:  # computed in float32: its float32 copy's bits
        assert torch.equal(w_hat, quantize_per_channel(w.float(), bits))


# ---------------------------------------------------------------------------------------------
# quantized: the ranks and the per-token mismatch
# ---------------------------------------------------------------------------------------------
def _counted_ranks(values):
    """1 + the values below, + half the other values equal (10 significant digits): the mean
    rank of a tie, by counting, without sorting."""
    keys = [float(f"{v:.10g}") for v in values]
    return np.array([1 + sum(k < x for k in keys) + (sum(k == x for k in keys) - 1) / 2
                     for x in keys])


# values from a small pool, so that ties are frequent, or anywhere
lists = st.one_of(st.lists(st.sampled_from([-2.5, 0.0, 1e-300, 0.1, 0.3, 7.0, 1e300]),
                           min_size=2, max_size=12),
                  st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=12))


@pytest.mark.properties
@given(lists, st.data())
def test_ranks_are_the_counted_ranks_and_the_correlation_is_their_pearson(a, data):
    b = data.draw(st.lists(st.floats(-1e3, 1e3), min_size=len(a), max_size=len(a)))
    assert average_ranks(a).tolist() == _counted_ranks(a).tolist()
    ra, rb = _counted_ranks(a), _counted_ranks(b)
    if np.ptp(ra) == 0 or np.ptp(rb) == 0:  # a constant list: undefined, refused
        with pytest.raises(ValueError, match="is constant"):
            rank_correlation(a, b)
        return
    expected = np.corrcoef(ra, rb)[0, 1]
    rho = rank_correlation(a, b)
    assert rho == pytest.approx(expected, abs=1e-12)
    assert -1.0 <= rho <= 1.0 and rho == rank_correlation(b, a)
    assert rank_correlation(a, a) == 1.0
    spot = data.draw(st.integers(0, len(a) - 1))
    bad = list(b)
    bad[spot] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    with pytest.raises(ValueError, match=f"b must be finite, got .* at index {spot}"):
        rank_correlation(a, bad)
    with pytest.raises(ValueError, match="a and b must have one length"):
        rank_correlation(a, b[:-1])


@pytest.mark.properties
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2 ** 32 - 1),
       st.sampled_from([0.0, 1e-3, 1.0, 10.0]))
def test_token_mismatch_is_the_visit_weighted_kl(N, V, seed, shift):
    g = np.random.default_rng(seed)
    logits = g.standard_normal((N, V))
    log_pi = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    other = logits + shift * g.standard_normal((N, V))
    log_mu = other - np.log(np.exp(other).sum(axis=1, keepdims=True))
    visits = g.random(N) + (np.arange(N) == 0)  # > 0 somewhere
    out = token_mismatch(log_pi, log_mu, visits)
    mu = np.exp(log_mu)
    per_state = (mu * (log_mu - log_pi)).sum(axis=1)
    expected = max(float(visits @ per_state / visits.sum()), 0.0)
    assert out["kl"] >= 0 and out["kl"] == pytest.approx(expected, rel=1e-10, abs=1e-15)
    quantiles = list(out["quantiles"].values())
    assert quantiles == sorted(quantiles)
    assert out["max_abs_log_ratio"] == pytest.approx(float(np.abs(log_pi - log_mu).max()),
                                                     rel=1e-15, abs=0)
    assert all(math.isfinite(v) for v in (out["kl"], out["kurtosis"], out["mean_abs_log_ratio"]))
    if shift == 0.0:
        assert out["kl"] == 0.0 and out["max_abs_log_ratio"] == 0.0


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------
@pytest.mark.properties
@given(st.lists(st.sampled_from([0.0, 0.1, 0.3, 1.0, 2.5, 1e-9, 1e9]), min_size=1, max_size=6),
       st.sampled_from([0.5, 0.9, 0.95]), st.integers(0, 2 ** 16))
def test_the_interval_is_ordered_and_within_the_observed_values(values, level, seed):
    low, high = stats.bootstrap_interval(values, level=level, resamples=200, seed=seed)
    assert min(values) <= low <= high <= max(values)
    assert (low, high) == stats.bootstrap_interval(values, level=level, resamples=200, seed=seed)
    if len(set(values)) == 1:
        assert (low, high) == (values[0], values[0])
    bad = [*values, math.nan]
    with pytest.raises(ValueError, match=f"values must be finite, got nan at index {len(values)}"):
        stats.bootstrap_interval(bad)


@st.composite
def records(draw):
    """A results record: the methods' accuracy curves (monotone or not), every seed's."""
    seeds, evaluations = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    samples = [10 * i for i in range(evaluations)]
    level = st.sampled_from([0.0, 0.2, 0.5, 0.9, 0.95, 1.0])
    methods = {}
    for method in draw(st.lists(st.sampled_from(["opd_full_vocab", "rl", "sft", "opd_sampled"]),
                                min_size=1, max_size=4, unique=True)):
        accuracy = [draw(st.lists(level, min_size=evaluations, max_size=evaluations))
                    for _ in range(seeds)]
        methods[method] = {"samples": samples, "accuracy": accuracy,
                           "reverse_kl": [[1.0] * evaluations] * seeds,
                           "seconds": [[0.5 * i for i in range(evaluations)]] * seeds,
                           "lr": 1e-3}
    return {"teacher_accuracy": draw(st.sampled_from([0.5, 1.0])),
            "config": {"target_fraction": draw(st.sampled_from([0.5, 0.9, 1.0])),
                       "steps": max(evaluations - 1, 1), "batch_size": 10, "seeds": seeds},
            "methods": methods}


def _first_hits(curve, target):
    for i, a in enumerate(curve):
        if a >= target:
            return i
    return None


@pytest.mark.properties
@given(records())
def test_the_headline_and_the_ratios_are_the_first_hits_of_each_seed(results):
    target = results["config"]["target_fraction"] * results["teacher_accuracy"]
    table = stats.headline(results)
    per_method = {}
    for method, record in results["methods"].items():
        hits = [_first_hits(curve, target) for curve in record["accuracy"]]
        samples = [None if i is None else record["samples"][i] for i in hits]
        per_method[method] = samples
        row = table[method]
        assert row["reached"] == sum(i is not None for i in hits)
        assert row["samples_per_seed"] == samples
        if None in samples:
            assert row["samples"] is None and row["seconds"] is None
        else:
            stat = row["samples"]
            assert stat["per_seed"] == samples and stat["mean"] == sum(samples) / len(samples)
            assert min(samples) <= stat["low"] <= stat["high"] <= max(samples)
    found = stats.ratios(results)
    base = per_method.get("opd_full_vocab")
    if base is None or None in base or min(base) == 0:
        assert found == {}
    else:
        budget = results["config"]["steps"] * results["config"]["batch_size"]
        for other, ratio in found.items():
            values = [budget if v is None else v for v in per_method[other]]
            assert ratio["bound"] == (None in per_method[other])
            assert ratio["mean"] == pytest.approx((sum(values) / len(values))
                                                  / (sum(base) / len(base)), rel=1e-15)
            assert math.isfinite(ratio["low"]) and ratio["low"] <= ratio["high"]
    assert "| method |" in stats.format_headline(results)


# ---------------------------------------------------------------------------------------------
# mismatch_training: the corrected loss in half precision, off the mask, off the device
# ---------------------------------------------------------------------------------------------
@st.composite
def loss_batches(draw):
    M, B, T = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    dtype = draw(st.sampled_from(DTYPES))
    trainer = (-2 * torch.rand(M, B, T, generator=g, dtype=torch.float64)).to(dtype)
    sampler = (trainer.double() + draw(st.sampled_from([0.0, 0.1, 1.0]))
               * torch.randn(M, B, T, generator=g, dtype=torch.float64)).clamp_max(0).to(dtype)
    advantages = torch.randn(M, B, T, generator=g, dtype=torch.float64).to(dtype)
    lengths = torch.randint(0, T + 1, (M, B), generator=g)  # 0: a row with no token
    mask = (torch.arange(T) < lengths[..., None]).to(draw(st.sampled_from(
        [torch.float32, torch.bool, torch.int64])))
    return trainer, sampler, advantages, mask


@pytest.mark.properties
@given(loss_batches(), st.sampled_from(["none", *MT.CORRECTIONS]),
       st.sampled_from([math.nan, math.inf, -math.inf, 0.0]))
def test_the_corrected_loss_is_float32_for_half_ignores_the_padding_and_stays_on_the_cpu(
        batch, correction, garbage):
    trainer, sampler, advantages, mask = batch
    dtype = torch.float32 if trainer.dtype in HALF else trainer.dtype

    def run(t, s, a):
        t = t.clone().requires_grad_()
        loss, used = MT.corrected_loss(t, s, a, mask, correction)
        (grad,) = torch.autograd.grad(loss, t, allow_unused=True)
        return loss.detach(), used, torch.zeros_like(t) if grad is None else grad

    with torch.device("meta"):
        loss, used, grad = run(trainer, sampler, advantages)
    assert loss.device.type == "cpu" and used.device.type == "cpu" and loss.dtype == dtype
    assert math.isfinite(float(loss)) and torch.isfinite(grad).all()
    padding = ~mask.bool()
    assert not used[padding].any() and (grad[padding] == 0).all()
    dirty = [x.masked_fill(padding, garbage) for x in (trainer, sampler, advantages)]
    loss2, used2, grad2 = run(*dirty)
    assert torch.equal(loss, loss2) and torch.equal(used, used2) and torch.equal(grad, grad2)
    if trainer.dtype in HALF:  # computed in float32: its float32 copy's loss, bit for bit
        loss32, used32, _ = run(trainer.float(), sampler.float(), advantages.float())
        assert torch.equal(loss, loss32) and torch.equal(used, used32)


@st.composite
def summary_records(draw):
    """A mismatch_training record: two or three conditions, 1-3 seeds, 2-4 evaluations."""
    seeds, evaluations = draw(st.integers(1, 3)), draw(st.integers(2, 4))
    gaps = draw(st.lists(st.integers(1, 5), min_size=evaluations - 1,
                         max_size=evaluations - 1))
    samples = [0, *np.cumsum([8 * gap for gap in gaps]).tolist()]
    unit = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
    names = ["fp32 none", "int4 none", *draw(st.lists(st.sampled_from(
        [f"int4 {c}" for c in MT.CORRECTIONS]), max_size=1))]
    runs = {"samples": samples, "conditions": names}
    for name in names:
        def curve(first=unit):
            return [[draw(first), *(draw(unit) for _ in range(evaluations - 1))]
                    for _ in range(seeds)]
        runs[name] = {"accuracy": curve(), "sampler_accuracy": curve(), "reverse_kl": curve(),
                      "mismatch_kl": curve(st.none()), "kept_fraction": curve(st.none())}
    return {"config": {"correction_level": "int4"}, "teacher_accuracy": 1.0,
            "methods": {"rl": runs}}


@pytest.mark.properties
@given(summary_records())
def test_the_summary_pairs_each_seed_and_weights_each_evaluation_by_its_steps(results):
    runs = results["methods"]["rl"]
    rows = {row["name"]: row for row in MT.mismatch_summary(results)["rl"]}
    steps = np.diff(runs["samples"])
    for name in runs["conditions"]:
        curves, row = runs[name], rows[name]
        finals = [c[-1] for c in curves["accuracy"]]
        reference = [c[-1] for c in runs["fp32 none"]["accuracy"]]
        uncorrected = [c[-1] for c in runs["int4 none"]["accuracy"]]
        assert row["final_accuracy"]["per_seed"] == finals
        assert row["difference"]["per_seed"] == [a - r for a, r in zip(finals, reference)]
        assert row["against_uncorrected"]["per_seed"] == [
            a - r for a, r in zip(finals, uncorrected)]
        for key in ("mismatch_kl", "kept_fraction"):
            expected = [float(np.dot(steps, c[1:]) / steps.sum()) for c in curves[key]]
            assert row[key]["per_seed"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        for stat in row.values():
            if isinstance(stat, dict):
                assert min(stat["per_seed"]) <= stat["low"] <= stat["high"] <= max(
                    stat["per_seed"])
    dropped = {**runs, "int4 none": {**runs["int4 none"],
                                     "accuracy": runs["int4 none"]["accuracy"][:-1]}}
    if len(dropped["int4 none"]["accuracy"]):  # a seed fewer in one condition: refused
        with pytest.raises(ValueError, match=r"\['int4 none'\]\['accuracy'\] must have one curve"):
            MT.mismatch_summary(dict(results, methods={"rl": dropped}))
