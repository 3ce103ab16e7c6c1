"""opd_literate.experiment.exact: the states of tinylm's answers and their probabilities, against
a brute-force list of every complete answer scored by the model's own teacher-forced pass."""

import itertools
import json
import math
import pathlib
import re
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.experiment.exact import answer_states, reach_log_probs, state_logits
from opd_literate.experiment.tinylm import EOS, PAD, EnsembleLM, TinyLM, V, make_prompts
from opd_literate.large_vocab.clamps import clamp_study, weighted_clamp_study


def _every_answer(max_answer=4):
    """Every complete answer: n - 1 tokens that are not <eos>, then <eos> (n < max_answer), or
    max_answer tokens of any kind; padded with <pad>, with its mask."""
    others = [v for v in range(V) if v != EOS]
    answers, masks = [], []
    for n in range(1, max_answer + 1):
        last = [EOS] if n < max_answer else range(V)
        for head in itertools.product(others, repeat=n - 1):
            for token in last:
                answers.append(list(head) + [token] + [PAD] * (max_answer - n))
                masks.append([1.0] * n + [0.0] * (max_answer - n))
    return torch.tensor(answers), torch.tensor(masks, dtype=torch.float64)


@pytest.fixture(scope="module")
def model_and_states():
    torch.manual_seed(3)
    model = TinyLM(hidden=16).double()
    model.requires_grad_(False)
    prompts = make_prompts(torch.tensor([[12, 34]]))
    return model, prompts, answer_states(prompts)


def test_there_are_2380_states_a_prompt_and_parents_come_first(model_and_states):
    _, _, states = model_and_states
    assert len(states["prompt"]) == 1 + 13 + 169 + 2197
    children = states["parent"] >= 0
    assert (states["parent"][children] < torch.nonzero(children).squeeze(-1)).all()
    assert not (states["prefix"] == EOS).any()


def test_reach_probabilities_are_sums_over_the_complete_answers(model_and_states):
    model, prompts, states = model_and_states
    reach = reach_log_probs(state_logits(model, prompts, states), states).exp()
    answers, masks = _every_answer()
    for b in range(len(prompts)):
        logits = model.logits(prompts[b].expand(len(answers), -1), answers)
        token_logp = torch.log_softmax(logits, -1).gather(-1, answers[..., None])[..., 0]
        p_answer = torch.exp((token_logp * masks).sum(-1))
        assert abs(float(p_answer.sum()) - 1) < 1e-12
        mine = torch.nonzero(states["prompt"] == b).squeeze(-1)
        # the states of position 2 of this prompt: the answers sharing their first two tokens
        for index in mine[states["position"][mine] == 2][:40]:
            prefix = states["prefix"][index, :2]
            shares = (answers[:, :2] == prefix).all(-1)
            np.testing.assert_allclose(float(reach[index]), float(p_answer[shares].sum()),
                                       rtol=1e-12, atol=0)


def test_an_ensemble_gives_each_models_logits(model_and_states):
    _, prompts, all_states = model_and_states
    states = {key: value[:200] for key, value in all_states.items()}  # positions 0 to 2
    torch.manual_seed(4)
    first, second = TinyLM(hidden=8), TinyLM(hidden=8)
    both = state_logits(EnsembleLM.from_models([first, second]), prompts, states)
    # float32, and the ensemble multiplies in another order: rounding only
    torch.testing.assert_close(both[1], state_logits(second, prompts, states),
                               rtol=1e-5, atol=1e-5)


def test_uniform_weights_give_clamp_study_rows():
    rows = clamp_study(V=64, temperatures=(1.0,), noises=(0.5,), ks=(1, 4), positions=8)
    from opd_literate.large_vocab.topk import zipf_pair
    pairs = [zipf_pair(64, 1.1, 1.0, 0.5, i) for i in range(8)]
    student = torch.stack([p[0] for p in pairs])
    teacher = torch.stack([p[1] for p in pairs])
    weighted = weighted_clamp_study(student, teacher, torch.full((8,), 0.125,
                                                                dtype=student.dtype), (1, 4))
    for row, mine in zip(rows, weighted):
        for key, value in mine.items():
            assert abs(row[key] - value) < 1e-12, key


@pytest.mark.parametrize("kwargs, message", [
    (dict(weights=-torch.ones(2)), "weights must be finite, >= 0 and not all 0"),
    (dict(weights=torch.zeros(2)), "weights must be finite, >= 0 and not all 0"),
    (dict(weights=torch.ones(3)), r"weights must have shape \(N,\) = \(2,\)"),
    (dict(ks=(0,)), r"every k must be an integer in \[1, V\] = \[1, 3\]"),
    (dict(ks=(4,)), r"every k must be an integer in \[1, V\] = \[1, 3\]"),
])
def test_weighted_clamp_study_names_bad_arguments(kwargs, message):
    arguments = dict(student_logits=torch.zeros(2, 3, dtype=torch.float64),
                     teacher_logits=torch.zeros(2, 3, dtype=torch.float64),
                     weights=torch.ones(2, dtype=torch.float64), ks=(1,))
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        weighted_clamp_study(**arguments)


def test_answer_states_refuses_float_prompts():
    with pytest.raises(TypeError, match=r"prompts must be a \(B, L\) long tensor"):
        answer_states(torch.zeros(2, 6))


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_states():
    prompts = make_prompts(torch.tensor([[1, 2]]))
    return prompts, answer_states(prompts, max_answer=2)


@pytest.mark.parametrize("logits, error, message", [
    (lambda n: torch.zeros(n, V, dtype=torch.long), TypeError,
     "logits must have a floating dtype, got torch.int64"),
    (lambda n: torch.zeros(n + 1, V), ValueError, r"logits must have shape \(\.\.\., N, V\)"),
    (lambda n: torch.zeros(n), ValueError, r"logits must have shape \(\.\.\., N, V\)"),
    (lambda n: torch.zeros(n, 3), ValueError, r"states\['token'\] must be token ids in \[0, V\)"),
    (lambda n: torch.full((n, V), math.nan), ValueError, r"no NaN, no \+inf"),
    (lambda n: torch.full((n, V), math.inf), ValueError, r"no NaN, no \+inf"),
    (lambda n: torch.full((n, V), -math.inf), ValueError, "-inf at every token of a state"),
])
def test_reach_log_probs_names_bad_logits(small_states, logits, error, message):
    _, states = small_states
    with pytest.raises(error, match=message):
        reach_log_probs(logits(len(states["prompt"])), states)


@pytest.mark.parametrize("change, error, message", [
    (lambda s: s.pop("parent"), ValueError, r"states is missing the keys \['parent'\]"),
    (lambda s: s.update(token=s["token"].float()), TypeError,
     r"states\['token'\] must be a long tensor"),
    (lambda s: s.update(position=s["position"][:-1]), ValueError,
     r"states\['position'\] must have shape \(14,\)"),
    (lambda s: s.update(position=s["position"] + 5), ValueError,
     r"states\['position'\] must lie in \[0, 2\)"),
    (lambda s: s.update(parent=torch.full_like(s["parent"], -1)), ValueError,
     r"states\['parent'\] must be -1 exactly at the states of position 0"),
    (lambda s: s.update(parent=torch.arange(len(s["parent"]))), ValueError,
     r"states\['parent'\] must index an earlier state"),
])
def test_a_broken_states_dict_is_refused(small_states, change, error, message):
    _, states = small_states
    broken = dict(states)
    change(broken)
    with pytest.raises(error, match=message):
        reach_log_probs(torch.zeros(len(states["prompt"]), V), broken)


def test_state_contexts_checks_prompts_and_their_states(small_states):
    prompts, states = small_states
    model = TinyLM(hidden=8)
    with pytest.raises(TypeError, match=r"prompts must be a \(B, L\) long tensor"):
        state_logits(model, prompts.float(), states)
    with pytest.raises(ValueError, match=r"states\['prompt'\] must index the 1 prompts"):
        state_logits(model, prompts, dict(states, prompt=states["prompt"] + 1))
    with pytest.raises(TypeError, match="states must be the dict of answer_states"):
        state_logits(model, prompts, list(states.values()))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(ks=(15,)), ValueError, r"every k must be an integer in \[1, V\] = \[1, 14\], got 15"),
    (dict(ks=4), TypeError, "ks must be a sequence of report sizes"),
    (dict(ks=()), ValueError, "ks must not be empty"),
    (dict(prompts=0), ValueError, r"prompts must be an integer in \[1, 3\]"),
    (dict(prompts=4), ValueError, r"prompts must be an integer in \[1, 3\]"),
])
def test_clamp_study_on_tinylm_names_bad_arguments_before_any_work(kwargs, error, message):
    from opd_literate.experiment.exact import clamp_study_on_tinylm

    # not a real Prepared: every check fires before the teacher or a student is run
    prepared = types.SimpleNamespace(config=None, test_pairs=torch.zeros(3, 2, dtype=torch.long),
                                     teacher=None, student_state=None)
    arguments = dict(prompts=3, ks=(1,))
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        clamp_study_on_tinylm(prepared, **arguments)


def test_clamp_study_on_tinylm_defaults_to_the_composed_configs_clamps():
    import inspect

    from opd_literate.experiment.exact import clamp_study_on_tinylm
    from opd_literate.large_vocab import clamps

    parameters = inspect.signature(clamp_study_on_tinylm).parameters
    assert parameters["log_prob_min_clamp"].default is clamps.VERL_LOG_PROB_MIN_CLAMP
    assert parameters["loss_max_clamp"].default is clamps.VERL_LOSS_MAX_CLAMP


def test_clamp_study_on_tinylm_refuses_what_is_not_a_prepared_run():
    from opd_literate.experiment.exact import clamp_study_on_tinylm

    with pytest.raises(TypeError, match=r"prepared must be the Prepared of run.prepare"):
        clamp_study_on_tinylm(object(), prompts=1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(log_prob_min_clamp=1.0), "log_prob_min_clamp must be <= 0.0"),
    (dict(loss_max_clamp=-1.0), "loss_max_clamp must be >= 0.0"),
])
def test_weighted_clamp_study_names_bad_clamps(kwargs, message):
    with pytest.raises(ValueError, match=message):
        weighted_clamp_study(torch.zeros(1, 3, dtype=torch.float64),
                             torch.zeros(1, 3, dtype=torch.float64),
                             torch.ones(1, dtype=torch.float64), (1,), **kwargs)


def test_half_precision_logits_are_summed_in_float32(model_and_states):
    model, prompts, states = model_and_states
    logits = state_logits(model, prompts, states)
    half = reach_log_probs(logits.bfloat16(), states)
    assert half.dtype == torch.float32
    # bf16 keeps 8 bits of the logits: the reach probabilities move by at most about 1%
    torch.testing.assert_close(half.exp().double(), reach_log_probs(logits, states).exp(),
                               rtol=0, atol=0.02)


@pytest.mark.properties
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 5), max_answer=st.integers(1, 3),
       eos_from_end=st.integers(0, 1), scale=st.sampled_from([0.1, 1.0, 5.0]))
def test_reach_probabilities_are_products_along_the_prefix(seed, vocab, max_answer, eos_from_end,
                                                           scale):
    """For any vocabulary, <eos> and logits: each state's reach probability is the product of
    the conditionals along its prefix (walked by hand from the root), and each position's
    states sum to 1 minus the probability of having ended before it."""
    eos = vocab - 1 - eos_from_end
    prompts = make_prompts(torch.tensor([[1, 2]]))
    states = answer_states(prompts, max_answer=max_answer, vocab=vocab, eos=eos)
    N = len(states["prompt"])
    assert N == sum((vocab - 1) ** t for t in range(max_answer))
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(N, vocab, generator=g, dtype=torch.float64)
    reach = reach_log_probs(logits, states).exp()
    p = torch.softmax(logits, -1)
    index = {(): 0}
    for i in range(1, N):
        t = int(states["position"][i])
        index[tuple(states["prefix"][i, :t].tolist())] = i
    for prefix, i in index.items():
        assert abs(float(reach[i]) - _walk(prefix, index, p)) <= 1e-13
    ended = 0.0
    for t in range(max_answer):
        at_t = float(reach[states["position"] == t].sum())
        assert abs(at_t - (1.0 - ended)) <= 1e-12
        ended += float((reach[states["position"] == t] * p[states["position"] == t, eos]).sum())


def _walk(prefix, index, p):
    """The product of the conditionals along ``prefix``, from the root state."""
    value = 1.0
    for t, token in enumerate(prefix):
        value *= float(p[index[prefix[:t]], token])
    return value


# ---------------------------------------------------------------------------------------------
# The large-vocabulary chapter's sentences under its tinylm clamp tables
# ---------------------------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).parents[2]
CLAMP_STUDY = ROOT / "docs" / "data" / "experiment" / "clamp_study.json"


def tinylm_clamp_claims(record, page):
    """Every number and claim of the sentences under the tables, against a clamp-study record
    (the committed one here; tests/site/test_docs_data.py may pass one recomputed)."""
    from opd_literate.large_vocab import clamps

    flat = " ".join(page.split())
    assert record["clamps"] == {"log_prob_min_clamp": clamps.VERL_LOG_PROB_MIN_CLAMP,
                                "loss_max_clamp": clamps.VERL_LOSS_MAX_CLAMP}
    assert record["dataclass_clamps"] == {
        "log_prob_min_clamp": clamps.DATACLASS_LOG_PROB_MIN_CLAMP,
        "loss_max_clamp": clamps.DATACLASS_LOSS_MAX_CLAMP}
    assert record["ks"] == [1, 2, 4, 8]

    def by_k(rows, k):
        return [row for row in rows if row["k"] == k]

    def mean(rows, key):
        return sum(row[key] for row in rows) / len(rows)

    stock, dataclass = record["rows"], record["dataclass_rows"]
    # "at k = 1 a position is clamped ... exactly where P > Q ...: about half of the positions"
    assert "at $k = 1$ a position is clamped, and sends no gradient, exactly where $P > Q$" in flat
    assert all(row["clamped"] == row["p_above_q"] for row in by_k(stock, 1))
    assert all(0.4 < row["clamped"] < 0.6 for row in by_k(stock, 1))
    # "At k = 2 from 9% to 13% of them are clamped, from k = 4 under 1%"
    low, high, under = (int(x) for x in re.search(
        r"At \$k = 2\$ from (\d+)% to (\d+)% of them are clamped, from \$k = 4\$ under (\d+)%",
        flat).groups())
    two = [row["clamped"] for row in by_k(stock, 2)]
    assert (round(100 * min(two)), round(100 * max(two))) == (low, high)
    assert all(row["clamped"] < under / 100 for k in (4, 8) for row in by_k(stock, k))
    # "at k = 8 only states ... below 10^-9, although P > Q at most of them"
    assert ("$k = 8$ only states the students reach with a total probability below $10^{-9}$, "
            "although $P > Q$ at most of them") in flat
    assert all(row["clamped"] < 1e-9 and row["p_above_q"] > 0.5 for row in by_k(stock, 8))
    # the dataclass's clamp: "at k = 2 from 37% to 41%", "(c) falls only from 0.68 ... to 0.60
    # at k = 8, where without the clamp it falls to 0.23"
    low, high = (int(x) for x in re.search(
        r"at \$k = 2\$ from (\d+)% to (\d+)% of the positions are clamped", flat).groups())
    two = [row["clamped"] for row in by_k(dataclass, 2)]
    assert (round(100 * min(two)), round(100 * max(two))) == (low, high)
    first, last, without = (float(x) for x in re.search(
        r"gradient error of \(c\) falls only from ([0-9.]+) at \$k = 1\$ to ([0-9.]+) at "
        r"\$k = 8\$, where without the clamp it falls to ([0-9.]+)\.", flat).groups())
    assert round(mean(by_k(dataclass, 1), "c_grad_error"), 2) == first
    assert round(mean(by_k(dataclass, 8), "c_grad_error"), 2) == last
    assert round(mean(by_k(stock, 8), "c_grad_error"), 2) == without
    # "M = 10 never binds" (the value is at most -c Q)
    assert "and $M = 10$ never binds" in flat
    assert all(row["capped"] == 0.0 for row in dataclass)
    # "For every student, every k and both settings the tail bucket (b) has the smaller error"
    assert "For every student, every $k$ and both settings the tail bucket (b) has" in flat
    assert all(row["b_grad_error"] < row["c_grad_error"] for row in stock + dataclass)


def test_the_committed_clamp_study_backs_the_chapter():
    record = json.loads(CLAMP_STUDY.read_text())
    tinylm_clamp_claims(record, (ROOT / "docs" / "large_vocab.md").read_text())
    seeds = {row["seed"] for row in record["rows"]}
    assert seeds == {row["seed"] for row in record["dataclass_rows"]}
    assert len(record["rows"]) == len(record["dataclass_rows"]) == len(seeds) * 4
