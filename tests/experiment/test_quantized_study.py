"""opd_literate.experiment.quantized.mismatch_study and its record: every field recomputed from
the public functions its docstring says it is made of (sampler_states, token_mismatch,
tinylm_answer_toy, comparison_table, full_parameter_bias, matched_toy_mismatch,
rank_correlation, opd_estimate), on a small stand-in for run.prepare's Prepared."""

import dataclasses
import inspect
import json
import types

import pytest
import torch

from opd_literate.experiment import quantized as Q
from opd_literate.experiment.exact import CLAMP_STUDY_KEYS
from opd_literate.experiment.quantized import (
    SAMPLERS,
    full_parameter_bias,
    mismatch_study,
    rank_correlation,
    sampler_copy,
    sampler_states,
    tinylm_answer_toy,
    token_mismatch,
    toy_token_mismatch,
)
from opd_literate.experiment.tinylm import (
    EOS,
    EnsembleLM,
    TinyLM,
    answer_tokens,
    make_prompts,
    token_logp,
)
from opd_literate.mismatch.estimators import REGISTRY, comparison_table
from opd_literate.mismatch.opd_mismatch import (
    OPD_RECIPES,
    PREFIX_RECIPES,
    add_teacher,
    opd_estimate,
)
from opd_literate.mismatch.toy import estimator_moments, make_ar_toy, make_toy
from tests.experiment._tiny import TINY

# The study runs 164 toy evaluations a sampler (~2.5 s on 2 cores): its tests are slow (they
# still run in mutation); the refusals, which stop before any work, are fast.
slow = pytest.mark.slow

# One-digit prompts (183 states, 2,380 answers a prompt), two-layer students, a batch of 5 (not
# comparison_table's default 64 nor TINY's 8, so that rel_rmse shows which N it was given).
CONFIG = dataclasses.replace(TINY, digits=1, student_layers=2, batch_size=5)
PAIRS = torch.tensor([[3, 4], [9, 8], [0, 7]])  # three test prompts; the study takes two
PROMPTS = 2
SAMPLER = "int4"

# The same computation repeated on the same inputs: equal up to the order of a reduction,
# which moves a well-conditioned sum of these sizes by ~1e-15 relative; 1e-12 is far above
# that and far below any change of definition (every mutant moves a value by >1e-6 relative).
REL, ABS = 1e-12, 1e-15


def _randomized(module, seed):
    """``module`` with every parameter drawn from N(0, 0.5^2): sharper than the default init,
    so that int4 visibly moves the distributions and each student differs from the other."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


@pytest.fixture(scope="module")
def prepared():
    """A stand-in for run.prepare's Prepared: the four attributes mismatch_study reads."""
    students = _randomized(EnsembleLM(CONFIG.seeds, CONFIG.student_hidden, CONFIG.student_layers,
                                      digits=CONFIG.digits), 1)
    teacher = _randomized(TinyLM(hidden=8, layers=1, digits=CONFIG.digits), 2)
    return types.SimpleNamespace(config=CONFIG, test_pairs=PAIRS, teacher=teacher,
                                 student_state=students.state_dict(), students=students)


@pytest.fixture(scope="module")
def study(prepared):
    """The study of the first two prompts with one sampler and every student (seeds default)."""
    return mismatch_study(prepared, prompts=PROMPTS, samplers=(SAMPLER,))


@pytest.fixture(scope="module")
def first_toy(prepared):
    """The answer toy of the first student, recomputed: tinylm_answer_toy with the teacher."""
    member = prepared.students.member(0)
    return member, tinylm_answer_toy(member, PAIRS[:PROMPTS], SAMPLER, teacher=prepared.teacher)


def _same(got, expected, where="record"):
    """Nested dicts and lists equal: the same keys in the same order, strings and ints exactly,
    floats to REL / ABS."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), where
        for key in expected:
            _same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(expected, (str, int)) and not isinstance(expected, bool):
        assert got == expected and type(got) is type(expected), where
    else:
        assert isinstance(got, float), (where, type(got))
        assert got == pytest.approx(float(expected), rel=REL, abs=ABS), where


_ROW_KEYS = ("name", "rel_bias", "rel_rmse", "token_frac", "seq_frac")


def _rows(table):
    return [{k: r[k] for k in _ROW_KEYS} for r in table]


# ---------------------------------------------------------------------------------------------
# The record's shape
# ---------------------------------------------------------------------------------------------
@slow
def test_the_record_is_json_ready_with_the_settings_it_was_given(study):
    assert list(study) == ["prompts", "batch_size", "seeds", "samplers", "mismatch",
                           "estimators", "opd", "toy_b"]
    assert study["prompts"] == PROMPTS and study["batch_size"] == CONFIG.batch_size
    assert study["seeds"] == [0, 1]  # every student by default, in order
    assert study["samplers"] == {SAMPLER: SAMPLERS[SAMPLER]}
    for key in ("mismatch", "estimators", "opd"):
        assert list(study[key]) == [SAMPLER], key
    assert len(study["mismatch"][SAMPLER]) == CONFIG.seeds
    # JSON-ready: plain dicts, lists, strings, ints and floats, unchanged by a round trip
    assert json.loads(json.dumps(study)) == study
    rows = study["estimators"][SAMPLER]
    assert list(rows) == ["tinylm", "parameters", "J", "toy_eps", "toy",
                          "toy_spearman_rel_bias", "toy_spearman_rel_rmse", "ar_toy_eps",
                          "ar_toy", "ar_toy_spearman_rel_bias", "ar_toy_spearman_rel_rmse"]
    for kind in ("tinylm", "toy", "ar_toy"):
        assert [r["name"] for r in rows[kind]] == list(REGISTRY), kind
    assert all(list(r) == [*_ROW_KEYS, "rel_bias_all"] for r in rows["tinylm"])
    assert all(list(r) == list(_ROW_KEYS) for r in rows["toy"] + rows["ar_toy"])
    recipes = [(r["logp"], r["weight"]) for r in study["opd"][SAMPLER]]
    assert recipes == [*OPD_RECIPES, *PREFIX_RECIPES]
    assert all(list(r) == ["logp", "weight", "rel_bias", "rel_rmse", "ar_toy_rel_bias",
                           "ar_toy_rel_rmse"] for r in study["opd"][SAMPLER])


# ---------------------------------------------------------------------------------------------
# Every field, recomputed
# ---------------------------------------------------------------------------------------------
@slow
def test_the_mismatch_of_each_student_is_token_mismatch_on_its_sampler_states(prepared, study):
    stats = study["mismatch"][SAMPLER]
    for seed in (0, 1):
        exact = sampler_states(prepared.students.member(seed), PAIRS[:PROMPTS], SAMPLER)
        expected = token_mismatch(exact["log_pi"].numpy(), exact["log_mu"].numpy(),
                                  exact["visits"].numpy())
        _same(stats[seed], expected, f"mismatch[{seed}]")
    assert stats[0]["kl"] != pytest.approx(stats[1]["kl"], rel=1e-3)  # two distinct students
    assert all(s["kl"] > 0 for s in stats)


@slow
def test_the_toys_own_mismatch_is_at_eps_0_3(study):
    _same(study["toy_b"], {"toy": toy_token_mismatch(make_toy(mismatch=0.3)),
                           "ar_toy": toy_token_mismatch(make_ar_toy(mismatch=0.3))}, "toy_b")


@slow
def test_the_tinylm_rows_are_the_comparison_table_of_the_first_students_answers(
        study, first_toy):
    member, toy = first_toy
    rows = study["estimators"][SAMPLER]
    expected = _rows(comparison_table(toy, N=CONFIG.batch_size))
    every = full_parameter_bias(member, PAIRS[:PROMPTS], toy)
    for row in expected:
        row["rel_bias_all"] = every["rel_bias"][row["name"]]
    _same(rows["tinylm"], expected, "tinylm")
    # the batch matters: N = 5, not comparison_table's default (the rmse shrinks like 1/sqrt N)
    default = {r["name"]: r["rel_rmse"] for r in comparison_table(toy)}
    assert rows["tinylm"][0]["rel_rmse"] > 1.5 * default[rows["tinylm"][0]["name"]]
    # every parameter of the student, counted independently
    assert rows["parameters"] == sum(p.numel() for p in member.parameters())
    assert rows["parameters"] == every["parameters"]


@slow
def test_J_is_the_trainers_probability_of_the_exact_answer(study, first_toy):
    """J = (1/B) sum_x pi(correct answer | x): teacher-forced by TinyLM.logits in float64 over
    the correct answer's tokens up to <eos> (an independent path from the enumeration)."""
    member, _ = first_toy
    trainer = sampler_copy(member, "float64")
    pairs = PAIRS[:PROMPTS]
    prompts, answers = make_prompts(pairs, CONFIG.digits), answer_tokens(pairs, CONFIG.digits)
    with torch.no_grad():
        logp = token_logp(trainer.logits(prompts, answers), answers)
    # the answer's tokens: the digits and <eos>; the padding after it is not written
    ends = (answers == EOS).long()
    written = torch.cumsum(ends, dim=1) - ends == 0
    expected = float(torch.where(written, logp, 0.0).sum(dim=1).exp().mean())
    assert 0 < expected < 1
    # exp of a sum of 3 float64 log-probs over 2 prompts: 1e-12 relative is ample
    assert study["estimators"][SAMPLER]["J"] == pytest.approx(expected, rel=1e-12)


@slow
@pytest.mark.parametrize("kind, make", [("toy", make_toy), ("ar_toy", make_ar_toy)])
def test_each_toy_at_its_matched_mismatch(study, kind, make):
    """The toy's eps gives the first student's mean KL (bisection to float precision: KL ~ eps^2
    moves by 2e-16 relative at most per ulp of eps; 1e-9 allows the 80 steps' last bracket), its
    rows are comparison_table at that eps, and the Spearman correlations are rank_correlation
    of the tinylm rows against them."""
    rows = study["estimators"][SAMPLER]
    kl = study["mismatch"][SAMPLER][0]["kl"]
    eps = rows[f"{kind}_eps"]
    assert 0 < eps < 10
    assert toy_token_mismatch(make(mismatch=eps))["kl"] == pytest.approx(kl, rel=1e-9)
    _same(rows[kind], _rows(comparison_table(make(mismatch=eps), N=CONFIG.batch_size)), kind)
    for key in ("rel_bias", "rel_rmse"):
        expected = rank_correlation([r[key] for r in rows["tinylm"]],
                                    [r[key] for r in rows[kind]])
        _same(rows[f"{kind}_spearman_{key}"], expected, f"{kind}_spearman_{key}")
        assert -1 <= rows[f"{kind}_spearman_{key}"] <= 1


@slow
def test_the_opd_rows_are_each_recipe_on_tinylm_and_on_the_matched_ar_toy(study, first_toy):
    """Sampled-token OPD against the per-state KL gradient (what discount-0 OPD estimates), on
    the answer toy with the teacher and on the autoregressive toy with add_teacher's at the
    matched eps, with rel_rmse for the study's batch."""
    _, toy = first_toy
    N = CONFIG.batch_size
    target = dict(toy, true_grad=toy["kl_grad_per_state"])
    ar = add_teacher(make_ar_toy(mismatch=study["estimators"][SAMPLER]["ar_toy_eps"]))
    ar_target = dict(ar, true_grad=ar["kl_grad_per_state"])
    expected = []
    for logp, weight in (*OPD_RECIPES, *PREFIX_RECIPES):
        ours = estimator_moments(target, opd_estimate(toy, logp, weight))
        theirs = estimator_moments(ar_target, opd_estimate(ar, logp, weight))
        expected.append(dict(logp=logp, weight=weight, rel_bias=ours["rel_bias"],
                             rel_rmse=ours["rel_rmse"](N), ar_toy_rel_bias=theirs["rel_bias"],
                             ar_toy_rel_rmse=theirs["rel_rmse"](N)))
    _same(study["opd"][SAMPLER], expected, "opd")
    # sampling with the trainer's log-probs and importance weights on the whole sequence is
    # unbiased for the per-state gradient: a check that the target is the right one
    by_recipe = {(r["logp"], r["weight"]): r for r in study["opd"][SAMPLER]}
    assert by_recipe[("trainer", "seq_is")]["rel_bias"] < 1e-10


@slow
def test_the_seeds_given_are_the_students_measured_and_the_first_is_the_toys(prepared):
    """seeds=[1]: only student 1, and the estimators are on it (recomputed). With fp32, whose
    mismatch is float32's rounding alone: its KL is below the toys' KL at eps = 1e-6, and the
    matched eps is found all the same (the study's bracket starts at 1e-9)."""
    record = mismatch_study(prepared, prompts=1, samplers=("fp32",), seeds=[1])
    assert record["seeds"] == [1] and record["prompts"] == 1
    assert list(record["samplers"]) == ["fp32"]
    member = prepared.students.member(1)
    exact = sampler_states(member, PAIRS[:1], "fp32")
    _same(record["mismatch"]["fp32"], [token_mismatch(
        exact["log_pi"].numpy(), exact["log_mu"].numpy(), exact["visits"].numpy())])
    toy = tinylm_answer_toy(member, PAIRS[:1], "fp32", teacher=prepared.teacher)
    _same([r["rel_bias"] for r in record["estimators"]["fp32"]["tinylm"]],
          [r["rel_bias"] for r in comparison_table(toy, N=CONFIG.batch_size)], "fp32")
    kl = record["mismatch"]["fp32"][0]["kl"]
    rows = record["estimators"]["fp32"]
    for kind, make in (("toy", make_toy), ("ar_toy", make_ar_toy)):
        assert 0 < kl < toy_token_mismatch(make(mismatch=1e-6))["kl"], kind
        assert 1e-9 < rows[f"{kind}_eps"] < 1e-6, kind
        assert toy_token_mismatch(make(mismatch=rows[f"{kind}_eps"]))["kl"] == pytest.approx(
            kl, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Refusals and defaults
# ---------------------------------------------------------------------------------------------
def _message(call):
    with pytest.raises((TypeError, ValueError)) as caught:
        call()
    return type(caught.value), str(caught.value)


def _stand_in(pairs=3, **changes):
    fields = dict(config=CONFIG, test_pairs=torch.zeros((pairs, 2), dtype=torch.long),
                  teacher=None, student_state={})
    fields.update(changes)
    return types.SimpleNamespace(**fields)


@pytest.mark.parametrize("missing", ["config", "test_pairs", "teacher", "student_state"])
def test_each_attribute_of_prepared_is_required(missing):
    fields = vars(_stand_in())
    del fields[missing]
    assert _message(lambda: mismatch_study(types.SimpleNamespace(**fields))) == (
        TypeError, f"prepared must be the Prepared of run.prepare (with .{missing}), got "
                   "SimpleNamespace")


SAMPLER_LIST = "fp32, bf16, fp16, int8, int4"


@pytest.mark.parametrize("samplers, shown", [
    ((), "()"), (("int8", "int8"), "('int8', 'int8')"), (("int3",), "('int3',)"),
    (("int8", "int3"), "('int8', 'int3')"), ("int8", "'int8'"), ([], "[]")])
def test_samplers_must_be_distinct_keys_of_SAMPLERS(samplers, shown):
    assert _message(lambda: mismatch_study(_stand_in(), 1, samplers=samplers)) == (
        ValueError, f"samplers must be a sequence of distinct keys of SAMPLERS ({SAMPLER_LIST}), "
                    f"at least one, got {shown}")


@pytest.mark.parametrize("seeds, shown", [
    ([], "[]"), ([0, 0], "[0, 0]"), ([-1], "[-1]"), ([2], "[2]"), ([True], "[True]"),
    ([0.0], "[0.0]"), ("0", "'0'"), ([0, 2], "[0, 2]")])
def test_seeds_must_be_distinct_students(seeds, shown):
    assert _message(lambda: mismatch_study(_stand_in(), 1, seeds=seeds)) == (
        ValueError, f"seeds must be distinct students in [0, 2), at least one, got {shown}")


def test_prompts_default_to_20_and_are_checked_before_the_samplers():
    """19 test prompts: the default 20 is refused, by name; 20 are enough for it (the next check
    to fire is then the samplers')."""
    assert _message(lambda: mismatch_study(_stand_in(19))) == (
        ValueError, "prompts must be an integer in [1, 19] (the test prompts), got 20")
    assert _message(lambda: mismatch_study(_stand_in(20), samplers=())) == (
        ValueError, f"samplers must be a sequence of distinct keys of SAMPLERS ({SAMPLER_LIST}), "
                    "at least one, got ()")
    assert _message(lambda: mismatch_study(_stand_in(3), prompts=True)) == (
        ValueError, "prompts must be an integer in [1, 3] (the test prompts), got True")


def test_samplers_default_to_every_sampler_and_seeds_to_every_student():
    """The defaults pass their checks: the first refusal is then the seeds' (with samplers
    default) and the load of the stand-in's empty student state (with both default)."""
    assert _message(lambda: mismatch_study(_stand_in(), 1, seeds=[5])) == (
        ValueError, "seeds must be distinct students in [0, 2), at least one, got [5]")
    with pytest.raises(RuntimeError, match="Missing key"):  # past every argument check
        mismatch_study(_stand_in(), 1)


# ---------------------------------------------------------------------------------------------
# The record of the docs
# ---------------------------------------------------------------------------------------------
def test_the_study_record_is_the_study_of_the_prepared_config_with_its_settings(monkeypatch):
    """mismatch_study_record: prepare(config, cache), then mismatch_study of it with prompts,
    beside the settings that shape the teacher and the students (CLAMP_STUDY_KEYS)."""
    from opd_literate.experiment import run

    calls = []

    def fake_prepare(config, cache):
        calls.append(("prepare", config, cache))
        return "prepared"

    def fake_study(prepared, prompts):
        calls.append(("study", prepared, prompts))
        return {"mismatch": "measured", "prompts": prompts}

    read_default = inspect.signature(run.prepare).parameters["cache"].default
    monkeypatch.setattr(run, "prepare", fake_prepare)
    monkeypatch.setattr(Q, "mismatch_study", fake_study)
    settings = {k: getattr(TINY, k) for k in CLAMP_STUDY_KEYS}
    assert Q.mismatch_study_record(TINY, 3, cache="off") == {
        "config": settings, "mismatch": "measured", "prompts": 3}
    assert calls == [("prepare", TINY, "off"), ("study", "prepared", 3)]
    # the defaults: 20 prompts, and the cache read as prepare reads it by default
    calls.clear()
    twenty = dataclasses.replace(TINY, eval_prompts=20)
    record = Q.mismatch_study_record(twenty)
    assert calls == [("prepare", twenty, read_default), ("study", "prepared", 20)]
    assert record["config"] == {k: getattr(twenty, k) for k in CLAMP_STUDY_KEYS}
    # 16 test prompts: the default 20 is refused before anything is prepared
    calls.clear()
    assert _message(lambda: Q.mismatch_study_record(TINY)) == (
        ValueError, "prompts must be an integer in [1, 16] (the test prompts), got 20")
    assert _message(lambda: Q.mismatch_study_record(TINY, 17)) == (
        ValueError, "prompts must be an integer in [1, 16] (the test prompts), got 17")
    assert calls == []
