"""The training study's loss is verl's decoupled PPO loss at one update a batch.

``opd_literate.experiment.mismatch_training`` trains with REINFORCE weighted by verl's rollout
correction over the tokens it keeps, and its chapter says that with one update a batch verl's
decoupled loss has the same gradient: ``compute_policy_loss_vanilla`` with ``old_log_prob``
the trainer's own (detached) log-probs, so its ratio is 1 and its clip inactive, the
``rollout_is_weights`` and ``response_mask`` of verl's helper at the preset's options. Checked
here against the installed release (``VERL_VERSION``), preset by preset.
"""

import pytest
import torch

try:
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo import rollout_corr_helper as helper
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig
except ImportError as error:  # the fast tier, or a machine without the verl environment
    pytest.skip(f"verl is not importable ({error}); build it with tools/env.sh verl .venv-verl",
                allow_module_level=True)

from opd_literate.experiment.mismatch_training import (
    CORRECTIONS,
    PEER_CORRECTIONS,
    PRESETS,
    corrected_loss,
)

pytestmark = pytest.mark.verl
# verl's presets (the study's other corrections are TRL's and KPop's, checked against TRL's
# weights in test_trl_is_modes.py and against kpop_mask in tests/experiment)
VERL_CORRECTIONS = tuple(c for c in CORRECTIONS if c not in PEER_CORRECTIONS)


def _batch(seed, B=16, T=5):
    g = torch.Generator().manual_seed(seed)
    trainer = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    sampler = trainer - 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64)
    return trainer, sampler, mask, advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("correction", VERL_CORRECTIONS)
def test_one_update_of_verls_decoupled_loss_has_the_studys_gradient(correction, seed):
    trainer, sampler, mask, advantages = _batch(seed)
    B = trainer.shape[0]
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                         clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2,
                         clip_ratio_c=3.0, global_batch_info={"global_batch_size": B},
                         policy_loss=PolicyLossConfig(
                             loss_mode="vanilla", rollout_correction=RolloutCorrectionConfig()))
    weights, keep, _ = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=trainer, rollout_log_prob=sampler, response_mask=mask,
        **PRESETS[correction])
    weights = None if weights is None else weights.batch["rollout_is_weights"]
    theirs = trainer.clone().requires_grad_(True)
    loss, *_ = core_algos.compute_policy_loss_vanilla(
        theirs.detach(), theirs, advantages, keep, loss_agg_mode="token-mean", config=config,
        rollout_is_weights=weights)
    loss.backward()
    ours = trainer.clone().requires_grad_(True)
    our_loss, _ = corrected_loss(ours[None], sampler[None], advantages[None], mask[None],
                                 correction)
    our_loss.backward()
    # the values differ by design (PPO's is -A w at ratio 1, REINFORCE's -A w log pi); the
    # gradients are the same
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-9, atol=1e-12)
    assert (keep.sum() < mask.sum()) == ("rs" in correction)
