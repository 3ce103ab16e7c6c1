"""opd_literate.experiment.exact: the states of tinylm's answers and their probabilities, against
a brute-force list of every complete answer scored by the model's own teacher-forced pass."""

import dataclasses
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

from opd_literate.experiment.exact import (
    STATE_KEYS,
    answer_states,
    clamp_study_on_tinylm,
    clamp_study_record,
    reach_log_probs,
    state_contexts,
    state_logits,
)
from opd_literate.experiment.run import prepare
from opd_literate.experiment.tinylm import EOS, PAD, EnsembleLM, TinyLM, V, make_prompts
from opd_literate.large_vocab.clamps import clamp_study, weighted_clamp_study
from tests.experiment._tiny import TINY


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


# ---------------------------------------------------------------------------------------------
# Found by mutation testing
# ---------------------------------------------------------------------------------------------
# tools/mutation.sh experiment.exact: each test below fails on mutants of opd_literate/
# experiment/exact.py that the tests above let through (docs/mutation.md lists the equivalent
# ones). Messages are compared whole; every expected value is enumerated or computed by a second
# route (the model's teacher-forced pass, a product walked by hand, weighted_clamp_study).


def _message(error, call):
    """The message of the ``error`` that ``call()`` raises."""
    with pytest.raises(error) as caught:
        call()
    return str(caught.value)


def _prompts(*pairs):
    return make_prompts(torch.tensor(pairs))


@pytest.mark.parametrize("prompts, message", [
    ([[1, 2]], "prompts must be a (B, L) long tensor, got list of shape ()"),
    (torch.zeros(2, 6), "prompts must be a (B, L) long tensor, got torch.float32 of shape (2, 6)"),
    (torch.zeros(6, dtype=torch.long),
     "prompts must be a (B, L) long tensor, got torch.int64 of shape (6,)"),
])
def test_bad_prompts_are_named_with_their_type_and_shape(prompts, message):
    assert _message(TypeError, lambda: answer_states(prompts)) == message


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_answer=0), "max_answer must be an integer >= 1, got 0"),
    (dict(max_answer=2.0), "max_answer must be an integer >= 1, got 2.0"),
    (dict(max_answer=True), "max_answer must be an integer >= 1, got True"),
    (dict(vocab=1, eos=0), "vocab must be an integer >= 2, got 1"),
    (dict(vocab=3.0, eos=0), "vocab must be an integer >= 2, got 3.0"),
    (dict(vocab=True, eos=0), "vocab must be an integer >= 2, got True"),
    (dict(vocab=3, eos=3), "eos must be a token id in [0, 3), got 3"),
    (dict(vocab=3, eos=-1), "eos must be a token id in [0, 3), got -1"),
    (dict(vocab=3, eos=1.0), "eos must be a token id in [0, 3), got 1.0"),
    (dict(vocab=3, eos=True), "eos must be a token id in [0, 3), got True"),
])
def test_answer_states_names_bad_sizes(kwargs, message):
    assert _message(ValueError, lambda: answer_states(_prompts([1, 2]), **kwargs)) == message


@pytest.mark.parametrize("kwargs, per_prompt", [
    (dict(max_answer=1), 1),  # the root only
    (dict(max_answer=3, vocab=2, eos=0), 3),  # one token continues: 1 + 1 + 1
    (dict(max_answer=3, vocab=2, eos=1), 3),
    (dict(max_answer=2, vocab=3, eos=2), 3),  # 1 + 2
])
def test_answer_states_takes_the_smallest_sizes_and_either_end_for_eos(kwargs, per_prompt):
    states = answer_states(_prompts([1, 2], [3, 4]), **kwargs)
    assert len(states["prompt"]) == 2 * per_prompt


def test_a_single_state_is_a_states_dict():
    """One prompt, one position: the root alone (N = 1), reached with probability 1."""
    states = answer_states(_prompts([1, 2]), max_answer=1)
    assert torch.equal(reach_log_probs(torch.zeros(1, V), states), torch.zeros(1))


def test_every_state_is_its_parent_plus_one_token_and_every_prefix_is_there():
    """Four positions (so that the third level's parents lie after two earlier levels), two
    prompts, and a vocabulary of 4 whose <eos> is 1: the states of (prompt, t) are the 3^t
    prefixes of the tokens {0, 2, 3}, enumerated here, and each state's parent is its prefix
    less its last token."""
    states = answer_states(_prompts([1, 2], [3, 4]), max_answer=4, vocab=4, eos=1)
    prompt, position, prefix = states["prompt"], states["position"], states["prefix"]
    parent, token = states["parent"], states["token"]
    assert len(prompt) == 2 * (1 + 3 + 9 + 27)
    for b in range(2):
        for t in range(4):
            rows = (prompt == b) & (position == t)
            found = sorted(tuple(row[:t]) for row in prefix[rows].tolist())
            assert found == sorted(itertools.product([0, 2, 3], repeat=t))
            assert (prefix[rows][:, t:] == PAD).all()
    root = position == 0
    assert (parent[root] == -1).all() and (token[root] == PAD).all()
    child = torch.nonzero(~root).squeeze(-1)
    up = parent[child]
    assert (position[up] == position[child] - 1).all() and (prompt[up] == prompt[child]).all()
    last = position[child] - 1
    assert torch.equal(token[child], prefix[child, last])
    shortened = prefix[child].clone()
    shortened[torch.arange(len(child)), last] = PAD
    assert torch.equal(prefix[up], shortened)


def test_every_tensor_takes_the_prompts_device():
    """Under a meta default device a tensor made without the prompts' device would land on
    meta (or the call would fail mixing devices): every output is on the CPU, as the prompts,
    and the same as without it."""
    model = TinyLM(hidden=8).double()
    prompts = _prompts([1, 2])
    states = answer_states(prompts)
    logits = state_logits(model, prompts, states)
    reach = reach_log_probs(logits, states)
    with torch.device("meta"):
        states_meta = answer_states(prompts)
        logits_meta = state_logits(model, prompts, states_meta)
        reach_meta = reach_log_probs(logits_meta, states_meta)
    for key in STATE_KEYS:
        assert states_meta[key].device.type == "cpu" and states_meta[key].dtype == torch.long
        assert torch.equal(states_meta[key], states[key]), key
    assert logits_meta.device.type == reach_meta.device.type == "cpu"
    assert torch.equal(logits_meta, logits) and torch.equal(reach_meta, reach)


def test_state_logits_are_the_teacher_forced_logits_at_every_state():
    """Every state (position 3 included) against the model's own teacher-forced pass over the
    state's prefix: its logits at the state's position see the same tokens."""
    torch.manual_seed(5)
    model = TinyLM(hidden=8).double()
    prompts = _prompts([12, 34], [56, 78])
    states = answer_states(prompts)
    forced = model.logits(prompts[states["prompt"]], states["prefix"])  # (N, T, V)
    at_state = forced[torch.arange(len(states["prompt"])), states["position"]]
    torch.testing.assert_close(state_logits(model, prompts, states), at_state,
                               rtol=1e-12, atol=1e-12)


def test_each_state_gets_the_context_of_its_own_position():
    """A model whose context_at writes t everywhere: row i of the contexts holds its state's
    position (``model.context_at`` is what writes a state's context)."""
    prompts = _prompts([1, 2])
    states = answer_states(prompts, max_answer=3)

    def context_at(rows_prompts, answers, t):
        return torch.full((len(rows_prompts), rows_prompts.shape[1] + answers.shape[1] - 1), t)

    contexts = state_contexts(types.SimpleNamespace(context_at=context_at), prompts, states)
    assert contexts.shape == (len(states["prompt"]), 6 + 3 - 1)
    assert torch.equal(contexts, states["position"][:, None].expand_as(contexts))


@pytest.fixture(scope="module")
def three_token_states():
    """Vocabulary 3 with <eos> = 0, three positions: 1 + 2 + 4 = 7 states, tokens 1 and 2."""
    return answer_states(_prompts([1, 2]), max_answer=3, vocab=3, eos=0)


def test_reach_log_probs_takes_any_leading_dimensions(three_token_states):
    """(2, 3, N, V) logits: each (N, V) slice gives the products walked by hand."""
    states = three_token_states
    N = len(states["prompt"])
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 3, N, 3, generator=g, dtype=torch.float64)
    reach = reach_log_probs(logits, states).exp()
    assert reach.shape == (2, 3, N)
    index = {(): 0}
    for i in range(1, N):
        index[tuple(states["prefix"][i, :int(states["position"][i])].tolist())] = i
    for a in range(2):
        for b in range(3):
            p = torch.softmax(logits[a, b], -1)
            for prefix, i in index.items():
                assert abs(float(reach[a, b, i]) - _walk(prefix, index, p)) <= 1e-14


def test_one_token_logits_give_probability_1_everywhere():
    """V = 1 is allowed: with vocabulary 2 and <eos> = 1 the only token written is 0, and a
    softmax over one logit is 1, so every state is reached with probability 1 (log 0)."""
    states = answer_states(_prompts([1, 2]), max_answer=3, vocab=2, eos=1)
    reach = reach_log_probs(torch.randn(len(states["prompt"]), 1, dtype=torch.float64), states)
    assert torch.equal(reach, torch.zeros(3, dtype=torch.float64))


def test_the_root_token_is_not_read(three_token_states):
    """A root's token (``<pad>``) leads nowhere: any value there gives the same reach."""
    states = three_token_states
    logits = torch.randn(len(states["prompt"]), 3, generator=torch.Generator().manual_seed(8),
                         dtype=torch.float64)
    odd = dict(states, token=torch.where(states["position"] == 0, -5, states["token"]))
    assert torch.equal(reach_log_probs(logits, odd), reach_log_probs(logits, states))


def _one_row(value, row):
    logits = torch.zeros(7, 3, dtype=torch.float64)
    logits[row] = value
    return logits


@pytest.mark.parametrize("logits, message", [
    (torch.zeros(7, 0), "logits must have shape (..., N, V) with N = 7 states and V >= 1, got "
                        "(7, 0)"),
    (torch.zeros(1, 7, 0), "logits must have shape (..., N, V) with N = 7 states and V >= 1, got "
                           "(1, 7, 0)"),
    (torch.zeros(8, 3), "logits must have shape (..., N, V) with N = 7 states and V >= 1, got "
                        "(8, 3)"),
    (_one_row(math.nan, 3), "logits must be finite or -inf (no NaN, no +inf)"),
    (_one_row(math.inf, 6), "logits must be finite or -inf (no NaN, no +inf)"),
    (_one_row(-math.inf, 2),
     "logits must not be -inf at every token of a state (its softmax is NaN)"),
    (torch.zeros(7, 2), "states['token'] must be token ids in [0, V) = [0, 2)"),
    (torch.zeros(5, 7, 2), "states['token'] must be token ids in [0, V) = [0, 2)"),
])
def test_reach_log_probs_names_bad_logits_whole(three_token_states, logits, message):
    assert _message(ValueError, lambda: reach_log_probs(logits, three_token_states)) == message


def test_one_row_of_minus_inf_in_one_model_is_refused(three_token_states):
    """An ensemble's (M, N, V) logits with one state of one model all -inf (the others finite)."""
    logits = torch.zeros(2, 7, 3, dtype=torch.float64)
    logits[1, 4] = -math.inf
    assert _message(ValueError, lambda: reach_log_probs(logits, three_token_states)) == (
        "logits must not be -inf at every token of a state (its softmax is NaN)")
    logits[1, 4, 0] = 0.0  # one token of probability 1 there: accepted
    assert torch.isfinite(reach_log_probs(logits, three_token_states)).all()


def test_a_token_below_0_is_refused_at_the_first_position(small_states):
    _, states = small_states
    broken = dict(states, token=states["token"].clone())
    broken["token"][1] = -1  # state 1 is at position 1
    assert int(states["position"][1]) == 1
    assert _message(ValueError, lambda: reach_log_probs(torch.zeros(14, V), broken)) == (
        f"states['token'] must be token ids in [0, V) = [0, {V})")


def _changed(states, key, index, value):
    tensor = states[key].clone()
    tensor[index] = value
    return dict(states, **{key: tensor})


@pytest.mark.parametrize("change, error, message", [
    (lambda s: list(s.values()), TypeError, "states must be the dict of answer_states, got list"),
    (lambda s: dict(s, token=s["token"].float()), TypeError,
     "states['token'] must be a long tensor, got torch.float32"),
    (lambda s: dict(s, parent=s["parent"].tolist()), TypeError,
     "states['parent'] must be a long tensor, got list"),
    (lambda s: {k: v[:0] for k, v in s.items()}, ValueError,
     "states['prompt'] must have shape (N,) with N >= 1 states, got (0,)"),
    (lambda s: dict(s, prompt=s["prompt"][:, None]), ValueError,
     "states['prompt'] must have shape (N,) with N >= 1 states, got (14, 1)"),
    (lambda s: dict(s, prompt=torch.tensor(0)), ValueError,
     "states['prompt'] must have shape (N,) with N >= 1 states, got ()"),
    (lambda s: dict(s, prefix=s["prefix"][:, 0]), ValueError,
     "states['prefix'] must have shape (14, T) like states['prompt'], got (14,)"),
    (lambda s: dict(s, prefix=torch.tensor(0)), ValueError,
     "states['prefix'] must have shape (14, T) like states['prompt'], got ()"),
    (lambda s: dict(s, prefix=s["prefix"][1:]), ValueError,
     "states['prefix'] must have shape (14, T) like states['prompt'], got (13, 2)"),
    (lambda s: dict(s, token=s["token"][:, None]), ValueError,
     "states['token'] must have shape (14,) like states['prompt'], got (14, 1)"),
    # the root at position -1, a last state at position T = 2
    (lambda s: _changed(s, "position", 0, -1), ValueError,
     "states['position'] must lie in [0, 2)"),
    (lambda s: _changed(s, "position", 13, 2), ValueError,
     "states['position'] must lie in [0, 2)"),
    (lambda s: _changed(s, "parent", 5, -2), ValueError,
     "states['parent'] must index an earlier state (or be -1 at the root)"),
    (lambda s: _changed(s, "parent", 5, 5), ValueError,
     "states['parent'] must index an earlier state (or be -1 at the root)"),
    (lambda s: _changed(s, "parent", 5, -1), ValueError,
     "states['parent'] must be -1 exactly at the states of position 0"),
])
def test_a_broken_states_dict_is_named_whole(small_states, change, error, message):
    _, states = small_states
    assert _message(error, lambda: reach_log_probs(torch.zeros(14, V), change(states))) == message


@pytest.mark.parametrize("prompt, ok", [(-1, False), (0, True), (1, False)])
def test_states_must_index_the_prompts(small_states, prompt, ok):
    prompts, states = small_states
    moved = dict(states, prompt=torch.full_like(states["prompt"], prompt))
    if ok:
        assert state_contexts(TinyLM, prompts, moved).shape == (14, 6 + 2 - 1)
    else:
        assert _message(ValueError, lambda: state_contexts(TinyLM, prompts, moved)) == (
            "states['prompt'] must index the 1 prompts")


FAKE_PREPARED = types.SimpleNamespace(config=None, test_pairs=torch.zeros(3, 2, dtype=torch.long),
                                      teacher=None, student_state=None)


@pytest.mark.parametrize("prepared, kwargs, error, message", [
    (FAKE_PREPARED, dict(ks=4), TypeError, "ks must be a sequence of report sizes, got int 4"),
    (FAKE_PREPARED, dict(ks="12"), TypeError,
     "ks must be a sequence of report sizes, got str '12'"),
    (FAKE_PREPARED, dict(ks=()), ValueError, "ks must not be empty"),
    (FAKE_PREPARED, dict(ks=(1, True)), ValueError,
     "every k must be an integer in [1, V] = [1, 14], got True"),
    (FAKE_PREPARED, dict(ks=(2.0,)), ValueError,
     "every k must be an integer in [1, V] = [1, 14], got 2.0"),
    (FAKE_PREPARED, dict(ks=(0,)), ValueError,
     "every k must be an integer in [1, V] = [1, 14], got 0"),
    # k = 14 = V passes: the next check (prompts) is the one that fires
    (FAKE_PREPARED, dict(ks=(14,), prompts=0), ValueError,
     "prompts must be an integer in [1, 3] (the test prompts), got 0"),
    (FAKE_PREPARED, dict(prompts=True), ValueError,
     "prompts must be an integer in [1, 3] (the test prompts), got True"),
    (FAKE_PREPARED, dict(prompts=2.0), ValueError,
     "prompts must be an integer in [1, 3] (the test prompts), got 2.0"),
    (object(), dict(), TypeError,
     "prepared must be the Prepared of run.prepare (with .config), got object"),
    (types.SimpleNamespace(config=None, test_pairs=None, teacher=None), dict(), TypeError,
     "prepared must be the Prepared of run.prepare (with .student_state), got SimpleNamespace"),
])
def test_clamp_study_on_tinylm_names_bad_arguments_whole(prepared, kwargs, error, message):
    arguments = dict(prompts=3, ks=(1,))
    arguments.update(kwargs)
    assert _message(error, lambda: clamp_study_on_tinylm(prepared, **arguments)) == message


# One-digit operands (answers of 3 tokens, 183 states a prompt), two-layer students: every
# setting that shapes the states and the students differs from its default.
TINY_ONE_DIGIT = dataclasses.replace(TINY, digits=1, held_out=20, val_prompts=4, eval_prompts=2,
                                     student_layers=2)


@pytest.fixture(scope="module")
def tiny_prepared():
    return prepare(TINY_ONE_DIGIT, cache="off")


def _states_by_hand(prepared, prompts):
    """_tinylm_states by a second route: the teacher's and each student's logits from their
    teacher-forced pass over each state's prefix, each student's reach the product of its
    conditionals along the prefix."""
    config = prepared.config
    prompt_ids = make_prompts(prepared.test_pairs[:prompts], config.digits)
    states = answer_states(prompt_ids, max_answer=config.digits + 2)
    rows = torch.arange(len(states["prompt"]))
    position, prefix = states["position"], states["prefix"]
    own = prompt_ids[states["prompt"]]
    teacher = prepared.teacher.logits(own, prefix)[rows, position].double()
    students = EnsembleLM(config.seeds, config.student_hidden, config.student_layers,
                          digits=config.digits)
    students.load_state_dict(prepared.student_state)
    with torch.no_grad():
        forced = students.logits(own.expand(config.seeds, -1, -1),
                                 prefix.expand(config.seeds, -1, -1)).double()  # (M, N, T, V)
    token_logp = torch.log_softmax(forced, -1).gather(
        -1, prefix.expand(config.seeds, -1, -1)[..., None])[..., 0]  # (M, N, T)
    written = torch.arange(prefix.shape[1]) < position[:, None]  # s < t
    reach = torch.where(written, token_logp, 0.0).sum(-1).exp()
    return forced[:, rows, position], teacher, reach


def _study_by_hand(states, ks, **clamps):
    """weighted_clamp_study seed by seed on the states of _states_by_hand."""
    students, teacher, reach = states
    return [{"seed": m, **row} for m in range(len(students))
            for row in weighted_clamp_study(students[m], teacher, reach[m], ks, **clamps)]


def _assert_rows_close(rows, expected):
    assert [list(row) for row in rows] == [list(row) for row in expected]
    for row, want in zip(rows, expected):
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_clamp_study_on_tinylm_is_the_weighted_study_of_every_students_own_states(tiny_prepared):
    """Both test prompts (prompts = len(test_pairs)), k = V = 14, both clamps set (each changes
    the rows: checked on the expected ones)."""
    clamps = dict(log_prob_min_clamp=-3.0, loss_max_clamp=0.05)
    by_hand = _states_by_hand(tiny_prepared, 2)
    expected = _study_by_hand(by_hand, (14,), **clamps)
    assert expected != _study_by_hand(by_hand, (14,), log_prob_min_clamp=-3.0)
    assert expected != _study_by_hand(by_hand, (14,), loss_max_clamp=0.05)
    rows = clamp_study_on_tinylm(tiny_prepared, 2, (14,), **clamps)
    assert [(row["seed"], row["k"]) for row in rows] == [(0, 14), (1, 14)]
    _assert_rows_close(rows, expected)


def test_clamp_study_record_holds_its_settings_and_both_studies(tiny_prepared, tmp_path,
                                                                monkeypatch):
    """One prompt, k = 2, cache "off" (no teacher file written); the rows are
    clamp_study_on_tinylm's, without clamps and with the dataclass's c = -10, M = 10."""
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path))
    record = clamp_study_record(TINY_ONE_DIGIT, 1, (2,), cache="off")
    assert list(tmp_path.iterdir()) == []
    assert list(record) == ["config", "prompts", "ks", "clamps", "rows", "dataclass_clamps",
                            "dataclass_rows"]
    assert record["config"] == {
        "seed": 0, "held_out": 20, "val_prompts": 4, "teacher_hidden": 8, "teacher_layers": 1,
        "teacher_steps": 2, "teacher_batch": 8, "pretrain_lr": 3e-3,
        "teacher_label_smoothing": 0.1, "seeds": 2, "student_hidden": 8, "student_layers": 2,
        "student_pretrain_steps": 1, "student_pretrain_batch": 8, "digits": 1}
    assert record["prompts"] == 1 and record["ks"] == [2]
    assert record["clamps"] == {"log_prob_min_clamp": None, "loss_max_clamp": None}
    assert record["dataclass_clamps"] == {"log_prob_min_clamp": -10.0, "loss_max_clamp": 10.0}
    by_hand = _states_by_hand(tiny_prepared, 1)
    _assert_rows_close(record["rows"], _study_by_hand(by_hand, (2,)))
    _assert_rows_close(record["dataclass_rows"], _study_by_hand(
        by_hand, (2,), log_prob_min_clamp=-10.0, loss_max_clamp=10.0))


def test_the_defaults_are_the_committed_studys(tmp_path, monkeypatch):
    """The CLI (--clamp-study) passes neither prompts nor ks: the committed record's 200 prompts
    and ks are the defaults of both functions. With fewer test prompts, the default of 200 is
    refused by name; the record's default cache ("read") trains a missing teacher and writes it
    first."""
    import inspect

    committed = json.loads(CLAMP_STUDY.read_text())
    for function in (clamp_study_on_tinylm, clamp_study_record):
        parameters = inspect.signature(function).parameters
        assert parameters["prompts"].default == committed["prompts"] == 200
        assert list(parameters["ks"].default) == committed["ks"]
    few = types.SimpleNamespace(config=None, test_pairs=torch.zeros(199, 2, dtype=torch.long),
                                teacher=None, student_state=None)
    assert _message(ValueError, lambda: clamp_study_on_tinylm(few)) == (
        "prompts must be an integer in [1, 199] (the test prompts), got 200")
    monkeypatch.setenv("OPD_LITERATE_CACHE", str(tmp_path))
    assert _message(ValueError, lambda: clamp_study_record(TINY)) == (
        f"prompts must be an integer in [1, {TINY.eval_prompts}] (the test prompts), got 200")
    assert len(list(tmp_path.glob("teacher-*.pt"))) == 1



def test_a_parent_at_the_wrong_position_or_prompt_is_refused():
    """reach_log_probs reads a parent's value before its own: a parent at the same position (or
    of another prompt) would be read unassigned, so the states are refused by name."""
    prompts = make_prompts(torch.tensor([[1, 2], [3, 4]]))
    states = answer_states(prompts, max_answer=3, vocab=3, eos=0)
    message = r"^states\['parent'\] must be a state of the same prompt one position earlier$"
    at_level_1 = torch.nonzero(states["position"] == 1).squeeze(-1)
    same_level = {k: v.clone() for k, v in states.items()}
    same_level["parent"][at_level_1[-1]] = at_level_1[0]
    other_prompt = {k: v.clone() for k, v in states.items()}
    first, second = (torch.nonzero((states["position"] == 0) & (states["prompt"] == b))[0, 0]
                     for b in (0, 1))
    child_of_first = torch.nonzero(states["parent"] == first)[0, 0]
    other_prompt["parent"][child_of_first] = second
    logits = torch.zeros(len(states["prompt"]), 3)
    for broken in (same_level, other_prompt):
        with pytest.raises(ValueError, match=message):
            reach_log_probs(logits, broken)
