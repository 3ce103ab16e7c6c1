"""verl 0.9.1's distillation defaults as its trainer composes them, against the project's constants.

``python -m verl.trainer.main_ppo`` is a ``hydra.main`` whose ``config_path`` and
``config_name`` (``verl/trainer/main_ppo.py``, line 166: ``"config"``, ``"ppo_trainer"``) are read
here from the installed file; the config is composed with Hydra from that folder, as the
decorator does, with no override, and its ``distillation`` section becomes a
``DistillationConfig`` through ``verl.utils.omega_conf_to_dataclass``, as the trainer does
(``verl/trainer/ppo/v1/trainer_base.py``, line 360). ``ppo_trainer.yaml`` (line 43) takes that
section from ``distillation/distillation.yaml`` (lines 24 to 43: ``loss_mode: k3``, ``topk: 32``,
``use_task_rewards: true``, ``distillation_loss_coef: 1.0``, ``loss_max_clamp: null``,
``log_prob_min_clamp: null``, ``use_policy_gradient: false``), which overrides the defaults of
the ``DistillationLossConfig`` dataclass (``verl/workers/config/distillation.py``, lines 65 to
84: 128, 10.0, -10.0 and ``True``). Both sets are compared with the constants of
``opd_literate.large_vocab.clamps`` and ``opd_literate.mismatch.task_rewards``, the one place
the project states them.

Then the loss itself, at the layer a user touches: verl's logits processor
(``fsdp/losses.py``, ``compute_forward_kl_topk``) and its loss (``losses.py``,
``distillation_loss``, which calls the registered ``compute_forward_kl_topk`` and applies
``loss_max_clamp``) are run with the composed config (``loss_mode=forward_kl_topk`` as a user
sets it on the command line) on reports where every clamp would bind: the value is clamped at 0
(``losses.py`` line 365, whatever the config says) and nowhere else; with the dataclass's
clamps set on the command line, also at $-10$ and 10. Values and gradients agree with
``clamps.verl_forward_kl_topk`` at its defaults and with the dataclass's clamps, to float32
rounding (verl sums in float32; ``TOL`` as in ``test_verl_distillation.py``).

Marker ``verl``, in ``.venv-verl``; skipped where verl or Hydra cannot be imported.
"""

from __future__ import annotations

import pytest
import torch

try:
    import hydra  # noqa: F401 (skip without it: _verl_trainer composes with it)
    import tensordict  # noqa: F401 (the same: the loss's data)
    from omegaconf import OmegaConf
    from verl.trainer.distillation import losses as verl_losses
    from verl.trainer.distillation.fsdp import losses as verl_fsdp
    from verl.utils import omega_conf_to_dataclass
    from verl.workers.config.distillation import DistillationConfig, DistillationLossConfig
except ImportError as error:
    pytest.skip(f"verl is not importable ({error}); build it with tools/env.sh verl .venv-verl",
                allow_module_level=True)

from _verl_trainer import (
    compose_trainer_config,
    one_sequence_data,
    token_sum_actor,
    trainer_entry,
    unpadded,
)

from opd_literate.large_vocab import clamps
from opd_literate.mismatch import task_rewards

pytestmark = pytest.mark.verl
F64 = torch.float64
TOL = 2e-6


@pytest.fixture(scope="module")
def composed():
    return compose_trainer_config()


def test_the_trainer_composes_ppo_trainer_from_its_config_folder(composed):
    folder, name = trainer_entry()
    assert (folder.name, name) == ("config", "ppo_trainer")
    defaults = OmegaConf.load(folder / f"{name}.yaml")["defaults"]
    assert {"distillation@distillation": "distillation"} in list(defaults)
    assert OmegaConf.select(composed, "distillation.distillation_loss._target_") == (
        "verl.workers.config.DistillationLossConfig")


def test_the_composed_distillation_loss_is_what_the_project_calls_verls(composed):
    config = omega_conf_to_dataclass(composed.distillation)
    assert isinstance(config, DistillationConfig)
    loss = config.distillation_loss
    assert isinstance(loss, DistillationLossConfig)
    assert (loss.topk, loss.log_prob_min_clamp, loss.loss_max_clamp) == (
        clamps.VERL_TOPK, clamps.VERL_LOG_PROB_MIN_CLAMP, clamps.VERL_LOSS_MAX_CLAMP)
    stock = {key: getattr(loss, key) for key in task_rewards.VERL_DISTILLATION}
    assert stock == task_rewards.VERL_DISTILLATION
    assert task_rewards.VERL_KINDS[(loss.loss_mode, loss.use_policy_gradient)] == (
        task_rewards.VERL_KIND)


def test_the_dataclass_defaults_are_what_the_project_calls_the_dataclasss():
    loss = DistillationLossConfig()
    assert (loss.topk, loss.log_prob_min_clamp, loss.loss_max_clamp) == (
        clamps.DATACLASS_TOPK, clamps.DATACLASS_LOG_PROB_MIN_CLAMP,
        clamps.DATACLASS_LOSS_MAX_CLAMP)
    defaults = {key: getattr(loss, key) for key in task_rewards.DATACLASS_DISTILLATION}
    assert defaults == task_rewards.DATACLASS_DISTILLATION
    assert task_rewards.VERL_KINDS[(loss.loss_mode, loss.use_policy_gradient)] == (
        task_rewards.DATACLASS_KIND)
    # the two differ: a statement of "verl's default" must say which
    assert (clamps.VERL_TOPK, clamps.VERL_LOG_PROB_MIN_CLAMP) != (
        clamps.DATACLASS_TOPK, clamps.DATACLASS_LOG_PROB_MIN_CLAMP)


def _reports():
    """Three positions of a V = 6 vocabulary, top-3 reports: (c) < 0 (P > Q); a value above 10
    (the student gives the teacher's top token e^-40); a teacher log-probability below -10."""
    log_q = torch.log(torch.tensor([
        [0.40, 0.30, 0.10, 0.10, 0.05, 0.05],
        [0.90, 0.04, 0.03, 0.01, 0.01, 0.01],
        [0.50, 0.30, 1e-6, 0.10, 0.10, 0.10],
    ], dtype=F64))
    log_q = log_q - torch.logsumexp(log_q, -1, keepdim=True)
    student = torch.tensor([
        [3.0, 2.5, 2.0, -1.0, -1.0, -1.0],
        [-40.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, -30.0, 0.0, 0.0, 0.0],
    ], dtype=F64)
    ids = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 2]])
    return student, log_q.gather(-1, ids), ids


def _verl_loss(composed_config, student, report, ids):
    """verl's per-position loss through its logits processor and ``distillation_loss`` (summed:
    ``loss_agg_mode="token-sum"``), and the processor's raw values."""
    config = omega_conf_to_dataclass(composed_config.distillation)
    T = student.shape[0]
    nested = [torch.nested.nested_tensor([x], layout=torch.jagged) for x in (report, ids)]
    out = verl_fsdp.compute_forward_kl_topk(student[None], *nested, config, "thd")
    # the processor's output is (1, T); verl reads a sequence of one prompt token and T response
    # tokens, whose last position predicts nothing: one more entry, never read
    padded = {key: unpadded(value[0]) for key, value in out.items()}
    total, _ = verl_losses.distillation_loss(token_sum_actor(), config, padded,
                                             one_sequence_data(T))
    return total, out["distillation_losses"][0]


SETTINGS = {
    "composed": (clamps.VERL_LOG_PROB_MIN_CLAMP, clamps.VERL_LOSS_MAX_CLAMP),
    "cap_only": (clamps.VERL_LOG_PROB_MIN_CLAMP, clamps.DATACLASS_LOSS_MAX_CLAMP),
    "dataclass_clamps": (clamps.DATACLASS_LOG_PROB_MIN_CLAMP, clamps.DATACLASS_LOSS_MAX_CLAMP),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_verls_loss_with_the_composed_config_is_verl_forward_kl_topk(setting):
    """``composed``: the trainer's config with ``loss_mode=forward_kl_topk`` and nothing else;
    the others set the dataclass's clamps on the command line (``null`` stays ``null``)."""
    low, high = SETTINGS[setting]
    overrides = ["distillation.distillation_loss.loss_mode=forward_kl_topk"] + [
        f"distillation.distillation_loss.{name}={value}"
        for name, value in (("log_prob_min_clamp", low), ("loss_max_clamp", high))
        if value is not None]
    composed_config = compose_trainer_config(overrides)
    loss = omega_conf_to_dataclass(composed_config.distillation).distillation_loss
    assert (loss.log_prob_min_clamp, loss.loss_max_clamp) == (low, high)
    student, report, ids = _reports()
    z_verl = student.clone().requires_grad_(True)
    total, raw = _verl_loss(composed_config, z_verl, report, ids)
    z_ours = student.clone().requires_grad_(True)
    if setting == "composed":  # the defaults of verl_forward_kl_topk are the composed config's
        ours = clamps.verl_forward_kl_topk(z_ours, report, ids)
    else:
        ours = clamps.verl_forward_kl_topk(z_ours, report, ids, log_prob_min_clamp=low,
                                           loss_max_clamp=high)
    torch.testing.assert_close(total.to(F64), ours.sum(), rtol=TOL, atol=TOL)
    total.backward()
    ours.sum().backward()
    torch.testing.assert_close(z_ours.grad, z_verl.grad, rtol=TOL, atol=TOL)
    raw, ours = raw.detach(), ours.detach()
    # position 0: (c) < 0 (P > Q), clamped at 0 whatever the config says
    assert raw[0] < 0 and float(ours[0]) == 0.0
    assert torch.equal(z_verl.grad[0], torch.zeros(6, dtype=F64))
    # position 2 reports a teacher log-probability below -10
    assert float(report[2].min()) < -10
    if low is None:
        # position 1's value is above 10: kept without a cap, capped at 10 with one
        assert raw[1] > 10
        assert (float(ours[1]) > 10) if high is None else (float(ours[1]) == high)
    else:
        # beside the clamp at c = -10 the value is at most -c Q <= 10: the cap never binds
        Q = float(report[1].exp().sum())
        assert float(ours[1]) <= -low * Q < high
