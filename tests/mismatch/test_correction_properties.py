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

The example count comes from the Hypothesis profile (conftest.py): "fast" (40) in the normal
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
    # k3's value e^{-d} - 1 + d overflows where -d > log(max): refused, never inf
    d = (trainer.double() - ref.double())[case["bool_mask"]]
    log_max = math.log(torch.finfo(dtype).max)
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
    # 0 < a <= b finite; the others one positive finite number
    entry = text.strip()
    if option.endswith("k1") and entry.count("_") == 1:
        bounds = [strict_number(v.strip()) for v in entry.split("_")]
    else:
        h = strict_number(entry)
        bounds = [None if h is None or h == 0 else 1 / h, h] if option.endswith("k1") else [h]
    valid = "," not in entry and all(v is not None and 0 < v < math.inf for v in bounds) \
        and bounds == sorted(bounds)
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
     "positive and finite"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", "nan"), ValueError,
     "positive and finite"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", NAN), ValueError,
     "rollout_rs_threshold must be a finite number"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", 10**400), ValueError,
     "rollout_rs_threshold must be a finite number, got an int of 401 digits"),
    (lambda t, s, m, a: C.rejection_mask(t, s, m, "token_k2", math.inf), ValueError,
     "positive and finite"),
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
