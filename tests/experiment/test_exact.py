"""opd_literate.experiment.exact: the states of tinylm's answers and their probabilities, against
a brute-force list of every complete answer scored by the model's own teacher-forced pass."""

import itertools

import numpy as np
import pytest
import torch

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
