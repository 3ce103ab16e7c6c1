"""verl's group advantages with a rejected answer: which choice of opd_literate.mismatch.groups
they are.

A batch of groups (one ``uid`` a prompt) goes through verl's own rejection,
``rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` with ``rollout_rs:
seq_sum_k1`` and the band ``"0.5_2.0"``, which zeroes the ``response_mask`` of the answers it
rejects, then through verl's ``compute_grpo_outcome_advantage`` and
``compute_rloo_outcome_advantage`` (and their vectorized forms) with that mask, as its trainers
call them (``verl/trainer/ppo/ray_trainer.py`` lines 1658 and 1667). Their advantages are the
``_all`` choices of ``groups.group_advantages`` (``groups.VERL_CHOICES``), not the ``_kept``
ones; the ``_kept`` choices are verl's functions run on the kept rows alone.

Tolerance: float64 on both sides; ``1e-12`` for the loop forms. The vectorized forms compute in
float32 (``verl.utils.groupwise.group_mean_std`` casts), so ``1e-6`` there.

Marker ``verl``: run in the environment that ``bash tools/env.sh verl .venv-verl`` builds;
skipped where verl cannot be imported.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

try:
    import verl
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo import rollout_corr_helper as helper
except ImportError as error:  # the fast tier, or a machine without the verl environment
    pytest.skip(f"verl is not importable ({error}); build it with tools/env.sh verl .venv-verl",
                allow_module_level=True)

from opd_literate._numerics import VERL_VERSION
from opd_literate.mismatch import correction as C
from opd_literate.mismatch.groups import VERL_CHOICES, VERL_EPSILON, group_advantages

pytestmark = pytest.mark.verl

F64 = torch.float64
PACKAGE = pathlib.Path(verl.__file__).parent


def _batch(seed, groups=3, G=4, T=5):
    """(B, T) log-probs of trainer and sampler, ragged masks, one reward at each response's last
    token; each group has its answers in consecutive rows. About one answer in four has a
    sequence log-ratio outside [log 0.5, log 2]: verl's seq_sum_k1 band rejects it."""
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    old = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    shift = torch.where(torch.rand(B, generator=g) < 0.25, 2.0, 0.0).to(F64)  # per row
    rollout = old - shift[:, None] / lengths[:, None]  # sum over the response: log rho = shift
    scores = torch.randint(0, 3, (B,), generator=g).to(F64) / 2  # 0, 0.5 or 1
    rewards = torch.zeros(B, T, dtype=F64)
    rewards[torch.arange(B), lengths - 1] = scores
    uid = np.array([f"prompt{i // G}" for i in range(B)], dtype=object)
    return old, rollout, mask, rewards, uid, scores


def _verl_mask(old, rollout, mask):
    _, keep, _ = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask,
        rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    return keep


def _verl(estimator, rewards, mask, uid):
    if estimator == "grpo":
        advantages, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, uid)
    elif estimator == "grpo_no_std":
        advantages, _ = core_algos.compute_grpo_outcome_advantage(
            rewards, mask, uid, norm_adv_by_std_in_grpo=False)
    else:  # the registry, as compute_advantage calls every estimator but GAE and GRPO
        advantages, _ = core_algos.get_adv_estimator_fn(estimator)(
            token_level_rewards=rewards, response_mask=mask, index=uid, config=None)
    return advantages


def _ours(choice, scores, kept, G):
    """group_advantages per group of G consecutive rows, (B,)."""
    return torch.from_numpy(group_advantages(scores.numpy().reshape(-1, G),
                                             kept.numpy().reshape(-1, G), choice,
                                             eps=VERL_EPSILON).reshape(-1))


def test_the_installed_verl_is_the_pinned_release():
    assert verl.__version__ == VERL_VERSION


@pytest.mark.parametrize("line,text", [
    (304, "scores = token_level_rewards.sum(dim=-1)"),
    (313, "id2score[index[i]].append(scores[i])"),
    (329, "scores = scores.unsqueeze(-1) * response_mask"),
    (612, "scores = token_level_rewards.sum(dim=-1)"),
    (620, "id2score[index[i]].append(scores[i])"),
    (634, "scores = scores.unsqueeze(-1) * response_mask"),
    (2514, "effective_mask = modified_response_mask"),
])
def test_the_cited_lines_of_core_algos(line, text):
    lines = (PACKAGE / "trainer" / "ppo" / "core_algos.py").read_text().splitlines()
    assert lines[line - 1].strip() == text


def test_the_trainers_reject_before_they_compute_the_advantages():
    ppo = PACKAGE / "trainer" / "ppo"
    helper_lines = (ppo / "rollout_corr_helper.py").read_text().splitlines()
    assert helper_lines[1060].strip() == 'batch.batch["response_mask"] = modified_response_mask'
    ray = (ppo / "ray_trainer.py").read_text().splitlines()
    assert "compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config)" in ray[1657]
    assert ray[1666].strip() == "batch = compute_advantage("
    v1 = (ppo / "v1" / "trainer_base.py").read_text().splitlines()
    assert "compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)" in v1[1770]
    assert v1[1774].strip() == "data = compute_advantage_for_multi_trajectories("


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo"])
def test_verls_advantages_are_the_all_choice_not_the_kept_one(estimator, seed):
    old, rollout, mask, rewards, uid, scores = _batch(seed)
    keep = _verl_mask(old, rollout, mask)
    kept = keep.sum(dim=-1) > 0
    assert 0 < int((~kept).sum()) < len(kept)  # verl rejected some answers, not all
    torch.testing.assert_close(keep, mask * kept[:, None].to(F64))  # whole answers
    theirs = _verl(estimator, rewards, keep, uid)
    choice = VERL_CHOICES[estimator]
    ours = _ours(choice, scores, kept, 4)[:, None] * keep
    torch.testing.assert_close(theirs, ours, rtol=1e-12, atol=1e-12)
    # the torch form on verl's own (B,) scores, grouped as (B / 4, 4)
    torch_form = C.group_advantages(scores.reshape(-1, 4), kept.reshape(-1, 4), choice,
                                    eps=VERL_EPSILON).reshape(-1)
    torch.testing.assert_close(theirs, torch_form[:, None] * keep, rtol=1e-12, atol=1e-12)
    other = _ours(choice.replace("_all", "_kept"), scores, kept, 4)[:, None] * keep
    assert (theirs - other).abs().max() > 1e-3


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo"])
def test_verl_on_the_kept_rows_alone_is_the_kept_choice(estimator, seed):
    """What dropping the rejected rows before the advantage gives: one-answer groups included
    (verl's mean 0 and std 1)."""
    old, rollout, mask, rewards, uid, scores = _batch(seed)
    keep = _verl_mask(old, rollout, mask)
    kept = keep.sum(dim=-1) > 0
    rows = torch.nonzero(kept).squeeze(-1)
    theirs = _verl(estimator, rewards[rows], keep[rows], uid[rows.numpy()])
    choice = VERL_CHOICES[estimator].replace("_all", "_kept")
    ours = (_ours(choice, scores, kept, 4)[:, None] * keep)[rows]
    torch.testing.assert_close(theirs, ours, rtol=1e-12, atol=1e-12)


def test_a_group_where_one_kept_answer_remains():
    """verl gives a prompt with one answer the mean 0 and the std 1: so does the _kept choice.
    verl's 1 is a float32 tensor, so its 1 + eps is rounded to float32, 1 + 2^-20: a relative
    difference of 4.6e-8 from 1 + 1e-6, inside assert_close's float64 rtol of 1e-7."""
    old = torch.zeros(2, 3, dtype=F64)
    rollout = torch.tensor([[0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]], dtype=F64)  # row 1: log rho 3
    mask = torch.ones(2, 3, dtype=F64)
    rewards = torch.tensor([[0.0, 0.0, 0.25], [0.0, 0.0, 1.0]], dtype=F64)
    uid = np.array(["p", "p"], dtype=object)
    keep = _verl_mask(old, rollout, mask)
    assert keep.sum(dim=-1).tolist() == [3.0, 0.0]
    kept = torch.tensor([True, False])
    scores = torch.tensor([0.25, 1.0], dtype=F64)
    # verl, both rows in the group: (0.25 - 0.625) / (std + eps) for the kept one
    theirs = _verl("grpo", rewards, keep, uid)
    torch.testing.assert_close(theirs[0], _ours("grpo_std_all", scores, kept, 2)[0].expand(3))
    # the kept row alone: 0.25 / (1 + eps)
    alone = _verl("grpo", rewards[:1], keep[:1], uid[:1])
    torch.testing.assert_close(alone[0], _ours("grpo_std_kept", scores, kept, 2)[0].expand(3))
    one_plus_eps = float(torch.tensor(1.0) + VERL_EPSILON)  # float32
    assert one_plus_eps == 1 + 2.0**-20
    assert alone[0, 0].item() == pytest.approx(0.25 / one_plus_eps, rel=1e-15)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("estimator,choice", [("grpo_vectorized", "grpo_std_all"),
                                              ("rloo_vectorized", "rloo_all")])
def test_the_vectorized_forms_are_the_all_choice_too(estimator, choice, seed):
    old, rollout, mask, rewards, uid, scores = _batch(seed)
    keep = _verl_mask(old, rollout, mask)
    kept = keep.sum(dim=-1) > 0
    theirs = core_algos.get_adv_estimator_fn(estimator)(
        token_level_rewards=rewards, response_mask=keep, index=uid, config=None)[0]
    ours = _ours(choice, scores, kept, 4)[:, None] * keep
    torch.testing.assert_close(theirs.to(F64), ours, rtol=1e-6, atol=1e-6)
