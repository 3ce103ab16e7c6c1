"""Found by mutation testing (opd_literate.experiment.mismatch_training): the training loop
against a reference written from its docstring, the study's wiring, and the refusals and the
summary's text compared whole."""

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

from opd_literate.experiment import mismatch_training as MT
from opd_literate.experiment import tinylm as lm
from opd_literate.experiment.ensemble import BatchedAdam
from opd_literate.experiment.quantized import ensemble_sampler
from opd_literate.experiment.train import Prepared
from opd_literate.opd import reverse_kl_rewards
from tests.experiment._tiny import TINY


# ---------------------------------------------------------------------------------------------
# The training loop, against a reference
# ---------------------------------------------------------------------------------------------
def _prepared(config):
    """A Prepared built by hand, without training: a random teacher, and students whose last
    bias favours "0", "1" and <eos>, so that on pairs summing to 0 or 1 about one answer in
    nine is right (RL's reward is not always 0)."""
    d, S = config.digits, config.seeds
    torch.manual_seed(11)
    teacher = lm.TinyLM(8, 1, digits=d).requires_grad_(False)
    students = lm.EnsembleLM(S, config.student_hidden, config.student_layers, digits=d)
    with torch.no_grad():
        for p in students.parameters():
            p.normal_(0, 0.5)
        students.biases[-1][:, [0, 1, lm.EOS]] += 4.0
    train_pairs = torch.tensor([[0, 0], [0, 1], [1, 0], [0, 0], [1, 0]])
    test_pairs = torch.tensor([[0, 0], [1, 0], [0, 1], [3, 4], [10, 7], [0, 0], [1, 0], [55, 2]])
    return Prepared(config=config, train_pairs=train_pairs, val_pairs=test_pairs[:2],
                    test_pairs=test_pairs, teacher=teacher, teacher_cached=False,
                    student_state={k: v.detach().clone() for k, v in students.state_dict().items()})


def _reference(method, prepared, study):
    """train_under_mismatch written from its docstring, model by model where that is possible
    without changing a float: model c * S + s is seed s of condition c; every condition has
    seed s's student, prompts and uniforms; RL answers each of B / group prompts group times,
    the reward 1 for an answer right to its last token less the mean of its group; the OPD
    reward takes the sampler's log-probs for the "sampler reward" condition; each model's loss
    is its own corrected_loss; Adam's step is scaled by min(1, step / warmup); the KL is
    kl_div's; the averages cover the steps since the last evaluation."""
    ex = study.experiment
    S, B, G, d = ex.seeds, ex.batch_size, ex.group, ex.digits
    T = d + 2
    conds = MT.conditions(study, method)
    C = len(conds)
    M = C * S
    of = [conds[m // S] for m in range(M)]
    trainer = lm.EnsembleLM(M, ex.student_hidden, ex.student_layers, digits=d)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.copy_(torch.cat([prepared.student_state[name]] * C))
    adam = BatchedAdam(list(trainer.parameters()), [study.lr] * M)
    teacher = lm.EnsembleLM.from_models([prepared.teacher]).requires_grad_(False)
    prompt_stream = torch.Generator().manual_seed(1_000_003 * ex.seed + 30)
    uniform_stream = torch.Generator().manual_seed(1_000_003 * ex.seed + 31)
    levels = {}
    for m in range(M):
        levels.setdefault(of[m].sampler, []).append(m)
    test_prompts = lm.make_prompts(prepared.test_pairs, d).expand(M, -1, -1)
    test_answers = lm.answer_tokens(prepared.test_pairs, d)
    N = len(prepared.test_pairs)

    def engines():
        out = []
        for level, models in levels.items():
            alone = lm.EnsembleLM.from_models([trainer.member(m) for m in models])
            out.append((models, alone if level == "fp32" else ensemble_sampler(alone, level)))
        return out

    def right(tokens, answers):  # per answer: 1.0 when every position matches
        return [float(torch.equal(tokens[i], answers[i])) for i in range(len(tokens))]

    record = {c.name: {k: [[] for _ in range(S)] for k in ("accuracy", "sampler_accuracy",
                                                         "reverse_kl", "mismatch_kl",
                                                         "kept_fraction")} for c in conds}
    samples, kl_steps, kept_steps = [0], [], []

    def evaluate():
        greedy, _ = lm.sample_tokens(trainer, test_prompts, greedy=True)
        served = torch.empty_like(greedy)
        for models, engine in engines():
            served[models], _ = lm.sample_tokens(engine, test_prompts[models], greedy=True)
        out = lm.rollout(trainer, test_prompts,
                         torch.Generator().manual_seed(1_000_003 * ex.seed + 32))
        teacher_logits = teacher.logits(test_prompts, out.tokens).double()
        for m in range(M):
            log_p = torch.log_softmax(out.logits[m].detach().double(), -1)
            log_q = torch.log_softmax(teacher_logits[m], -1)
            per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
            reverse = float((per_token * out.mask[m]).sum() / out.mask[m].sum())
            row = record[of[m].name]
            s = m % S
            row["accuracy"][s].append(sum(right(greedy[m], test_answers)) / N)
            row["sampler_accuracy"][s].append(sum(right(served[m], test_answers)) / N)
            row["reverse_kl"][s].append(reverse)
            n = len(kl_steps)
            row["mismatch_kl"][s].append(sum(k[m] for k in kl_steps) / n if n else None)
            row["kept_fraction"][s].append(sum(k[m] for k in kept_steps) / n if n else None)
        kl_steps.clear()
        kept_steps.clear()

    evaluate()
    for step in range(1, study.steps + 1):
        drawn = torch.randint(0, len(prepared.train_pairs), (S, B), generator=prompt_stream)
        if method == "rl":  # answer b of the batch is for the (b // G)-th prompt drawn
            drawn = drawn[:, torch.arange(B) // G]
        pairs = torch.cat([prepared.train_pairs[drawn]] * C)
        uniforms = torch.cat([torch.rand((S, B, T), generator=uniform_stream)] * C)
        prompts = lm.make_prompts(pairs, d)
        tokens = torch.zeros((M, B, T), dtype=torch.long)
        mask, sampler_logp = torch.zeros(M, B, T), torch.zeros(M, B, T)
        sampler_logits = torch.zeros(M, B, T, lm.V)
        for models, engine in engines():
            t, k, p, z = MT.engine_sample(engine, prompts[models], uniforms[models])
            tokens[models], mask[models], sampler_logp[models], sampler_logits[models] = (
                t, k, p, z.float())
        logits = trainer.logits(prompts, tokens)
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
        if method == "rl":
            answers = lm.answer_tokens(pairs, d)
            advantages = torch.zeros(M, B, T)
            for m in range(M):
                reward = right(tokens[m], answers[m])
                for b in range(B):
                    group = reward[b - b % G: b - b % G + G]
                    advantages[m, b] = reward[b] - sum(group) / G
        else:
            teacher_logp = MT._teacher_logp(teacher, prompts, tokens)
            advantages = torch.stack([
                reverse_kl_rewards(sampler_logp[m] if of[m].reward_logp == "sampler"
                                   else logp[m].detach(), teacher_logp[m], mask[m])
                for m in range(M)])
        loss, kept = 0.0, []
        for m in range(M):
            part, used = MT.corrected_loss(logp[m:m + 1], sampler_logp[m:m + 1],
                                           advantages[m:m + 1], mask[m:m + 1],
                                           of[m].correction)
            loss = loss + part
            # in float32, the mask's dtype, as the loop divides (the average is then float64)
            kept.append(float(used.sum() / mask[m].sum()))
        adam.zero_grad()
        loss.backward()
        adam.step(1.0 if step >= ex.warmup_steps else step / ex.warmup_steps)
        log_mu = torch.log_softmax(sampler_logits.double(), -1)
        log_pi = torch.log_softmax(logits.detach().double(), -1)
        kl = F.kl_div(log_pi, log_mu, log_target=True, reduction="none").sum(-1)
        kl_steps.append([float((kl[m] * mask[m]).sum() / mask[m].sum()) for m in range(M)])
        kept_steps.append(kept)
        if step % study.eval_every == 0 or step == study.steps:
            samples.append(step * B)
            evaluate()
    return samples, [c.name for c in conds], record


def test_the_mismatch_kl_is_each_models_mean_over_its_tokens():
    """KL((1/2, 1/2) || (1/4, 3/4)) = (1/2) log 2 + (1/2) log(2/3) = (1/2) log(4/3) at every
    token of model 0's one token and of model 1's three; 0 where the logits agree; a model
    without a token has 0, not NaN."""
    same, other = (torch.zeros(3, 1, 3, 2, dtype=torch.float64) for _ in range(2))
    other[..., 1] = math.log(3.0)
    mask = torch.tensor([[[1.0, 0, 0]], [[1, 1, 1]], [[0, 0, 0]]])
    kl = MT._kl_per_model(same, other, mask)
    assert kl.dtype == torch.float64
    assert kl.tolist() == pytest.approx([0.5 * math.log(4 / 3)] * 2 + [0.0], rel=1e-14)
    assert MT._kl_per_model(same, same, mask).tolist() == [0.0, 0.0, 0.0]


class _Bar:
    def __init__(self):
        self.updates = []

    def update(self, n):
        self.updates.append(n)


# RL with three-digit operands, two hidden layers and one warm-up step (min(1, step / 1));
# OPD with two digits, one layer and two warm-up steps (a half step first). Evaluations at 0,
# 2 and 3: the last averages one step, the one before two.
@pytest.mark.parametrize("method, digits, layers, warmup",
                         [("rl", 3, 2, 1), ("opd_sampled", 2, 1, 2)])
def test_the_loop_is_the_reference_written_from_its_docstring(method, digits, layers, warmup):
    ex = dataclasses.replace(TINY, digits=digits, student_layers=layers, warmup_steps=warmup,
                             seed=1)
    study = MT.MismatchTrainingConfig(experiment=ex, steps=3, eval_every=2, lr=0.01)
    prepared = _prepared(ex)
    bar = _Bar()
    got = MT.train_under_mismatch(method, MT._Run(prepared, study), bar)
    samples, names, record = _reference(method, prepared, study)
    assert bar.updates == [1, 1, 1]
    assert got["samples"] == samples == [0, 16, 24]
    assert got["conditions"] == names and set(got) == {"samples", "conditions", *names}
    for name in names:
        assert set(got[name]) == set(record[name])
        for key, per_seed in record[name].items():
            for s, expected in enumerate(per_seed):
                curve = got[name][key][s]
                assert len(curve) == 3, (name, key)
                if key in ("accuracy", "sampler_accuracy"):
                    assert curve == expected, (name, key, s)
                    continue
                if key == "reverse_kl":  # the loop's is in float32, the reference's float64
                    assert curve == pytest.approx(expected, rel=1e-5), (name, key, s)
                    continue
                # float64 averages of the steps' float64 KL and float32 fractions: a float32
                # accumulator would be off by about 1e-8 of the value
                assert curve[0] is None and expected[0] is None
                assert curve[1:] == pytest.approx(expected[1:], rel=1e-12, abs=1e-300), (
                    name, key, s)
    # the run is not degenerate: RL sees right answers, the corrections drop tokens, int4's
    # sampler is measurably off and the training moved the students
    if method == "rl":
        assert any(0 < a < 1 for n in names for c in record[n]["accuracy"] for a in c)
    assert any(v < 1 for c in record["int4 decoupled_geo_rs"]["kept_fraction"] for v in c[1:])
    assert all(v > 1e-4 for c in record["int4 none"]["mismatch_kl"] for v in c[1:])
    assert record["fp32 none"]["reverse_kl"][0][0] != record["fp32 none"]["reverse_kl"][0][2]


# ---------------------------------------------------------------------------------------------
# The study: what run_mismatch_training hands to whom, and what it records
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def wired(monkeypatch):
    """run_mismatch_training with its collaborators replaced by recorders: prepare, the
    teacher's accuracy, the bar, the CPU count, the clock, and the training (in this process
    or in workers, which yield the methods in the reverse order)."""
    import time

    from opd_literate.experiment import _workers
    from opd_literate.experiment import run as run_module

    calls = {"prepare": [], "accuracy": [], "bars": [], "train": [], "workers": []}
    prepared = _prepared(TINY)

    class Bar:
        def __init__(self, total, enabled):
            calls["bars"].append([total, enabled, 0])
            calls["bar"] = self

        def update(self, n):
            pass

        def close(self):
            calls["bars"][-1][2] += 1

    def prepare(config, cache):
        calls["prepare"].append((config, cache))
        return prepared

    def greedy_accuracy(model, pairs):
        calls["accuracy"].append((model, pairs))
        return 0.625

    def train(method, run, bar):
        calls["train"].append((method, run, bar, torch.get_num_threads()))
        return {"trained": method}

    def train_in_workers(methods, run, workers, bar, train):
        calls["workers"].append((methods, run, workers, bar, train))
        return (item for item in [("opd_sampled", {"trained": "opd_sampled"}),
                                  ("rl", {"trained": "rl"})])

    clock = iter([100.0])
    monkeypatch.setattr(run_module, "prepare", prepare)
    monkeypatch.setattr(lm, "greedy_accuracy", greedy_accuracy)
    monkeypatch.setattr(_workers, "progress_bar", Bar)
    monkeypatch.setattr(_workers, "available_cpus", lambda: 7)
    monkeypatch.setattr(_workers, "train_in_workers", train_in_workers)
    monkeypatch.setattr(MT, "train_under_mismatch", train)
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock, 112.3456))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield calls, prepared, train
    torch.set_num_threads(threads)


def test_the_study_trains_both_methods_on_one_thread_and_records_the_run(wired):
    calls, prepared, train = wired
    study = MT.MismatchTrainingConfig(experiment=TINY, steps=3, eval_every=1)
    results = MT.run_mismatch_training(study)
    assert results == {"config": study.as_dict(), "teacher_accuracy": 0.625,
                       "methods": {"rl": {"trained": "rl"},
                                   "opd_sampled": {"trained": "opd_sampled"}},
                       "run": {"workers": 1, "cpus": 7, "wall_seconds": 12.3}}
    assert list(results) == ["config", "teacher_accuracy", "methods", "run"]
    assert calls["prepare"] == [(TINY, "read")]  # the default cache mode
    assert calls["accuracy"] == [(prepared.teacher, prepared.test_pairs)]
    assert calls["bars"] == [[6, True, 1]]  # two methods of 3 steps, shown by default, closed
    assert [c[0] for c in calls["train"]] == ["rl", "opd_sampled"] and not calls["workers"]
    for _, run, bar, threads in calls["train"]:
        assert isinstance(run, MT._Run) and run.prepared is prepared and run.config is study
        assert bar is calls["bar"] and threads == 1
    assert torch.get_num_threads() == 3  # given back


def test_the_study_in_workers_hands_them_the_run_and_keeps_the_methods_order(wired):
    calls, prepared, train = wired
    study = MT.MismatchTrainingConfig(experiment=TINY, steps=2, eval_every=1)
    results = MT.run_mismatch_training(study, progress=False, workers=5, cache="off")
    assert list(results["methods"]) == ["rl", "opd_sampled"]
    assert results["methods"]["rl"] == {"trained": "rl"}
    assert results["run"]["workers"] == 2  # one a method at most
    assert calls["prepare"] == [(TINY, "off")] and calls["bars"] == [[4, False, 1]]
    ((methods, run, workers, bar, trainer),) = calls["workers"]
    assert methods == MT.STUDY_METHODS and workers == 2 and trainer is train
    assert run.prepared is prepared and run.config is study and bar is calls["bar"]
    assert not calls["train"]
    MT.run_mismatch_training(study, workers=2)
    assert len(calls["workers"]) == 2 and not calls["train"]


@pytest.mark.parametrize("workers", [0, -1, True, "2", 1.0])
def test_the_study_refuses_a_worker_count_that_is_not_a_positive_int(wired, workers):
    with pytest.raises(ValueError, match=rf"^workers must be a positive integer, got "
                                         rf"{re.escape(repr(workers))}$"):
        MT.run_mismatch_training(MT.MISMATCH_QUICK, workers=workers)
    assert not wired[0]["prepare"]


# ---------------------------------------------------------------------------------------------
# Refusals, compared whole
# ---------------------------------------------------------------------------------------------
_NAMES = "fp32, bf16, fp16, int8, int4"


@pytest.mark.parametrize("call, error, message", [
    (lambda: MT.Condition("int3"), ValueError,
     f"sampler must be a key of SAMPLERS ({_NAMES}), got 'int3'"),
    (lambda: MT.MismatchTrainingConfig(experiment=5), TypeError,
     "experiment must be an ExperimentConfig, got int"),
    (lambda: MT.MismatchTrainingConfig(levels=("fp32", "int3")), ValueError,
     f"levels and correction_level must be keys of SAMPLERS ({_NAMES}), got 'int3'"),
    (lambda: MT.MismatchTrainingConfig(corrections=("none",)), ValueError,
     "corrections must be presets or peer corrections; 'none' is trained at each level"),
    (lambda: MT.MismatchTrainingConfig(lr=0.0), ValueError,
     "lr must be a positive finite float, got 0.0"),
    (lambda: MT.MismatchTrainingConfig(lr=math.inf), ValueError,
     "lr must be a positive finite float, got inf"),
    (lambda: MT.conditions(TINY, "rl"), TypeError,
     "config must be a MismatchTrainingConfig, got ExperimentConfig"),
    (lambda: MT.train_under_mismatch("rl", 5), TypeError,
     "run must be a _Run(prepared, config) of this module, got int"),
    (lambda: MT.train_under_mismatch("rl", MT._Run(None, MT.MISMATCH_QUICK), bar=1), TypeError,
     "bar must be None or have an update(n) method, got int"),
    (lambda: MT.run_mismatch_training(TINY), TypeError,
     "config must be a MismatchTrainingConfig, got ExperimentConfig"),
    (lambda: MT.run_mismatch_training(progress="yes"), TypeError,
     "progress must be a bool, got str"),
    (lambda: MT.corrected_loss(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), torch.zeros(2, 3, 4),
                               torch.ones(2, 3, 4), "none"), ValueError,
     "sampler_logp must have the same shape as trainer_logp (2, 3, 4), got (2, 3, 5)"),
    (lambda: MT.format_summary(dict(_record(), teacher_accuracy=1.5)), ValueError,
     "teacher_accuracy must be <= 1.0, got 1.5"),
    (lambda: MT.format_summary(dict(_record(), teacher_accuracy=-0.25)), ValueError,
     "teacher_accuracy must be >= 0.0, got -0.25"),
    (lambda: MT.format_summary([]), TypeError, "teacher_accuracy must be a real number, got None"),
])
def test_every_refusal_says_what_it_got_in_full(call, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        call()


# ---------------------------------------------------------------------------------------------
# The summary: records read and refused, the table's text
# ---------------------------------------------------------------------------------------------
def _record(samples=(0, 64), **changes):
    """One method, two conditions, two seeds with the same curves (each bootstrap interval is
    then the point itself); a change "name.curve" replaces a curve, "name" a condition, any
    other key a field of the method."""
    def curves(accuracy, sampler, reverse, kl, kept):
        return {"accuracy": [list(accuracy)] * 2, "sampler_accuracy": [list(sampler)] * 2,
                "reverse_kl": [list(reverse)] * 2, "mismatch_kl": [[None, *kl]] * 2,
                "kept_fraction": [[None, *kept]] * 2}

    n = len(samples) - 1
    runs = {"samples": list(samples), "conditions": ["fp32 none", "int4 none"],
            "fp32 none": curves([0.5] + [0.75] * n, [0.5] + [0.75] * n, [1.0] + [0.25] * n,
                                [0.0] * n, [1.0] * n),
            "int4 none": curves([0.5] + [0.625] * n, [0.5] * (n + 1), [1.0] + [0.5] * n,
                                [0.125] * n, [0.875] * n)}
    for key, value in changes.items():
        if "." in key:
            name, curve = key.split(".")
            runs[name] = dict(runs[name], **{curve: value})
        else:
            runs[key] = value
    return {"config": {"correction_level": "int4"}, "teacher_accuracy": 0.875,
            "methods": {"rl": runs}}


def test_the_table_is_written_as_documented():
    """Every number by hand: fp32's final accuracy 0.75, int4's 0.625 (0.125 below), int4's
    sampler 0.5, its KL 0.125 and kept fraction 0.875; one decimal format for all cells."""
    def row(name, trainer, sampler, versus, kl, kept):
        return (name.ljust(34) + " " + trainer.rjust(20) + " " + sampler.rjust(20) + " "
                + versus.rjust(22) + " " + kl.rjust(9) + " " + kept.rjust(6))

    expected = "\n".join([
        "teacher accuracy 0.875",
        "",
        "rl: final greedy accuracy (trainer, sampler), its difference to fp32, per-token "
        "KL(sampler || trainer), kept tokens; mean [95% interval]",
        row("condition", "trainer", "sampler", "vs fp32", "KL", "kept"),
        row("fp32 none", "0.750 [0.750, 0.750]", "0.750 [0.750, 0.750]",
            "0.000 [0.000, 0.000]", "0.00e+00", "1.000"),
        row("int4 none", "0.625 [0.625, 0.625]", "0.500 [0.500, 0.500]",
            "-0.125 [-0.125, -0.125]", "1.25e-01", "0.875")])
    assert MT.format_summary(_record()) == expected
    assert MT.format_summary(dict(_record(), teacher_accuracy=0.5)).startswith(
        "teacher accuracy 0.500\n\nrl: ")


def test_the_summary_reads_the_last_evaluation_and_names_every_statistic():
    """Three evaluations: the final values are the third ones, not the second."""
    record = _record(samples=(0, 32, 64), **{
        "int4 none.accuracy": [[0.5, 0.25, 0.375]] * 2,
        "int4 none.sampler_accuracy": [[0.5, 0.25, 0.125]] * 2,
        "int4 none.reverse_kl": [[1.0, 0.5, 0.75]] * 2})
    rows = {row["name"]: row for row in MT.mismatch_summary(record)["rl"]}
    int4 = rows["int4 none"]
    assert set(int4) == {"name", "final_accuracy", "final_sampler_accuracy", "final_reverse_kl",
                         "difference", "against_uncorrected", "sampler_against_uncorrected",
                         "mismatch_kl", "kept_fraction"}
    assert int4["final_accuracy"] == dict(mean=0.375, low=0.375, high=0.375,
                                          per_seed=[0.375, 0.375])
    assert int4["final_sampler_accuracy"]["per_seed"] == [0.125, 0.125]
    assert int4["final_reverse_kl"] == dict(mean=0.75, low=0.75, high=0.75, per_seed=[0.75] * 2)
    assert int4["difference"]["per_seed"] == [0.375 - 0.75] * 2
    # two evaluations (step 0 and one more) are enough
    assert MT.mismatch_summary(_record())["rl"][1]["final_accuracy"]["mean"] == 0.625


@pytest.mark.parametrize("record, error, message", [
    ({"methods": {}}, ValueError,
     "results must be a record of run_mismatch_training (with 'config' and 'methods')"),
    (["methods", "config"], ValueError,
     "results must be a record of run_mismatch_training (with 'config' and 'methods')"),
    ({"config": {}, "methods": []}, TypeError,
     "results['config'] and results['methods'] must be dicts"),
    ({"config": {"correction_level": "int4"}, "methods": {"rl": {"conditions": ["int4 none"]}}},
     ValueError, "methods['rl'] must have 'samples' and 'conditions'"),
    ({"config": {"correction_level": "int4"}, "methods": {"rl": ["samples", "conditions"]}},
     ValueError, "methods['rl'] must have 'samples' and 'conditions'"),
    (_record(samples=(-8, 0, 8)), ValueError,
     "methods['rl']['samples'] must hold finite numbers in [0.0, inf], got -8 at index 0"),
    (_record(samples=(None, 0, 8)), TypeError,
     "methods['rl']['samples'] must hold real numbers (None at step 0 only), got None at "
     "index 0"),
    (_record(**{"int4 none.accuracy": [{"a": 1}, {"a": 1}]}), TypeError,
     "methods['rl']['int4 none']['accuracy'][0] must be a list of numbers, got dict"),
    (_record(**{"int4 none": []}), ValueError,
     "methods['rl']['int4 none']['accuracy'] must be a list of curves, one a seed, got None"),
    (_record(**{"int4 none.reverse_kl": []}), ValueError,
     "methods['rl']['int4 none']['reverse_kl'] must be a list of curves, one a seed, got []"),
])
def test_a_malformed_record_is_refused_by_name(record, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        MT.mismatch_summary(record)


def test_the_configuration_is_recorded_with_the_experiments_own_record():
    study = MT.MismatchTrainingConfig(experiment=TINY, steps=3, eval_every=1,
                                      corrections=("decoupled_seq_is",))
    assert study.as_dict() == {
        "experiment": TINY.as_dict(), "levels": ["fp32", "bf16", "int8", "int4"],
        "correction_level": "int4", "corrections": ["decoupled_seq_is"], "steps": 3,
        "lr": 1e-3, "eval_every": 1}
    # the experiment's record: lrs a list, digits left out at 2 (not dataclasses.asdict's)
    assert study.as_dict()["experiment"]["lrs"] == [1e-3]
    assert "digits" not in study.as_dict()["experiment"]
