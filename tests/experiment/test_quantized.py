"""opd_literate.experiment.quantized: the quantized and low-precision samplers, the mismatch they
create, and every estimator on tinylm's enumerated answers, with the toys' own definitions."""

import numpy as np
import pytest
import torch

from opd_literate.experiment.exact import answer_states
from opd_literate.experiment.quantized import (
    answer_toy,
    matched_toy_mismatch,
    quantize_per_channel,
    rank_correlation,
    sampler_copy,
    tinylm_answer_toy,
    token_mismatch,
    toy_token_mismatch,
)
from opd_literate.experiment.tinylm import TinyLM, make_prompts, token_logp
from opd_literate.mismatch.estimators import REGISTRY, comparison_table
from opd_literate.mismatch.opd_mismatch import (
    OPD_RECIPES,
    PREFIX_RECIPES,
    add_teacher,
    opd_estimate,
)
from opd_literate.mismatch.toy import estimator_moments, log_softmax, make_ar_toy, make_toy


# ---------------------------------------------------------------------------------------------
# The quantizer and the samplers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_quantization_is_symmetric_per_channel_round_to_nearest(bits):
    torch.manual_seed(0)
    rows = torch.logspace(-2, 1, 6, dtype=torch.float64)[:, None]  # channels of every scale
    w = torch.randn(6, 40, dtype=torch.float64) * rows
    q_max = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=1, keepdim=True) / q_max
    w_hat = quantize_per_channel(w, bits)
    codes = w_hat / scale
    assert torch.allclose(codes, codes.round(), atol=1e-9)  # on the grid s * integer
    assert codes.round().abs().max() <= q_max  # symmetric: -2^(bits-1) unused
    assert codes.round().abs().amax(dim=1).eq(q_max).all()  # the largest entry is exact
    assert ((w - w_hat).abs() <= scale / 2 + 1e-12).all()  # round to nearest: half a step
    assert torch.equal(quantize_per_channel(w_hat, bits), w_hat) or torch.allclose(
        quantize_per_channel(w_hat, bits), w_hat, atol=1e-15)  # idempotent
    assert w_hat.dtype == w.dtype


@pytest.mark.parametrize("weight, bits, error", [
    (torch.ones(3), 8, TypeError), (torch.ones(2, 2, dtype=torch.long), 8, TypeError),
    (torch.ones(2, 2), 1, ValueError), (torch.ones(2, 2), 9, ValueError),
    (torch.ones(2, 2), True, ValueError), (torch.tensor([[1.0, float("nan")]]), 8, ValueError)])
def test_quantization_names_bad_input(weight, bits, error):
    with pytest.raises(error, match="weight|bits"):
        quantize_per_channel(weight, bits)


def _exact_excess(w, w_hat, bits, u):
    """max over entries of |W - W_hat| - (s_o / 2 + 3 u max_i |W_oi|), in exact rationals (every
    float is a dyadic rational): <= 0 where the docstring's bound holds."""
    from fractions import Fraction

    q_max = 2 ** (bits - 1) - 1
    worst = None
    for row, row_hat in zip(w.double().tolist(), w_hat.double().tolist()):
        m = max(abs(Fraction(x)) for x in row)
        bound = m / q_max / 2 + 3 * u * m
        for x, y in zip(row, row_hat):
            excess = abs(Fraction(x) - Fraction(y)) - bound
            worst = excess if worst is None else max(worst, excess)
    return worst


UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24,
                 torch.bfloat16: 2.0 ** -24, torch.float16: 2.0 ** -24}  # the compute dtype's


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_error_bound_holds_in_every_dtype_and_half_weights_come_back_in_float32(dtype, bits):
    """|W - W_hat| <= s/2 + 3u max|W_o|, exactly (rationals), for every dtype the function takes;
    a half-precision weight is computed and returned in float32, bit for bit its float32
    copy's. Rounded back to the half type the result would break s/2 (0.90 s in bfloat16,
    0.52 s in float16 at int8 on 64 channels of 160), within the docstring's extra half ulp."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(bits)
    scales = torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None]
    w = (torch.randn(64, 160, generator=g, dtype=torch.float64) * scales).to(dtype)
    w_hat = quantize_per_channel(w, bits)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    assert w_hat.dtype == wide and w_hat.shape == w.shape
    assert _exact_excess(w, w_hat, bits, Fraction(UNIT_ROUNDOFF[dtype])) <= 0
    if dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(w_hat, quantize_per_channel(w.float(), bits))
        half_u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
        q_max = 2 ** (bits - 1) - 1
        s = w.double().abs().amax(dim=1, keepdim=True) / q_max
        rounded = (w.double() - w_hat.to(dtype).double()).abs()
        bound = s / 2 + 3 * 2.0 ** -24 * q_max * s + half_u * w_hat.double().abs()
        assert (rounded <= bound).all()
        if bits == 8:  # the reason it is returned in float32
            worst = float((rounded / s).max())
            assert worst > {torch.bfloat16: 0.75, torch.float16: 0.51}[dtype], worst


def test_an_empty_weight_is_quantized_to_an_empty_weight():
    """nn.Linear(0, 3)'s (3, 0) weight and nn.Linear(3, 0)'s (0, 3): empty in, empty out (a new
    tensor); a TinyLM with no hidden units runs as int8 on its head's bias alone."""
    for shape in ((3, 0), (0, 3), (0, 0)):
        w = torch.empty(shape, dtype=torch.bfloat16)
        out = quantize_per_channel(w, 8)
        assert out.shape == shape and out.dtype == torch.float32
    w = torch.empty(3, 0)
    assert quantize_per_channel(w, 4) is not w
    with pytest.warns(UserWarning, match="zero-element"):  # torch's init of an empty layer
        model = TinyLM(hidden=0, layers=1)
    engine = sampler_copy(model, "int8")
    prompts, answers = make_prompts(torch.tensor([[1, 2]])), torch.tensor([[3, 13, 12, 12]])
    logits = engine.logits(prompts, answers)
    assert torch.equal(logits, model.mlp[-1].bias.detach().expand_as(logits))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_largest_weights_stay_finite(dtype):
    """s q_max rounds past the largest float at the top of the range: clamped there, within
    the bound, never inf."""
    from fractions import Fraction

    top = torch.finfo(dtype).max
    w = torch.tensor([[top, -top, top / 3], [1.0, 0.5, 0.25]], dtype=dtype)
    for bits in range(2, 9):
        w_hat = quantize_per_channel(w, bits)
        assert torch.isfinite(w_hat).all(), bits
        assert _exact_excess(w, w_hat, bits, Fraction(UNIT_ROUNDOFF[dtype])) <= 0


def test_a_channel_whose_scale_underflows_is_returned_as_zeros():
    """The docstring's condition: below the normal range the roundings underflow; a scale that
    underflows to 0 (here 2^-149 / 127 in float32) leaves its channel at 0."""
    tiny = torch.tensor([[2.0 ** -149, 0.0]], dtype=torch.float32)
    assert quantize_per_channel(tiny, 8).tolist() == [[0.0, 0.0]]


def test_sampler_copy_and_ensemble_sampler_name_a_wrong_model():
    from opd_literate.experiment.quantized import ensemble_sampler
    from opd_literate.experiment.tinylm import EnsembleLM

    with pytest.raises(TypeError, match="model must be a TinyLM, got EnsembleLM"):
        sampler_copy(EnsembleLM(2, 8, 1), "int8")
    with pytest.raises(TypeError, match="ensemble must be an EnsembleLM, got TinyLM"):
        ensemble_sampler(TinyLM(hidden=8), "int8")


def test_sampler_copies_leave_the_model_alone_and_the_float64_copy_is_the_trainer():
    torch.manual_seed(1)
    model = TinyLM(hidden=8, layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = make_prompts(torch.tensor([[12, 34]]))
    answers = torch.tensor([[4, 6, 12, 13]])
    for sampler in ("float64", "fp32", "bf16", "fp16", "int8", "int4"):
        engine = sampler_copy(model, sampler)
        assert torch.isfinite(engine.logits(prompts, answers).double()).all()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    trainer = sampler_copy(model, "float64").logits(prompts, answers)
    assert trainer.dtype == torch.float64
    assert torch.allclose(trainer.float(), model.logits(prompts, answers), atol=1e-6)
    with pytest.raises(ValueError, match="sampler"):
        sampler_copy(model, "int3")
    with pytest.raises(TypeError, match="TinyLM"):
        sampler_copy(torch.nn.Linear(2, 2), "int8")


def _bf16_from_float32(x):
    """float32 -> bfloat16 (kept as float32), round to nearest, ties to even, from the bits."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def _scalar_half_engine(engine, context, position, half):
    """The rounded engine written another way: Python floats, math.fsum (the correctly rounded
    sum) and math.erf per output, numpy's float32 and ``half`` roundings."""
    import math

    def r(values):
        return half(np.float32(values)).astype(np.float64)

    def params(layer):
        return layer.weight.detach().double().numpy(), layer.bias.detach().double().numpy()

    tokens = engine.token_embedding.weight.detach().double().numpy()
    places = engine.position_embedding.weight.detach().double().numpy()
    h = np.concatenate([tokens[int(c)] for c in context] + [places[int(position)]])
    for layer in engine.mlp:
        if isinstance(layer, torch.nn.Linear):
            W, b = params(layer)
            h = r([math.fsum([*(W[o] * h), b[o]]) for o in range(len(b))])
        else:
            h = r([0.5 * x * (1 + math.erf(x / math.sqrt(2))) for x in h])
    return h


@pytest.mark.parametrize("sampler", ["bf16", "fp16"])
def test_the_rounded_half_engine_is_its_definition_and_ignores_the_order_of_its_sums(sampler):
    """rounded_half_forward: against a scalar implementation of the same definition (exact
    sums, numpy's roundings), bit for bit; and the same logits, bit for bit, from a copy of the
    model whose hidden units are permuted (the same function, every sum in another order)."""
    from opd_literate.experiment.exact import state_contexts
    from opd_literate.experiment.quantized import rounded_half_forward

    torch.manual_seed(3)
    model = TinyLM(hidden=16, layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    prompts = make_prompts(torch.tensor([[12, 34], [90, 7]]))
    states = answer_states(prompts, model.max_answer)
    engine = sampler_copy(model, sampler)
    contexts = state_contexts(engine, prompts, states)
    z = rounded_half_forward(engine, contexts, states["position"])
    half = {"bf16": _bf16_from_float32, "fp16": np.float16}[sampler]
    assert torch.equal(z.to(engine.mlp[0].weight.dtype).double(), z)  # numbers of the type
    for row in (0, 1, 50, len(z) - 1):
        expected = _scalar_half_engine(engine, contexts[row], states["position"][row], half)
        assert np.array_equal(z[row].numpy(), expected), row
    permuted = sampler_copy(model, sampler)
    with torch.no_grad():
        for first, second in ((0, 2), (2, 4)):  # permute layer `first`'s outputs
            order = torch.randperm(16)
            permuted.mlp[first].weight.copy_(permuted.mlp[first].weight[order])
            permuted.mlp[first].bias.copy_(permuted.mlp[first].bias[order])
            permuted.mlp[second].weight.copy_(permuted.mlp[second].weight[:, order])
    assert torch.equal(rounded_half_forward(permuted, contexts, states["position"]), z)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        rounded_half_forward(sampler_copy(model, "fp32"), contexts, states["position"])


_KERNELS_SCRIPT = """
import hashlib, sys, torch
from opd_literate.experiment.exact import answer_states, state_contexts, state_logits
from opd_literate.experiment.quantized import rounded_half_forward, sampler_copy
from opd_literate.experiment.tinylm import TinyLM, make_prompts
model = TinyLM(hidden=128, layers=2)
model.load_state_dict(torch.load(sys.argv[1], weights_only=True))
prompts = make_prompts(torch.tensor([[12, 34], [90, 7], [55, 55]]))
states = answer_states(prompts, model.max_answer)
out = [torch.backends.cpu.get_cpu_capability()]
for sampler in ("bf16", "fp16"):
    engine = sampler_copy(model, sampler)
    z = rounded_half_forward(engine, state_contexts(engine, prompts, states), states["position"])
    torch_own = state_logits(engine, prompts, states).double()
    out += [hashlib.sha256(x.numpy().tobytes()).hexdigest() for x in (z, torch_own)]
print(" ".join(out))
"""


@pytest.mark.slow
def test_the_rounded_half_engine_gives_the_same_bits_with_torchs_baseline_kernels(tmp_path):
    """What rounded_half_forward is for: the same logits, bit for bit, with the kernels torch
    picks for this CPU and with its baseline ones (``ATEN_CPU_CAPABILITY=default``, another
    process). torch's own half-precision forward pass is printed beside it, not asserted (on a
    CPU whose best kernels are the baseline it agrees with itself)."""
    import os
    import subprocess
    import sys

    torch.manual_seed(5)
    model = TinyLM(hidden=128, layers=2)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    runs = {}
    for name, extra in (("picked", {}), ("baseline", {"ATEN_CPU_CAPABILITY": "default"})):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"} | extra
        done = subprocess.run([sys.executable, "-c", _KERNELS_SCRIPT, str(tmp_path / "model.pt")],
                              env=env, capture_output=True, text=True, timeout=300, check=True)
        runs[name] = done.stdout.split()
    picked, baseline = runs["picked"], runs["baseline"]
    assert baseline[0] == "DEFAULT"
    print(f"torch's kernels {picked[0]}: its own bf16 and fp16 forward pass "
          f"{'the same' if picked[2::2] == baseline[2::2] else 'other'} bits with the baseline")
    assert picked[1::2] == baseline[1::2]  # bf16, fp16: the rounded engine's logits


# ---------------------------------------------------------------------------------------------
# The measured mismatch
# ---------------------------------------------------------------------------------------------
def test_token_mismatch_is_zero_without_mismatch_and_names_bad_input():
    log_p = log_softmax(np.random.default_rng(0).normal(size=(5, 4)))
    out = token_mismatch(log_p, log_p, np.ones(5))
    assert out["kl"] == 0.0 and out["max_abs_log_ratio"] == 0.0
    assert set(out["quantiles"].values()) == {0.0} and out["kurtosis"] == 0.0
    with pytest.raises(ValueError, match="finite"):
        token_mismatch(np.full((1, 2), -np.inf), log_p[:1, :2], np.ones(1))
    with pytest.raises(ValueError, match="visits"):
        token_mismatch(log_p, log_p, np.zeros(5))
    with pytest.raises(ValueError, match="shape"):
        token_mismatch(log_p, log_p[:, :3], np.ones(5))


def test_token_mismatch_of_the_toy_is_the_mean_kl_of_its_positions():
    toy = make_toy(mismatch=0.3)
    log_pi, log_mu = log_softmax(toy["theta"]), log_softmax(toy["theta"] + 0.3 * toy["b"])
    kl = (np.exp(log_mu) * (log_mu - log_pi)).sum(axis=1).mean()
    assert toy_token_mismatch(toy)["kl"] == pytest.approx(kl, rel=1e-12)


def test_the_ar_toys_visits_are_the_expected_kl_over_its_responses():
    toy = make_ar_toy(mismatch=0.3)
    log_pi, log_mu = log_softmax(toy["theta"]), log_softmax(toy["theta"] + 0.3 * toy["b"])
    kl_rows = (np.exp(log_mu) * (log_mu - log_pi)).sum(axis=-1)  # (T, V + 1)
    per_response = (kl_rows[np.arange(toy["T"]), toy["prev"]] * toy["mask"]).sum(axis=1)
    expected = toy["p_sampler"] @ per_response / (toy["p_sampler"] @ toy["mask"].sum(axis=1))
    assert toy_token_mismatch(toy)["kl"] == pytest.approx(expected, rel=1e-12)


def test_the_matched_mismatch_gives_the_target_kl():
    target = 1e-3
    def kl_of(e):
        return toy_token_mismatch(make_toy(T=2, V=3, mismatch=e))["kl"]

    assert kl_of(matched_toy_mismatch(target, kl_of)) == pytest.approx(target, rel=1e-9)
    with pytest.raises(ValueError, match="outside"):
        matched_toy_mismatch(1e9, lambda e: e)


def test_rank_correlation_shares_ties():
    assert rank_correlation([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)
    # ranks (1.5, 1.5, 3) and (1, 2, 3): centred (-0.5, -0.5, 1) and (-1, 0, 1), so
    # rho = 1.5 / sqrt(1.5 * 2) = sqrt(3) / 2
    assert rank_correlation([1, 1, 2], [1, 2, 3]) == pytest.approx(3 ** 0.5 / 2, rel=1e-15)
    with pytest.raises(ValueError, match=r"a is constant \(every value 1.0 to 10 significant "
                                         r"digits\): its rank correlation is undefined"):
        rank_correlation([1, 1, 1], [1, 2, 3])


# ---------------------------------------------------------------------------------------------
# The same definitions as the toys
# ---------------------------------------------------------------------------------------------
def _ar_toy_as_answers(toy, teacher_logits=None):
    """make_ar_toy's model enumerated as tinylm's is: answer_states, one state per prefix, the
    logits of row (t, 1 + y_{t-1}) there, and the score's features a one-hot of that row."""
    T, P, V = toy["theta"].shape
    states = answer_states(torch.zeros((1, 1), dtype=torch.long), T, vocab=V, eos=V - 1)
    position = states["position"].numpy()
    prefix = states["prefix"].numpy()
    previous = np.where(position > 0, 1 + prefix[np.arange(len(position)),
                                                 np.maximum(position - 1, 0)], 0)
    row = position * P + previous  # the parameter row (t, p) of the state
    theta = toy["theta"].reshape(T * P, V)
    sampler = (toy["theta"] + toy["mismatch"] * toy["b"]).reshape(T * P, V)
    features = np.eye(T * P)[row]

    def half_zeros(Y, mask, prompt):  # make_ar_toy's reward: at least half the tokens are 0
        return (2 * ((Y == 0) & (mask > 0)).sum(axis=1) >= mask.sum(axis=1)).astype(float)

    teacher = None if teacher_logits is None else log_softmax(teacher_logits.reshape(T * P, V))[row]
    return answer_toy(states, log_softmax(theta)[row], log_softmax(sampler)[row], half_zeros,
                      eos=V - 1, pad=V - 1, features=features, log_teacher=teacher)


@pytest.mark.parametrize("mismatch, baseline", [(0.3, 0.0), (1.0, 0.5)])
def test_every_estimator_on_enumerated_answers_equals_the_ar_toy(mismatch, baseline):
    """The tinylm computation (answer_toy, parameters shared by the positions) on the model of
    make_ar_toy: every row of the comparison table equals the toy's own to 1e-12."""
    toy = make_ar_toy(T=4, V=3, mismatch=mismatch, seed=2)
    answers = _ar_toy_as_answers(toy)
    assert len(answers["Y"]) == len(toy["Y"])
    assert answers["p_train"].sum() == pytest.approx(1.0, abs=1e-12)
    ours = comparison_table(answers, baseline=baseline)
    theirs = comparison_table(toy, baseline=baseline)
    assert [r["name"] for r in ours] == list(REGISTRY)
    for a, b in zip(ours, theirs):
        for key in ("bias", "var", "rel_bias", "rel_rmse", "token_frac", "seq_frac"):
            assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-12), (a["name"], key)


def test_sampled_token_opd_on_enumerated_answers_equals_the_ar_toy():
    toy = add_teacher(make_ar_toy(T=4, V=3, mismatch=0.5, seed=1))
    answers = _ar_toy_as_answers(toy, teacher_logits=toy["phi"])
    assert answers["kl"] == pytest.approx(toy["kl"], rel=1e-12)
    for goal in ("kl_grad_per_state", "kl_grad"):
        ours, theirs = dict(answers, true_grad=answers[goal]), dict(toy, true_grad=toy[goal])
        for logp, weight in (*OPD_RECIPES, *PREFIX_RECIPES):
            a = estimator_moments(ours, opd_estimate(answers, logp, weight))
            b = estimator_moments(theirs, opd_estimate(toy, logp, weight))
            assert a["rel_bias"] == pytest.approx(b["rel_bias"], rel=1e-12, abs=1e-12)
            assert a["var"] == pytest.approx(b["var"], rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# On tinylm: the probabilities, the reward and the score against autograd
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_answers():
    torch.manual_seed(4)
    model = TinyLM(hidden=4, layers=1, embed=4, digits=1)  # answers of 3 tokens: 2,380 of them
    with torch.no_grad():  # a sharper head, so that the int4 sampler is visibly off
        model.mlp[-1].weight.mul_(8.0)
        model.mlp[-1].bias.mul_(2.0)
    pairs = torch.tensor([[3, 4], [9, 8]])
    return model, pairs, tinylm_answer_toy(model, pairs, "int4", features="head")


def test_every_answer_once_with_both_distributions_summing_to_one(tiny_answers):
    _, _, toy = tiny_answers
    assert len(toy["Y"]) == 2 * (1 + 13 + 13**2 * 14)  # two prompts
    answers = {(p, *y) for p, y in zip(toy["prompt"].tolist(), toy["Y"].tolist())}
    assert len(answers) == len(toy["Y"])
    assert toy["p_train"].sum() == pytest.approx(1.0, abs=1e-12)
    assert toy["p_sampler"].sum() == pytest.approx(1.0, abs=1e-9)
    assert toy["R"].sum() == 2.0  # one correct answer a prompt: "7<eos>", "17<eos>"
    assert toy["Y"][toy["R"] == 1].tolist() == [[7, 12, 13], [1, 7, 12]]
    assert toy_token_mismatch is not None and token_mismatch(
        toy["log_pi"], toy["log_mu"], toy["visits"])["kl"] > 0


def test_the_score_and_the_true_gradient_are_autograd_of_the_lm_head(tiny_answers):
    model, pairs, toy = tiny_answers
    trainer = sampler_copy(model, "float64")
    head = trainer.mlp[-1]
    prompts = make_prompts(pairs, digits=1)[torch.from_numpy(toy["prompt"])]
    Y = torch.from_numpy(toy["Y"])
    logp = token_logp(trainer.logits(prompts, Y), Y) * torch.from_numpy(toy["mask"])
    log_pi_y = logp.sum(dim=1)  # (M,) log pi(y), teacher-forced
    assert np.allclose(log_pi_y.detach().numpy(), np.log(toy["p_train"] * len(pairs)), atol=1e-10)
    # grad of J = sum_y pi(y) R(y) with respect to the head's weight and bias
    J = (log_pi_y.exp() * torch.from_numpy(toy["R"])).sum() / len(pairs)  # uniform prompts
    grad_w, grad_b = torch.autograd.grad(J, [head.weight, head.bias], retain_graph=True)
    expected = torch.cat([grad_w, grad_b[:, None]], dim=1).numpy()  # (V, H + 1) = [W, c]
    assert np.allclose(toy["true_grad"], expected, atol=1e-12)
    # one answer's score, summed over its tokens: the gradient of its log pi(y)
    for m in (0, int(np.argmax(toy["R"])), len(Y) - 1):
        gw, gb = torch.autograd.grad(log_pi_y[m], [head.weight, head.bias], retain_graph=True)
        assert np.allclose(toy["score"][m].sum(axis=0),
                           torch.cat([gw, gb[:, None]], dim=1).numpy(), atol=1e-12)


def test_the_bias_score_is_the_last_column_of_the_head_score(tiny_answers):
    model, pairs, toy = tiny_answers
    bias = tinylm_answer_toy(model, pairs, "int4")
    assert bias["score"].shape[-1] == 1
    assert np.array_equal(bias["score"][..., 0], toy["score"][..., -1])
    assert np.array_equal(bias["true_grad"][:, 0], toy["true_grad"][:, -1])


def test_the_bias_over_every_parameter_is_autograd_of_the_enumerated_objective(tiny_answers):
    """full_parameter_bias: its true gradient is autograd of J(theta) = sum_m pi_m R_m over
    every parameter (an independent path: J itself, not the surrogate); its head-bias part is
    the toy's own mean; seq_is is unbiased over every parameter, naive is not."""
    from opd_literate.experiment.quantized import full_parameter_bias

    model, pairs, toy = tiny_answers
    out = full_parameter_bias(model, pairs, toy, names=["naive", "seq_is", "token_tis"])
    assert list(out["rel_bias"]) == ["naive", "seq_is", "token_tis"]  # the names asked, in order
    trainer = sampler_copy(model, "float64")
    assert out["parameters"] == sum(p.numel() for p in trainer.parameters())
    prompts = make_prompts(pairs, digits=1)[torch.from_numpy(toy["prompt"])]
    Y = torch.from_numpy(toy["Y"])
    logp = token_logp(trainer.logits(prompts, Y), Y) * torch.from_numpy(toy["mask"])
    J = (logp.sum(dim=1).exp() * torch.from_numpy(toy["R"])).sum() / len(pairs)
    grads = torch.autograd.grad(J, list(trainer.parameters()))
    assert out["true_grad_norm"] == pytest.approx(
        float(torch.cat([g.flatten() for g in grads]).norm()), rel=1e-10)
    assert out["rel_bias"]["seq_is"] < 1e-10
    assert out["rel_bias"]["naive"] > 1e-3 and out["rel_bias"]["token_tis"] > 1e-3
    with pytest.raises(ValueError, match="build the toy from the same pairs"):
        full_parameter_bias(model, pairs[:1], toy)
    # the head's bias alone: the answer toy's own moments (its features="bias" score)
    bias_toy = tinylm_answer_toy(model, pairs, "int4")
    head = full_parameter_bias(model, pairs, bias_toy, names=["naive", "token_tis"],
                               parameter_names=["mlp.2.bias"])
    assert head["parameters"] == 14 and list(head["rel_bias"]) == ["naive", "token_tis"]
    rows = {r["name"]: r for r in comparison_table(bias_toy, names=["naive", "token_tis"])}
    for name in ("naive", "token_tis"):
        assert head["rel_bias"][name] == pytest.approx(rows[name]["rel_bias"], rel=1e-10)
    with pytest.raises(ValueError, match="parameter_names must name parameters"):
        full_parameter_bias(model, pairs, toy, parameter_names=["head"])


def test_answer_toy_names_bad_input():
    states = answer_states(torch.zeros((1, 1), dtype=torch.long), 2, vocab=2, eos=1)
    good = np.log(np.full((2, 2), 0.5))

    def one(Y, mask, prompt):
        return np.ones(len(Y))

    with pytest.raises(ValueError, match="finite"):
        answer_toy(states, np.full((2, 2), -np.inf), good, one, eos=1, pad=1)
    with pytest.raises(ValueError, match="states"):
        answer_toy(states, good[:1], good[:1], one, eos=1, pad=1)
    with pytest.raises(ValueError, match="reward"):
        answer_toy(states, good, good, lambda Y, mask, prompt: np.ones(1), eos=1, pad=1)
    with pytest.raises(ValueError, match="eos and pad"):
        answer_toy(states, good, good, one, eos=2, pad=1)
    with pytest.raises(ValueError, match="features"):
        answer_toy(states, good, good, one, eos=1, pad=1, features=np.ones((3, 1)))
    with pytest.raises(ValueError, match="vocab"):
        answer_states(torch.zeros((1, 1), dtype=torch.long), 2, vocab=1, eos=0)
    with pytest.raises(ValueError, match="eos"):
        answer_states(torch.zeros((1, 1), dtype=torch.long), 2, vocab=3, eos=3)


# ---------------------------------------------------------------------------------------------
# Refusals: every public function names the argument, what it got and what it expected
# ---------------------------------------------------------------------------------------------
def _refusals():
    """(label, call, error, message) for each malformed call of the module's functions."""
    import math
    import types

    from opd_literate.experiment import quantized as Q
    from opd_literate.experiment.exact import state_contexts
    from tests.experiment._tiny import TINY

    torch.manual_seed(0)
    model = TinyLM(hidden=4, layers=1, digits=1)
    engine = sampler_copy(model, "bf16")
    prompts = make_prompts(torch.tensor([[1, 2]]), digits=1)
    states = answer_states(prompts, model.max_answer)
    context, position = state_contexts(engine, prompts, states)[:3], states["position"][:3]
    bad_id = context.clone()
    bad_id[0, 0] = -1
    log_p = log_softmax(np.random.default_rng(0).normal(size=(3, 4)))
    states_toy = answer_states(torch.zeros((1, 1), dtype=torch.long), 2, vocab=2, eos=1)
    half = np.log(np.full((2, 2), 0.5))

    def one(Y, mask, prompt):
        return np.ones(len(Y))

    prepared = types.SimpleNamespace(config=TINY, test_pairs=torch.zeros((16, 2), dtype=torch.long),
                                     teacher=None, student_state={})
    return [
        ("rounded_half_forward float context",
         lambda: Q.rounded_half_forward(engine, context.float(), position), TypeError,
         "context must be a long tensor, got torch.float32"),
        ("rounded_half_forward context width",
         lambda: Q.rounded_half_forward(engine, context[:, :-1], position), ValueError,
         r"context must have shape \(\.\.\., 6\), got \(3, 5\)"),
        ("rounded_half_forward position shape",
         lambda: Q.rounded_half_forward(engine, context, position[:2]), ValueError,
         r"position must have shape \(3,\) \(context's without its last axis\), got \(2,\)"),
        ("rounded_half_forward negative id",
         lambda: Q.rounded_half_forward(engine, bad_id, position), ValueError,
         r"context must hold ids in \[0, 14\), got -1"),
        ("rounded_half_forward position past the answer",
         lambda: Q.rounded_half_forward(engine, context, position + 3), ValueError,
         r"position must hold ids in \[0, 3\), got 3"),
        ("rounded_half_forward not a model",
         lambda: Q.rounded_half_forward(object(), context, position), TypeError,
         "engine must be a bfloat16 or float16 TinyLM"),
        ("engine_logits sampler", lambda: Q.engine_logits(model, "int3", prompts, states),
         ValueError, "sampler must be 'float64' or one of"),
        ("token_mismatch unnormalized", lambda: token_mismatch(log_p + 0.1, log_p, np.ones(3)),
         ValueError, r"log_pi must hold log-probabilities: exp of row 0 sums to 1\.105"),
        ("token_mismatch bool", lambda: token_mismatch(log_p > 0, log_p, np.ones(3)), TypeError,
         "log_pi must hold real numbers, got dtype bool"),
        ("token_mismatch NaN visits",
         lambda: token_mismatch(log_p, log_p, np.array([1.0, math.nan, 1.0])), ValueError,
         "visits must be finite, non-negative and not all 0"),
        ("token_mismatch no tokens", lambda: token_mismatch(log_p[:, :0], log_p[:, :0],
                                                            np.ones(3)),
         ValueError, r"log_pi and log_mu must be \(N, V\) of one shape with N, V >= 1"),
        ("answer_toy states", lambda: answer_toy({}, half, half, one, eos=1, pad=1), ValueError,
         "states must be the dict of answer_states"),
        ("answer_toy reward", lambda: answer_toy(states_toy, half, half, 1.0, eos=1, pad=1),
         TypeError, "reward must be callable"),
        ("answer_toy eos float", lambda: answer_toy(states_toy, half, half, one, eos=1.0, pad=1),
         TypeError, "eos and pad must be integer token ids, got 1.0, 1"),
        ("answer_toy eos bool", lambda: answer_toy(states_toy, half, half, one, eos=True, pad=1),
         TypeError, "eos and pad must be integer token ids, got True, 1"),
        ("answer_toy unnormalized", lambda: answer_toy(states_toy, half, half - 1, one, eos=1,
                                                       pad=1),
         ValueError, r"log_mu must hold log-probabilities: exp of row 0 sums to 0\.36"),
        ("sampler_states float pairs",
         lambda: Q.sampler_states(model, torch.zeros(1, 2), "int8"), TypeError,
         r"pairs must be a \(B, 2\) long tensor, got torch.float32"),
        ("sampler_states pairs shape",
         lambda: Q.sampler_states(model, torch.zeros((1, 3), dtype=torch.long), "int8"),
         ValueError, r"pairs must have shape \(B, 2\) with B >= 1, got \(1, 3\)"),
        ("sampler_states negative operand",
         lambda: Q.sampler_states(model, torch.tensor([[-1, 2]]), "int8"), ValueError,
         r"pairs must be operands in \[0, 10\) for 1-digit prompts, got -1"),
        ("sampler_states long operand",
         lambda: Q.sampler_states(model, torch.tensor([[3, 10]]), "int8"), ValueError,
         r"pairs must be operands in \[0, 10\) for 1-digit prompts, got 10"),
        ("sampler_states model", lambda: Q.sampler_states(None, torch.tensor([[3, 4]]), "int8"),
         TypeError, "model must be a TinyLM, got NoneType"),
        ("tinylm_answer_toy teacher digits",
         lambda: tinylm_answer_toy(model, torch.tensor([[3, 4]]), "int8",
                                   teacher=TinyLM(hidden=4)),
         ValueError, "teacher must answer the model's 1-digit prompts, got a 2-digit teacher"),
        ("tinylm_answer_toy teacher type",
         lambda: tinylm_answer_toy(model, torch.tensor([[3, 4]]), "int8", teacher="teacher"),
         TypeError, "teacher must be a TinyLM, got str"),
        ("full_parameter_bias toy", lambda: Q.full_parameter_bias(model, torch.tensor([[3, 4]]),
                                                                  {}),
         ValueError, "toy must be a tinylm_answer_toy dict"),
        ("full_parameter_bias names",
         lambda: Q.full_parameter_bias(model, torch.tensor([[3, 4]]),
                                       dict.fromkeys(("log_pi", "mask", "state", "Y", "R",
                                                      "p_train", "p_sampler")),
                                       names=["tis"]),
         ValueError, r"names must be a non-empty list of estimators of REGISTRY, got \['tis'\]"),
        ("toy_token_mismatch dict", lambda: toy_token_mismatch([]), ValueError,
         "toy must be a toy of the mismatch chapter"),
        ("toy_token_mismatch theta", lambda: toy_token_mismatch(
            {"theta": np.zeros(3), "b": np.zeros(3), "mismatch": 0.1}), ValueError,
         r"toy\['theta'\] must be \(T, V\) or \(T, P, V\)"),
        ("toy_token_mismatch NaN mismatch", lambda: toy_token_mismatch(
            dict(make_toy(), mismatch=math.nan)), ValueError,
         r"toy\['mismatch'\] must be a finite number, got nan"),
        ("matched_toy_mismatch low", lambda: matched_toy_mismatch(0.1, lambda e: e, low=0.0),
         ValueError, "low must be > 0, got 0.0"),
        ("matched_toy_mismatch band",
         lambda: matched_toy_mismatch(0.1, lambda e: e, low=2.0, high=1.0), ValueError,
         "low must be < high, got low=2.0 >= high=1.0"),
        ("matched_toy_mismatch iterations",
         lambda: matched_toy_mismatch(0.1, lambda e: e, iterations=0), ValueError,
         "iterations must be a positive integer, got 0"),
        ("matched_toy_mismatch callable", lambda: matched_toy_mismatch(0.1, 0.5), TypeError,
         "kl_of must be callable"),
        ("matched_toy_mismatch NaN KL",
         lambda: matched_toy_mismatch(0.1, lambda e: math.nan), ValueError,
         r"kl_of\(low\) must be a finite number, got nan"),
        ("average_ranks NaN", lambda: Q.average_ranks([1.0, math.nan]), ValueError,
         "values must be finite, got nan at index 1"),
        ("average_ranks 2-D", lambda: Q.average_ranks([[1.0, 2.0]]), ValueError,
         r"values must have 1 dimension, got shape \(1, 2\)"),
        ("average_ranks strings", lambda: Q.average_ranks(["a", "b"]), TypeError,
         "values must hold real numbers"),
        ("rank_correlation lengths", lambda: rank_correlation([1, 2, 3], [1, 2]), ValueError,
         "a and b must have one length, got 3 and 2"),
        ("rank_correlation NaN", lambda: rank_correlation([1, 2, 3], [1, math.nan, 2]),
         ValueError, "b must be finite, got nan at index 1"),
        ("rank_correlation too short", lambda: rank_correlation([1], [2]), ValueError,
         "a must have at least 2 entries, got 1"),
        ("rank_correlation constant b", lambda: rank_correlation([1, 2], [5, 5]), ValueError,
         r"b is constant \(every value 5.0"),
        ("rank_correlation bools", lambda: rank_correlation([True, False], [1, 2]), TypeError,
         "a must hold real numbers, got dtype bool"),
        ("mismatch_study prepared", lambda: Q.mismatch_study(object()), TypeError,
         r"prepared must be the Prepared of run.prepare \(with .config\), got object"),
        ("mismatch_study prompts", lambda: Q.mismatch_study(prepared, prompts=17), ValueError,
         r"prompts must be an integer in \[1, 16\] \(the test prompts\), got 17"),
        ("mismatch_study one sampler string",
         lambda: Q.mismatch_study(prepared, 4, samplers="int8"), ValueError,
         "samplers must be a sequence of distinct keys of SAMPLERS .* got 'int8'"),
        ("mismatch_study seeds", lambda: Q.mismatch_study(prepared, 4, seeds=[2]), ValueError,
         r"seeds must be distinct students in \[0, 2\), at least one, got \[2\]"),
        ("mismatch_study_record config",
         lambda: Q.mismatch_study_record(prepared), TypeError,
         "config must be an ExperimentConfig, got SimpleNamespace"),
        ("mismatch_study_record prompts",
         lambda: Q.mismatch_study_record(TINY, prompts=0), ValueError,
         r"prompts must be an integer in \[1, 16\]"),
    ]


@pytest.mark.parametrize("case", _refusals(), ids=lambda case: case[0])
def test_every_public_function_names_a_malformed_argument(case):
    _, call, error, message = case
    with pytest.raises(error, match=message):
        call()


def test_bits_may_be_a_numpy_integer_but_not_a_bool():
    weight = torch.tensor([[0.5, -1.0, 0.25]])
    assert torch.equal(quantize_per_channel(weight, np.int64(4)), quantize_per_channel(weight, 4))
    with pytest.raises(ValueError, match=r"^bits must be an integer from 2 to 8, got True$"):
        quantize_per_channel(weight, True)


# ---------------------------------------------------------------------------------------------
# Found by mutation testing: each test below fails on mutants of quantized.py that the tests
# above let through (mutmut 3.8.1; docs/mutation.md). Expected values are derived by hand in
# the comments, or by an independent computation (named), and messages are compared whole.
# ---------------------------------------------------------------------------------------------
def _whole(message):
    """A pytest.raises pattern matching ``message`` exactly, from its start to its end."""
    import re

    return "^" + re.escape(message) + "$"



def _states_2x2(eos=1):
    """The docstring example's states: a root (position 0) and its child after token 0."""
    return answer_states(torch.zeros((1, 1), dtype=torch.long), 2, vocab=2, eos=eos)


def _mutation_refusals():
    """(label, call, error, whole message): the argument checks, one case per mutant family."""
    from types import SimpleNamespace

    from opd_literate.experiment import quantized as Q

    half = np.log(np.full((2, 2), 0.5))
    bad_rows = np.log(np.array([[0.5, 0.5], [0.2, 0.3]]))  # row 1 sums to 0.5
    states = _states_2x2()

    def one(Y, mask, prompt):
        return np.ones(len(Y))

    def toy(log_pi=half, log_mu=half, reward=one, eos=1, pad=1, **kw):  # a call, repeatable
        return lambda: answer_toy(states, log_pi, log_mu, reward, eos=eos, pad=pad, **kw)

    class Stand(torch.nn.Module):  # a module with some of TinyLM's attributes
        def __init__(self, **attributes):
            super().__init__()
            for k, v in attributes.items():
                setattr(self, k, v)

    real = "(a bool, a complex number, a string or None?)"
    model = TinyLM(hidden=4, layers=1, digits=1)
    pair = torch.tensor([[3, 4]])
    fpb_keys = ("log_pi", "mask", "state", "Y", "R", "p_train", "p_sampler")
    stand_toy = dict.fromkeys(fpb_keys, None) | {"log_pi": np.zeros((5, 14))}
    toy_183 = dict.fromkeys(fpb_keys, None) | {"log_pi": np.zeros((183, 14))}
    parameters = ", ".join(name for name, _ in model.named_parameters())  # torch's own names
    inf_row = np.array([[0.0, -np.inf], [np.log(0.5), np.log(0.5)]])
    return [
        # quantize_per_channel: the message names what it got
        ("quantize 1-D", lambda: quantize_per_channel(torch.ones(3), 8), TypeError,
         "weight must be a 2-D floating tensor (out, in), got torch.float32 of shape (3,)"),
        ("quantize list", lambda: quantize_per_channel([[1.0]], 8), TypeError,
         "weight must be a 2-D floating tensor (out, in), got list of shape ()"),
        ("quantize NaN", lambda: quantize_per_channel(torch.tensor([[1.0, float("nan")]]), 8),
         ValueError, "weight must be finite: a NaN or inf has no quantization scale"),
        ("quantize bits str", lambda: quantize_per_channel(torch.ones(1, 2), "4"), ValueError,
         "bits must be an integer from 2 to 8, got '4'"),
        ("quantize bits float", lambda: quantize_per_channel(torch.ones(1, 2), 4.0), ValueError,
         "bits must be an integer from 2 to 8, got 4.0"),
        # _check_model (through sampler_states): each of its four conditions alone
        ("model with models", lambda: Q.sampler_states(
            Stand(mlp=torch.nn.Sequential(), digits=1, models=[]), torch.tensor([[1, 2]]),
            "int8"), TypeError, "model must be a TinyLM, got Stand"),
        ("model without digits", lambda: Q.sampler_states(
            Stand(mlp=torch.nn.Sequential()), torch.tensor([[1, 2]]), "int8"), TypeError,
         "model must be a TinyLM, got Stand"),
        ("model not a module", lambda: Q.sampler_states(
            SimpleNamespace(mlp=None, digits=1), torch.tensor([[1, 2]]), "int8"), TypeError,
         "model must be a TinyLM, got SimpleNamespace"),
        ("sampler_states sampler", lambda: Q.sampler_states(None, torch.tensor([[1, 2]]), "int3"),
         ValueError, "sampler must be one of ['bf16', 'fp16', 'fp32', 'int4', 'int8'], got 'int3'"),
        # _check_pairs
        ("pairs list", lambda: Q._check_pairs([[1, 2]], 1), TypeError,
         "pairs must be a (B, 2) long tensor, got list"),
        ("pairs empty", lambda: Q._check_pairs(torch.zeros((0, 2), dtype=torch.long), 1),
         ValueError, "pairs must have shape (B, 2) with B >= 1, got (0, 2)"),
        ("pairs 2-digit", lambda: Q._check_pairs(torch.tensor([[25, 100]]), 2), ValueError,
         "pairs must be operands in [0, 100) for 2-digit prompts, got 100"),
        # _check_log_probs
        ("log probs 1-D", lambda: Q._check_log_probs("x", [0.0]), ValueError,
         "x must have 2 dimensions, got shape (1,)"),
        ("log probs -inf first", lambda: Q._check_log_probs("x", [[-np.inf, np.nan, 0.0]]),
         ValueError, "x must be finite: a token of probability 0 has no log-ratio, got -inf"),
        ("log probs shape", lambda: Q._check_log_probs("x", half[:1], shape=(2, 2)), ValueError,
         "x must have shape (2, 2), got (1, 2)"),
        # the row named is the one farthest from 1: |0.5 - 1| > |1 - 1|, and |1.5 - 1| > |0.6 - 1|
        ("log probs row", lambda: Q._check_log_probs("x", np.log([[0.5, 0.5], [0.25, 0.25]])),
         ValueError, "x must hold log-probabilities: exp of row 1 sums to 0.5, not 1"),
        ("log probs row above", lambda: Q._check_log_probs("x", np.log([[1.0, 0.5], [0.3, 0.3]])),
         ValueError, "x must hold log-probabilities: exp of row 0 sums to 1.5, not 1"),
        # _check_prompts
        ("prompts float", lambda: Q._check_prompts(2.0, 16), ValueError,
         "prompts must be an integer in [1, 16] (the test prompts), got 2.0"),
        # token_mismatch: each argument named
        ("token_mismatch 1-D log_pi", lambda: token_mismatch(np.zeros(2), half, np.ones(2)),
         ValueError, "log_pi must have 2 dimensions, got shape (2,)"),
        ("token_mismatch 1-D log_mu", lambda: token_mismatch(half, np.zeros(2), np.ones(2)),
         ValueError, "log_mu must have 2 dimensions, got shape (2,)"),
        ("token_mismatch -inf log_pi", lambda: token_mismatch(inf_row, half, np.ones(2)),
         ValueError, "log_pi must be finite: a token of probability 0 has no log-ratio, got -inf"),
        ("token_mismatch -inf log_mu", lambda: token_mismatch(half, inf_row, np.ones(2)),
         ValueError, "log_mu must be finite: a token of probability 0 has no log-ratio, got -inf"),
        ("token_mismatch bool log_mu", lambda: token_mismatch(half, half > 0, np.ones(2)),
         TypeError, f"log_mu must hold real numbers, got dtype bool {real}"),
        ("token_mismatch no states", lambda: token_mismatch(half[:0], half[:0], np.ones(0)),
         ValueError, "log_pi and log_mu must be (N, V) of one shape with N, V >= 1, got shape "
         "(0, 2) and (0, 2)"),
        ("token_mismatch unnormalized log_mu", lambda: token_mismatch(half, bad_rows, np.ones(2)),
         ValueError, "log_mu must hold log-probabilities: exp of row 1 sums to 0.5, not 1"),
        ("token_mismatch bool visits", lambda: token_mismatch(half, half, np.ones(2) > 0),
         TypeError, f"visits must hold real numbers, got dtype bool {real}"),
        ("token_mismatch 2-D visits", lambda: token_mismatch(half, half, np.ones((2, 1))),
         ValueError, "visits must have shape (2,), got (2, 1)"),
        ("token_mismatch visits length",
         lambda: token_mismatch(np.log(np.full((3, 2), 0.5)), np.log(np.full((3, 2), 0.5)),
                                np.ones(2)),
         ValueError, "visits must have shape (3,), got (2,)"),
        ("token_mismatch negative visits",
         lambda: token_mismatch(half, half, np.array([1.0, -1.0])), ValueError,
         "visits must be finite, non-negative and not all 0"),
        # answer_toy
        ("answer_toy states keys", lambda: answer_toy({"prompt": 0}, half, half, one, eos=1,
                                                      pad=1), ValueError,
         "states must be the dict of answer_states (keys prompt, position, prefix, parent), got "
         "['prompt']"),
        ("answer_toy states None", lambda: answer_toy(None, half, half, one, eos=1, pad=1),
         ValueError, "states must be the dict of answer_states (keys prompt, position, prefix, "
         "parent), got <class 'NoneType'>"),
        ("answer_toy reward", toy(reward=0.5), TypeError,
         "reward must be callable (Y, mask, prompt) -> (M,), got float"),
        ("answer_toy bool log_pi", toy(log_pi=half > 0), TypeError,
         f"log_pi must hold real numbers, got dtype bool {real}"),
        ("answer_toy bool log_mu", toy(log_mu=half > 0), TypeError,
         f"log_mu must hold real numbers, got dtype bool {real}"),
        ("answer_toy -inf log_pi", toy(log_pi=inf_row), ValueError,
         "log_pi and log_mu must be finite: a token of probability 0 has no importance ratio"),
        ("answer_toy -inf log_mu", toy(log_mu=inf_row), ValueError,
         "log_pi and log_mu must be finite: a token of probability 0 has no importance ratio"),
        ("answer_toy shapes", toy(log_mu=np.log(np.full((2, 3), 1 / 3))), ValueError,
         "log_pi and log_mu must be (N, V) with N = 2 states, got (2, 2) and (2, 3)"),
        ("answer_toy unnormalized log_pi", toy(log_pi=bad_rows), ValueError,
         "log_pi must hold log-probabilities: exp of row 1 sums to 0.5, not 1"),
        ("answer_toy pad = V", toy(pad=2), ValueError,
         "eos and pad must be token ids in [0, 2), got 1, 2"),
        ("answer_toy bool features", toy(features=np.ones((2, 1)) > 0), TypeError,
         f"features must hold real numbers, got dtype bool {real}"),
        ("answer_toy NaN features", toy(features=np.array([[1.0], [np.nan]])), ValueError,
         "features must be a finite (N, F) array with N = 2, got (2, 1)"),
        ("answer_toy bool teacher", toy(log_teacher=half > 0), TypeError,
         f"log_teacher must hold real numbers, got dtype bool {real}"),
        ("answer_toy -inf teacher", toy(log_teacher=inf_row), ValueError,
         "log_teacher must be finite with shape (2, 2), got shape (2, 2)"),
        ("answer_toy teacher shape", toy(log_teacher=np.log(np.full((2, 3), 1 / 3))), ValueError,
         "log_teacher must be finite with shape (2, 2), got shape (2, 3)"),
        ("answer_toy unnormalized teacher", toy(log_teacher=bad_rows), ValueError,
         "log_teacher must hold log-probabilities: exp of row 1 sums to 0.5, not 1"),
        ("answer_toy 1-D log-probs", toy(log_pi=np.zeros(2), log_mu=np.zeros(2)), ValueError,
         "log_pi and log_mu must be (N, V) with N = 2 states, got (2,) and (2,)"),
        ("answer_toy a state too many", toy(log_pi=np.log(np.full((3, 2), 0.5)),
                                            log_mu=np.log(np.full((3, 2), 0.5))), ValueError,
         "log_pi and log_mu must be (N, V) with N = 2 states, got (3, 2) and (3, 2)"),
        # no tokens at all (V = 0): no row to normalize, so the first check to fail is eos's
        ("answer_toy no tokens", toy(log_pi=np.zeros((2, 0)), log_mu=np.zeros((2, 0))),
         ValueError, "eos and pad must be token ids in [0, 0), got 1, 1"),
        # the docstring example's 3 answers: a NaN reward, or one (M, 1) column, is refused
        ("answer_toy NaN reward", toy(reward=lambda Y, mask, prompt: np.full(len(Y), np.nan)),
         ValueError, "reward must return 3 finite values, got shape (3,)"),
        ("answer_toy column reward", toy(reward=lambda Y, mask, prompt: np.ones((len(Y), 1))),
         ValueError, "reward must return 3 finite values, got shape (3, 1)"),
        ("answer_toy 1-D features", toy(features=np.ones(2)), ValueError,
         "features must be a finite (N, F) array with N = 2, got (2,)"),
        ("answer_toy features of 3 states", toy(features=np.ones((3, 1))), ValueError,
         "features must be a finite (N, F) array with N = 2, got (3, 1)"),
        # full_parameter_bias: each check, its message whole
        ("full_parameter_bias model", lambda: Q.full_parameter_bias(None, pair, {}), TypeError,
         "model must be a TinyLM, got NoneType"),
        ("full_parameter_bias empty toy", lambda: Q.full_parameter_bias(model, pair, {}),
         ValueError, f"toy must be a tinylm_answer_toy dict (keys {', '.join(fpb_keys)}), got []"),
        ("full_parameter_bias toy None", lambda: Q.full_parameter_bias(model, pair, None),
         ValueError, f"toy must be a tinylm_answer_toy dict (keys {', '.join(fpb_keys)}), got "
         "NoneType"),
        ("full_parameter_bias partial toy",
         lambda: Q.full_parameter_bias(model, pair, {"Y": None, "R": None}), ValueError,
         f"toy must be a tinylm_answer_toy dict (keys {', '.join(fpb_keys)}), got ['R', 'Y']"),
        ("full_parameter_bias no names",
         lambda: Q.full_parameter_bias(model, pair, stand_toy, names=[]), ValueError,
         "names must be a non-empty list of estimators of REGISTRY, got []"),
        ("full_parameter_bias one name as a string",
         lambda: Q.full_parameter_bias(model, pair, stand_toy, names="naive"), ValueError,
         "names must be a non-empty list of estimators of REGISTRY, got 'naive'"),
        # one 1-digit prompt has 1 + 13 + 13^2 = 183 states (test_exact); the toy has 5
        ("full_parameter_bias other pairs",
         lambda: Q.full_parameter_bias(model, pair, stand_toy), ValueError,
         "toy has 5 states, pairs give 183: build the toy from the same pairs"),
        ("full_parameter_bias unknown parameter",
         lambda: Q.full_parameter_bias(model, pair, toy_183, parameter_names=["head"]),
         ValueError, f"parameter_names must name parameters of the model ({parameters}), got "
         "['head']"),
        ("full_parameter_bias no parameter",
         lambda: Q.full_parameter_bias(model, pair, toy_183, parameter_names=[]),
         ValueError, f"parameter_names must name parameters of the model ({parameters}), got []"),
        # tinylm_answer_toy
        ("tinylm_answer_toy features",
         lambda: tinylm_answer_toy(None, None, "int8", features="all"), ValueError,
         "features must be 'bias' or 'head', got 'all'"),
        ("tinylm_answer_toy model with a teacher",
         lambda: tinylm_answer_toy(None, None, "int8", teacher=TinyLM(hidden=4, digits=1)),
         TypeError, "model must be a TinyLM, got NoneType"),
        # toy_token_mismatch
        ("toy_token_mismatch keys", lambda: toy_token_mismatch({"theta": np.zeros((1, 2))}),
         ValueError, "toy must be a toy of the mismatch chapter (a dict with theta, b and "
         "mismatch), got dict"),
        ("toy_token_mismatch list", lambda: toy_token_mismatch([]), ValueError,
         "toy must be a toy of the mismatch chapter (a dict with theta, b and mismatch), got list"),
        ("toy_token_mismatch bool theta", lambda: toy_token_mismatch(
            dict(theta=np.zeros((1, 2)) > 0, b=np.zeros((1, 2)), mismatch=0.1)), TypeError,
         f"toy['theta'] must hold real numbers, got dtype bool {real}"),
        ("toy_token_mismatch bool b", lambda: toy_token_mismatch(
            dict(theta=np.zeros((1, 2)), b=np.zeros((1, 2)) > 0, mismatch=0.1)), TypeError,
         f"toy['b'] must hold real numbers, got dtype bool {real}"),
        # matched_toy_mismatch
        ("matched target 0", lambda: matched_toy_mismatch(0.0, lambda e: e), ValueError,
         "target_kl must be > 0, got 0.0"),
        ("matched target bool", lambda: matched_toy_mismatch(True, lambda e: e), TypeError,
         "target_kl must be a real number, got bool True"),
        ("matched high 0", lambda: matched_toy_mismatch(0.1, lambda e: e, high=0.0), ValueError,
         "high must be > 0, got 0.0"),
        ("matched high bool", lambda: matched_toy_mismatch(0.1, lambda e: e, high=True),
         TypeError, "high must be a real number, got bool True"),
        ("matched low = high", lambda: matched_toy_mismatch(1.0, lambda e: e, low=1.0, high=1.0),
         ValueError, "low must be < high, got low=1.0 >= high=1.0"),
        ("matched iterations float", lambda: matched_toy_mismatch(0.1, lambda e: e,
                                                                  iterations=2.5),
         ValueError, "iterations must be a positive integer, got 2.5"),
        ("matched kl_of", lambda: matched_toy_mismatch(0.1, 0.5), TypeError,
         "kl_of must be callable eps -> KL, got float"),
        # the default high is 10: kl_of(10) = 10 < 10.5
        ("matched default high", lambda: matched_toy_mismatch(10.5, lambda e: e), ValueError,
         "target_kl = 10.5 is outside the KLs at low = 1e-06 and high = 10.0"),
        # rank_correlation
        ("rank a 2-D", lambda: rank_correlation([[1, 2], [3, 4]], [1, 2]), ValueError,
         "a must have 1 dimension, got shape (2, 2)"),
        ("rank b 2-D", lambda: rank_correlation([1, 2], [[1], [2]]), ValueError,
         "b must have 1 dimension, got shape (2, 1)"),
        # constant to 10 significant digits, not equal: the message shows the first value
        ("rank constant a", lambda: rank_correlation([1.0, 1.00000000001], [1, 2]), ValueError,
         "a is constant (every value 1.0 to 10 significant digits): its rank correlation is "
         "undefined"),
    ]


@pytest.mark.parametrize("case", _mutation_refusals(), ids=lambda case: case[0])
def test_each_check_names_its_argument_whole(case):
    _, call, error, message = case
    with pytest.raises(error, match=_whole(message)):
        call()


def test_valid_edges_are_accepted():
    """The ends of each accepted range: operand 0 and 10^digits - 1, one prompt and all of
    them, eos and pad 0, one bisection step, a target at either end's KL."""
    from opd_literate.experiment import quantized as Q

    Q._check_pairs(torch.tensor([[0, 99], [25, 0]]), 2)
    Q._check_prompts(1, 16)
    Q._check_prompts(16, 16)
    half = np.log(np.full((2, 2), 0.5))
    toy = answer_toy(_states_2x2(eos=0), half, half, lambda Y, m, p: np.ones(len(Y)), eos=0,
                     pad=0)
    # eos 0 ends the root's answer; state 1 (prefix 1) ends with either token; pad 0 after eos
    assert sorted(map(tuple, toy["Y"].tolist())) == [(0, 0), (1, 0), (1, 1)]
    # one step: mid = log(sqrt(1e-6 * 10)), where eps^2 = 1e-5 < 0.25, so lo = mid and the
    # answer is exp((mid + log 10) / 2) = (1e-5)^(1/4) * 10^(1/2) = 10^(-3/4)
    assert matched_toy_mismatch(0.25, lambda e: e ** 2, iterations=1) == pytest.approx(
        10 ** -0.75, rel=1e-12)
    assert matched_toy_mismatch(1.0, lambda e: e, low=1.0, high=2.0) == pytest.approx(1.0)
    assert matched_toy_mismatch(2.0, lambda e: e, low=1.0, high=2.0) == pytest.approx(2.0)


def test_matched_mismatch_calls_kl_of_at_both_ends_then_once_a_step():
    """The defaults: 80 steps, so 2 + 80 evaluations; on a KL flat from eps = 1 (clipped) the
    bisection keeps the smallest eps that reaches the target (KL < target moves low up)."""
    calls = []
    matched_toy_mismatch(0.04, lambda e: calls.append(e) or e ** 2)
    assert len(calls) == 82
    assert matched_toy_mismatch(1.0, lambda e: min(e, 1.0)) == pytest.approx(1.0, rel=1e-12)


def test_the_subnormal_scale_is_clamped_to_the_symmetric_grid():
    """2^-140 in float32 at 8 bits: s = 2^-140 / 127 = (512 / 127) 2^-149 rounds to 4 * 2^-149
    (the subnormal grid), so W / s = 128 rounds to 128 and is clamped to +-127: W_hat =
    +-508 * 2^-149 (by hand), never the code +-128 outside the grid."""
    w = torch.tensor([[2.0 ** -140, -(2.0 ** -140)]], dtype=torch.float32)
    expected = [[508 * 2.0 ** -149, -508 * 2.0 ** -149]]
    assert quantize_per_channel(w, 8).tolist() == expected


def test_level_ancestors_and_the_answers_of_the_docstring_example():
    """The docstring's two states (root 0, its child 1 after token 0) and three answers, by
    hand: ancestors [[0, -1], [0, 1]]; the root's answer (eos) has state [0, -1], the two of
    state 1 [0, 1]; T, V and eos as given; states as numpy arrays give the same toy."""
    from opd_literate.experiment.quantized import _level_ancestors

    states = _states_2x2()
    arrays = {k: v.numpy() for k, v in states.items()}
    assert _level_ancestors(arrays, 2).tolist() == [[0, -1], [0, 1]]
    half, skew = np.log([0.5, 0.5]), np.log([0.8, 0.2])

    def first_is_zero(Y, mask, prompt):  # a bool reward: R is float all the same
        return Y[:, 0] == 0

    toy = answer_toy(states, np.stack([half, half]), np.stack([skew, half]), first_is_zero,
                     eos=1, pad=1)
    order = np.lexsort(toy["Y"].T[::-1])  # answers sorted: (0, 0), (0, 1), (1, 1)
    assert toy["Y"][order].tolist() == [[0, 0], [0, 1], [1, 1]]
    assert toy["state"][order].tolist() == [[0, 1], [0, 1], [0, -1]]
    assert toy["mask"][order].tolist() == [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
    assert toy["R"].dtype == np.float64 and toy["R"][order].tolist() == [1.0, 1.0, 0.0]
    assert (toy["T"], toy["V"], toy["eos"]) == (2, 2, 1)
    from_arrays = answer_toy(arrays, np.stack([half, half]), np.stack([skew, half]),
                             first_is_zero, eos=1, pad=1)
    for key in ("Y", "state", "p_sampler", "score"):
        assert np.array_equal(from_arrays[key], toy[key]), key


def test_weighted_quantiles_by_hand():
    """Values 3, 1, 2 with weights 1/4, 1/2, 1/4: sorted 1, 2, 3 with cumulative 1/2, 3/4, 1;
    the smallest value whose cumulative weight reaches q (by hand)."""
    from opd_literate.experiment.quantized import _weighted_quantiles

    out = _weighted_quantiles(np.array([3.0, 1.0, 2.0]), np.array([0.25, 0.5, 0.25]),
                              np.array([0.4, 0.5, 0.6, 0.75, 0.8, 1.0]))
    assert out.tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def test_token_mismatch_moments_and_quantiles_by_hand():
    """One state, mu = (0.6, 0.3995, 0.0005), pi = (0.65, 0.25, 0.1): log-ratios r = log(pi /
    mu) of weights mu; sorted by value r2 < r1 < r3 with cumulative 0.3995, 0.9995, 1, and by
    |r| the order r1, r2, r3 with cumulative 0.6, 0.9995, 1 (by hand). The two-token docstring
    example: a two-point distribution of weights p = 0.8, q = 0.2 has kurtosis
    (1 - 3pq) / (pq) = 3.25 and variance pq (log 4)^2."""
    mu, pi = np.array([0.6, 0.3995, 0.0005]), np.array([0.65, 0.25, 0.1])
    r = np.log(pi / mu)
    out = token_mismatch(np.log([pi]), np.log([mu]), np.ones(1))
    assert list(out["quantiles"].values()) == pytest.approx([r[1]] * 3 + [r[0]] * 4, rel=1e-12)
    assert list(out["abs_quantiles"].values()) == pytest.approx(
        [abs(r[0]), abs(r[1]), abs(r[1])], rel=1e-12)
    assert out["max_abs_log_ratio"] == pytest.approx(abs(r[2]), rel=1e-12)
    assert out["mean_abs_log_ratio"] == pytest.approx(mu @ np.abs(r), rel=1e-12)
    two = token_mismatch(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]), np.ones(1))
    assert two["kurtosis"] == pytest.approx(3.25, rel=1e-12)
    assert list(two["abs_quantiles"].values()) == pytest.approx(
        [np.log(1.6), np.log(2.5), np.log(2.5)], rel=1e-12)


def test_token_mismatch_normalizes_rows_within_the_tolerance():
    """Rows may sum to 1 within 1e-6: here mu = (0.5, 0.5 + 8e-7) and pi = (0.4, 0.6), so the
    token weights are normalized by their total 1 + 8e-7 (by hand): token 0 has the smaller
    log-ratio log 0.8 and weight 0.5 / (1 + 8e-7) < 1/2, so the median is token 1's; the mean
    |log rho| is sum_v mu_v |r_v| / total, the kurtosis the two-point (1 - 3pq) / (pq)."""
    mu, pi = np.array([0.5, 0.5 + 8e-7]), np.array([0.4, 0.6])
    r = np.log(pi / mu)
    out = token_mismatch(np.log([pi]), np.log([mu]), np.ones(1))
    assert out["quantiles"]["0.5"] == pytest.approx(r[1], rel=1e-12)
    assert out["mean_abs_log_ratio"] == pytest.approx(mu @ np.abs(r) / mu.sum(), rel=1e-12)
    p = mu / mu.sum()
    assert out["kurtosis"] == pytest.approx((1 - 3 * p[0] * p[1]) / (p[0] * p[1]), rel=1e-9)


def test_sampler_states_visits_are_divided_by_the_prompts():
    """Two prompts: each root is reached with probability 1, divided by B = 2 (by hand)."""
    from opd_literate.experiment.quantized import sampler_states

    torch.manual_seed(0)
    model = TinyLM(hidden=4, layers=1, embed=4, digits=1)
    out = sampler_states(model, torch.tensor([[3, 4], [9, 8]]), "int8")
    roots = out["states"]["position"] == 0
    assert out["visits"][roots].tolist() == [0.5, 0.5]


def test_tinylm_answer_toy_head_features_and_the_teacher():
    """One prompt: the head score has H + 1 features (the input of the LM head, then 1), its
    true gradient is autograd of J over [W, c]; with a teacher, the sequence KL is
    sum_y pi(y) (log pi(y) - log pi_T(y)) with both log-probabilities teacher-forced by
    TinyLM.logits (an independent path)."""
    torch.manual_seed(6)
    model = TinyLM(hidden=4, layers=1, embed=4, digits=1)
    teacher = TinyLM(hidden=4, layers=1, embed=4, digits=1)
    pairs = torch.tensor([[3, 4]])
    toy = tinylm_answer_toy(model, pairs, "int4", teacher=teacher, features="head")
    assert toy["score"].shape == (len(toy["Y"]), 3, 14, 5)
    trainer, forced = sampler_copy(model, "float64"), sampler_copy(teacher, "float64")
    prompts = make_prompts(pairs, digits=1)[torch.from_numpy(toy["prompt"])]
    Y, mask = torch.from_numpy(toy["Y"]), torch.from_numpy(toy["mask"])
    log_pi_y = (token_logp(trainer.logits(prompts, Y), Y) * mask).sum(dim=1)
    log_t_y = (token_logp(forced.logits(prompts, Y), Y) * mask).sum(dim=1)
    head = trainer.mlp[-1]
    J = (log_pi_y.exp() * torch.from_numpy(toy["R"])).sum()
    gw, gb = torch.autograd.grad(J, [head.weight, head.bias])
    assert np.allclose(toy["true_grad"], torch.cat([gw, gb[:, None]], dim=1).numpy(),
                       atol=1e-12)
    kl = float((log_pi_y.exp() * (log_pi_y - log_t_y)).sum().detach())
    assert toy["kl"] == pytest.approx(kl, rel=1e-10)
    assert toy["kl_grad"].shape == (14, 5)


# From the mutation run of this module (docs/mutation.md, "quantized.py"): the cases its
# surviving mutants showed no test held.
def test_the_kurtosis_normalises_by_the_mass_even_where_a_row_is_not_exactly_1():
    """A row within the 1e-6 that the check allows: the kurtosis of log rho under the atoms'
    weights, normalised by their sum, computed here term by term."""
    mu, pi = np.array([0.8, 0.2000009]), np.array([0.5, 0.5])
    out = token_mismatch(np.log([pi]), np.log([mu]), np.ones(1))
    x, w = np.log(pi) - np.log(mu), mu / mu.sum()
    mean = (w * x).sum()
    expected = (w * (x - mean) ** 4).sum() / ((w * (x - mean) ** 2).sum()) ** 2
    assert out["kurtosis"] == pytest.approx(expected, rel=1e-12)  # the mass times the mean: 1e-6


def test_the_abs_quantiles_are_named_by_their_levels():
    out = token_mismatch(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]), np.ones(1))
    assert list(out["abs_quantiles"]) == ["0.5", "0.99", "0.999"]


def test_answer_toy_and_full_parameter_bias_name_the_type_they_were_given():
    from opd_literate.experiment.quantized import full_parameter_bias

    with pytest.raises(ValueError, match=r"states must be the dict of answer_states .*, got "
                                         r"<class 'list'>"):
        answer_toy([], np.zeros((1, 2)), np.zeros((1, 2)), np.zeros(1), eos=0, pad=1)
    model = TinyLM(hidden=8, layers=1)
    with pytest.raises(ValueError, match=r"toy must be a tinylm_answer_toy dict .*, got list$"):
        full_parameter_bias(model, torch.tensor([[1, 2], [3, 4]]), [])
