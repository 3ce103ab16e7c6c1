"""Training under the mismatch (opd_literate.experiment.mismatch_training): the ensemble's
samplers are the quantized module's, the engine samples its own distribution, the corrected loss
is correction.py's per model, and a tiny run is wired as the module says."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.experiment import mismatch_training as MT
from opd_literate.experiment import tinylm as lm
from opd_literate.experiment.quantized import SAMPLERS, ensemble_sampler, sampler_copy
from opd_literate.mismatch.correction import (
    clip_cov_loss,
    gspo_loss,
    kpop_mask,
    reinforce_loss,
    rollout_correction,
    sapo_loss,
    trl_importance_weights,
)
from opd_literate.opd import reverse_kl_rewards
from tests.experiment._tiny import TINY


def _random_ensemble(models=3, hidden=8, layers=2, seed=0):
    torch.manual_seed(seed)
    ensemble = lm.EnsembleLM(models, hidden, layers)
    with torch.no_grad():
        for p in ensemble.parameters():
            p.normal_(0, 0.5)
    return ensemble


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_the_ensembles_sampler_is_sampler_copy_model_by_model(sampler):
    """Each model of ensemble_sampler has the weights sampler_copy gives it alone, bit for bit
    (the same quantization code on the same numbers), and its logits to float32 rounding (the
    ensemble's forward adds the products in another order)."""
    ensemble = _random_ensemble()
    engine = ensemble_sampler(ensemble, sampler)
    prompts = lm.make_prompts(torch.tensor([[3, 4], [51, 97], [0, 0]]))
    answers = lm.answer_tokens(torch.tensor([[3, 4], [51, 97], [0, 0]]))
    for m in range(ensemble.models):
        alone = sampler_copy(ensemble.member(m), sampler)
        mine = engine.member(m)  # a float32 TinyLM: a bf16 or fp16 value widens exactly
        for (name, a), (_, b) in zip(alone.named_parameters(), mine.named_parameters()):
            assert torch.equal(a.float(), b), name
        if sampler in ("fp32", "int8", "int4"):
            expected = alone.logits(prompts, answers)
            got = engine.logits(prompts.expand(3, -1, -1), answers.expand(3, -1, -1))[m]
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    expected_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(sampler, torch.float32)
    assert all(p.dtype == expected_dtype for p in engine.parameters())
    assert not any(p.requires_grad for p in engine.parameters())
    with pytest.raises(ValueError, match="sampler must be one of"):
        ensemble_sampler(ensemble, "int3")


class _FixedSampler:
    """A sampler whose logits at position t are table[t], whatever the context."""

    def __init__(self, table):
        self.table, self.max_answer = table, table.shape[0]

    context_at = staticmethod(lm.TinyLM.context_at)

    def __call__(self, context, position):
        return self.table[position]


def test_the_engine_inverts_its_cdf_and_never_writes_a_token_of_probability_0():
    """At K evenly spaced uniforms the share of each token is its probability to within 1/K,
    a token whose float32 probability is 0 is never written, even at u = 0 or u near 1, and
    the reported log-probs are those of the logits that wrote the tokens."""
    V, K = lm.V, 2000
    table = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    table[0, [0, 5]] = -300.0  # exp(-300) underflows to 0 in float32; u = 0 is tried below
    table[0, lm.EOS] = 1.0
    sampler = _FixedSampler(table)
    u = (torch.arange(K, dtype=torch.float64) + 0.5) / K
    u = torch.cat([u, torch.tensor([0.0, 1 - 2 ** -24])])  # float32's largest below 1
    uniforms = torch.stack([u, u.flip(0)], dim=-1)[None].float()  # (1, K + 2, 2)
    prompts = lm.make_prompts(torch.zeros(1, K + 2, 2, dtype=torch.long))
    tokens, mask, logp, logits = MT.engine_sample(sampler, prompts, uniforms)
    p = torch.softmax(table[0].float(), -1)
    counts = torch.bincount(tokens[0, :K, 0], minlength=V).double() / K
    assert torch.allclose(counts, p.double(), atol=1.0 / K + 1e-6)
    assert not (tokens[..., 0] == 5).any() and not (tokens[..., 0] == 0).any()
    assert torch.isfinite(logp).all() and (logp <= 0).all()
    expected = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.equal(logp, torch.where(mask.bool(), expected, torch.zeros_like(expected)))
    ended = tokens[..., 0] == lm.EOS
    assert (tokens[..., 1][ended] == lm.PAD).all() and (mask[..., 1][ended] == 0).all()


def test_the_engine_names_bad_uniforms():
    sampler = _FixedSampler(torch.zeros(4, lm.V))
    prompts = lm.make_prompts(torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"uniforms must have shape \(1, 3, 4\), got \(1, 3\)"):
        MT.engine_sample(sampler, prompts, torch.zeros(1, 3))
    for bad, error, message in (
            (dict(prompts=prompts[0]), TypeError, r"prompts must be an \(M, B, L\) long tensor"),
            (dict(prompts=prompts.float()), TypeError, "prompts must be an .* long tensor"),
            (dict(uniforms=torch.zeros(1, 3, 4, dtype=torch.bool)), TypeError,
             "uniforms must be a floating tensor, got torch.bool")):
        arguments = {"prompts": prompts, "uniforms": torch.zeros(1, 3, 4)} | bad
        with pytest.raises(error, match=message):
            MT.engine_sample(sampler, arguments["prompts"], arguments["uniforms"])
    two_models = lm.EnsembleLM(2, 8, 1)
    with pytest.raises(ValueError, match=r"one batch per model of the sampler \(2\), got shape "
                                         r"\(1, 3, 6\)"):
        MT.engine_sample(two_models, prompts, torch.zeros(1, 3, 4))
    table = torch.zeros(4, lm.V)
    table[1, 3] = math.nan
    with pytest.raises(ValueError, match="logits at answer position 1 are not all finite"):
        MT.engine_sample(_FixedSampler(table), prompts, torch.full((1, 3, 4), 0.5))
    for bad in (1.0, -1e-9, math.nan):
        with pytest.raises(ValueError, match=r"uniforms must lie in \[0, 1\)"):
            MT.engine_sample(sampler, prompts, torch.full((1, 3, 4), bad))


def _batch(M=3, B=6, T=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    trainer = (-torch.rand(M, B, T, generator=g, dtype=dtype) * 2).requires_grad_()
    sampler = trainer.detach() + 0.3 * torch.randn(M, B, T, generator=g, dtype=dtype)
    sampler = sampler.clamp_max(0.0)
    lengths_ = torch.randint(1, T + 1, (M, B), generator=g)
    mask = (torch.arange(T) < lengths_[..., None]).float()
    advantages = torch.randn(M, B, T, generator=g, dtype=dtype)
    return trainer, sampler, advantages, mask


def _per_model(trainer, sampler, advantages, mask, correction, used=None):
    total = 0.0
    for m in range(trainer.shape[0]):
        if correction == "none":
            weights, keep = mask[m], mask[m].bool()
        elif correction.startswith("trl_"):  # TRL: the mask's tokens all count in the mean
            mode = correction.removeprefix("trl_")
            weights, keep = trl_importance_weights(trainer[m].detach(), sampler[m], mask[m],
                                                   mode)[0], mask[m].bool()
        elif correction == "kpop":  # a rejection: the kept tokens alone count
            keep = kpop_mask(trainer[m].detach(), sampler[m], mask[m])[0]
            weights = keep.to(trainer.dtype)
        else:
            options = MT.PRESETS[correction]
            weights, keep, _ = rollout_correction(trainer[m].detach(), sampler[m], mask[m],
                                                  **options)
        total = total + reinforce_loss(trainer[m], advantages[m], keep, weights,
                                       reduction="token-mean")
        if used is not None:
            used.append(keep & (weights != 0))
    return total


@pytest.mark.parametrize("correction", ["none", *MT.CORRECTIONS])
def test_the_corrected_loss_is_each_models_own_reinforce_loss(correction):
    """One call over the (M * B, T) rows equals the sum of the M models' own token-mean losses,
    in value and gradient, for every correction (geometric rejection at verl's 0.1% band rejects
    most rows here, some models entirely: their loss is 0)."""
    trainer, sampler, advantages, mask = _batch()
    loss, keep = MT.corrected_loss(trainer, sampler, advantages, mask, correction)
    (grad,) = torch.autograd.grad(loss, trainer)
    used = []
    expected = _per_model(trainer, sampler, advantages, mask, correction, used)
    (expected_grad,) = torch.autograd.grad(expected, trainer)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-12, rel=1e-12)
    assert torch.allclose(grad, expected_grad, atol=1e-12, rtol=1e-12)
    assert torch.equal(keep, torch.stack(used)) and not (keep & (mask == 0)).any()
    if correction in ("decoupled_geo_rs", "decoupled_token_icepop", "decoupled_seq_is_rs",
                      "kpop"):
        assert keep.sum() < mask.sum()  # each sets some tokens' weight to 0 here
    else:
        assert torch.equal(keep, mask.bool())


POLICY_LOSSES = {"gspo": gspo_loss, "clip_cov": clip_cov_loss, "sapo": sapo_loss}


@pytest.mark.parametrize("correction", sorted(POLICY_LOSSES))
def test_a_policy_loss_correction_has_the_gradient_of_verls_loss_model_by_model(correction):
    """gspo, clip_cov and sapo: the gradient of the one-call loss is that of the policy loss
    itself (bypass mode, the study's token mean), each model on its own batch: Clip-Cov's
    covariance and eligible share are one batch's statistics."""
    trainer, sampler, advantages, mask = _batch()
    advantages = advantages.clone()
    advantages[0, :2] = 0.0  # a group with one reward: A = 0
    loss, keep = MT.corrected_loss(trainer, sampler, advantages, mask, correction)
    (grad,) = torch.autograd.grad(loss, trainer)
    expected = sum(POLICY_LOSSES[correction](trainer[m], sampler[m], advantages[m], mask[m],
                                             reduction="token-mean")[0]
                   for m in range(trainer.shape[0]))
    (expected_grad,) = torch.autograd.grad(expected, trainer)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    weights, _ = MT.correction_weights(trainer[0].detach(), sampler[0], mask[0], correction,
                                       advantages[0])
    assert torch.equal(keep[0], mask[0].bool() & (weights != 0))
    with pytest.raises(ValueError, match=f"correction '{correction}' needs the advantages"):
        MT.correction_weights(trainer[0].detach(), sampler[0], mask[0], correction)


def test_kpop_is_weights_the_kept_tokens_by_the_raw_ratio():
    """prime-rl's KPop: the mask of kpop_mask, the uncapped ratio on what it keeps."""
    trainer, sampler, advantages, mask = _batch(seed=3)
    loss, keep = MT.corrected_loss(trainer, sampler, advantages, mask, "kpop_is")
    (grad,) = torch.autograd.grad(loss, trainer)
    expected = 0.0
    for m in range(trainer.shape[0]):
        kept = kpop_mask(trainer[m].detach(), sampler[m], mask[m])[0]
        ratio = torch.exp(trainer[m].detach() - sampler[m])
        expected = expected + reinforce_loss(trainer[m], advantages[m], kept,
                                             torch.where(kept, ratio, torch.zeros_like(ratio)),
                                             reduction="token-mean")
    (expected_grad,) = torch.autograd.grad(expected, trainer)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    assert keep.sum() < mask.sum()


def test_the_strongest_are_the_least_error_estimators_not_yet_trained():
    """STRONGEST_CORRECTIONS' claim, read from the committed tinylm record: at int4 with 64
    answers, every estimator of smaller relative RMSE than sapo's is gspo, clip_cov or
    ppo_clip_bypass (which ties clip_cov), and none of them is trained by CORRECTIONS."""
    import json
    import pathlib

    record = json.loads((pathlib.Path(__file__).parents[2] / "docs" / "data" / "experiment"
                         / "tinylm_mismatch.json").read_text())
    assert record["batch_size"] == 64
    rows = {r["name"]: r["rel_rmse"] for r in record["estimators"]["int4"]["tinylm"]}
    better = {name for name, error in rows.items() if error < rows["sapo"]}
    assert better == {"gspo", "clip_cov", "ppo_clip_bypass"}
    assert rows["clip_cov"] == pytest.approx(rows["ppo_clip_bypass"], rel=1e-9)
    assert rows["gspo"] < rows["clip_cov"] < rows["sapo"]
    assert not set(MT.STRONGEST_CORRECTIONS) & set(MT.CORRECTIONS)
    study = MT.MISMATCH_STRONGEST
    assert study.levels == ("fp32", "int4") and study.correction_level == "int4"
    assert study.corrections[-len(MT.STRONGEST_CORRECTIONS):] == MT.STRONGEST_CORRECTIONS
    assert dataclasses.replace(study, levels=MT.MISMATCH_DEFAULT.levels,
                               corrections=MT.MISMATCH_DEFAULT.corrections) == MT.MISMATCH_DEFAULT


@pytest.mark.parametrize("method", MT.STUDY_METHODS)
def test_without_a_correction_the_loss_is_train_pys(method, monkeypatch):
    """On the same answers, the uncorrected study loss (sampler = trainer) has the value and
    the gradient of the experiment's own loss (train._method_loss), in float64."""
    from opd_literate.experiment import train

    students = _random_ensemble(models=2, hidden=8, layers=1, seed=4).double()
    teacher = _random_ensemble(models=1, hidden=8, layers=1, seed=5).double()
    teacher.requires_grad_(False)
    config = dataclasses.replace(TINY, batch_size=8)  # group 4: two prompts of four answers
    pairs = torch.randint(0, 100, (2, 8, 2), generator=torch.Generator().manual_seed(6))
    # the prompts train.py answers: RL's first two, four times each
    answered = pairs[:, :2].repeat_interleave(4, dim=1) if method == "rl" else pairs
    prompts = lm.make_prompts(answered)
    tokens, _ = lm.sample_tokens(students, prompts, torch.Generator().manual_seed(7))
    tokens[:, ::3] = lm.answer_tokens(answered)[:, ::3]  # some right answers: RL's reward 1
    mask = lm.answer_mask(tokens)

    def fixed_rollout(model, given, generator=None, greedy=False):
        assert torch.equal(given, prompts)
        logits = model.logits(given, tokens)
        return lm.Rollout(given, tokens, lm.token_logp(logits, tokens), logits, mask)

    monkeypatch.setattr(train.lm, "rollout", fixed_rollout)
    expected, _ = train._method_loss(method, students, teacher, pairs, config, None)
    expected_grads = torch.autograd.grad(expected, list(students.parameters()))
    logp = lm.token_logp(students.logits(prompts, tokens), tokens)
    teacher_logp = MT._teacher_logp(teacher, prompts, tokens) if method != "rl" else None
    advantages = MT._advantages(method, torch.zeros(2, dtype=torch.bool), tokens,
                                lm.answer_tokens(answered), logp, logp.detach(), teacher_logp,
                                mask, config.group)
    loss, _ = MT.corrected_loss(logp, logp.detach(), advantages, mask, "none")
    grads = torch.autograd.grad(loss, list(students.parameters()))
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-10, abs=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert any(float(g.abs().max()) > 0 for g in grads)


def test_the_sampler_reward_uses_the_samplers_log_probs():
    trainer, sampler, _, mask = _batch()
    teacher = torch.zeros_like(sampler) - 1.0
    flags = torch.tensor([False, True, False])
    rewards = MT._advantages("opd_sampled", flags, None, None, trainer, sampler, teacher, mask, 4)
    assert torch.equal(rewards[1], reverse_kl_rewards(sampler[1], teacher[1], mask[1]))
    assert torch.equal(rewards[0], reverse_kl_rewards(trainer[0].detach(), teacher[0], mask[0]))


def test_the_teacher_is_scored_once_per_distinct_answer_with_the_same_result():
    teacher = _random_ensemble(models=1, hidden=8, layers=1)
    pairs = torch.randint(0, 100, (4, 6, 2))
    pairs[2] = pairs[0]
    prompts = lm.make_prompts(pairs)
    tokens = torch.randint(0, lm.V, (4, 6, 4))
    tokens[2] = tokens[0]
    expected, _ = lm.score(teacher, prompts, tokens)
    assert torch.allclose(MT._teacher_logp(teacher, prompts, tokens), expected, atol=1e-6)


def test_the_configuration_names_bad_settings():
    for change, message in ((dict(levels=("fp32", "int3")), "keys of SAMPLERS"),
                            (dict(correction_level="int2"), "keys of SAMPLERS"),
                            (dict(levels=("int4", "int4")), "distinct and not empty"),
                            (dict(levels=()), "distinct and not empty"),
                            (dict(levels=("int4", "fp32")), "must start with 'fp32'"),
                            (dict(correction_level="fp16"), "hold correction_level"),
                            (dict(corrections=("bypass_pg_is",)), "decoupled preset"),
                            (dict(corrections=("disabled",)), "decoupled preset"),
                            (dict(corrections=("none",)), "'none' is trained at each level"),
                            (dict(corrections=("decoupled_seq_is",) * 2), "distinct"),
                            (dict(steps=0), "steps must be a positive integer"),
                            (dict(eval_every=True), "eval_every must be a positive integer"),
                            (dict(lr=math.nan), "lr must be a positive finite float"),
                            (dict(experiment=dataclasses.replace(TINY, batch_size=6)),
                             "multiple of its group")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(MT.MISMATCH_DEFAULT, **change)
    for bad in ("token_tis", "bypass_pg_is", "disabled"):
        with pytest.raises(ValueError, match="correction must be 'none', a decoupled preset"):
            MT.corrected_loss(*_batch(), bad)
    with pytest.raises(TypeError, match="experiment must be an ExperimentConfig, got NoneType"):
        MT.MismatchTrainingConfig(experiment=None)
    for fields, message in ((("int3",), "sampler must be a key of SAMPLERS"),
                            (("int4", "tis"), "correction must be 'none', a decoupled preset"),
                            (("int4", "none", "smapler"), "reward_logp must be 'trainer' or")):
        with pytest.raises(ValueError, match=message):
            MT.Condition(*fields)
    with pytest.raises(ValueError, match="method must be one of rl, opd_sampled, got 'sft'"):
        MT.conditions(MT.MISMATCH_DEFAULT, "sft")
    with pytest.raises(TypeError, match="config must be a MismatchTrainingConfig"):
        MT.run_mismatch_training(TINY)
    with pytest.raises(TypeError, match="progress must be a bool"):
        MT.run_mismatch_training(progress="yes")
    trainer, sampler, advantages, mask = _batch()
    with pytest.raises(ValueError, match="mask values must be 0 or 1, found 2.0"):
        MT.corrected_loss(trainer, sampler, advantages, 2 * mask, "none")
    with pytest.raises(ValueError, match="sampler_logp must be finite where mask is 1"):
        MT.corrected_loss(trainer, torch.full_like(sampler, math.nan), advantages, mask, "none")
    with pytest.raises(ValueError, match=r"trainer_logp must have 3 dimensions, got shape "
                                         r"\(6, 4\)"):
        MT.corrected_loss(trainer[0], sampler[0], advantages[0], mask[0], "none")
    with pytest.raises(ValueError, match=r"advantages must have the same shape as trainer_logp "
                                         r"\(3, 6, 4\), got \(3, 6\)"):
        MT.corrected_loss(trainer, sampler, advantages[..., 0], mask, "none")
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got list"):
        MT.corrected_loss(trainer, sampler, advantages, mask.tolist(), "none")
    with pytest.raises(ValueError, match="method must be one of rl, opd_sampled, got 'sft'"):
        MT.train_under_mismatch("sft", None)


def test_the_conditions_are_the_levels_then_the_corrections_then_the_reward_bug():
    names = [c.name for c in MT.conditions(MT.MISMATCH_DEFAULT, "opd_sampled")]
    assert names[:4] == ["fp32 none", "bf16 none", "int8 none", "int4 none"]
    n = 4 + len(MT.CORRECTIONS)
    assert names[4:n] == [f"int4 {c}" for c in MT.CORRECTIONS]
    assert names[n:] == ["int4 none, sampler reward"]
    assert [c.name for c in MT.conditions(MT.MISMATCH_DEFAULT, "rl")] == names[:n]


@pytest.fixture(scope="module")
def tiny_run():
    from opd_literate.experiment.run import prepare

    study = MT.MismatchTrainingConfig(experiment=TINY, steps=3, eval_every=1)
    prepared = prepare(TINY, cache="off")
    return study, {method: MT.train_under_mismatch(method, MT._Run(prepared, study))
                   for method in MT.STUDY_METHODS}


@pytest.mark.slow
def test_a_tiny_run_records_every_curve_of_every_condition(tiny_run):
    study, runs = tiny_run
    for method, run in runs.items():
        assert run["conditions"] == [c.name for c in MT.conditions(study, method)]
        assert run["samples"] == [0, 8, 16, 24]
        for name in run["conditions"]:
            curves = run[name]
            for key, per_seed in curves.items():
                assert len(per_seed) == TINY.seeds, key
                assert all(len(c) == 4 for c in per_seed), key
            for key in ("mismatch_kl", "kept_fraction"):
                assert all(c[0] is None for c in curves[key])
            assert all(math.isfinite(v) for key in curves for c in curves[key] for v in c
                       if v is not None)
            if name.split()[1] == "none":
                assert all(v == 1.0 for c in curves["kept_fraction"] for v in c[1:])
        # the rejection reads the sampler's log-probs: geometric rejection drops tokens
        assert any(v < 1 for c in run["int4 decoupled_geo_rs"]["kept_fraction"] for v in c[1:])
        assert all(v < 1e-9 for c in run["fp32 none"]["mismatch_kl"] for v in c[1:])
        int4 = [v for c in run["int4 none"]["mismatch_kl"] for v in c[1:]]
        for level in ("bf16", "int8"):  # a nearly uniform tiny student: small, but ordered
            low = [v for c in run[f"{level} none"]["mismatch_kl"] for v in c[1:]]
            assert all(0 < a < b / 10 for a, b in zip(low, int4))


@pytest.mark.slow
def test_every_condition_starts_from_the_same_students_and_draws_the_same_first_answers(tiny_run):
    """Step 0: the same weights everywhere. Step 1: every int4 condition has the same sampler
    (nothing has been updated yet), the same prompts and the same uniforms, hence the same
    answers and the same mismatch."""
    _, runs = tiny_run
    for run in runs.values():
        first = {name: [c[0] for c in run[name]["accuracy"]] for name in run["conditions"]}
        assert len({tuple(v) for v in first.values()}) == 1
        int4 = [n for n in run["conditions"] if n.startswith("int4")]
        kls = {tuple(c[1] for c in run[n]["mismatch_kl"]) for n in int4}
        assert len(kls) == 1
        samplers = {tuple(c[0] for c in run[n]["sampler_accuracy"]) for n in int4}
        assert len(samplers) == 1
    # after the first update the sampler's log-probs in the OPD reward change the weights
    opd = runs["opd_sampled"]
    assert (opd["int4 none"]["mismatch_kl"][0][2]
            != opd["int4 none, sampler reward"]["mismatch_kl"][0][2])


def test_the_summary_pairs_the_seeds_and_weights_each_evaluation_by_its_steps():
    """Differences are taken seed by seed; a mean over training weights each evaluation's
    average by the steps it covers (here 50 and 20 steps of 8 answers)."""
    def curves(accuracy, sampler, kl, kept):
        return {"accuracy": accuracy, "sampler_accuracy": sampler,
                "reverse_kl": [[1.0, 0.5, 0.4]] * 2, "mismatch_kl": kl, "kept_fraction": kept}

    on_policy = curves([[0.5, 0.6, 0.6], [0.5, 0.7, 0.8]], [[0.5, 0.6, 0.6], [0.5, 0.7, 0.8]],
                       [[None, 0.0, 0.0]] * 2, [[None, 1.0, 1.0]] * 2)
    int4 = curves([[0.5, 0.5, 0.5], [0.5, 0.6, 0.6]], [[0.4, 0.4, 0.5], [0.4, 0.5, 0.7]],
                  [[None, 0.1, 0.2], [None, 0.2, 0.2]], [[None, 1.0, 1.0]] * 2)
    corrected = curves([[0.5, 0.6, 0.55], [0.5, 0.6, 0.7]], [[0.4, 0.4, 0.4], [0.4, 0.5, 0.5]],
                       [[None, 0.1, 0.2], [None, 0.2, 0.2]], [[None, 0.5, 1.0], [None, 1.0, 1.0]])
    names = ["fp32 none", "int4 none", "int4 decoupled_seq_is_rs"]
    results = {"config": {"correction_level": "int4"},
               "methods": {"rl": {"samples": [0, 400, 560], "conditions": names,
                                  **dict(zip(names, (on_policy, int4, corrected)))}}}
    rows = {row["name"]: row for row in MT.mismatch_summary(results)["rl"]}
    assert rows["fp32 none"]["difference"]["per_seed"] == [0.0, 0.0]
    assert rows["int4 none"]["difference"]["per_seed"] == pytest.approx([-0.1, -0.2])
    assert rows["int4 none"]["difference"]["mean"] == pytest.approx(-0.15)
    low, high = rows["int4 none"]["difference"]["low"], rows["int4 none"]["difference"]["high"]
    assert -0.2 - 1e-12 <= low <= -0.15 <= high <= -0.1 + 1e-12
    row = rows["int4 decoupled_seq_is_rs"]
    assert row["against_uncorrected"]["per_seed"] == pytest.approx([0.05, 0.1])
    assert row["sampler_against_uncorrected"]["per_seed"] == pytest.approx([-0.1, -0.2])
    assert row["mismatch_kl"]["per_seed"] == pytest.approx([(50 * 0.1 + 20 * 0.2) / 70, 0.2])
    assert row["kept_fraction"]["per_seed"] == pytest.approx([(50 * 0.5 + 20) / 70, 1.0])
    assert "int4 none" in MT.format_summary(dict(results, teacher_accuracy=1.0))
    with pytest.raises(ValueError, match="results must be a record of run_mismatch_training"):
        MT.mismatch_summary({})


def _summary_record(**changes):
    """A two-seed record of three conditions, evaluations at 0, 400 and 560 samples; a change
    "name.curve" replaces one curve of one condition, any other key a field of the method."""
    import copy

    def curves(accuracy):
        return {"accuracy": [accuracy] * 2, "sampler_accuracy": [accuracy] * 2,
                "reverse_kl": [[1.0, 0.5, 0.4]] * 2, "mismatch_kl": [[None, 0.1, 0.2]] * 2,
                "kept_fraction": [[None, 1.0, 0.5]] * 2}

    names = ["fp32 none", "int4 none", "int4 decoupled_seq_is_rs"]
    runs = {"samples": [0, 400, 560], "conditions": names,
            **{n: curves([0.5, 0.6, a]) for n, a in zip(names, (0.7, 0.6, 0.65))}}
    runs = copy.deepcopy(runs)
    for key, value in changes.items():
        if "." in key:
            name, curve = key.split(".")
            runs[name][curve] = value
        else:
            runs[key] = value
    return {"config": {"correction_level": "int4"}, "teacher_accuracy": 1.0,
            "methods": {"rl": runs}}


def test_a_well_formed_summary_record_is_read():
    rows = MT.mismatch_summary(_summary_record())["rl"]
    assert [r["name"] for r in rows] == ["fp32 none", "int4 none", "int4 decoupled_seq_is_rs"]
    assert rows[2]["against_uncorrected"]["per_seed"] == pytest.approx([0.05, 0.05])


@pytest.mark.parametrize("call, error, message", [
    (lambda: MT.conditions(None, "rl"), TypeError,
     "config must be a MismatchTrainingConfig, got NoneType"),
    (lambda: MT.engine_sample(object(), lm.make_prompts(torch.zeros(1, 3, 2, dtype=torch.long)),
                              torch.zeros(1, 3, 4)),
     TypeError, "sampler must be an EnsembleLM .* got object"),
    (lambda: MT.engine_sample(lm.EnsembleLM(1, 8, 1), torch.full((1, 3, 6), lm.V),
                              torch.zeros(1, 3, 4)),
     ValueError, r"prompts must hold token ids in \[0, 14\), got 14"),
    (lambda: MT.engine_sample(lm.EnsembleLM(1, 8, 1), torch.full((1, 3, 6), -1),
                              torch.zeros(1, 3, 4)),
     ValueError, r"prompts must hold token ids in \[0, 14\), got -1"),
    (lambda: MT.train_under_mismatch("rl", None), TypeError,
     r"run must be a _Run\(prepared, config\) of this module, got NoneType"),
    (lambda: MT.train_under_mismatch("rl", MT._Run(None, TINY)), TypeError,
     "run.config must be a MismatchTrainingConfig, got ExperimentConfig"),
    (lambda: MT.train_under_mismatch("rl", MT._Run(None, MT.MISMATCH_QUICK), bar=1), TypeError,
     "bar must be None or have an update"),
    (lambda: MT.mismatch_summary({"config": [], "methods": {}}), TypeError,
     r"results\['config'\] and results\['methods'\] must be dicts"),
    (lambda: MT.mismatch_summary(dict(_summary_record(), config={"correction_level": "int3"})),
     ValueError, r"results\['config'\]\['correction_level'\] must be a key of SAMPLERS, got "
                 r"'int3'"),
    (lambda: MT.mismatch_summary(_summary_record(samples=[0])), ValueError,
     r"methods\['rl'\]\['samples'\] must list step 0 and one evaluation at least, got \[0\]"),
    (lambda: MT.mismatch_summary(_summary_record(samples=[0, 400, 400])), ValueError,
     r"methods\['rl'\]\['samples'\] must increase"),
    (lambda: MT.mismatch_summary(_summary_record(conditions=["fp32 none"])), ValueError,
     r"methods\['rl'\]\['conditions'\] must be a list of condition names with 'int4 none'"),
    (lambda: MT.mismatch_summary(_summary_record(conditions=["fp32 none", "int4 none", "x"])),
     ValueError, r"methods\['rl'\] has no curves for the conditions \['x'\]"),
    (lambda: MT.mismatch_summary(_summary_record(**{"int4 none.accuracy": [[0.5, 0.6, 0.7]]})),
     ValueError, r"methods\['rl'\]\['int4 none'\]\['accuracy'\] must have one curve per seed "
                 r"\(2, as every condition: the seeds are paired\), got 1"),
    (lambda: MT.mismatch_summary(_summary_record(**{"int4 none.accuracy": [[0.5, 0.6]] * 2})),
     ValueError, r"methods\['rl'\]\['int4 none'\]\['accuracy'\]\[0\] must have 3 entries \(one "
                 r"per evaluation\), got 2"),
    (lambda: MT.mismatch_summary(_summary_record(
        **{"int4 none.accuracy": [[0.5, math.nan, 0.7]] * 2})),
     ValueError, r"methods\['rl'\]\['int4 none'\]\['accuracy'\]\[0\] must hold finite numbers "
                 r"in \[0.0, 1.0\], got nan at index 1"),
    (lambda: MT.mismatch_summary(_summary_record(
        **{"int4 none.mismatch_kl": [[None, None, 0.2]] * 2})),
     TypeError, r"methods\['rl'\]\['int4 none'\]\['mismatch_kl'\]\[0\] must hold real numbers "
                r"\(None at step 0 only\), got None at index 1"),
    (lambda: MT.mismatch_summary(_summary_record(
        **{"int4 none.kept_fraction": [[None, 1.0, 0.5], [None, 1.0, 1.5]]})),
     ValueError, r"\['kept_fraction'\]\[1\] must hold finite numbers in \[0.0, 1.0\], got 1.5 at "
                 r"index 2"),
    (lambda: MT.mismatch_summary(_summary_record(**{"int4 none.reverse_kl": None})),
     ValueError, r"methods\['rl'\]\['int4 none'\]\['reverse_kl'\] must be a list of curves, one "
                 r"a seed, got None"),
    (lambda: MT.format_summary({k: v for k, v in _summary_record().items()
                                if k != "teacher_accuracy"}),
     TypeError, "teacher_accuracy must be a real number, got None"),
])
def test_every_function_names_a_malformed_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_command_line_refuses_two_studies_and_the_long_regime(capsys, tmp_path):
    from opd_literate.experiment.cli import main

    for argv, message in ((["--mismatch-training", "--clamp-study"],
                           "--clamp-study and --mismatch-training write different files"),
                          (["--mismatch-training", "--long"], "--long is not supported"),
                          (["--strongest"], "--strongest chooses the corrections of "
                                            "--mismatch-training; it needs it")):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--out", str(tmp_path)])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Properties (Hypothesis)
# ---------------------------------------------------------------------------------------------
@pytest.mark.properties
@given(M=st.integers(1, 3), B=st.integers(1, 5), T=st.integers(1, 4), seed=st.integers(0, 2**16),
       correction=st.sampled_from(["none", *MT.CORRECTIONS]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_property_the_one_call_loss_is_the_sum_of_the_models_losses(M, B, T, seed, correction,
                                                                     dtype):
    trainer, sampler, advantages, mask = _batch(M, B, T, seed, dtype)
    loss, keep = MT.corrected_loss(trainer, sampler, advantages, mask, correction)
    expected = _per_model(trainer, sampler, advantages, mask, correction)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert math.isfinite(float(loss.detach()))
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=tolerance,
                                             rel=tolerance)
    (grad,) = torch.autograd.grad(loss, trainer)
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()


@pytest.mark.properties
@given(M=st.integers(1, 3), B=st.integers(1, 5), T=st.integers(1, 4), seed=st.integers(0, 2**16),
       correction=st.sampled_from(sorted(POLICY_LOSSES)), zero_advantages=st.booleans())
def test_property_a_policy_loss_correction_has_the_losses_gradient(M, B, T, seed, correction,
                                                                   zero_advantages):
    """The second study's policy losses, float64, any batch: the one-call loss's gradient is the
    sum of each model's own policy loss's (bypass mode, token mean); finite, 0 off the mask."""
    trainer, sampler, advantages, mask = _batch(M, B, T, seed)
    if zero_advantages:  # RL's groups with one reward
        advantages = torch.where(advantages > 0, torch.zeros_like(advantages), advantages)
    loss, keep = MT.corrected_loss(trainer, sampler, advantages, mask, correction)
    (grad,) = torch.autograd.grad(loss, trainer)
    expected = sum(POLICY_LOSSES[correction](trainer[m], sampler[m], advantages[m], mask[m],
                                             reduction="token-mean")[0] for m in range(M))
    (expected_grad,) = torch.autograd.grad(expected, trainer)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
    assert not (keep & (mask == 0)).any()


@pytest.mark.properties
@given(logits=st.lists(st.floats(-60, 60), min_size=lm.V, max_size=lm.V),
       u=st.floats(0.0, 1.0, exclude_max=True))
def test_property_the_written_token_is_where_the_uniform_falls_in_the_cdf(logits, u):
    table = torch.tensor([logits] * 4, dtype=torch.float32)
    prompts = lm.make_prompts(torch.zeros(1, 1, 2, dtype=torch.long))
    uniforms = torch.full((1, 1, 4), min(u, 1 - 2 ** -24))  # in float32, still below 1
    tokens, _, logp, _ = MT.engine_sample(_FixedSampler(table), prompts, uniforms)
    p = torch.softmax(table[0], -1).double()
    cdf = p.cumsum(0)
    v = int(tokens[0, 0, 0])
    scaled = float(uniforms[0, 0, 0]) * float(cdf[-1])
    assert p[v] > 0 and math.isfinite(float(logp[0, 0, 0]))
    assert (float(cdf[v - 1]) if v else 0.0) <= scaled < float(cdf[v])


@pytest.mark.slow
def test_the_quick_command_writes_its_record_figure_and_table(tmp_path):
    """``--mismatch-training --quick`` as a user runs it: two worker processes, the record with
    the quick configuration, the PNG, the table on stdout."""
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "opd_literate.experiment", "--mismatch-training",
                             "--quick", "--no-progress", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "mismatch_training.json").read_text())
    assert record["config"] == json.loads(json.dumps(MT.MISMATCH_QUICK.as_dict()))
    assert record["run"]["workers"] == min(2, record["run"]["cpus"])
    assert (tmp_path / "mismatch_training.png").stat().st_size > 10_000
    assert "int4 decoupled_geo_rs" in result.stdout and "opd_sampled:" in result.stdout
    assert list(record["methods"]) == list(MT.STUDY_METHODS)
    for runs in record["methods"].values():
        assert runs["samples"] == [0, 1920, 3840]
        assert len(runs["int4 none"]["accuracy"]) == MT.MISMATCH_QUICK.experiment.seeds
