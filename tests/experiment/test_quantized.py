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
    assert rank_correlation([1, 1, 1], [1, 2, 3]) == 0.0


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
    assert head["parameters"] == 14
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
