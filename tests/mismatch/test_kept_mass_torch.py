"""``correction.kept_mass_log_ratio``, the torch form of ``engine_toy``'s ``reported``,
``kept_mass`` and ``trainer_mask``: on the engine toy's enumerated batch it gives the numpy
form's per-token log-ratios and scores, and the sequence ratio's exact mean gives
``kept_mass_table``'s relative biases; half precision is computed in float32; every bad input
is named; and (Hypothesis, marker ``properties``) on random logits, kept sets and masks its
values and gradients are finite and equal to a float64 reference written here."""

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch.correction import KeptMassRatio, kept_mass_log_ratio
from opd_literate.mismatch.engine import (
    KEPT_MASS,
    KEPT_MASS_CHOICES,
    REPORTED,
    engine_toy,
    kept_mass_table,
    processed_log_probs,
)
from opd_literate.mismatch.toy import make_ar_toy, make_toy

# The chapter's two tables (docs/hooks/generate.py: ENGINE_KEPT_MASS, ENGINE_KEPT_MASS_MIN_P),
# then top-k alone, min-p at another temperature, all three cuts, and SGLang's float32 rule.
CUTS = [dict(temperature=0.7, top_p=0.93), dict(temperature=0.7, top_p=1.0, min_p=0.3),
        dict(top_k=2), dict(temperature=1.3, min_p=0.3),
        dict(temperature=0.8, top_k=3, top_p=0.9), dict(temperature=0.7, top_p=0.8),
        dict(temperature=0.7, top_p=0.93, sampler="sglang")]
# The same where every target is non-zero (top-k 2 cuts the reward's token at some position,
# and no sequence the engine writes has a reward: kept_mass_table refuses it)
TABLE_CUTS = [dict(top_k=3) if cut == dict(top_k=2) else cut for cut in CUTS]
CHOICES = [dict(options) for _, options in KEPT_MASS_CHOICES]
# every valid option of engine_toy, beyond the table's rows
ALL_OPTIONS = [dict(reported=r, kept_mass=k, trainer_mask=m) for r in REPORTED
               for k in (None, *KEPT_MASS) for m in (False, True)
               if not (k == "trainer" and m)]


def log_mass(logits, keep):
    """log of softmax(logits)'s mass on ``keep``, one value a row of the last axis (float64)."""
    top = logits.max(axis=-1, keepdims=True)
    on_keep = np.where(keep, logits, -np.inf)
    top_keep = on_keep.max(axis=-1, keepdims=True)
    return ((top_keep[..., 0] + np.log(np.exp(on_keep - top_keep).sum(axis=-1)))
            - (top[..., 0] + np.log(np.exp(logits - top).sum(axis=-1))))


def enumerated_batch(toy, options, cut):
    """``engine_toy(toy, **cut, **options)`` and, for its sequences, what a trainer holds: its
    logits (M, T, V), the engine's reported log-probs before any correction, the written tokens,
    the kept sets (M, T, V), the mask and, where the correction reads it, the reported
    distribution's log-mass on the kept set."""
    engine = engine_toy(toy, **cut, **options)
    reported = options.get("reported", "processed")
    as_reported = engine_toy(toy, **cut, reported=reported)  # no correction, no mask
    assert np.array_equal(as_reported["Y"], engine["Y"])
    z = toy["theta"] + toy["mismatch"] * toy["b"]  # the engine's raw logits
    keep = np.isfinite(processed_log_probs(z, **cut))  # the kept set of every row
    Y = engine["Y"]
    positions = np.broadcast_to(np.arange(Y.shape[1])[None, :], Y.shape)
    rows = (positions, engine["prev"]) if "prev" in engine else (positions,)
    mask = engine.get("mask", np.ones(Y.shape))
    tau = cut.get("temperature", 1.0)
    inputs = dict(
        trainer_logits=torch.tensor(toy["theta"][rows]),
        sampler_logp=torch.tensor(as_reported["logp_sampler"]),
        tokens=torch.tensor(Y), kept=torch.tensor(keep[rows]), mask=torch.tensor(mask),
        temperature=tau, **options)
    if options.get("kept_mass") == "sampler" and reported != "processed":
        # log l(S_t) of the reported distribution: softmax(z) (raw), softmax(z / tau) (tempered)
        per_row = log_mass(z if reported == "raw" else z / tau, keep)
        inputs["sampler_log_kept"] = torch.tensor(np.where(mask > 0, per_row[rows], 0.0))
    return engine, inputs, rows


def scores(out, inputs, engine, rows):
    """The gradient of each token's trainer log-prob, placed in the toy's parameter layout."""
    (grad,) = torch.autograd.grad(out.trainer_logp.sum(), inputs["trainer_logits"])
    if "prev" not in engine:
        return grad.numpy()  # (M, T, V): each (m, t) row of logits is read by one token
    full = np.zeros(engine["score"].shape)  # (M, T, V + 1, V)
    M = full.shape[0]
    full[np.arange(M)[:, None], rows[0], rows[1]] = grad.numpy()
    return full


def run(engine, inputs, rows):
    inputs = dict(inputs, trainer_logits=inputs["trainer_logits"].clone().requires_grad_(True))
    out = kept_mass_log_ratio(**inputs)
    return out, scores(out, inputs, engine, rows)


# ---------------------------------------------------------------------------------------------
# On the enumerated batch: engine_toy's log-ratios, scores and the table's biases
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
@pytest.mark.parametrize("cut", CUTS, ids=str)
def test_every_choice_gives_engine_toys_log_ratio_and_score(make, cut):
    toy = make(mismatch=0.3)
    for options in ALL_OPTIONS:
        engine, inputs, rows = enumerated_batch(toy, options, cut)
        out, score = run(engine, inputs, rows)
        assert isinstance(out, KeptMassRatio) and out.log_ratio.dtype == torch.float64
        expected = engine["logp_train"] - engine["logp_sampler"]
        np.testing.assert_allclose(out.log_ratio.detach().numpy(), expected, rtol=0,
                                   atol=1e-12, err_msg=str(options))
        np.testing.assert_allclose(out.trainer_logp.detach().numpy(), engine["logp_train"],
                                   rtol=0, atol=1e-12, err_msg=str(options))
        np.testing.assert_allclose(out.sampler_logp.numpy(), engine["logp_sampler"], rtol=0,
                                   atol=1e-12, err_msg=str(options))
        assert not out.sampler_logp.requires_grad
        np.testing.assert_allclose(score, engine["score"], rtol=0, atol=1e-12,
                                   err_msg=str(options))


@pytest.mark.parametrize("cut", TABLE_CUTS, ids=str)
def test_the_sequence_ratios_exact_mean_gives_the_kept_mass_tables_biases(cut):
    toy = make_toy()
    table = None  # kept_mass_table samples by the exact rule only
    if "sampler" not in cut:
        table = kept_mass_table(toy, temperature=cut.get("temperature", 1.0),
                                top_p=cut.get("top_p", 1.0), top_k=cut.get("top_k"),
                                min_p=cut.get("min_p", 0.0))
    for i, options in enumerate(CHOICES):
        engine, inputs, rows = enumerated_batch(toy, options, cut)
        out, score = run(engine, inputs, rows)
        rho = torch.exp(out.log_ratio.detach().sum(dim=1)).numpy()  # (M,)
        mean = np.einsum("m,m,m,m...->...", engine["p_sampler"], rho, engine["R"], score)
        targets = {"true": engine["true_grad"],
                   "writable": engine["true_grad"] - engine["truncated_grad"],
                   "masked": engine["masked_grad"]}
        for name, target in targets.items():
            bias = float(np.linalg.norm(mean - target) / np.linalg.norm(target))
            if table is not None:
                assert bias == pytest.approx(table[i][f"rel_bias_{name}"], rel=1e-9, abs=1e-12)
        # the identities of the chapter, for every cut: the exact ratio unbiased for J^W, the
        # mask replayed for the engine's policy
        if options == dict(reported="processed"):
            np.testing.assert_allclose(mean, targets["writable"], rtol=0, atol=1e-13)
        if options.get("trainer_mask"):
            np.testing.assert_allclose(mean, targets["masked"], rtol=0, atol=1e-13)


def test_at_the_chapters_setting_the_table_is_reproduced_row_by_row():
    """The chapter's table (make_toy, temperature 0.7, top-p 0.93), each row's three biases."""
    toy, cut = make_toy(), dict(temperature=0.7, top_p=0.93)
    table = kept_mass_table(toy, **cut)
    assert [row["options"] for row in table] == CHOICES
    for row, options in zip(table, CHOICES):
        engine, inputs, rows = enumerated_batch(toy, options, cut)
        out, score = run(engine, inputs, rows)
        rho = torch.exp(out.log_ratio.detach().sum(dim=1)).numpy()
        mean = np.einsum("m,m,m,mtv->tv", engine["p_sampler"], rho, engine["R"], score)
        restricted = engine["true_grad"] - engine["truncated_grad"]
        assert float(np.linalg.norm(mean - restricted) / np.linalg.norm(restricted)) == \
            pytest.approx(row["rel_bias_writable"], rel=1e-9, abs=1e-12)


def test_a_trainer_without_the_temperature_is_temperature_one():
    toy, cut = make_toy(), dict(temperature=0.7, top_p=0.93)
    for options in (dict(), dict(kept_mass="trainer"), dict(trainer_mask=True)):
        engine = engine_toy(toy, **cut, **options, trainer_temperature=False)
        _, inputs, rows = enumerated_batch(toy, options, cut)
        out, score = run(engine, dict(inputs, temperature=1.0), rows)
        np.testing.assert_allclose(out.log_ratio.detach().numpy(),
                                   engine["logp_train"] - engine["logp_sampler"], rtol=0,
                                   atol=1e-12)
        np.testing.assert_allclose(score, engine["score"], rtol=0, atol=1e-12)


def test_the_trainers_kept_mass_has_the_masks_value_and_the_full_vocabularys_score():
    toy, cut = make_toy(), dict(temperature=0.7, top_p=0.93)
    engine, inputs, rows = enumerated_batch(toy, dict(kept_mass="trainer"), cut)
    added, added_score = run(engine, inputs, rows)
    _, masked_inputs, _ = enumerated_batch(toy, dict(trainer_mask=True), cut)
    replayed, replayed_score = run(engine, masked_inputs, rows)
    _, plain_inputs, _ = enumerated_batch(toy, dict(), cut)
    plain, plain_score = run(engine, plain_inputs, rows)
    torch.testing.assert_close(added.log_ratio, replayed.log_ratio, rtol=0, atol=1e-13)
    np.testing.assert_array_equal(added_score, plain_score)
    assert np.abs(added_score - replayed_score).max() > 0.1


# ---------------------------------------------------------------------------------------------
# Half precision, padding, devices
# ---------------------------------------------------------------------------------------------
def small_case(dtype=torch.float64):
    """Two responses of two tokens over V = 4; the second response's last token is padding
    holding garbage (NaN logits, an out-of-range token, an empty kept set)."""
    logits = torch.tensor([[[2.0, 1.0, 0.5, -math.inf], [0.3, -0.2, 1.5, 0.0]],
                           [[1.0, 1.0, -1.0, 0.5], [math.nan, 0.0, 0.0, 0.0]]])
    kept = torch.tensor([[[True, True, False, False], [True, False, True, True]],
                         [[True, True, False, True], [False, False, False, False]]])
    return dict(trainer_logits=logits.to(dtype),
                sampler_logp=torch.tensor([[-0.4, -0.9], [-1.1, math.nan]]).to(dtype),
                tokens=torch.tensor([[1, 2], [3, -100]]), kept=kept,
                mask=torch.tensor([[1, 1], [1, 0]]), temperature=0.7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", ALL_OPTIONS, ids=str)
def test_half_precision_is_computed_in_float32(dtype, options):
    case = dict(small_case(dtype), **options)
    exact = dict(case, trainer_logits=case["trainer_logits"].float(),
                 sampler_logp=case["sampler_logp"].float())
    if options["kept_mass"] == "sampler" and options["reported"] != "processed":
        case["sampler_log_kept"] = torch.tensor([[-0.1, -0.3], [-0.2, 0.0]]).to(dtype)
        exact["sampler_log_kept"] = case["sampler_log_kept"].float()
    theta = case["trainer_logits"].clone().requires_grad_(True)
    out = kept_mass_log_ratio(**dict(case, trainer_logits=theta))
    reference = kept_mass_log_ratio(**exact)
    for got, want in zip(out, reference):
        assert got.dtype == torch.float32
        assert torch.equal(got.detach(), want)
    (grad,) = torch.autograd.grad(out.trainer_logp.sum(), theta)
    assert grad.dtype == dtype and bool(torch.isfinite(grad).all())


def test_padding_is_exactly_zero_in_every_output_and_gradient_whatever_it_holds():
    case = small_case()
    theta = case["trainer_logits"].clone().requires_grad_(True)
    out = kept_mass_log_ratio(**dict(case, trainer_logits=theta, kept_mass="trainer"))
    for tensor in out:
        assert tensor[1, 1].item() == 0.0 and bool(torch.isfinite(tensor).all())
    out.log_ratio.sum().backward()
    assert bool(torch.isfinite(theta.grad).all())
    assert torch.equal(theta.grad[1, 1], torch.zeros(4, dtype=torch.float64))
    # a cut token and an impossible one (-inf) get no gradient under the replayed mask
    theta.grad = None
    kept_mass_log_ratio(**dict(case, trainer_logits=theta, trainer_mask=True)).trainer_logp.sum(
        ).backward()
    assert theta.grad[0, 0, 2].item() == 0.0 and theta.grad[0, 0, 3].item() == 0.0


def test_a_small_temperature_does_not_overflow():
    case = dict(small_case(torch.float32), temperature=1e-30)
    out = kept_mass_log_ratio(**case)
    assert bool(torch.isfinite(out.log_ratio).all())
    # token 1 has logit 1, the row's largest 2: log pi = (1 - 2) / tau, the rest underflows
    assert out.trainer_logp[0, 0].item() == pytest.approx(-1e30, rel=1e-6)


def test_tensors_come_back_on_the_inputs_device_under_a_meta_default_device():
    case = small_case()
    with torch.device("meta"):
        out = kept_mass_log_ratio(**dict(case, kept_mass="trainer"))
    plain = kept_mass_log_ratio(**dict(case, kept_mass="trainer"))
    for got, want in zip(out, plain):
        assert got.device.type == "cpu" and torch.equal(got, want)


def test_an_empty_batch_gives_empty_outputs():
    out = kept_mass_log_ratio(torch.zeros(0, 3, 5), torch.zeros(0, 3), torch.zeros(0, 3,
                              dtype=torch.int64), torch.ones(0, 3, 5, dtype=torch.bool),
                              torch.ones(0, 3), temperature=1.0, kept_mass="trainer")
    assert all(tuple(t.shape) == (0, 3) for t in out)


# ---------------------------------------------------------------------------------------------
# Bad input: each error names the argument
# ---------------------------------------------------------------------------------------------
def _with(**changes):
    return changes


BAD = [
    (_with(trainer_logits=[[[0.0]]]), TypeError, r"trainer_logits must be a torch\.Tensor"),
    (_with(trainer_logits=torch.zeros(2, 2, 4, dtype=torch.int64)), TypeError,
     r"trainer_logits must have a floating dtype, got torch\.int64"),
    (_with(trainer_logits=torch.zeros(2, 4)), ValueError,
     r"trainer_logits must have 3 dimensions, got shape \(2, 4\)"),
    (_with(trainer_logits=torch.zeros(2, 2, 0), kept=torch.ones(2, 2, 0, dtype=torch.bool)),
     ValueError, r"trainer_logits must have a vocabulary of at least 1 entry.*V = 0"),
    (_with(sampler_logp=torch.zeros(2, 3)), ValueError,
     r"sampler_logp must have the shape \(B, T\) = \(2, 2\) of trainer_logits \(2, 2, 4\), "
     r"got \(2, 3\)"),
    (_with(sampler_logp=torch.zeros(2, 2, dtype=torch.int64)), TypeError,
     r"sampler_logp must have a floating dtype"),
    (_with(tokens=[[1, 2], [3, 0]]), TypeError, r"tokens must be a torch\.Tensor, got list"),
    (_with(tokens=torch.zeros(2, 2)), TypeError,
     r"tokens must have an integer dtype \(token ids\), got torch\.float32"),
    (_with(tokens=torch.zeros(2, 2, dtype=torch.bool)), TypeError,
     r"tokens must have an integer dtype"),
    (_with(tokens=torch.zeros(2, 1, dtype=torch.int64)), ValueError,
     r"tokens must have the shape \(B, T\) = \(2, 2\) of trainer_logits \(2, 2, 4\), got \(2, "
     r"1\)"),
    (_with(tokens=torch.tensor([[1, 4], [3, 0]])), ValueError,
     r"tokens must be token ids in \[0, 4\) where mask is 1, got 4 at position \(0, 1\)"),
    (_with(tokens=torch.tensor([[1, 2], [-1, 0]])), ValueError,
     r"tokens must be token ids in \[0, 4\) where mask is 1, got -1 at position \(1, 0\)"),
    (_with(kept=torch.ones(2, 2, 4)), TypeError,
     r"kept must be a bool tensor \(True: the engine kept the token\), got torch\.float32"),
    (_with(kept=torch.ones(2, 2, 3, dtype=torch.bool)), ValueError,
     r"kept must have the shape of trainer_logits \(2, 2, 4\), got \(2, 2, 3\)"),
    (_with(kept=None), TypeError, r"kept must be a torch\.Tensor, got NoneType"),
    (_with(mask=torch.ones(2, 3)), ValueError,
     r"mask must have the shape of sampler_logp \(2, 2\), got \(2, 3\)"),
    (_with(mask=torch.tensor([[1, 2], [1, 0]])), ValueError, r"mask values must be 0 or 1"),
    (_with(temperature=0.0), ValueError, r"temperature must be > 0, got 0\.0"),
    (_with(temperature=-0.7), ValueError, r"temperature must be > 0, got -0\.7"),
    (_with(temperature=math.nan), ValueError, r"temperature must be a finite number"),
    (_with(temperature=True), TypeError, r"temperature must be a real number"),
    (_with(temperature=1e-320), ValueError,
     r"temperature must be at least 1 / \(the largest torch\.float32 number\), got 1e-320"),
    (_with(reported="sglang"), ValueError,
     r"reported must be one of \('processed', 'raw', 'tempered'\), got 'sglang'"),
    (_with(reported=None), TypeError, r"reported must be one of .*, got NoneType None"),
    (_with(kept_mass="engine"), ValueError,
     r"kept_mass must be None or one of \('sampler', 'trainer'\), got 'engine'"),
    (_with(kept_mass=1), TypeError, r"kept_mass must be None or one of .*, got int 1"),
    (_with(trainer_mask=1), TypeError, r"trainer_mask must be True or False, got 1"),
    (_with(kept_mass="trainer", trainer_mask=True), ValueError,
     r"kept_mass='trainer' with trainer_mask=True counts the trainer's kept mass twice"),
    (_with(reported="tempered", kept_mass="sampler"), ValueError,
     r"kept_mass='sampler' with reported='tempered' needs sampler_log_kept"),
    (_with(sampler_log_kept=torch.zeros(2, 2)), ValueError,
     r"sampler_log_kept is read only by kept_mass='sampler' with reported 'raw' or "
     r"'tempered', got kept_mass=None, reported='processed'"),
    (_with(reported="raw", kept_mass="sampler", sampler_log_kept=torch.zeros(2, 3)),
     ValueError, r"sampler_log_kept must have the same shape as sampler_logp \(2, 2\), got "
                 r"\(2, 3\)"),
    (_with(reported="raw", kept_mass="sampler",
           sampler_log_kept=torch.tensor([[0.0, math.nan], [0.0, 0.0]])),
     ValueError, r"sampler_log_kept must be finite where mask is 1 .*got nan at position "
                 r"\(0, 1\)"),
    (_with(sampler_logp=torch.tensor([[-0.4, -math.inf], [-1.1, 0.0]])), ValueError,
     r"sampler_logp must be finite where mask is 1 .*got -inf at position \(0, 1\)"),
    (_with(sampler_logp=torch.tensor([[-0.4, 0.3], [-1.1, 0.0]])), ValueError,
     r"sampler_logp must be <= 0 where mask is 1 \(the log of a probability\), got 0.3"),
    (_with(reported="raw", kept_mass="sampler",
           sampler_log_kept=torch.tensor([[0.0, 0.5], [0.0, 0.0]])),
     ValueError, r"sampler_log_kept must be <= 0 where mask is 1 .*at position \(0, 1\)"),
    (_with(reported="raw", kept_mass="sampler", sampler_logp=torch.tensor([[-0.4, -0.2],
                                                                          [-1.1, -0.5]]),
           sampler_log_kept=torch.tensor([[-0.1, -0.3], [0.0, 0.0]])),
     ValueError, r"sampler_logp must be <= sampler_log_kept where mask is 1 .*-0.2.* > "
                 r".*-0.3.* at position \(0, 1\)"),
    (_with(trainer_logits=torch.tensor([[[2.0, 1.0, math.nan, 0.0], [0.0] * 4],
                                        [[0.0] * 4, [0.0] * 4]])), ValueError,
     r"trainer_logits must not hold NaN where mask is 1 .*at position \(0, 0\)"),
    (_with(trainer_logits=torch.tensor([[[2.0, 1.0, math.inf, 0.0], [0.0] * 4],
                                        [[0.0] * 4, [0.0] * 4]])), ValueError,
     r"trainer_logits must not hold \+inf where mask is 1 .*at position \(0, 0\)"),
    (_with(trainer_logits=torch.tensor([[[2.0, -math.inf, 0.0, 0.0], [0.0] * 4],
                                        [[0.0] * 4, [0.0] * 4]])), ValueError,
     r"trainer_logits must be finite at the written token where mask is 1 .*got -inf at "
     r"position \(0, 0\), token 1"),
    (_with(kept=torch.tensor([[[True, False, True, True]] * 2] * 2)), ValueError,
     r"kept must hold the written token where mask is 1 \(the engine writes only kept "
     r"tokens\), got False at position \(0, 0\) for token 1"),
    (_with(trainer_logits=torch.tensor([[[0.0, -3e38, 0.0, 0.0], [0.0] * 4],
                                        [[0.0] * 4, [0.0] * 4]]), temperature=0.5,
           trainer_mask=True,
           kept=torch.tensor([[[False, True, False, False], [True] * 4], [[True] * 4] * 2])),
     ValueError, r"the log-ratio at position \(0, 0\) overflows torch\.float32"),
]


def valid_call():
    return dict(trainer_logits=torch.zeros(2, 2, 4), sampler_logp=torch.full((2, 2), -1.0),
                tokens=torch.tensor([[1, 2], [3, 0]]), kept=torch.ones(2, 2, 4, dtype=torch.bool),
                mask=torch.ones(2, 2), temperature=1.0)


def test_the_valid_call_of_the_table_is_valid():
    out = kept_mass_log_ratio(**valid_call())
    assert torch.allclose(out.log_ratio, torch.full((2, 2), 1.0 - math.log(4.0)))


@pytest.mark.parametrize(("changes", "error", "message"), BAD,
                         ids=[re.sub(r"\W+", "_", m)[:40] for _, _, m in BAD])
def test_bad_input_is_refused_naming_the_argument(changes, error, message):
    with pytest.raises(error, match=message):
        kept_mass_log_ratio(**dict(valid_call(), **changes))


def test_an_input_on_another_device_is_refused_naming_it():
    for name in ("sampler_logp", "tokens", "kept", "mask"):
        call = valid_call()
        call[name] = call[name].to("meta")
        with pytest.raises(ValueError, match=rf"{name} must be on the device of trainer_logits "
                                             r"\(cpu\), got meta"):
            kept_mass_log_ratio(**call)


# ---------------------------------------------------------------------------------------------
# Properties (Hypothesis): random logits, kept sets and masks against a float64 reference
# ---------------------------------------------------------------------------------------------
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def batches(draw):
    """A valid call: logits with -inf entries, kept sets holding the written token, a mask,
    garbage (NaN, inf, an out-of-range token, an empty kept set) at the padding."""
    B, T, V = draw(st.integers(0, 3)), draw(st.integers(0, 4)), draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3]))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = scale * g.standard_normal((B, T, V))
    tokens = g.integers(0, V, (B, T))
    written = np.eye(V, dtype=bool)[tokens]  # (B, T, V)
    logits = np.where(~written & (g.random((B, T, V)) < 0.2), -np.inf, logits)
    kept = written | (g.random((B, T, V)) < draw(st.sampled_from([0.0, 0.5, 1.0])))
    mask = g.random((B, T)) < draw(st.sampled_from([0.0, 0.6, 1.0]))
    sampler = -scale * g.random((B, T))
    log_kept = sampler * g.random((B, T))  # a mass between the token's and 1
    garbage = draw(st.sampled_from([0.0, -math.inf, math.inf, math.nan]))
    pad = ~mask
    logits[pad] = garbage
    sampler[pad] = garbage
    log_kept[pad] = garbage
    tokens[pad] = draw(st.sampled_from([0, -100, V + 3]))
    kept[pad] = draw(st.booleans())
    options = draw(st.sampled_from(ALL_OPTIONS))
    call = dict(trainer_logits=torch.from_numpy(logits).to(dtype),
                sampler_logp=torch.from_numpy(sampler).to(draw(st.sampled_from(DTYPES))),
                tokens=torch.from_numpy(tokens), kept=torch.from_numpy(kept),
                mask=torch.from_numpy(mask).to(draw(st.sampled_from([torch.bool, torch.int64,
                                                                     torch.float32]))),
                temperature=draw(st.sampled_from([0.05, 0.7, 1.0, 2.5])), **options)
    if options["kept_mass"] == "sampler" and options["reported"] != "processed":
        call["sampler_log_kept"] = torch.from_numpy(log_kept).to(draw(st.sampled_from(DTYPES)))
    return call


def reference(call):
    """log pi', log mu' and the score of each valid token, in float64 from the definitions, on
    the inputs as rounded to their dtypes."""
    z = call["trainer_logits"].double().numpy() / call["temperature"]
    log_mu = call["sampler_logp"].double().numpy()
    B, T, V = z.shape
    mask = call["mask"].numpy() != 0
    trainer, sampler = np.zeros((B, T)), np.zeros((B, T))
    score = np.zeros((B, T, V))
    for b, t in zip(*np.nonzero(mask)):
        row, S, y = z[b, t], call["kept"][b, t].numpy(), int(call["tokens"][b, t])
        log_p = row - row.max() - np.log(np.exp(row - row.max()).sum())  # log pi_tau
        top = log_p[S].max()  # finite: S_t holds y_t
        log_K = top + np.log(np.exp(log_p[S] - top).sum())  # log pi_tau(S_t)
        if call["trainer_mask"]:
            trainer[b, t] = log_p[y] - log_K
            policy = np.exp(np.where(S, log_p - log_K, -np.inf))  # pi_S
        else:
            trainer[b, t] = log_p[y]
            policy = np.exp(log_p)
        score[b, t] = (np.eye(V)[y] - policy) / call["temperature"]
        sampler[b, t] = log_mu[b, t]
        if "sampler_log_kept" in call:
            sampler[b, t] -= call["sampler_log_kept"][b, t].double().item()
        elif call["kept_mass"] == "trainer":
            sampler[b, t] += log_K
    return trainer, sampler, score


def expected_dtype(call):
    wide = call["trainer_logits"].dtype
    for name in ("sampler_logp", "sampler_log_kept"):
        if name in call:
            wide = torch.promote_types(wide, call[name].dtype)
    return torch.float32 if wide in (torch.float16, torch.bfloat16) else wide


@pytest.mark.properties
@given(batches())
def test_values_and_gradients_are_finite_and_equal_the_float64_reference(call):
    theta = call["trainer_logits"].clone().requires_grad_(True)
    out = kept_mass_log_ratio(**dict(call, trainer_logits=theta))
    dtype = expected_dtype(call)
    assert all(t.dtype == dtype and bool(torch.isfinite(t).all()) for t in out)
    trainer, sampler, score = reference(call)
    # a few ulps of the compute dtype times the largest |theta / tau| and |log mu'|, on the
    # valid rows
    logits = call["trainer_logits"].double().numpy()[call["mask"].numpy() != 0]  # (n, V)
    largest = float(np.abs(np.where(np.isfinite(logits), logits, 0.0)).max(initial=0.0))
    scale = (largest / call["temperature"] + float(np.abs(sampler).max(initial=0.0))
             + math.log(logits.shape[-1]) + 1.0)
    atol = 64 * torch.finfo(dtype).eps * scale
    np.testing.assert_allclose(out.trainer_logp.detach().double().numpy(), trainer, rtol=0,
                               atol=atol)
    np.testing.assert_allclose(out.sampler_logp.double().numpy(), sampler, rtol=0, atol=atol)
    np.testing.assert_allclose(out.log_ratio.detach().double().numpy(), trainer - sampler,
                               rtol=0, atol=2 * atol)
    (grad,) = torch.autograd.grad(out.trainer_logp.sum(), theta, allow_unused=True)
    if grad is None:  # an empty batch
        return
    assert grad.dtype == theta.dtype and bool(torch.isfinite(grad).all())
    # the score: entries of size 1 / tau, rounded to the input's dtype at the end
    tolerance = (atol + torch.finfo(theta.dtype).eps) / call["temperature"]
    np.testing.assert_allclose(grad.double().numpy(), score, rtol=0, atol=tolerance)


@pytest.mark.properties
@given(batches(), st.sampled_from([0.0, -math.inf, math.nan]))
def test_what_the_padding_holds_changes_nothing(call, other):
    mask = call["mask"] != 0
    changed = dict(call, trainer_logits=torch.where(mask[..., None], call["trainer_logits"],
                                                    torch.tensor(other).to(
                                                        call["trainer_logits"].dtype)),
                   sampler_logp=torch.where(mask, call["sampler_logp"],
                                            torch.tensor(other).to(call["sampler_logp"].dtype)),
                   tokens=torch.where(mask, call["tokens"], torch.tensor(-7)),
                   kept=torch.where(mask[..., None], call["kept"], torch.tensor(False)))
    for got, want in zip(kept_mass_log_ratio(**changed), kept_mass_log_ratio(**call)):
        assert torch.equal(got, want)
        assert bool((got[~mask] == 0).all())
