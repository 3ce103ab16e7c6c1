"""Property tests of ``opd_literate.mismatch.correction`` (Hypothesis), as tests/opd has for opd.

Cases: shapes with B or T = 0, every float dtype (and mixed ones), ragged, empty and full
masks of bool, integer and floating dtype, log-ratios up to 1e3, advantages up to 1e3 of shape
(B, T) or (B,), and ``-inf``, ``inf`` or NaN at the masked-out positions; options drawn from
every level, mode, criterion, reduction and estimator, with thresholds at their extremes
(1e-40, 5e-324, 1e39, inf, reversed bands). Every public function of the module must

* return finite values, metrics and gradients, or raise a ValueError / TypeError whose message
  names the argument, exactly where the test's own reading says the input is invalid;
* give the same values and gradients whatever the masked-out positions hold, with exactly 0
  there (weights and gradients) and ``keep`` False;
* return tensors of the compute dtype (float32 for half-precision inputs, else the promoted
  dtype) on the inputs' device, even under a ``meta`` default device; a half-precision input
  gives the same values as its exact float32 copy (it is computed in float32);
* refuse NaN inside the mask with an error naming the argument.

The example count comes from the Hypothesis profile (conftest.py): "fast" (25) in the normal
run, ``--hypothesis-profile=ci`` (1,000) in .ci/run. The table of malformed calls and the
regression tests of the defects the fuzzing found close the file.
"""

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch import correction as C
from opd_literate.opd import REDUCTIONS

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
HALF = (torch.float16, torch.bfloat16)
GARBAGE = [0.0, -math.inf, math.inf, math.nan]


def compute_dtype(*dtypes):
    """The dtype the module must compute in, read independently of _numerics."""
    wide = dtypes[0]
    for d in dtypes[1:]:
        wide = torch.promote_types(wide, d)
    return torch.float32 if wide in HALF else wide


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------
@st.composite
def batches(draw):
    """(trainer, sampler, advantages, mask) with garbage at the masked-out positions."""
    B, T = draw(st.integers(0, 3)), draw(st.integers(0, 5))
    dtype = draw(st.sampled_from(DTYPES))
    sampler_dtype = draw(st.sampled_from([dtype, dtype, torch.float32, torch.float64]))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3]))  # the largest |log rho_t|
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask = g.random((B, T)) < draw(st.sampled_from([0.0, 0.5, 0.8, 1.0]))  # 0: empty, 1: full
    trainer = -scale * g.random((B, T))
    sampler = -scale * g.random((B, T))
    per_response = draw(st.booleans())
    advantages = draw(st.sampled_from([1.0, 1e3])) * g.standard_normal(
        (B,) if per_response else (B, T))
    mask_dtype = draw(st.sampled_from([torch.bool, torch.int64, torch.float32, torch.float16]))
    mask_t = torch.from_numpy(mask)
    case = {
        "trainer": torch.from_numpy(trainer).to(dtype),
        "sampler": torch.from_numpy(sampler).to(sampler_dtype),
        "advantages": torch.from_numpy(advantages).to(draw(st.sampled_from(DTYPES))),
        "mask": mask_t.to(mask_dtype),
        "bool_mask": mask_t,
    }
    return with_garbage(case, draw(st.sampled_from(GARBAGE)), g)


def with_garbage(case, value, g):
    """The case with ``value`` at a random half of the masked-out positions of every tensor."""
    out = dict(case)
    padding = ~case["bool_mask"]
    for name in ("trainer", "sampler", "advantages"):
        x = case[name].clone()
        spots = padding & torch.from_numpy(g.random(padding.shape) < 0.5)
        if x.ndim == 1:  # per-response advantages: garbage on the responses without a token
            spots = padding.all(dim=1) & torch.from_numpy(g.random(x.shape) < 0.5)
        x[spots] = value
        out[name] = x
    return out


THRESHOLDS = [5e-324, 1e-300, 1e-40, 1e-8, 0.5, 1.0, 2.0, 1e30, 1e39, math.inf]
LOWERS = [None, 0.0, 5e-324, 1e-40, 0.5, 1.0, 3.0]


@st.composite
def is_options(draw):
    mode = draw(st.sampled_from(C.IS_MODES))
    return {
        "rollout_is": draw(st.sampled_from(C.IS_LEVELS)),
        "rollout_is_threshold": draw(st.sampled_from(THRESHOLDS)),
        "mode": mode,
        "lower": draw(st.sampled_from(LOWERS)) if mode != "truncate" else None,
        "rollout_is_batch_normalize": draw(st.booleans()),
    }


def is_error(options, dtype):
    """The argument a valid call must be refused for, or None (the test's own reading)."""
    high, lower = options["rollout_is_threshold"], options["lower"]
    info = torch.finfo(dtype)
    if lower is not None and lower > high:
        return "lower"
    if math.isfinite(high) and not info.tiny <= high <= info.max:
        return "rollout_is_threshold"
    return None


RS_BOUNDS = ["1e-300", "0.001", "0.5", "1", "2", "1e3", "1e300", "0.5_2", "2_0.5", "0.999_1.001"]


@st.composite
def rs_options(draw):
    options = draw(st.lists(st.sampled_from(C.RS_OPTIONS), min_size=1, max_size=3, unique=True))
    single = [b for b in RS_BOUNDS if "_" not in b]  # the criteria other than k1 take one bound
    if draw(st.booleans()):  # one threshold shared by every criterion
        choices = RS_BOUNDS if all(o.endswith("k1") for o in options) else single
        threshold = draw(st.sampled_from(choices))
        if "_" not in threshold and draw(st.booleans()):
            threshold = float(threshold)  # a number, not a string
    else:
        threshold = ",".join(draw(st.sampled_from(RS_BOUNDS if o.endswith("k1") else single))
                             for o in options)
    return ",".join(options), threshold


def rs_error(rollout_rs, threshold):
    """True where a k1 criterion gets an empty band: a single h < 1, or 'a_b' with a > b."""
    options = rollout_rs.split(",")
    specs = str(threshold).split(",")
    specs = specs * len(options) if len(specs) == 1 else specs
    for option, spec in zip(options, specs):
        if option.endswith("k1"):
            if "_" in spec:
                a, b = (float(v) for v in spec.split("_"))
            else:
                b = float(spec)
                a = 1 / b
            if a > b:
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Checks shared by the properties
# ---------------------------------------------------------------------------------------------
def tensors_of(value):
    """The tensors and floats of an output (a tensor, a (tensor, dict), a Correction, a dict)."""
    if isinstance(value, torch.Tensor):
        return {"": value}, {}
    if isinstance(value, dict):
        return {}, value
    if isinstance(value, C.Correction):
        return {"weights": value.weights, "keep": value.keep}, value.metrics
    tensor, metrics = value
    return {"": tensor}, metrics


def check_output(name, value, case, dtype):
    """Finite, of the compute dtype, on the CPU, exactly 0 (or False) off the mask."""
    tensors, metrics = tensors_of(value)
    padding = ~case["bool_mask"]
    for key, t in tensors.items():
        assert t.device.type == "cpu", (name, key, t.device)
        if t.dtype == torch.bool:
            assert not t[padding].any(), (name, key)
            continue
        assert t.dtype == dtype, (name, key, t.dtype, dtype)
        assert torch.isfinite(t).all(), (name, key, t)
        if t.ndim == 2:
            assert (t[padding] == 0).all(), (name, key)
    for key, v in metrics.items():
        assert isinstance(v, float) and math.isfinite(v), (name, key, v)


def check_gradient(name, grad, case):
    """A finite gradient, exactly 0 off the mask (fp16 may overflow: see check_half)."""
    padding = ~case["bool_mask"]
    if grad is None:
        return
    assert (grad[padding] == 0).all(), name
    if grad.dtype != torch.float16:
        assert torch.isfinite(grad).all(), name


def same(a, b):
    """Bit-equal outputs: the masked-out positions are selected away before any arithmetic, so
    two runs on this machine that differ only there compute the same floats."""
    ta, ma = tensors_of(a)
    tb, mb = tensors_of(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta) and ma == mb


def run(fn, trainer, *args, grad=True, **kwargs):
    """The output and the gradient in trainer_logp of one call (None where it has none)."""
    x = trainer.clone().requires_grad_(grad)
    out = fn(x, *args, **kwargs)
    tensors, _ = tensors_of(out)
    total = sum(t.sum() for t in tensors.values() if t.requires_grad)
    if not grad or not torch.is_tensor(total):
        return out, None
    (g,) = torch.autograd.grad(total, x, allow_unused=True)
    return out, g


def half_matches_float32(fn, case, *args, **kwargs):
    """A half-precision input gives the values (and gradient, rounded) of its float32 copy."""
    t, s = case["trainer"], case["sampler"]
    out, g = run(fn, t, s, *args, **kwargs)
    out32, g32 = run(fn, t.float() if t.dtype in HALF else t,
                     s.float() if s.dtype in HALF else s, *args, **kwargs)
    assert same(out, out32), fn.__name__
    if g is not None:
        assert g.dtype == t.dtype and torch.equal(g, g32.to(t.dtype)), fn.__name__
        assert torch.isfinite(g32).all(), fn.__name__


# ---------------------------------------------------------------------------------------------
# Properties: weights, rejection, diagnostics
# ---------------------------------------------------------------------------------------------
def weight_calls(case, is_opts, rs, veto):
    """name -> (function, extra arguments, keyword arguments, expected error argument)."""
    rollout_rs, rs_threshold = rs
    dtype = compute_dtype(case["trainer"].dtype, case["sampler"].dtype)
    calls = {f"log_ratios {level}": (C.log_ratios, (case["mask"], level), {}, None)
             for level in C.IS_LEVELS}
    calls["importance_weights"] = (C.importance_weights, (case["mask"],), is_opts,
                                   is_error(is_opts, dtype))
    calls["rejection_mask"] = (C.rejection_mask, (case["mask"], rollout_rs, rs_threshold), {},
                               "rollout_rs_threshold" if rs_error(*rs) else None)
    calls["veto_mask"] = (C.veto_mask, (case["mask"],), {"veto_threshold": veto}, None)
    calls["offpolicy_metrics"] = (C.offpolicy_metrics, (case["mask"],), {}, None)
    calls["rollout_correction"] = (
        C.rollout_correction, (case["mask"],),
        dict(is_opts, rollout_rs=rollout_rs, rollout_rs_threshold=rs_threshold,
             veto_threshold=veto),
        is_error(is_opts, dtype) or ("rollout_rs_threshold" if rs_error(*rs) else None))
    return calls


# The slowest of the file's properties: the slow tier runs it (and .ci/run's property step
# at 1,000 examples), which keeps the README's command under a minute on 2 cores.
@pytest.mark.slow
@pytest.mark.properties
@given(batches(), is_options(), rs_options(), st.sampled_from([1e-300, 1e-4, 0.5, 1.0, 1e300]),
       st.data())
def test_weights_rejection_and_metrics(case, is_opts, rs, veto, data):
    dtype = compute_dtype(case["trainer"].dtype, case["sampler"].dtype)
    dirty = with_garbage(case, data.draw(st.sampled_from(GARBAGE)),
                         np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    for name, (fn, args, kwargs, error) in weight_calls(case, is_opts, rs, veto).items():
        if error is not None:
            with pytest.raises(ValueError, match=error):
                fn(case["trainer"], case["sampler"], *args, **kwargs)
            continue
        with torch.device("meta"):  # a tensor created without device= would land on meta
            out, grad = run(fn, case["trainer"], case["sampler"], *args, **kwargs)
        check_output(name, out, case, dtype)
        check_gradient(name, grad, case)
        out2, grad2 = run(fn, dirty["trainer"], dirty["sampler"], *args, **kwargs)
        assert same(out, out2), name
        assert (grad is None) == (grad2 is None) and (grad is None or torch.equal(grad, grad2))
        if case["trainer"].dtype in HALF or case["sampler"].dtype in HALF:
            half_matches_float32(fn, case, *args, **kwargs)


@pytest.mark.properties
@given(batches(), is_options())
def test_the_effective_sample_size_is_in_0_1_and_0_only_without_weight(case, is_opts):
    """importance_weights' docstring: mean(u)^2 / mean(u^2) of the applied weights, in (0, 1]
    when one is above 0 (whatever their scale: caps down to 5e-324), 0 when none is."""
    opts = dict(is_opts, rollout_is_batch_normalize=False)  # the metrics' weights, returned
    dtype = compute_dtype(case["trainer"].dtype, case["sampler"].dtype)
    if is_error(opts, dtype):
        return
    w, metrics = C.importance_weights(case["trainer"], case["sampler"], case["mask"], **opts)
    mask = case["bool_mask"]
    if not mask.any():
        assert metrics == {}
        return
    u, ess = w[mask].double(), metrics["rollout_is_eff_sample_size"]
    if not (u > 0).any():
        assert ess == 0.0
        return
    v = u / u.max()
    expected = float(v.mean() ** 2 / v.square().mean())
    assert 0 < ess <= 1
    assert ess == pytest.approx(expected, rel=1e-5 if dtype == torch.float32 else 1e-12)


# ---------------------------------------------------------------------------------------------
# Properties: the losses and the KL penalty
# ---------------------------------------------------------------------------------------------
CLIPS = [0.0, 0.2, 1.0, 1e3, 1e39]


@st.composite
def loss_calls(draw, case):
    A, mask = case["advantages"], case["mask"]
    reduction = draw(st.sampled_from(REDUCTIONS))
    clip = {"clip_ratio": draw(st.sampled_from(CLIPS)),
            "clip_ratio_low": draw(st.sampled_from([None] + CLIPS)),
            "clip_ratio_high": draw(st.sampled_from([None] + CLIPS))}
    B, T = case["bool_mask"].shape
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    weights = draw(st.sampled_from([1.0, 1e3])) * g.random((B, T))
    weights[~case["bool_mask"].numpy()] = draw(st.sampled_from(GARBAGE))  # off the mask: anything
    weights = torch.from_numpy(weights).to(draw(st.sampled_from(DTYPES)))
    return {
        "ppo_clip_loss": (C.ppo_clip_loss, (case["sampler"], A, mask),
                          dict(clip, reduction=reduction,
                               clip_ratio_c=draw(st.sampled_from([1.0 + 1e-6, 3.0, 1e39,
                                                                  math.inf])))),
        "cispo_loss": (C.cispo_loss, (case["sampler"], A, mask), dict(clip, reduction=reduction)),
        "gspo_loss": (C.gspo_loss, (case["sampler"], A, mask),
                      {"clip_ratio_low": clip["clip_ratio_low"] or 3e-4,
                       "clip_ratio_high": clip["clip_ratio_high"] or 4e-4,
                       "reduction": reduction}),
        "reinforce_loss": (lambda t, a, m, **kw: C.reinforce_loss(t, a, m, **kw),
                           (A, mask), {"weights": draw(st.sampled_from([None, weights])),
                                       "reduction": reduction}),
        **{f"dppo_{d}_loss": (getattr(C, f"dppo_{d}_loss"), (case["sampler"], A, mask),
                              dict(clip, reduction=reduction, clip_ratio_c=draw(
                                  st.sampled_from([1e-6, 1.0, 3.0, 1e39, math.inf]))))
           for d in ("tv", "kl")},
        "dro_loss": (C.dro_loss, (case["sampler"], A, mask),
                     {"dro_beta": draw(st.sampled_from([1e-3, 0.05, 1.0, 100.0])),
                      "reduction": reduction}),
    }


@pytest.mark.properties
@given(batches(), st.data())
def test_losses(case, data):
    calls = data.draw(loss_calls(case))
    dirty = with_garbage(case, data.draw(st.sampled_from(GARBAGE)),
                         np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    dtype = compute_dtype(case["trainer"].dtype, case["sampler"].dtype)
    for name, (fn, args, kwargs) in calls.items():
        if name == "reinforce_loss":
            loss_dtype = compute_dtype(case["trainer"].dtype)
            dirty_args = (dirty["advantages"], case["mask"])
        else:
            loss_dtype = dtype
            dirty_args = (dirty["sampler"], dirty["advantages"], case["mask"])
        with torch.device("meta"):
            out, grad = run(fn, case["trainer"], *args, **kwargs)
        check_output(name, out, case, loss_dtype)
        assert tensors_of(out)[0][""].ndim == 0, name
        check_gradient(name, grad, case)
        out2, grad2 = run(fn, dirty["trainer"], *dirty_args, **kwargs)
        assert same(out, out2) and torch.equal(grad, grad2), name
        if case["trainer"].dtype in HALF:
            t32 = case["trainer"].float()
            args32 = args if name == "reinforce_loss" else (
                case["sampler"].float() if case["sampler"].dtype in HALF else case["sampler"],
            ) + args[1:]
            out32, g32 = run(fn, t32, *args32, **kwargs)
            assert same(out, out32), name
            assert torch.isfinite(g32).all() and torch.equal(grad, g32.to(grad.dtype)), name


@pytest.mark.properties
@given(batches(), st.sampled_from(C.KL_PENALTIES), st.sampled_from([0.0, 100.0, 1000.0]),
       st.data())
def test_kl_penalty(case, kind, shift, data):
    # the shift puts d = trainer_logp - ref_logp near and beyond float32's and float64's e^{-d}
    case = dict(case, sampler=case["sampler"] + shift)
    trainer, ref, mask = case["trainer"], case["sampler"], case["mask"]
    dtype = compute_dtype(trainer.dtype, ref.dtype)
    # k3's value e^{-d} - 1 + d overflows where -d > log(max): refused, never inf; its gradient
    # 1 - e^{-d} comes back in the trainer's dtype, which may be narrower (fp16 beside float64)
    d = (trainer.double() - ref.double())[case["bool_mask"]]
    log_max = math.log(torch.finfo(dtype).max)
    if kind == "k3":
        log_max = min(log_max, math.log(torch.finfo(trainer.dtype).max))
    overflow = kind.startswith("k3") and d.numel() > 0 and -d.min().item() > log_max + 1
    fits = not kind.startswith("k3") or d.numel() == 0 or -d.min().item() < log_max - 1
    try:
        with torch.device("meta"):
            out, grad = run(C.kl_penalty, trainer, ref, mask, kind)
    except ValueError as error:
        assert not fits and "overflows" in str(error), (kind, error)
        return
    assert not overflow, kind
    check_output(kind, out, case, dtype)
    check_gradient(kind, grad, case)
    dirty = with_garbage(case, data.draw(st.sampled_from(GARBAGE)),
                         np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    out2, grad2 = run(C.kl_penalty, dirty["trainer"], dirty["sampler"], mask, kind)
    assert torch.equal(out, out2) and torch.equal(grad, grad2), kind
    if trainer.dtype in HALF or ref.dtype in HALF:
        half_matches_float32(C.kl_penalty, case, mask, kind)


# ---------------------------------------------------------------------------------------------
# Properties: DPPO and DRO
# ---------------------------------------------------------------------------------------------
DPPO_DRO = ("dppo_tv_loss", "dppo_kl_loss", "dro_loss")


@st.composite
def dppo_dro_options(draw, name):
    if name == "dro_loss":
        return {"dro_beta": draw(st.sampled_from([1e-3, 0.05, 1.0, 100.0]))}
    return {"clip_ratio_low": draw(st.sampled_from([0.0, 0.01, 0.2, 1.0, math.inf])),
            "clip_ratio_high": draw(st.sampled_from([0.0, 0.01, 0.2, 1.0, math.inf])),
            "clip_ratio_c": draw(st.sampled_from([1e-6, 1.0, 3.0, 1e39, math.inf]))}


def normaliser(mask, reduction):
    """d loss / d (token b, t's loss) of each reduction, written out (as in test_correction)."""
    B, T = mask.shape
    mask = mask.double()
    n_b = mask.sum(1, keepdim=True).clamp_min(1)
    return {
        "token-mean": torch.full_like(mask, 1.0 / max(float(mask.sum()), 1.0)),
        "seq-mean-token-sum": torch.full_like(mask, 1.0 / max(B, 1)),
        "seq-mean-token-mean": (1.0 / (max(B, 1) * n_b)).expand(B, T),
        "seq-mean-token-sum-norm": torch.full_like(mask, 1.0 / max(B * T, 1)),
        "sum": torch.ones_like(mask),
        "token-sum": torch.ones_like(mask),
        "token-sum-norm": torch.full_like(mask, 1.0 / max(T, 1)),
    }[reduction] * mask


def float64_case(case):
    """The case's tensors in float64 (exact copies): the properties below compare to 1e-12."""
    return dict(case, trainer=case["trainer"].double(), sampler=case["sampler"].double(),
                advantages=case["advantages"].double())


@pytest.mark.properties
@given(batches(), st.sampled_from(DPPO_DRO), st.sampled_from(["trainer_logp", "sampler_logp"]),
       st.sampled_from([1e-3, 0.5, 30.0, 1e4]), st.data())
def test_dppo_and_dro_refuse_a_positive_log_probability_inside_the_mask_only(case, name,
                                                                            argument, value,
                                                                            data):
    """A value above 0 at one position inside the mask is refused, naming the argument and the
    position; the same value at every position off the mask changes no bit of the loss, the
    metrics or the gradient."""
    fn, options = getattr(C, name), data.draw(dppo_dro_options(name))
    key = {"trainer_logp": "trainer", "sampler_logp": "sampler"}[argument]
    mask = case["bool_mask"]
    args = (case["advantages"], case["mask"])
    out, grad = run(fn, case["trainer"], case["sampler"], *args, **options)
    padding = {k: case[k].masked_fill(~mask, value) for k in ("trainer", "sampler")}
    out2, grad2 = run(fn, padding["trainer"], padding["sampler"], *args, **options)
    assert same(out, out2) and torch.equal(grad, grad2), name
    if not mask.any():
        return
    b, t = data.draw(st.sampled_from(mask.nonzero().tolist()))
    bad = dict(case)
    bad[key] = case[key].clone()
    bad[key][b, t] = value
    with pytest.raises(ValueError, match=rf"^{argument} must be <= 0 where mask is 1 \(a "
                                         rf"log-probability: .*\), got .* at position "
                                         rf"\({b}, {t}\)$"):
        fn(bad["trainer"], bad["sampler"], *args, **options)


@pytest.mark.properties
@given(batches(), st.sampled_from(DPPO_DRO), st.data())
def test_dppo_and_dro_reductions_agree_response_by_response(case, name, data):
    """A response's loss and gradient depend on its own tokens only (the loss under a mask of
    that row alone), and every reduction is its formula of the per-response sums S_b, its
    gradient the gradient of "sum" times the normaliser (float64, to 1e-12)."""
    case = float64_case(case)
    fn, options = getattr(C, name), data.draw(dppo_dro_options(name))
    trainer, sampler, A, mask = (case[k] for k in ("trainer", "sampler", "advantages",
                                                   "bool_mask"))
    B, T = mask.shape
    (total, _), grad_sum = run(fn, trainer, sampler, A, case["mask"], reduction="sum",
                               **options)
    S = torch.zeros(B, dtype=torch.float64)
    for b in range(B):
        row = torch.zeros_like(mask)
        row[b] = mask[b]
        (loss, _), grad = run(fn, trainer, sampler, A, row, reduction="sum", **options)
        S[b] = loss.detach()
        assert (grad[~row] == 0).all() and torch.equal(grad[row], grad_sum[row]), name
    n = mask.sum(1).clamp_min(1).double()
    N, B1, T1 = max(float(mask.sum()), 1.0), max(B, 1), max(T, 1)
    expected = {"sum": S.sum(), "token-sum": S.sum(), "token-mean": S.sum() / N,
                "seq-mean-token-sum": S.sum() / B1, "seq-mean-token-mean": (S / n).sum() / B1,
                "seq-mean-token-sum-norm": S.sum() / (B1 * T1), "token-sum-norm": S.sum() / T1}
    scale = 1e-12 * max(1.0, float(S.abs().sum()), float(grad_sum.abs().sum()))
    torch.testing.assert_close(total.detach(), S.sum(), rtol=1e-12, atol=scale)
    for reduction in REDUCTIONS:
        (loss, _), grad = run(fn, trainer, sampler, A, case["mask"], reduction=reduction,
                              **options)
        torch.testing.assert_close(loss.detach(), expected[reduction], rtol=1e-12, atol=scale)
        torch.testing.assert_close(grad, grad_sum * normaliser(mask, reduction), rtol=1e-12,
                                   atol=scale)


@pytest.mark.properties
@given(batches(), st.sampled_from(["dppo_tv_loss", "dppo_kl_loss"]),
       st.sampled_from([0.0, 0.01, 0.1, 1.0]), st.data())
def test_dppo_weights_are_0_or_the_truncated_ratio_and_a_wider_region_keeps_more(case, name,
                                                                                  widen, data):
    """-grad / A (reduction "sum") is 0 or min(r_t, c) with r_t = exp(clamp(log rho_t, +-20));
    widening both thresholds keeps every token it kept, and an infinite region removes none."""
    case = float64_case(case)
    fn, options = getattr(C, name), data.draw(dppo_dro_options(name))
    trainer, sampler, mask = case["trainer"], case["sampler"], case["bool_mask"]
    B, T = mask.shape
    A = case["advantages"]
    A = (A[:, None].expand(B, T) if A.ndim == 1 else A).masked_fill(~mask, 0.0)
    ratio = torch.exp((trainer - sampler).clamp(-20.0, 20.0)).masked_fill(~mask, 0.0)
    truncated = torch.clamp(ratio, max=min(options["clip_ratio_c"], math.exp(21.0)))
    kept = {}
    for extra in (0.0, widen, math.inf):
        wider = dict(options, clip_ratio_low=options["clip_ratio_low"] + extra,
                     clip_ratio_high=options["clip_ratio_high"] + extra)
        (_, metrics), grad = run(fn, trainer, sampler, case["advantages"], case["mask"],
                                 reduction="sum", **wider)
        moved = mask & (A != 0)
        weight = torch.where(moved, -grad / torch.where(moved, A, 1.0), 0.0)
        inside = moved & (weight != 0)
        torch.testing.assert_close(weight[inside], truncated[inside], rtol=1e-12, atol=0)
        kept[extra] = inside, metrics["actor/pg_clipfrac"]
    assert not (kept[0.0][0] & ~kept[widen][0]).any() and kept[widen][1] <= kept[0.0][1]
    assert kept[math.inf][1] == 0.0 and torch.equal(kept[math.inf][0], mask & (A != 0))


@pytest.mark.properties
@given(batches(), st.sampled_from([1e-3, 0.05, 1.0, 100.0]))
def test_dro_gradient_is_minus_a_plus_beta_times_the_log_ratio(case, beta):
    """Reduction "sum": -A + beta (log pi - log mu) on every valid token, 0 off the mask."""
    case = float64_case(case)
    trainer, sampler, mask = case["trainer"], case["sampler"], case["bool_mask"]
    B, T = mask.shape
    A = case["advantages"]
    A = A[:, None].expand(B, T) if A.ndim == 1 else A
    _, grad = run(C.dro_loss, trainer, sampler, case["advantages"], case["mask"],
                  dro_beta=beta, reduction="sum")
    expected = torch.where(mask, -A + beta * (trainer - sampler), 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Properties: NaN inside the mask
# ---------------------------------------------------------------------------------------------
NAN_CALLS = {
    "trainer_logp": lambda c: C.importance_weights(c["trainer"], c["sampler"], c["mask"]),
    "sampler_logp": lambda c: C.rollout_correction(c["trainer"], c["sampler"], c["mask"],
                                                   rollout_rs="token_k1",
                                                   rollout_rs_threshold=2.0),
    "ref_logp": lambda c: C.kl_penalty(c["trainer"], c["sampler"], c["mask"], "k3"),
    "advantages": lambda c: C.ppo_clip_loss(c["trainer"], c["sampler"], c["advantages"],
                                            c["mask"]),
    "weights": lambda c: C.reinforce_loss(c["trainer"], c["advantages"], c["mask"],
                                          weights=c["weights"]),
}
WHERE = {"trainer_logp": "trainer", "sampler_logp": "sampler", "ref_logp": "sampler",
         "advantages": "advantages", "weights": "weights"}


@pytest.mark.properties
@given(batches(), st.sampled_from(sorted(NAN_CALLS)), st.sampled_from([math.nan, math.inf,
                                                                        -math.inf]),
       st.data())
def test_a_non_finite_value_inside_the_mask_is_an_error_naming_the_argument(case, argument,
                                                                            value, data):
    mask = case["bool_mask"]
    if not mask.any():
        return
    case = dict(case, weights=torch.ones(mask.shape, dtype=case["trainer"].dtype))
    b, t = data.draw(st.sampled_from(mask.nonzero().tolist()))
    x = case[WHERE[argument]].clone()
    x[(b,) if x.ndim == 1 else (b, t)] = value
    case[WHERE[argument]] = x
    with pytest.raises(ValueError, match=rf"\b{argument} must be finite"):
        NAN_CALLS[argument](case)


# ---------------------------------------------------------------------------------------------
# Properties: option strings
# ---------------------------------------------------------------------------------------------
def strict_number(text):
    """The test's reading of one bound: what float() reads, without its leniencies."""
    if text != text.strip() or "_" in text or not text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


@pytest.mark.properties
@given(st.sampled_from(["token_k1", "seq_mean_k1", "token_k3", "seq_max_k2"]),
       st.text(alphabet="0123456789._,eE+- infa", max_size=12))
def test_a_threshold_string_is_read_strictly_or_refused(option, text):
    trainer, sampler = torch.zeros(1, 2), torch.zeros(1, 2)
    try:
        C.rejection_mask(trainer, sampler, torch.ones(1, 2), option, text)
    except ValueError as error:
        assert "rollout_rs_threshold" in str(error), error
        accepted = False
    else:
        accepted = True
    # the independent reading: one entry; k1 takes "a_b" or h (the band [1/h, h]), with
    # 0 < a <= b, a finite and b possibly inf (no bound on that side, as verl reads it), h
    # finite; the others one positive number, inf included (no rejection); NaN never
    entry = text.strip()
    if option.endswith("k1") and entry.count("_") == 1:
        bounds = [strict_number(v.strip()) for v in entry.split("_")]
    else:
        h = strict_number(entry)
        bounds = [None if h is None or h == 0 else 1 / h, h] if option.endswith("k1") else [h]
    valid = "," not in entry and all(v is not None and 0 < v for v in bounds) \
        and bounds == sorted(bounds) and (not option.endswith("k1") or math.isfinite(bounds[0]))
    assert accepted == valid, (option, text)


# ---------------------------------------------------------------------------------------------
# Malformed calls
# ---------------------------------------------------------------------------------------------
def _batch():
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(2, 3, generator=g, dtype=torch.float64)
    sampler = -torch.rand(2, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return trainer, sampler, mask, torch.tensor([1.0, -1.0], dtype=torch.float64)


NAN = math.nan
MALFORMED = [
    # tensors: type, dtype, ndim, shape, mask values
    (lambda t, s, m, a: C.log_ratios(t.numpy(), s, m), TypeError, "trainer_logp must be a torch"),
    (lambda t, s, m, a: C.log_ratios(t, s.long(), m), TypeError, "sampler_logp must have a float"),
    (lambda t, s, m, a: C.log_ratios(t, s.to(torch.complex64), m), TypeError, "sampler_logp"),
    (lambda t, s, m, a: C.log_ratios(t[0], s[0], m[0]), ValueError, "2 dimensions"),
    (lambda t, s, m, a: C.log_ratios(t, s.T, m), ValueError, "same shape"),
    (lambda t, s, m, a: C.log_ratios(t, s, m[:, :2]), ValueError, "mask must have the shape"),
    (lambda t, s, m, a: C.log_ratios(t, s, m.tolist()), TypeError, "mask must be a torch"),
    (lambda t, s, m, a: C.log_ratios(t, s, m * 0.5), ValueError, "mask values must be 0 or 1"),
    (lambda t, s, m, a: C.log_ratios(t, s, m.double().masked_fill(m == 0, NAN)), ValueError,
     "mask values"),
    (lambda t, s, m, a: C.log_ratios(t, s, m.to(torch.complex64)), TypeError, "mask must be"),
    (lambda t, s, m, a: C.log_ratios(t, s, m, "seq"), ValueError, "level"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a.long(), m), TypeError, "advantages"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a[:1], m), ValueError, "advantages must have"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a[:, None], m), ValueError, "advantages must have"),
    (lambda t, s, m, a: C.reinforce_loss(t, a, m, weights=t[:, :2]), ValueError,
     r"^weights must have the same shape as trainer_logp \(2, 3\)"),
    (lambda t, s, m, a: C.reinforce_loss(t, a, m, weights=m), TypeError, "^weights must have a"),
    (lambda t, s, m, a: C.reinforce_loss(t, a, m, weights=t[0]), ValueError,
     "^weights must have 2 dimensions"),
    (lambda t, s, m, a: C.reinforce_loss(t.numpy(), a, m), TypeError,
     "^trainer_logp must be a torch.Tensor"),
    (lambda t, s, m, a: C.reinforce_loss(t[0], a, m[0]), ValueError,
     "^trainer_logp must have 2 dimensions"),
    (lambda t, s, m, a: C.kl_penalty(t, s[:, :2], m), ValueError, "ref_logp must have the same"),
    (lambda t, s, m, a: C.kl_penalty(t, s.long(), m), TypeError, "ref_logp"),
    # importance-weight options
    (lambda t, s, m, a: C.importance_weights(t, s, m, None), ValueError, "rollout_is must be"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, "Token"), ValueError, "rollout_is must be"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, rollout_is_threshold=NAN), ValueError,
     "rollout_is_threshold must be a finite"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, rollout_is_threshold=-1), ValueError,
     "rollout_is_threshold must be > 0"),
    # a string is verl's "upper" or IcePop's "lower_upper"; anything else is refused
    (lambda t, s, m, a: C.importance_weights(t, s, m, rollout_is_threshold="two"), ValueError,
     "rollout_is_threshold must be a number or a string"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, rollout_is_threshold=True), TypeError,
     "rollout_is_threshold"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, rollout_is_threshold=5e-324), ValueError,
     "rollout_is_threshold=5e-324 is outside the normal range of torch.float64"),
    (lambda t, s, m, a: C.importance_weights(t.float(), s.float(), m, rollout_is_threshold=1e39),
     ValueError, "rollout_is_threshold=1e\\+39 is outside the normal range of torch.float32"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, mode="clamp", lower=math.inf), ValueError,
     "lower must be a finite"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, mode="clamp", lower=-0.1), ValueError,
     "lower must be >= 0"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, mode="mask", lower=NAN), ValueError,
     "lower"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, mode="mask", lower=2.5), ValueError,
     "lower must be <= rollout_is_threshold"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, mode="truncate", lower=0.0), ValueError,
     "lower applies"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, rollout_is_batch_normalize=1), TypeError,
     "rollout_is_batch_normalize"),
    (lambda t, s, m, a: C.rollout_correction(t, s, m, mode="clamp"), ValueError,
     "need rollout_is"),
    (lambda t, s, m, a: C.rollout_correction(t, s, m, rollout_is_threshold=NAN), ValueError,
     "rollout_is_threshold"),
    (lambda t, s, m, a: C.rollout_correction(t, s, m, rollout_is_threshold=-2.0), ValueError,
     "rollout_is_threshold"),
    # rejection options: malformed strings are refused, not read as something else
    (lambda t, s, m, a: C.rejection_mask(t, s, m, ["token_k1"], 2.0), TypeError, "rollout_rs"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, " , ", 2.0), ValueError, "at least one"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1;seq_mean_k3", 2.0), ValueError,
     "not verl's"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "Token_K1", 2.0), ValueError, "not verl's"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "seq_max_k1", 2.0), ValueError, "not verl's"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, ",token_k1", 2.0), ValueError,
     "rollout_rs has an empty entry"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1,", 2.0), ValueError,
     "rollout_rs has an empty entry"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1,token_k1", 2.0), ValueError,
     "more than once"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1,seq_mean_k3", ",0.1"), ValueError,
     "rollout_rs_threshold has an empty entry"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1,seq_mean_k3", "2,,0.1"), ValueError,
     "rollout_rs_threshold has an empty entry"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k3", ""), ValueError,
     "must name a threshold"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k3", "2_0"), ValueError,
     "one upper bound"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k3", "1_000"), ValueError,
     "one upper bound"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", "0.5_2_0"), ValueError,
     "k1 takes 'lower_upper'"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", "0.5_2.0_3"), ValueError,
     "k1 takes 'lower_upper'"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", "2.0_0.5"), ValueError,
     "empty band"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "seq_sum_k1", 0.5), ValueError, "empty band"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", 0), ValueError, "positive"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", "-0"), ValueError, "positive"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", "0.5_"), ValueError,
     "not a number"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", "0x10"), ValueError,
     "not a number"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", "inf"), ValueError,
     "whose lower bound 1/h is 0"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", "nan"), ValueError,
     r"must be positive \(or inf\)"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", NAN), ValueError,
     "rollout_rs_threshold must be a finite number"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", 10**400), ValueError,
     "rollout_rs_threshold must be a finite number, got an int of 401 digits"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k1", "inf_inf"), ValueError,
     "has the lower bound inf, which keeps no token"),
    (lambda t, s, m, a: C.importance_weights(t, s, m, rollout_is_threshold=10**400), ValueError,
     "rollout_is_threshold must be a finite number"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", torch.tensor(0.1)), TypeError,
     "rollout_rs_threshold"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", [0.1]), TypeError,
     "rollout_rs_threshold"),
    (lambda t, s, m, a: C.rollout_correction(t, s, m, rollout_rs="token_k2"), TypeError,
     "rollout_rs_threshold"),
    # veto, clip ratios, reductions, estimators
    (lambda t, s, m, a: C.veto_mask(t, s, m, veto_threshold=NAN), ValueError,
     "^veto_threshold must be a finite"),
    (lambda t, s, m, a: C.veto_mask(t, s, m, veto_threshold=math.inf), ValueError,
     "veto_threshold"),
    (lambda t, s, m, a: C.rollout_correction(t, s, m, veto_threshold=-1e-4), ValueError,
     "veto_threshold"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a, m, clip_ratio=-0.1), ValueError,
     "^clip_ratio must be >= 0"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a, m, clip_ratio=NAN), ValueError, "clip_ratio"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a, m, clip_ratio_high=math.inf), ValueError,
     "clip_ratio_high"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a, m, clip_ratio_c=NAN), ValueError,
     "^clip_ratio_c must be a finite"),
    (lambda t, s, m, a: C.ppo_clip_loss(t, s, a, m, clip_ratio_c=0.5), ValueError,
     "clip_ratio_c must be > 1"),
    (lambda t, s, m, a: C.cispo_loss(t, s, a, m, clip_ratio_low="0.2"), TypeError,
     "clip_ratio_low"),
    (lambda t, s, m, a: C.gspo_loss(t, s, a, m, clip_ratio_low=-1e-4), ValueError,
     "^clip_ratio_low must be >= 0"),
    (lambda t, s, m, a: C.gspo_loss(t, s, a, m, reduction="token_mean"), ValueError,
     "reduction"),
    (lambda t, s, m, a: C.reinforce_loss(t, a, m, reduction=None), ValueError, "reduction"),
    (lambda t, s, m, a: C.dppo_tv_loss(t, s, a, m, clip_ratio_high=NAN), ValueError,
     "^clip_ratio_high must be a finite number"),
    (lambda t, s, m, a: C.dppo_tv_loss(t, s, a, m, clip_ratio_low=-1e-3), ValueError,
     "^clip_ratio_low must be >= 0"),
    (lambda t, s, m, a: C.dppo_kl_loss(t, s, a, m, clip_ratio_c=-3.0), ValueError,
     "^clip_ratio_c must be > 0"),
    (lambda t, s, m, a: C.dppo_kl_loss(t, s, a, m, clip_ratio_c="3"), TypeError,
     "^clip_ratio_c must be a real number"),
    (lambda t, s, m, a: C.dppo_kl_loss(t.masked_fill(m > 0, 0.5), s, a, m), ValueError,
     r"^trainer_logp must be <= 0 where mask is 1 .* got 0.5 at position \(0, 0\)"),
    (lambda t, s, m, a: C.dppo_kl_loss(t, s, a.long(), m), TypeError, "advantages"),
    (lambda t, s, m, a: C.dro_loss(t, s, a, m, dro_beta=-1.0), ValueError,
     "^dro_beta must be > 0"),
    (lambda t, s, m, a: C.dro_loss(t, s, a, m, dro_beta=math.inf), ValueError,
     "^dro_beta must be a finite number"),
    (lambda t, s, m, a: C.dro_loss(t, s, a, m, dro_beta=True), TypeError, "^dro_beta"),
    (lambda t, s, m, a: C.dro_loss(t, s, a, m, dro_beta=0.1, reduction="seq-mean"), ValueError,
     "reduction"),
    (lambda t, s, m, a: C.kl_penalty(t, s, m, "K1"), ValueError, "kind"),
    (lambda t, s, m, a: C.kl_penalty(t, s, m, "k2+"), ValueError, "kind"),
    (lambda t, s, m, a: C.kl_penalty(t.float(), s.float() + 100.0, m, "k3"), ValueError,
     "overflows torch.float32"),
    (lambda t, s, m, a: C.kl_penalty(t, s + 1000.0, m, "k3+"), ValueError,
     "overflows torch.float64"),
]


@pytest.mark.parametrize("call, error, message", MALFORMED)
def test_a_malformed_call_gets_an_error_naming_the_problem(call, error, message):
    with pytest.raises(error, match=message):
        call(*_batch())


# ---------------------------------------------------------------------------------------------
# DPPO and DRO: every refusal, compared whole
# ---------------------------------------------------------------------------------------------
def _set(x, index, value):
    x = x.clone()
    x[index] = value
    return x


_WHY = {"dppo_tv_loss": r"DPPO-TV reads p = exp\(log p\) as a probability",
        "dppo_kl_loss": r"DPPO-KL's binary KL needs 1 - p >= 0",
        "dro_loss": r"DRO's value is the log-likelihood of the sampled token"}
_FINITE = r"must be finite where mask is 1 \(a sampled token has a probability > 0\), got "
# (what is changed in the valid batch of _batch(), the error, the whole message as a regex)
_DPPO_DRO_REFUSALS = [
    ("trainer numpy", TypeError, r"trainer_logp must be a torch.Tensor, got ndarray"),
    ("sampler long", TypeError, r"sampler_logp must have a floating dtype, got torch.int64"),
    ("trainer 1-D", ValueError,
     r"trainer_logp must have 2 dimensions, got shape \(3,\) \(1 dimensions\)"),
    ("sampler (2, 2)", ValueError,
     r"sampler_logp must have the same shape as trainer_logp \(2, 3\), got \(2, 2\)"),
    ("mask (2, 2)", ValueError, r"mask must have the shape of trainer_logp \(2, 3\), got \(2, 2\)"),
    ("mask list", TypeError, r"mask must be a torch.Tensor, got list"),
    ("mask 2", ValueError, r"mask values must be 0 or 1, found 2"),
    ("trainer nan", ValueError, r"trainer_logp " + _FINITE + r"nan at position \(0, 1\)"),
    ("sampler -inf", ValueError, r"sampler_logp " + _FINITE + r"-inf at position \(1, 0\)"),
    ("trainer 0.5", ValueError, r"trainer_logp must be <= 0 where mask is 1 \(a "
     r"log-probability: {why}\), got 0.5 at position \(0, 1\)"),
    ("sampler 2", ValueError, r"sampler_logp must be <= 0 where mask is 1 \(a "
     r"log-probability: {why}\), got 2.0 at position \(1, 0\)"),
    ("advantages (3,)", ValueError, r"advantages must have shape \(B, T\) = \(2, 3\) or "
     r"\(B,\) = \(2,\), got \(3,\)"),
    ("advantages long", TypeError, r"advantages must have a floating dtype, got torch.int64"),
    ("advantages nan", ValueError,
     r"advantages must be finite where mask is 1, got nan at position \(1, 0\)"),
    ("reduction mean", ValueError, r"reduction must be one of .*, got 'mean'"),
]


def _refusal_call(change, t, s, m, a):
    """The arguments of _batch() with one change: every other check passes."""
    tensors = {"trainer": t, "sampler": s, "mask": m, "advantages": a}
    what, how = change.split(" ", 1)
    kwargs = {}
    if what == "reduction":
        kwargs["reduction"] = how
    elif how == "numpy":
        tensors[what] = tensors[what].numpy()
    elif how == "long":
        tensors[what] = tensors[what].long()
    elif how == "list":
        tensors[what] = tensors[what].tolist()
    elif how == "1-D":
        tensors[what] = tensors[what][0]
    elif how in ("(2, 2)", "(3,)"):
        tensors[what] = (tensors[what][:, :2] if how == "(2, 2)"
                         else torch.zeros(3, dtype=torch.float64))
    else:  # a value at a position inside the mask ((0, 1) or (1, 0); row 1 of a is (1, 0))
        index = {"trainer": (0, 1), "sampler": (1, 0), "mask": (0, 1), "advantages": 1}[what]
        tensors[what] = _set(tensors[what], index, float(how))
    return (tensors["trainer"], tensors["sampler"], tensors["advantages"], tensors["mask"]), kwargs


@pytest.mark.parametrize("name", DPPO_DRO)
@pytest.mark.parametrize("change, error, message", _DPPO_DRO_REFUSALS)
def test_every_dppo_and_dro_refusal_names_the_argument(name, change, error, message):
    fn = getattr(C, name)
    options = {"dro_beta": 0.5} if name == "dro_loss" else {}
    args, kwargs = _refusal_call(change, *_batch())
    fn(*_refusal_call("reduction sum", *_batch())[0], **options)  # the valid call passes
    with pytest.raises(error) as caught:
        fn(*args, **options, **kwargs)
    assert re.fullmatch(message.format(why=_WHY[name]), str(caught.value)), str(caught.value)


# ---------------------------------------------------------------------------------------------
# Regression tests of the defects the fuzzing found
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", C.IS_LEVELS)
def test_batch_normalised_weights_of_an_empty_batch(level):
    # T = 0: max over the response's tokens was an IndexError for the sequence levels
    empty = torch.zeros(2, 0)
    w, metrics = C.importance_weights(empty, empty, empty, level, rollout_is_batch_normalize=True)
    assert w.shape == (2, 0) and metrics == {"rollout_is_batch_norm_factor": 1.0}


@pytest.mark.parametrize("option", C.RS_OPTIONS)
def test_rejection_of_an_empty_batch(option):
    # T = 0: seq_max_k2 and seq_max_k3 took a max over an empty dimension (IndexError)
    empty = torch.zeros(3, 0)
    keep, metrics = C.rejection_mask(empty, empty, empty, option, 2.0)
    assert keep.shape == (3, 0) and keep.dtype == torch.bool and metrics == {}


def test_an_all_padding_batch_rejects_nothing_and_reports_nothing():
    trainer, sampler = torch.zeros(2, 3), torch.full((2, 3), -5.0)
    keep, metrics = C.rejection_mask(trainer, sampler, torch.zeros(2, 3), "seq_max_k3", 0.1)
    assert not keep.any() and metrics == {}


@pytest.mark.parametrize("threshold", [1e-40, 1e-300, 1e39])
def test_a_float32_cap_outside_float32_is_named_and_fine_in_float64(threshold):
    # torch said "value cannot be converted to type float without overflow" (1e-40 through
    # the metrics' lower bound 1/h = 1e40, 1e39 itself); 1e-300 rounded the weights to 0 and
    # gave a NaN effective sample size
    trainer, sampler = torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, 0.0]])
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"rollout_is_threshold=.* torch\.float32"):
        C.importance_weights(trainer, sampler, mask, rollout_is_threshold=threshold)
    w, metrics = C.importance_weights(trainer.double(), sampler.double(), mask,
                                      rollout_is_threshold=threshold)
    # min(r, h): the cap itself below every ratio, the ratios e, 1/e under a cap above them
    expected = [threshold] * 2 if threshold < 1 else [math.e, 1 / math.e]
    assert w[0].tolist() == pytest.approx(expected, rel=1e-12)
    assert all(math.isfinite(v) for v in metrics.values())


def test_a_clip_ratio_above_float32_is_no_clip():
    # torch.clamp(ratio, 1 - 1e39, 1 + 1e39) was "value cannot be converted" in float32; a ratio
    # is at most e^20, so such a range never binds and the loss is the unclipped one
    trainer = torch.tensor([[0.0, -3.0]], requires_grad=True)
    sampler = torch.tensor([[-2.0, 0.0]])
    A, mask = torch.tensor([1.0]), torch.ones(1, 2)
    loss, metrics = C.ppo_clip_loss(trainer, sampler, A, mask, clip_ratio=1e39)
    loss.backward()
    ratios = [math.exp(2.0), math.exp(-3.0)]
    assert loss.item() == pytest.approx(-sum(ratios) / 2, rel=1e-6)
    assert trainer.grad[0].tolist() == pytest.approx([-r / 2 for r in ratios], rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0


@pytest.mark.parametrize("threshold, read_as", [
    ("0.5_2.0_3", "lower 0.5, upper 2.03"),  # float("2.0_3") is 2.03
    ("0.5_2_0", "lower 0.5, upper 20"),
    ("1_0", "lower 1, upper 0 (an error about positivity)"),
    (",2.0", "one threshold shared by both options"),
])
def test_a_malformed_threshold_string_is_not_read_as_something_else(threshold, read_as):
    trainer, sampler, mask, _ = _batch()
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        C.rejection_mask(trainer, sampler, mask, "token_k1,seq_mean_k1", threshold)


def test_a_single_k1_threshold_below_one_is_refused_not_an_empty_band():
    # "h" means [1/h, h]: at h = 0.5 that is [2, 0.5], which silently rejected every token
    trainer, sampler, mask, _ = _batch()
    with pytest.raises(ValueError, match=r"empty band \[2\.0, 0\.5\]"):
        C.rejection_mask(trainer, sampler, mask, "token_k1", 0.5)
    keep, _ = C.rejection_mask(trainer, sampler, mask, "token_k1", 1.0)  # [1, 1]: allowed
    assert torch.equal(keep, mask.bool() & (trainer == sampler))


def test_a_numpy_threshold_is_a_number():
    trainer, sampler, mask, _ = _batch()
    keep, _ = C.rejection_mask(trainer, sampler, mask, "token_k2", np.float32(0.5))
    same_keep, _ = C.rejection_mask(trainer, sampler, mask, "token_k2", float(np.float32(0.5)))
    assert torch.equal(keep, same_keep)


def test_kl_penalty_names_ref_logp():
    trainer, ref, mask, _ = _batch()
    with pytest.raises(ValueError, match=re.escape("ref_logp must be finite where mask is 1")):
        C.kl_penalty(trainer, ref.masked_fill(mask > 0, NAN), mask)
    with pytest.raises(ValueError, match="ref_logp must have the same shape"):
        C.kl_penalty(trainer, ref[:, :1], mask)


def test_k3_just_inside_float32_is_finite_and_beyond_is_refused():
    mask = torch.ones(1, 1)
    d = math.log(torch.finfo(torch.float32).max) - 1.0  # e^{d} fits in float32, e^{100} does not
    k = C.kl_penalty(torch.zeros(1, 1), torch.tensor([[d]]), mask, "k3")
    assert torch.isfinite(k).all() and k.item() == pytest.approx(math.exp(d) - 1 - d, rel=1e-5)
    with pytest.raises(ValueError, match=r"overflows torch\.float32 at position \(0, 1\)") as err:
        C.kl_penalty(torch.zeros(1, 2), torch.tensor([[0.0, 100.0]]), torch.ones(1, 2), "k3")
    assert "kl_penalty 'k3' overflows" in str(err.value)
    assert "d = trainer_logp - ref_logp = -100.0; use float64 inputs" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_k3_gradient_overflowing_the_trainers_dtype_is_refused(dtype):
    # found by the 'ci' profile: d = -100 fits float64's value, but the gradient 1 - e^{100}
    # autograd returns in the trainer's dtype was -inf; the backward pass now refuses it
    trainer = torch.tensor([[-0.0003]], dtype=dtype)
    ref = torch.tensor([[100.0]], dtype=torch.float64)
    mask = torch.ones(1, 1)
    t = trainer.double().item()  # -0.0003 as the dtype rounds it
    x = trainer.clone().requires_grad_()
    k = C.kl_penalty(x, ref, mask, "k3")  # the float64 value is finite
    assert k.dtype == torch.float64
    assert k.item() == pytest.approx(math.exp(100 - t) - 1 + t - 100, rel=1e-12)
    with pytest.raises(ValueError, match=rf"gradient .* overflows trainer_logp's {dtype} at "
                                         r"position \(0, 0\)"):
        k.sum().backward()
    # k3+ takes k2's gradient d, which fits
    x = trainer.clone().requires_grad_()
    C.kl_penalty(x, ref, mask, "k3+").sum().backward()
    assert torch.isfinite(x.grad).all()
    # d = -10: e^{10} fits every dtype's gradient (float16's max is e^{11.09})
    x = trainer.clone().requires_grad_()
    C.kl_penalty(x, ref - 90, mask, "k3").sum().backward()
    # the float64 gradient rounded once to the trainer's dtype (within its half ulp)
    assert x.grad.item() == pytest.approx(1 - math.exp(10 - t), rel=torch.finfo(dtype).eps)


def test_a_k3_gradient_that_fits_after_the_upstream_factor_is_not_refused():
    """Found by review: the refusal is of the gradient autograd actually returns, so a mean
    over many tokens and a small coefficient keep a large 1 - e^{-d} finite in float16."""
    trainer = torch.full((1, 1000), -0.0003, dtype=torch.float16)
    ref = torch.full((1, 1000), 12.0, dtype=torch.float64)  # 1 - e^{12} ~ -1.6e5 > fp16 max
    x = trainer.clone().requires_grad_()
    (0.01 * C.kl_penalty(x, ref, torch.ones(1, 1000), "k3").mean()).backward()
    expected = 0.01 / 1000 * (1 - math.exp(12 + 0.0003))
    assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()
    assert x.grad[0, 0].item() == pytest.approx(expected, rel=2e-3)  # float16's rounding
    # at a unit upstream gradient, float16 rounds 1 - e^{-d} = -65510 to -65504: finite, kept
    d = -math.log(65511.0)
    x = torch.tensor([[0.0]], dtype=torch.float16, requires_grad=True)
    C.kl_penalty(x, torch.tensor([[-d]], dtype=torch.float64), torch.ones(1, 1),
                 "k3").sum().backward()
    assert x.grad.item() == -65504.0


# ---------------------------------------------------------------------------------------------
# Found by mutation testing
# ---------------------------------------------------------------------------------------------
def _gspo_case(rhos, A):
    """One response per row with the token ratios ``rhos``; trainer_logp requires grad."""
    trainer = torch.full((len(rhos), len(rhos[0])), math.log(0.5), dtype=torch.float64)
    sampler = trainer - torch.log(torch.tensor(rhos, dtype=torch.float64))
    return trainer.requires_grad_(), sampler, torch.tensor(A, dtype=torch.float64)


@pytest.mark.parametrize("rhos, A, clipped", [
    ([[0.625, 2.5]], [1.0], True),    # s = 1.25 > 1 + 4e-4, A > 0: the cap bites
    ([[0.8, 0.8]], [1.0], False),     # s = 0.8, A > 0: below the band, the unclipped term wins
    ([[0.8, 0.8]], [-1.0], True),     # s = 0.8 < 1 - 3e-4, A < 0: the floor bites
    ([[1.0001, 1.0001]], [-1.0], False),  # s inside [1 - 3e-4, 1 + 4e-4]: nothing clipped
])
def test_gspo_default_band_is_the_papers(rhos, A, clipped):
    trainer, sampler, A = _gspo_case(rhos, A)
    loss, metrics = C.gspo_loss(trainer, sampler, A, torch.ones(trainer.shape))
    loss.backward()
    s = math.prod(rhos[0]) ** (1 / len(rhos[0]))
    expected = [0.0, 0.0] if clipped else [-A.item() * s / 2] * 2  # seq-mean-token-mean
    assert trainer.grad[0].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert metrics["actor/pg_clipfrac"] == (1.0 if clipped else 0.0)
    # mean of -log rho_t over the tokens
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(map(math.log, rhos[0])) / 2, rel=1e-12)


def test_gspo_clip_fraction_counts_tokens():
    # a clipped response (s = 1.25, A = 1) and one at s = 1 exactly, where the two terms are
    # equal and nothing is clipped: half of the four tokens
    trainer, sampler, A = _gspo_case([[0.625, 2.5], [1.0, 1.0]], [1.0, 1.0])
    _, metrics = C.gspo_loss(trainer, sampler, A, torch.ones(2, 2))
    assert metrics["actor/pg_clipfrac"] == 0.5


def test_gspo_without_a_lower_clip_ratio_has_a_floor_of_one():
    # clip_ratio_low=None is epsilon_l = 0: the band [1, 1 + eps_h], so s = 0.8 with A < 0 is
    # clipped up to 1 (a constant, no gradient)
    trainer, sampler, A = _gspo_case([[0.8, 0.8]], [-1.0])
    loss, metrics = C.gspo_loss(trainer, sampler, A, torch.ones(1, 2), clip_ratio_low=None)
    loss.backward()
    assert loss.item() == pytest.approx(1.0, rel=1e-12) and trainer.grad.abs().max() == 0
    assert metrics["actor/pg_clipfrac"] == 1.0


def test_cispo_clip_fraction_and_kl():
    # rho = 9 is clipped to 1.2, the two rho = 1 are not: a third of the tokens; ppo_kl is the
    # mean of -log rho
    trainer = torch.log(torch.tensor([[0.9, 0.5, 0.5]], dtype=torch.float64))
    sampler = torch.log(torch.tensor([[0.1, 0.5, 0.5]], dtype=torch.float64))
    _, metrics = C.cispo_loss(trainer, sampler, torch.tensor([1.0]), torch.ones(1, 3))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3, rel=1e-12)
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(9.0) / 3, rel=1e-12)


def test_veto_default_is_1e_minus_4():
    trainer = torch.log(torch.tensor([[5e-5, 1.0], [2e-4, 1.0]], dtype=torch.float64))
    keep = C.veto_mask(trainer, torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 2))
    assert keep.tolist() == [[False, False], [True, True]]


def _ppo(rhos, A, **options):
    trainer = torch.log(torch.tensor([rhos], dtype=torch.float64)).requires_grad_()
    sampler = torch.zeros(1, len(rhos), dtype=torch.float64)
    loss, metrics = C.ppo_clip_loss(trainer, sampler, torch.tensor([A], dtype=torch.float64),
                                    torch.ones(1, len(rhos)), reduction="sum", **options)
    loss.backward()
    return loss.item(), trainer.grad[0].tolist(), metrics


def test_ppo_defaults_clip_at_0_2_and_dual_clip_at_3():
    # A = -1: rho = 0.5 is clipped up to 0.8 (no gradient), 1.1 is inside, 3.5 is above the
    # dual clip 3 (the constant -cA = 3, no gradient); 2 is only PPO-clipped from above, which
    # for A < 0 keeps the unclipped term 2 (gradient -A rho = 2)
    loss, grad, metrics = _ppo([0.5, 1.1, 2.0, 3.5], -1.0)
    assert loss == pytest.approx(0.8 + 1.1 + 2.0 + 3.0, rel=1e-12)
    assert grad == pytest.approx([0.0, 1.1, 2.0, 0.0], rel=1e-12)
    assert metrics["actor/pg_clipfrac"] == 0.25  # only 0.5: the clipped term is the larger
    assert metrics["actor/pg_clipfrac_lower"] == 0.25  # only 3.5
    assert metrics["actor/ppo_kl"] == pytest.approx(
        -sum(map(math.log, [0.5, 1.1, 2.0, 3.5])) / 4, rel=1e-12)


def test_ppo_dual_clip_counts_only_negative_advantages_and_strict_excess():
    # A = 0.5 > 0: the dual clip never applies, whatever -cA is
    _, _, metrics = _ppo([1.0, 1.0], 0.5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    # L = -cA exactly is not counted (verl's torch.gt, core_algos.py at VERL_COMMIT)
    r = torch.exp(torch.log(torch.tensor([[2.5]], dtype=torch.float64))).item()  # as computed
    _, _, metrics = _ppo([2.5], -1.0, clip_ratio_c=r)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_a_ratio_equal_to_the_veto_threshold_is_not_vetoed():
    # the veto is rho_t < tau, strictly: log rho_t = log 0.5 exactly here
    trainer = torch.log(torch.tensor([[0.5, 1.0]], dtype=torch.float64))
    assert trainer[0, 0].item() == math.log(0.5)
    keep = C.veto_mask(trainer, torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2),
                       veto_threshold=0.5)
    assert keep.all()


def test_dppo_kl_takes_a_log_probability_of_exactly_zero_and_a_padding_above_it():
    """log p = 0 is a probability of 1 (accepted, finite); a positive value off the mask is
    never read."""
    trainer, sampler, mask, A = _batch()
    trainer = trainer.clone()
    trainer[0, 0] = 0.0
    trainer[0, 2] = 5.0  # padding
    loss, metrics = C.dppo_kl_loss(trainer, sampler, A, mask)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())


def test_a_dppo_cap_above_float32_is_no_cap():
    """clip_ratio_c = 1e39 in float32 (which torch.clamp refuses) is no truncation, as inf is."""
    trainer, sampler, mask, A = _batch()
    t, s = trainer.float(), sampler.float()
    big, _ = C.dppo_tv_loss(t, s - 30.0, A.float(), mask, clip_ratio_c=1e39, clip_ratio=math.inf)
    none, _ = C.dppo_tv_loss(t, s - 30.0, A.float(), mask, clip_ratio_c=math.inf,
                             clip_ratio=math.inf)
    assert torch.equal(big, none) and torch.isfinite(big)


# rejection_mask's statistics (verl's compute_rs_metrics), computed by hand on log-ratios that
# are multiples of L = log 2, so that every band edge is met exactly
L2 = math.log(2.0)


def _rs_case(x, mask):
    """trainer_logp = the log-ratios x (NaN where mask is 0), sampler_logp = 0."""
    mask = torch.tensor(mask, dtype=torch.float64)
    trainer = torch.tensor(x, dtype=torch.float64).masked_fill(mask == 0, math.nan)
    return trainer, torch.zeros_like(trainer), mask


def _assert_metrics(metrics, expected, prefix):
    assert {k[len(prefix):] for k in metrics if k.startswith(prefix)} == set(expected)
    for name, value in expected.items():
        assert metrics[prefix + name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_token_k1_statistics_by_hand():
    assert math.log(0.5) == -L2
    # k1 = -x per token: [2L, -L, 0], [-2L], [-L, -L], [L], and an empty response; band [-L, L]
    trainer, sampler, mask = _rs_case(
        [[-2 * L2, L2, 0.0], [2 * L2, 0, 0], [L2, L2, 0], [-L2, 0, 0], [0, 0, 0]],
        [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    keep, m = C.rejection_mask(trainer, sampler, mask, "token_k1", "0.5_2.0")
    # the edges -L and L are kept (log a <= k1 <= log b), 2L and -2L are not
    assert keep.tolist() == [[False, True, True], [False, False, False], [True, True, False],
                             [True, False, False], [False, False, False]]
    per_response = [L2 / 3, -2 * L2, -L2, L2]  # the mean k1 of each response with a token
    _assert_metrics(m, {
        "mean": -2 * L2 / 7, "max": 2 * L2, "min": -2 * L2,
        "fraction_high": 1 / 7, "fraction_low": 1 / 7,  # strictly above L, strictly below -L
        # k1 clamped to the band: [L, -L, 0, -L, -L, -L, L]
        "std": math.sqrt(6 * L2**2 / 7 - (2 * L2 / 7) ** 2),
        "seq_mean": -5 * L2 / 12, "seq_std": L2 * math.sqrt(65) / 6,  # n - 1
        "seq_max": L2, "seq_min": -2 * L2, "seq_max_deviation": 2 * L2,
        "seq_fraction_high": 0.0, "seq_fraction_low": 0.25,
        "masked_fraction": 2 / 7, "seq_masked_fraction": 0.5,
    }, "rollout_rs_token_k1_")
    assert sum(per_response) / 4 == pytest.approx(-5 * L2 / 12)
    assert m["rollout_rs_masked_fraction"] == 2 / 7
    assert m["rollout_rs_seq_masked_fraction"] == 0.5


def test_seq_sum_k2_statistics_by_hand():
    # k2 = x^2 / 2 per token: [2, 0], [0.5], [2, 2]; the sums 2, 0.5, 4 against u = 2
    trainer, sampler, mask = _rs_case([[2.0, 0.0], [1.0, 0.0], [2.0, -2.0]],
                                      [[1, 1], [1, 0], [1, 1]])
    keep, m = C.rejection_mask(trainer, sampler, mask, "seq_sum_k2", 2.0)
    assert keep.tolist() == [[True, True], [True, False], [False, False]]  # 2 <= 2 is kept
    _assert_metrics(m, {
        "mean": (2 + 2 + 0.5 + 4 + 4) / 5, "max": 4.0, "min": 0.5,
        "fraction_high": 1 / 3, "fraction_low": 0.0,  # over the responses, not the tokens
        # the sums clamped to [0, 2] on each token: [2, 2, 0.5, 2, 2]
        "std": math.sqrt((4 * 4 + 0.25) / 5 - 1.7**2),
        "seq_mean": 6.5 / 3, "seq_std": math.sqrt(111) / 6,
        "seq_max": 4.0, "seq_min": 0.5, "seq_max_deviation": 4.0, "seq_fraction_high": 1 / 3,
        "masked_fraction": 2 / 5, "seq_masked_fraction": 1 / 3,
    }, "rollout_rs_seq_sum_k2_")


@pytest.mark.parametrize("x, std, seq_std", [
    ([[1.0]], 0.0, 0.0),  # one token, one response: no spread
    ([[1.0], [2.0]], 0.75, 1.5 / math.sqrt(2)),  # k2 = 0.5 and 2: std over 2, seq_std n - 1
])
def test_rs_std_of_one_and_two_values(x, std, seq_std):
    trainer, sampler, mask = _rs_case(x, [[1]] * len(x))
    _, m = C.rejection_mask(trainer, sampler, mask, "token_k2", 4.0)
    assert m["rollout_rs_token_k2_std"] == pytest.approx(std, rel=1e-12)
    assert m["rollout_rs_token_k2_seq_std"] == pytest.approx(seq_std, rel=1e-12)


def test_rs_divergences_read_the_clamped_log_ratio():
    # x = 30 and -30 are read as 20 and -20 (verl's SAFETY_BOUND), so k1 spans [-20, 20]
    trainer, sampler, mask = _rs_case([[30.0, -30.0]], [[1, 1]])
    _, m = C.rejection_mask(trainer, sampler, mask, "token_k1", 2.0)
    assert (m["rollout_rs_token_k1_max"], m["rollout_rs_token_k1_min"]) == (20.0, -20.0)


def test_chained_criteria_keep_what_every_one_keeps_in_either_order():
    # the docstring's batch: token_k1 rejects the second token of the first response,
    # seq_mean_k3 the whole first response; the last criterion must not undo the first
    trainer = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.8, 0.2], [0.5, 0.5]]))
    for rs, threshold in (("token_k1,seq_mean_k3", "0.5_2.0,0.1"),
                          ("seq_mean_k3,token_k1", "0.1,0.5_2.0")):
        keep, _ = C.rejection_mask(trainer, sampler, torch.ones(2, 2), rs, threshold)
        assert keep.tolist() == [[False, False], [True, True]]


# importance_weights' metrics (verl's compute_is_metrics) at the edges of the band
IS_KEYS = {"rollout_is_mean", "rollout_is_max", "rollout_is_min",
           "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "rollout_is_std",
           "rollout_is_eff_sample_size", "rollout_is_seq_mean", "rollout_is_seq_std",
           "rollout_is_seq_max", "rollout_is_seq_min", "rollout_is_seq_max_deviation",
           "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low"}


@pytest.mark.parametrize("level", C.IS_LEVELS)
def test_is_metrics_of_one_ratio_on_the_edge_of_the_band(level):
    # one token with rho = 1 and the threshold 1: the band [1/1, 1] holds it (no fraction is
    # strict), every weight is 1, one value has no spread and an effective sample size of 1
    one = torch.zeros(1, 1, dtype=torch.float64)
    w, m = C.importance_weights(one, one, torch.ones(1, 1), level, rollout_is_threshold=1.0)
    assert w.tolist() == [[1.0]]
    assert m == {**{k: 1.0 for k in IS_KEYS}, "rollout_is_ratio_fraction_high": 0.0,
                 "rollout_is_ratio_fraction_low": 0.0, "rollout_is_std": 0.0,
                 "rollout_is_seq_std": 0.0, "rollout_is_seq_max_deviation": 0.0,
                 "rollout_is_seq_fraction_high": 0.0, "rollout_is_seq_fraction_low": 0.0}


def test_is_std_of_two_weights():
    # weights 2 and 1 (one token per response): std over the tokens 0.5, over the responses
    # (n - 1) 1 / sqrt 2
    trainer = torch.tensor([[L2], [0.0]], dtype=torch.float64)
    _, m = C.importance_weights(trainer, torch.zeros_like(trainer), torch.ones(2, 1),
                                rollout_is_threshold=4.0)
    assert m["rollout_is_std"] == pytest.approx(0.5, rel=1e-12)
    assert m["rollout_is_seq_std"] == pytest.approx(1 / math.sqrt(2), rel=1e-12)


def test_is_fraction_low_without_a_lower_bound_is_zero():
    # no cap (inf): the band is [0, inf], so the ratio 0.5 is not "low"
    trainer = torch.tensor([[L2, -L2]], dtype=torch.float64)
    _, m = C.importance_weights(trainer, torch.zeros_like(trainer), torch.ones(1, 2),
                                rollout_is_threshold=math.inf)
    assert m["rollout_is_ratio_fraction_low"] == 0.0 and m["rollout_is_seq_fraction_low"] == 0.0


def test_is_fractions_read_the_given_lower_bound():
    # mode "mask" with lower = 0.25 and the cap 2: rho = 0.4 is inside [0.25, 2] (it would be
    # low against 1/h = 0.5)
    trainer = torch.tensor([[math.log(0.4)]], dtype=torch.float64)
    w, m = C.importance_weights(trainer, torch.zeros_like(trainer), torch.ones(1, 1),
                                mode="mask", lower=0.25)
    assert w.item() == pytest.approx(0.4, rel=1e-12)
    assert m["rollout_is_ratio_fraction_low"] == 0.0 and m["rollout_is_seq_fraction_low"] == 0.0


def test_the_oob_ratio_is_reported_only_for_a_lower_bound_in_mode_mask():
    one = torch.zeros(1, 1, dtype=torch.float64)
    ones = torch.ones(1, 1)
    assert set(C.importance_weights(one, one, ones)[1]) == IS_KEYS  # truncate
    assert set(C.importance_weights(one, one, ones, mode="mask")[1]) == IS_KEYS  # lower 0
    # the band [1, 1] holds rho = 1 exactly: weight 1, not out of bounds
    w, m = C.importance_weights(one, one, ones, mode="mask", lower=1.0, rollout_is_threshold=1.0)
    assert w.item() == 1.0 and m["rollout_is_oob_ratio"] == 0.0
    assert set(m) == IS_KEYS | {"rollout_is_oob_ratio"}


def test_batch_normalize_of_one_response_and_of_a_tiny_mean():
    # one sequence weight (about 2) is divided by itself: 1 on both tokens
    trainer = torch.tensor([[L2, 0.0]], dtype=torch.float64)
    w, m = C.importance_weights(trainer, torch.zeros_like(trainer), torch.ones(1, 2), "sequence",
                                rollout_is_threshold=4.0, rollout_is_batch_normalize=True)
    assert w[0].tolist() == pytest.approx([1.0, 1.0], rel=1e-12)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(2.0, rel=1e-12)
    # a mean of exactly 1e-8 (every weight capped there) is not > 1e-8: the factor is 1
    one = torch.zeros(1, 1, dtype=torch.float64)
    w, m = C.importance_weights(one, one, torch.ones(1, 1), rollout_is_threshold=1e-8,
                                rollout_is_batch_normalize=True)
    assert w.item() == 1e-8 and m["rollout_is_batch_norm_factor"] == 1.0


def test_is_threshold_at_the_ends_of_float32_and_beyond():
    x = torch.zeros(1, 1)
    info = torch.finfo(torch.float32)
    for threshold in (info.tiny, info.max):  # the closed range [tiny, max] is accepted
        C.importance_weights(x, x, torch.ones(1, 1), rollout_is_threshold=threshold)
    with pytest.raises(ValueError) as error:
        C.importance_weights(x, x, torch.ones(1, 1), rollout_is_threshold=1e39)
    assert str(error.value) == (
        "rollout_is_threshold=1e+39 is outside the normal range of torch.float32 "
        "[1.18e-38, 3.4e+38], the dtype the weights are computed in (float32 for "
        "half-precision inputs); use float64 inputs, or inf for no cap")


# the refusals of the option parsing, compared whole (the argument, the option and the value)
_T2 = torch.zeros(1, 2, dtype=torch.float64)


@pytest.mark.parametrize("rs, threshold, error, message", [
    (5, 2.0, TypeError, "rollout_rs must be a string such as 'token_k1,seq_mean_k3', got int 5"),
    ("token_k1", None, TypeError, "rollout_rs_threshold must be a number or a string such as "
     "'0.5_2.0,0.01', got None"),
    ("token_k1", True, TypeError, "rollout_rs_threshold must be a number or a string such as "
     "'0.5_2.0,0.01', got True"),
    ("token_k1", [2.0], TypeError, "rollout_rs_threshold must be a number or a string, got list"),
    ("token_k1", "0.5_x", ValueError, "rollout_rs_threshold '0.5_x' for 'token_k1' is not a "
     "number (k1 takes 'lower_upper' or one number)"),
    ("token_k1", "x_2.0", ValueError, "rollout_rs_threshold 'x_2.0' for 'token_k1' is not a "
     "number (k1 takes 'lower_upper' or one number)"),
    ("token_k1", "0_2.0", ValueError, "rollout_rs_threshold for 'token_k1' must be positive "
     "(or inf), got '0_2.0'"),
    ("token_k1", "0.5_0", ValueError, "rollout_rs_threshold for 'token_k1' must be positive "
     "(or inf), got '0.5_0'"),
    ("token_k1", "0.5_nan", ValueError, "rollout_rs_threshold for 'token_k1' must be positive "
     "(or inf), got '0.5_nan'"),
    ("token_k1", "inf", ValueError, "rollout_rs_threshold for 'token_k1' must be positive, got "
     "'inf', whose lower bound 1/h is 0 (for no lower bound on the ratio write 'a_inf')"),
    ("seq_sum_k1", "inf_inf", ValueError, "rollout_rs_threshold 'inf_inf' for 'seq_sum_k1' has "
     "the lower bound inf, which keeps no token"),
    ("token_k2", "x", ValueError, "rollout_rs_threshold 'x' for 'token_k2' is not a number "
     "(k1 takes 'lower_upper' or one number)"),
    ("token_k2", "0", ValueError, "rollout_rs_threshold for 'token_k2' must be positive (or "
     "inf), got '0'"),
    ("token_k1", "2.0_0.5", ValueError, "rollout_rs_threshold '2.0_0.5' for 'token_k1' is the "
     "empty band [2.0, 0.5] (lower > upper; a single number h < 1 means the band [1/h, h])"),
    ("token_k1,,token_k2", 2.0, ValueError,
     "rollout_rs has an empty entry (entry 2 of 3 in 'token_k1,,token_k2')"),
])
def test_rejection_option_refusals_in_full(rs, threshold, error, message):
    with pytest.raises(error) as caught:
        C.rejection_mask(_T2, _T2, torch.ones(1, 2), rs, threshold)
    assert str(caught.value) == message


def test_an_infinite_rejection_bound_is_no_bound_on_that_side():
    # "0.5_inf" keeps -log rho in [log 0.5, inf]: rho <= 2 with no lower bound (as verl reads
    # it); a k2 threshold of inf rejects nothing
    trainer = torch.tensor([[math.log(2.5), -30.0, math.log(1.5)]], dtype=torch.float64)
    sampler, mask = torch.zeros_like(trainer), torch.ones(1, 3)
    keep, _ = C.rejection_mask(trainer, sampler, mask, "token_k1", "0.5_inf")
    assert keep.tolist() == [[False, True, True]]
    keep, _ = C.rejection_mask(trainer, sampler, mask, "token_k2", math.inf)
    assert keep.all()


def test_one_rejection_threshold_is_shared_by_every_option():
    # token_k1 at 2 keeps rho = 1.5; token_k2 at the same 2 keeps k2 = 0.5 (log 1.5)^2 <= 2,
    # but rho = e^-2.5 has k1 = 2.5 > log 2 and k2 = 3.125 > 2: both criteria are applied
    trainer = torch.tensor([[math.log(1.5), -2.5]], dtype=torch.float64)
    keep, m = C.rejection_mask(trainer, torch.zeros_like(trainer), torch.ones(1, 2),
                               "token_k1,token_k2", 2.0)
    assert keep.tolist() == [[True, False]]
    assert m["rollout_rs_token_k1_masked_fraction"] == 0.5
    assert m["rollout_rs_token_k2_masked_fraction"] == 0.5


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(rollout_is_threshold="abc"), ValueError, "rollout_is_threshold must be a number or a "
     "string 'upper' or 'lower_upper' such as '0.5_5.0', got 'abc'"),
    (dict(rollout_is_batch_normalize=1), TypeError,
     "rollout_is_batch_normalize must be a bool, got int"),
])
def test_importance_option_refusals_in_full(kwargs, error, message):
    with pytest.raises(error) as caught:
        C.importance_weights(_T2, _T2, torch.ones(1, 2), **kwargs)
    assert str(caught.value) == message


@pytest.mark.parametrize("kwargs, message", [
    (dict(rollout_is_batch_normalize=True), "mode, lower and rollout_is_batch_normalize need "
     "rollout_is ('token', 'sequence' or 'geometric'); it is None"),
    (dict(rollout_is_threshold=-1.0), "rollout_is_threshold must be > 0, got -1.0"),
    (dict(veto_threshold=-1.0), "veto_threshold must be > 0, got -1.0"),
])
def test_rollout_correction_refusals_in_full(kwargs, message):
    with pytest.raises(ValueError) as caught:
        C.rollout_correction(_T2, _T2, torch.ones(1, 2), **kwargs)
    assert str(caught.value) == message


def test_rollout_correction_defaults_and_options_reach_the_weights():
    trainer = torch.tensor([[math.log(4.0), math.log(0.25)]], dtype=torch.float64)
    sampler, ones = torch.zeros_like(trainer), torch.ones(1, 2)
    # no IS: weights 1 in the compute dtype; an infinite (unused) threshold is accepted
    c = C.rollout_correction(trainer, sampler, ones, rollout_is_threshold=math.inf)
    assert c.weights.dtype == torch.float64 and c.weights.tolist() == [[1.0, 1.0]]
    # the default cap is 2 (verl's rollout_is_threshold)
    c = C.rollout_correction(trainer, sampler, ones, rollout_is="token")
    assert c.weights[0].tolist() == pytest.approx([2.0, 0.25], rel=1e-12)
    # IcePop "0.5_5.0" drops rho = 0.25 (mode "mask"), it does not clamp it to 0.5
    c = C.rollout_correction(trainer, sampler, ones, rollout_is="token",
                             rollout_is_threshold="0.5_5.0")
    assert c.weights[0].tolist() == pytest.approx([4.0, 0.0], rel=1e-12)
    # batch normalisation: the sequence weight 1 (4 * 0.25) is its own mean
    c = C.rollout_correction(trainer, sampler, ones, rollout_is="sequence",
                             rollout_is_batch_normalize=True)
    assert c.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.0)


def test_veto_reads_the_log_ratio_in_the_compute_dtype():
    # float16 inputs are compared in float32: log rho = -300 + 0.1875 = -299.8125 exactly,
    # below log tau = -299.78 (in float16 the difference would round to -299.75, above it)
    trainer = torch.tensor([[-300.0]], dtype=torch.float16)
    sampler = torch.tensor([[-0.1875]], dtype=torch.float16)
    assert (trainer - sampler).item() == -299.75
    tau = math.exp(-299.78)
    assert not C.veto_mask(trainer, sampler, torch.ones(1, 1), veto_threshold=tau).any()
    c = C.rollout_correction(trainer, sampler, torch.ones(1, 1), veto_threshold=tau)
    assert not c.keep.any()


def test_offpolicy_metrics_beyond_the_safety_bound_by_hand():
    # x = [30, 0] and [-30, 0]: the token terms read clamp(x, -20, 20), chi2_seq the clamped
    # sums 20 and -20; the log-perplexities are those of the trainer: -mean log pi = 0 and 15
    trainer = torch.tensor([[0.0, 0.0], [-30.0, 0.0]], dtype=torch.float64)
    sampler = torch.tensor([[-30.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    m = C.offpolicy_metrics(trainer, sampler, torch.ones(2, 2))
    assert m["k3_kl"] == pytest.approx((math.expm1(20) - 20 + math.expm1(-20) + 20) / 4,
                                       rel=1e-12)
    assert m["chi2_token"] == pytest.approx((math.exp(40) + 2 + math.exp(-40)) / 4 - 1,
                                            rel=1e-12)
    assert m["chi2_seq"] == pytest.approx((math.exp(40) + math.exp(-40)) / 2 - 1, rel=1e-12)
    assert m["training_log_ppl"] == 7.5 and m["rollout_log_ppl"] == 7.5


@pytest.mark.parametrize("trainer, sampler, mask, message", [
    (torch.zeros(2), torch.zeros(2), torch.ones(2),
     "trainer_logp must have 2 dimensions, got shape (2,) (1 dimensions)"),
    (torch.zeros(1, 2), torch.zeros(2), torch.ones(1, 2),
     "sampler_logp must have 2 dimensions, got shape (2,) (1 dimensions)"),
    (torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2),
     "sampler_logp must have the same shape as trainer_logp (1, 2), got (1, 3)"),
    (torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 3),
     "mask must have the shape of trainer_logp (1, 2), got (1, 3)"),
])
def test_batch_refusals_in_full(trainer, sampler, mask, message):
    with pytest.raises(ValueError) as caught:
        C.importance_weights(trainer, sampler, mask)
    assert str(caught.value) == message


# DPPO at the edges of its trust region
def _dppo(loss_fn, trainer, sampler, A, **kwargs):
    trainer = torch.tensor([trainer], dtype=torch.float64).requires_grad_()
    sampler = torch.tensor([sampler], dtype=torch.float64)
    A = torch.tensor(A, dtype=torch.float64)
    loss, m = loss_fn(trainer, sampler, A, torch.ones(trainer.shape), **kwargs)
    loss.backward()
    return trainer.grad, m


def test_dppo_tv_edges_are_inside():
    half = math.log(0.5)
    assert torch.exp(torch.tensor(half, dtype=torch.float64)).item() == 0.5
    # p - q = 0.5 = delta_h with A > 0, p - q = -0.5 = -delta_l with A < 0: both inside
    _, m = _dppo(C.dppo_tv_loss, [0.0], [half], [1.0], clip_ratio_high=0.5)
    assert m["actor/pg_clipfrac"] == 0.0
    _, m = _dppo(C.dppo_tv_loss, [half], [0.0], [-1.0], clip_ratio_low=0.5)
    assert m["actor/pg_clipfrac"] == 0.0
    # A = 0 takes the A <= 0 side: p - q = 0.5 is above delta_h = 0.1, not below -delta_l
    _, m = _dppo(C.dppo_tv_loss, [0.0], [half], [0.0], clip_ratio_high=0.1, clip_ratio_low=0.5)
    assert m["actor/pg_clipfrac"] == 0.0
    # a ratio equal to the cap is not truncated: rho = 1 = c
    _, m = _dppo(C.dppo_tv_loss, [half], [half], [1.0], clip_ratio_c=1.0)
    assert m["actor/pg_clipfrac_lower"] == 0.0


def test_dppo_kl_edges_are_inside():
    # a binary KL equal to the threshold is inside (kl <= delta), on either side
    up_t, up_s = math.log(0.6), math.log(0.3)  # p > q, A > 0
    kl_up = float(C._binary_kl(torch.tensor(up_s, dtype=torch.float64),
                               torch.tensor(up_t, dtype=torch.float64)))
    _, m = _dppo(C.dppo_kl_loss, [up_t], [up_s], [1.0], clip_ratio_high=kl_up)
    assert m["actor/pg_clipfrac"] == 0.0
    _, m = _dppo(C.dppo_kl_loss, [up_s], [up_t], [-1.0],  # p < q, A < 0
                 clip_ratio_low=float(C._binary_kl(torch.tensor(up_t, dtype=torch.float64),
                                                   torch.tensor(up_s, dtype=torch.float64))))
    assert m["actor/pg_clipfrac"] == 0.0


def test_dppo_binary_kl_at_a_probability_of_one():
    # q = 1: KL = log(1 / p) = log 2 for p = 1/2 (the 1 - q term is 0 * log(1e-8 / ...) = 0),
    # inside a delta_l of 1 with A < 0
    _, m = _dppo(C.dppo_kl_loss, [math.log(0.5)], [0.0], [-1.0], clip_ratio_low=1.0)
    assert m["actor/pg_clipfrac"] == 0.0
    # p = 1, q = 1/2: KL = 0.5 log 0.5 + 0.5 log((0.5 + 1e-8) / 1e-8) = 8.517, inside 10
    kl = 0.5 * math.log(0.5) + 0.5 * math.log((0.5 + 1e-8) / 1e-8)
    assert kl == pytest.approx(8.5172, abs=1e-4)
    _, m = _dppo(C.dppo_kl_loss, [0.0], [math.log(0.5)], [1.0], clip_ratio_high=10.0)
    assert m["actor/pg_clipfrac"] == 0.0


def test_dppo_truncation_defaults_and_the_largest_cap():
    # dppo_kl_loss's default cap is 3 (verl's clip_ratio_c): rho = 3.5 is weighted 3; with
    # A = -1 (p >= q: inside) the gradient of -w A log pi is w
    grad, m = _dppo(C.dppo_kl_loss, [math.log(0.35)], [math.log(0.1)], [-1.0])
    assert grad.item() == pytest.approx(3.0, rel=1e-12) and m["actor/pg_clipfrac_lower"] == 1.0
    # no cap (inf): rho = e^20 (the clamp's largest) is weighted e^20
    grad, _ = _dppo(C.dppo_tv_loss, [0.0], [-20.0], [-1.0], clip_ratio_c=math.inf)
    assert grad.item() == pytest.approx(math.exp(20), rel=1e-12)


def test_dppo_thresholds_accept_inf_and_refuse_a_negative_clip_ratio():
    grad, m = _dppo(C.dppo_tv_loss, [0.0], [-5.0], [1.0], clip_ratio_low=math.inf,
                    clip_ratio_high=math.inf)
    assert m["actor/pg_clipfrac"] == 0.0
    with pytest.raises(ValueError) as caught:
        _dppo(C.dppo_tv_loss, [0.0], [0.0], [1.0], clip_ratio=-0.1)
    assert str(caught.value) == "clip_ratio must be >= 0.0, got -0.1"


def test_dppo_reads_probabilities_in_the_compute_dtype():
    # float16 inputs: p = exp(log p) in float32, not rounded to float16, meets delta_h
    trainer = torch.tensor([[-0.5]], dtype=torch.float16)
    sampler = torch.tensor([[math.log(0.5)]], dtype=torch.float16)
    p32, q32 = torch.exp(trainer.float()), torch.exp(sampler.float())
    p16 = p32.half().float()
    assert p16.item() != p32.item()
    high = float(((p32 - q32) + (p16 - q32)) / 2)  # between the two readings: p32 is outside
    _, m = C.dppo_tv_loss(trainer, sampler, torch.tensor([1.0]), torch.ones(1, 1),
                          clip_ratio_high=high)
    assert m["actor/pg_clipfrac"] == 1.0


def test_ppo_clip_high_is_cut_at_e21_not_lower():
    # rho = e^20 with A > 0 and no real cap: clip(rho) = rho, nothing is clipped
    trainer = torch.zeros(1, 1, dtype=torch.float64)
    _, m = C.ppo_clip_loss(trainer, trainer - 20.0, torch.tensor([1.0], dtype=torch.float64),
                           torch.ones(1, 1), clip_ratio_high=1e30)
    assert m["actor/pg_clipfrac"] == 0.0
    with pytest.raises(ValueError) as caught:
        C.ppo_clip_loss(trainer, trainer, torch.tensor([1.0]), torch.ones(1, 1),
                        clip_ratio_high=-0.1)
    assert str(caught.value) == "clip_ratio_high must be >= 0.0, got -0.1"


def test_cispo_and_gspo_report_no_lower_clip():
    trainer, sampler, mask, A = _batch()
    assert C.cispo_loss(trainer, sampler, A, mask)[1]["actor/pg_clipfrac_lower"] == 0.0
    assert C.gspo_loss(trainer, sampler, A, mask)[1]["actor/pg_clipfrac_lower"] == 0.0


def test_dro_overflow_refusal_in_full():
    trainer = torch.tensor([[0.0, -3.0]])
    with pytest.raises(ValueError) as caught:
        C.dro_loss(trainer, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                   dro_beta=1e38)
    assert str(caught.value) == (
        "dro_loss overflows torch.float32 at position (0, 1): dro_beta / 2 * (log ratio)^2 "
        "with dro_beta=1e+38, log ratio -3.0; use float64 inputs or a smaller dro_beta")


def test_a_ratio_below_e_minus_20_is_read_as_e_minus_20():
    # verl's SAFETY_BOUND clamps the log-ratio on both sides: rho = e^-30 weighs e^-20
    trainer = torch.tensor([[-30.0]], dtype=torch.float64)
    w, _ = C.importance_weights(trainer, torch.zeros_like(trainer), torch.ones(1, 1))
    assert w.item() == pytest.approx(math.exp(-20), rel=1e-12)


def test_advantages_refusal_names_them():
    with pytest.raises(TypeError) as caught:
        C.ppo_clip_loss(_T2, _T2, [1.0], torch.ones(1, 2))
    assert str(caught.value) == "advantages must be a torch.Tensor, got list"


@pytest.mark.parametrize("A", [1.0, -1.0])
def test_dppo_kl_takes_equal_probabilities_as_inside_even_with_a_positive_kl(A):
    # log p = -2e-20 and log q = -1e-20 both give p = q = 1.0, yet the binary KL is about
    # q (log q - log p) = 1e-20 > delta = 0: p = q keeps the token inside on both sides
    _, m = _dppo(C.dppo_kl_loss, [-2e-20], [-1e-20], [A], clip_ratio=0.0)
    assert m["actor/pg_clipfrac"] == 0.0
