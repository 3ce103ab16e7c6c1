"""The mismatch chapter's "OPD with task rewards" claims about verl 0.9.1, against the installed
release (marker ``verl``, in ``.venv-verl``): the defaults of its distillation loss, how its
trainer adds the distillation term to the task's policy loss, and that each
``(loss_mode, use_policy_gradient)`` of ``task_rewards.VERL_KINDS`` is the estimate it names:
verl's per-token cost as a reward (``k3_reward`` for ``k3``, the dataclass's default) or its
gradient backpropagated (``k3_loss``, what the trainer's composed config runs: the config itself
in ``test_verl_config.py``), exactly where verl's clamp of $k_3$ at 10 is idle, and at every gap
with ``verl_clamps=True``. Float64 on both sides: equal to ``1e-12``.
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
from opd_literate.mismatch.toy import make_ar_toy, toy_from_logits

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


def _verl_estimate(toy, mode, policy_gradient):
    """verl's ``kl_penalty`` on the toy's log-probabilities: as a reward, its value times the
    score; as a loss, its autograd gradient with respect to the student's log-probability times
    the score (the chain rule through log pi(y_t))."""
    mask = toy["mask"] > 0
    logp = torch.as_tensor(toy["logp_train"]).requires_grad_(True)
    cost = kl_penalty(logprob=logp, ref_logprob=torch.as_tensor(toy["logp_teacher"]),
                      kl_penalty=mode)
    if policy_gradient:
        factor = cost.detach().numpy()
    else:
        (factor,) = torch.autograd.grad(cost[torch.as_tensor(mask)].sum(), logp)
        factor = factor.numpy()
    extra = (1,) * (np.ndim(toy["score"]) - 2)
    selected = np.where(mask, factor, 0.0)
    return selected.reshape(selected.shape + extra) * toy["score"], cost.detach().numpy()[mask]


@pytest.mark.parametrize("verl_clamps", [False, True])
@pytest.mark.parametrize("mode, policy_gradient", sorted(VERL_KINDS))
def test_each_verl_setting_is_the_estimate_it_names(mode, policy_gradient, verl_clamps):
    """On the chapter's toy verl's clamp is idle: with or without ``verl_clamps``."""
    toy = add_teacher(make_ar_toy(mismatch=0.0))
    expected, _ = _verl_estimate(toy, mode, policy_gradient)
    np.testing.assert_allclose(
        teacher_estimate(toy, VERL_KINDS[mode, policy_gradient], verl_clamps=verl_clamps),
        expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode, policy_gradient", sorted(VERL_KINDS))
def test_where_verls_clamp_binds_verl_clamps_is_verl(mode, policy_gradient):
    """A teacher of scale 4 on the chapter's toy: 14 of its 289 tokens have k3 > 10, where verl
    returns 10 with gradient 0 (``core_algos.py`` lines 2242 and 2245 of verl 0.9.1).
    ``verl_clamps=True`` is verl's there; without it the k3 kinds are not (the condition of the
    docstring is needed), and verl's k1 and k2, never clamped, are the other kinds either way."""
    toy = add_teacher(make_ar_toy(mismatch=0.0), scale=4.0)
    expected, cost = _verl_estimate(toy, mode, policy_gradient)
    kind = VERL_KINDS[mode, policy_gradient]
    np.testing.assert_allclose(teacher_estimate(toy, kind, verl_clamps=True), expected,
                               rtol=0, atol=1e-12)
    unclamped = np.abs(teacher_estimate(toy, kind) - expected).max()
    if mode == "k3":
        assert int((cost == 10.0).sum()) == 14 and cost.size == 289  # the clamp binds
        assert unclamped > 0.5
    else:
        assert unclamped < 1e-12


@pytest.mark.parametrize("d", [-800.0, -20.5, -4.0, -2.61088, -2.61086, -1e-9, 0.0, 0.3,
                               10.99997, 10.99999, 20.5, 700.0])
def test_verls_k3_on_one_token_is_the_clamped_model(d):
    """verl's k3 value and gradient at one token of gap d (float64), against the hand toy's
    estimates divided by its score: both sides of both roots of k3 = 10, and beyond the clamp of
    -d at +-20, where the model's e^{-d} would overflow (d = -800)."""
    logits = np.log([[0.7, 0.3]])
    toy = add_teacher(toy_from_logits(logits, logits), phi=np.log([[0.4, 0.6]]))
    student = min(d, 0.0) - 1.0
    toy = dict(toy, logp_train=np.full((2, 1), student), logp_teacher=np.full((2, 1), student - d),
               mask=np.ones((2, 1)))
    for policy_gradient in (True, False):
        expected, _ = _verl_estimate(toy, "k3", policy_gradient)
        ours = teacher_estimate(toy, VERL_KINDS["k3", policy_gradient], verl_clamps=True)
        # atol: verl's e^x - x - 1 cancels near d = 0 (about 1e-16 lost; the model uses expm1)
        np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-15)
