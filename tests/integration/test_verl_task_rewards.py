"""The mismatch chapter's "OPD with task rewards" claims about verl 0.9.1, against the installed
release (marker ``verl``, in ``.venv-verl``): the defaults of its distillation loss, how its
trainer adds the distillation term to the task's policy loss, and that each
``(loss_mode, use_policy_gradient)`` of ``task_rewards.VERL_KINDS`` is the estimate it names:
verl's per-token cost as a reward (``k3_reward`` for ``k3``, the dataclass's default) or its
gradient backpropagated (``k3_loss``, what the trainer's composed config runs: the config itself
in ``test_verl_config.py``). Float64 on both sides: equal to ``1e-12``.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

try:
    from verl.trainer.distillation import losses as verl_losses
    from verl.trainer.ppo.core_algos import kl_penalty
    from verl.workers.config.distillation import DistillationLossConfig
except ImportError as error:
    pytest.skip(f"verl is not importable ({error}); build it with tools/env.sh verl .venv-verl",
                allow_module_level=True)

from opd_literate.mismatch.opd_mismatch import add_teacher
from opd_literate.mismatch.task_rewards import (
    DATACLASS_DISTILLATION,
    DATACLASS_KIND,
    VERL_KINDS,
    teacher_estimate,
)
from opd_literate.mismatch.toy import make_ar_toy

pytestmark = pytest.mark.verl


def test_the_dataclass_default_is_k3_as_a_reward_added_to_the_task_loss():
    """The dataclass's defaults; a trainer run composes ``use_policy_gradient: false`` instead
    (``k3_loss``: ``test_verl_config.py``)."""
    config = DistillationLossConfig()
    assert {key: getattr(config, key) for key in DATACLASS_DISTILLATION} == (
        DATACLASS_DISTILLATION)
    assert config.policy_loss_mode == "vanilla"
    assert VERL_KINDS[config.loss_mode, config.use_policy_gradient] == DATACLASS_KIND


def test_with_use_policy_gradient_false_the_trainer_backpropagates_the_loss():
    as_loss = inspect.getsource(verl_losses.distillation_loss)
    assert "distillation_loss = agg_loss(\n            loss_mat=distillation_losses," in as_loss
    combined = inspect.getsource(verl_losses.distillation_ppo_loss)
    assert "if not distillation_loss_config.use_task_rewards:" in combined


def test_the_trainer_adds_lambda_times_the_distillation_policy_loss():
    combined = inspect.getsource(verl_losses.distillation_ppo_loss)
    assert "policy_loss += distill_loss * distillation_loss_coef" in combined
    as_reward = inspect.getsource(verl_losses.distillation_loss)
    assert "advantages=-distillation_losses.detach()" in as_reward


def test_verls_k3_per_token_cost_is_k3_reward():
    toy = add_teacher(make_ar_toy(mismatch=0.0))
    mask = toy["mask"] > 0
    cost = kl_penalty(logprob=torch.as_tensor(toy["logp_train"]),
                      ref_logprob=torch.as_tensor(toy["logp_teacher"]), kl_penalty="k3").numpy()
    assert np.abs(cost[mask]).max() < 10  # verl's clamp of the value at +-10 is not reached
    expected = np.where(mask, cost, 0.0)[..., None, None] * toy["score"]
    np.testing.assert_allclose(teacher_estimate(toy, "k3_reward"), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode, policy_gradient", sorted(VERL_KINDS))
def test_each_verl_setting_is_the_estimate_it_names(mode, policy_gradient):
    """verl's ``kl_penalty`` on the toy's log-probabilities: as a reward, its value times the
    score; as a loss, its autograd gradient with respect to the student's log-probability times
    the score (the chain rule through log pi(y_t))."""
    toy = add_teacher(make_ar_toy(mismatch=0.0))
    mask = toy["mask"] > 0
    logp = torch.as_tensor(toy["logp_train"]).requires_grad_(True)
    cost = kl_penalty(logprob=logp, ref_logprob=torch.as_tensor(toy["logp_teacher"]),
                      kl_penalty=mode)
    if policy_gradient:
        factor = cost.detach().numpy()
    else:
        (factor,) = torch.autograd.grad(cost[torch.as_tensor(mask)].sum(), logp)
        factor = factor.numpy()
    expected = np.where(mask, factor, 0.0)[..., None, None] * toy["score"]
    np.testing.assert_allclose(teacher_estimate(toy, VERL_KINDS[mode, policy_gradient]),
                               expected, rtol=0, atol=1e-12)
