"""The training step (``opd_literate.experiment.train``): each method's budget of student samples.
"""

import dataclasses

import torch

from opd_literate.experiment import tinylm as lm
from opd_literate.experiment import train
from opd_literate.experiment.config import METHODS
from tests.experiment._tiny import TINY


def test_every_method_uses_batch_size_samples_and_rl_the_first_prompts_group_times(
        monkeypatch):
    """docs/experiment.md: "RL answers the first 16 of them, 4 times each, so that it too uses
    64 samples a step"; the OPD methods answer every prompt once. Checked at 8 prompts, group
    4: RL must see prompts 0, 0, 0, 0, 1, 1, 1, 1."""
    config = dataclasses.replace(TINY, batch_size=8, group=4)
    pairs = torch.tensor([[10 * i + 1, 2 * i] for i in range(8)])
    seen = []
    real_rollout = lm.rollout

    def rollout(model, prompts, generator=None, greedy=False):
        seen.append(prompts.clone())
        return real_rollout(model, prompts, generator, greedy)

    monkeypatch.setattr(lm, "rollout", rollout)
    torch.manual_seed(0)
    student, teacher = lm.TinyLM(8, 1), lm.TinyLM(8, 1)
    generator = torch.Generator().manual_seed(0)
    for method in METHODS:
        seen.clear()
        _, used = train._method_loss(method, student, teacher, pairs, config, generator)
        assert used == 8, method
        if method == "rl":
            expected = [pairs[0]] * 4 + [pairs[1]] * 4
            assert seen[0].tolist() == lm.make_prompts(torch.stack(expected)).tolist()
        elif method != "sft":
            assert seen[0].tolist() == lm.make_prompts(pairs).tolist()
    # The batched form: each model of an ensemble gets its own batch, treated the same way.
    ensemble = lm.EnsembleLM.from_models([student, lm.TinyLM(8, 1)])
    batched = torch.stack([pairs, pairs.flip(0)])  # (M, B, 2)
    seen.clear()
    _, used = train._method_loss("rl", ensemble, teacher, batched, config, generator)
    firsts = [[pairs[0]] * 4 + [pairs[1]] * 4, [pairs[7]] * 4 + [pairs[6]] * 4]
    assert used == 8 and seen[0].tolist() == lm.make_prompts(
        torch.stack([torch.stack(f) for f in firsts])).tolist()
