"""The batched experiment: an ensemble trains each model as it would train alone, the learning
rate is chosen on the validation prompts only, and the intervals are the percentile bootstrap."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from opd_literate.experiment import run, stats, train
from opd_literate.experiment import tinylm as lm
from opd_literate.experiment.config import DEFAULT
from opd_literate.experiment.ensemble import BatchedAdam, sum_of_model_losses
from opd_literate.opd import full_vocab_reverse_kl
from tests.experiment._tiny import TINY as TINY_ONE_LR

# The plumbing tests' tiny configuration with two learning rates: one per student of a batch.
TINY = dataclasses.replace(TINY_ONE_LR, lrs=(1e-3, 3e-3))


def _models(n, hidden=16, layers=2, seed=0):
    torch.manual_seed(seed)
    return [lm.TinyLM(hidden, layers) for _ in range(n)]


def _batch(n_models, n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 100, (n_models, n, 2), generator=g)
    return lm.make_prompts(pairs), lm.answer_tokens(pairs)


def test_ensemble_logits_are_each_models_logits():
    models = _models(3)
    ensemble = lm.EnsembleLM.from_models(models)
    prompts, answers = _batch(3)
    stacked = ensemble.logits(prompts, answers)
    for m, model in enumerate(models):
        torch.testing.assert_close(stacked[m], model.logits(prompts[m], answers[m]),
                                   rtol=1e-5, atol=1e-5)
        back = ensemble.member(m)
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                     model.state_dict().values()))


def test_one_model_ensemble_takes_any_leading_dimensions():
    (model,) = _models(1, hidden=32)
    single = lm.EnsembleLM.from_models([model])
    prompts, answers = _batch(4)  # (4, 24, 6): not a model dimension for a one-model ensemble
    torch.testing.assert_close(single.logits(prompts, answers), model.logits(prompts, answers),
                               rtol=1e-5, atol=1e-5)


def test_ensemble_refuses_a_wrong_model_dimension():
    ensemble = lm.EnsembleLM.from_models(_models(2))
    prompts, answers = _batch(3)
    with pytest.raises(ValueError, match="leading model dimension of 2, got shape"):
        ensemble.logits(prompts, answers)


def test_batched_training_equals_training_each_model_alone():
    """Three steps of full-vocabulary OPD (fixed tokens, so no sampling enters) at two learning
    rates: the ensemble with BatchedAdam and the warm-up factor ends at the weights that
    torch.optim.Adam reaches for each model alone."""
    models, teacher = _models(2), _models(1, hidden=32, seed=5)[0]
    initial = [m.mlp[0].weight.detach().clone() for m in models]
    lrs, scales = [1e-2, 3e-3], [0.5, 1.0, 1.0]
    prompts, tokens = _batch(2)
    mask = lm.answer_mask(tokens)
    with torch.no_grad():
        teacher_logits = teacher.logits(prompts, tokens)
    ensemble = lm.EnsembleLM.from_models(models)
    optimizer = BatchedAdam(ensemble.parameters(), lrs)
    for scale in scales:
        loss = sum_of_model_losses(True, full_vocab_reverse_kl, ensemble.logits(prompts, tokens),
                              teacher_logits, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step(scale)
    for m, (model, lr) in enumerate(zip(models, lrs)):
        alone = torch.optim.Adam(model.parameters(), lr=lr)
        for scale in scales:
            alone.param_groups[0]["lr"] = lr * scale
            loss = full_vocab_reverse_kl(model.logits(prompts[m], tokens[m]), teacher_logits[m],
                                         mask[m])
            alone.zero_grad()
            loss.backward()
            alone.step()
        trained = ensemble.member(m)
        # Adam moves each weight by about lr a step (3e-3 to 1e-2 here); atol 1e-5 is float
        # rounding of m / sqrt(v) where a gradient is nearly 0.
        for name, value in model.state_dict().items():
            torch.testing.assert_close(trained.state_dict()[name], value, rtol=1e-5, atol=1e-5,
                                       msg=name)
        assert (trained.mlp[0].weight - initial[m]).abs().max() > lr  # it did move
        assert not torch.equal(trained.mlp[0].weight, models[1 - m].mlp[0].weight)


def test_bootstrap_interval_is_the_percentile_of_every_resample():
    """Five seeds: all 5^5 equally likely resamples enumerated; the interval of 10,000 random
    resamples lies within one step of the exact 2.5% and 97.5% quantiles of their means."""
    values = [0.0, 1.0, 3.0, 4.0, 10.0]
    means = np.sort([np.mean(r) for r in itertools.product(values, repeat=5)])
    exact_low, exact_high = np.quantile(means, 0.025), np.quantile(means, 0.975)
    low, high = stats.bootstrap_interval(values)
    step = 1.0 / 5 + 1e-9  # the means move in steps of (smallest gap) / 5
    assert abs(low - exact_low) <= step and abs(high - exact_high) <= step
    assert stats.bootstrap_interval([2.0, 2.0]) == (2.0, 2.0)
    # two values: means 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4; the tails are the ends
    assert stats.bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)


def _record(accuracies, samples, seconds=None):
    n = len(samples)
    return {"samples": samples, "accuracy": accuracies,
            "reverse_kl": [[1.0] * n for _ in accuracies],
            "seconds": seconds or [[float(i) for i in range(n)] for _ in accuracies],
            "lr": 0.001}


def test_headline_means_and_ratio_bound_by_hand():
    samples = [0, 10, 20, 30]
    results = {"teacher_accuracy": 1.0, "config": {"target_fraction": 0.9, "steps": 3,
                                                   "batch_size": 10, "seeds": 2},
               "methods": {
                   "opd_full_vocab": _record([[0.1, 0.95, 1, 1], [0.1, 0.5, 0.91, 1]], samples),
                   "sft": _record([[0.1, 0.5, 0.5, 0.9], [0.1, 0.2, 0.95, 1]], samples),
                   "rl": _record([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.95]], samples)}}
    table = stats.headline(results)
    assert table["opd_full_vocab"]["samples"]["mean"] == 15  # (10 + 20) / 2
    assert table["opd_full_vocab"]["seconds"]["mean"] == 1.5
    assert table["sft"]["samples"]["per_seed"] == [30, 20]
    assert table["rl"]["samples"] is None and table["rl"]["reached"] == 1
    found = stats.ratios(results)
    assert found["sft"]["mean"] == pytest.approx(25 / 15) and not found["sft"]["bound"]
    # RL: seed 0 misses and counts as the budget 30; seed 1 reaches at 30: at least 30 / 15
    assert found["rl"]["mean"] == pytest.approx(2.0) and found["rl"]["bound"]
    text = stats.format_headline(results)
    assert "rl / opd_full_vocab: at least 2.0x" in text and "1 of 2 seeds never" in text


def test_learning_rate_is_chosen_on_validation_not_test(monkeypatch, tmp_path):
    """An _evaluate whose test accuracy favours the larger learning rate and whose validation
    accuracy favours the smaller: the chosen rate must be the smaller, for every method."""
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path))
    config = dataclasses.replace(TINY, lrs=(1e-3, 3e-3))

    def fake_evaluate(students, teacher, test_pairs, val_pairs, seed):
        M, S = students.models, config.seeds
        small = torch.tensor([m < S for m in range(M)], dtype=torch.float32)
        return 1 - small, small, torch.ones(M)  # test, validation, reverse KL

    monkeypatch.setattr(train, "_evaluate", fake_evaluate)
    results = run.run_experiment(config, progress=False)
    for method, record in results["methods"].items():
        assert record["lr"] == 1e-3, method
        assert results["lr_search"][method]["0.001"]["val_samples_to_target"] == [0, 0]


def test_validation_and_test_prompts_are_disjoint_and_held_out():
    train_pairs, held_out = run._split(DEFAULT)
    val = DEFAULT.val_prompts
    val_pairs = held_out[:val]
    test_pairs = held_out[val: val + DEFAULT.eval_prompts]
    keys = [set(map(tuple, p.tolist())) for p in (train_pairs, val_pairs, test_pairs)]
    assert len(keys[1]) == val and len(keys[2]) == DEFAULT.eval_prompts
    assert not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]


def test_each_seed_is_a_different_student_and_run(monkeypatch, tmp_path):
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path))
    results = run.run_experiment(dataclasses.replace(TINY, student_pretrain_steps=3),
                                 ["opd_sampled"], progress=False)
    kl = results["methods"]["opd_sampled"]["reverse_kl"]
    assert len(kl) == TINY.seeds and kl[0] != kl[1]
