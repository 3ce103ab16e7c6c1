"""The mismatch chapter's "OPD with task rewards" claims about verl 0.9.1, against the installed
release (marker ``verl``, in ``.venv-verl``): the defaults of its distillation loss, how its
trainer adds the distillation term to the task's policy loss, and that the per-token cost of its
default (``loss_mode="k3"`` as a reward) is the ``k3_reward`` of
``opd_literate.mismatch.task_rewards``. Float64 on both sides: equal to ``1e-12``.
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
from opd_literate.mismatch.task_rewards import teacher_estimate
from opd_literate.mismatch.toy import make_ar_toy

pytestmark = pytest.mark.verl


def test_the_default_distillation_is_k3_as_a_reward_added_to_the_task_loss():
    config = DistillationLossConfig()
    assert (config.loss_mode, config.use_policy_gradient, config.use_task_rewards,
            config.distillation_loss_coef, config.policy_loss_mode) == (
        "k3", True, True, 1.0, "vanilla")


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
