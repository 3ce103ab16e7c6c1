"""TRL 1.16.0's loss types against the torch module and the catalogue: sapo, luspo, vespo,
cispo, and the PPO clip of dapo, bnpo, grpo and dr_grpo.

``GRPOTrainer._compute_loss`` is called on a stub holding the attributes it reads (as
``test_trl_is_modes.py`` does), with the sampler's log-probabilities as
``old_per_token_logps`` and vLLM off, so that TRL's own loss has the sampler as its anchor (a
check of the losses' arithmetic: no TRL configuration passes the sampler there; with vLLM the
anchor is TRL's recomputation, ``test_under_vllm_each_loss_type_weighs_by_the_vllm_mode_at_one_
update``); its value and gradient equal those of ``sapo_loss``, ``luspo_loss`` and ``vespo_loss`` of
``opd_literate.mismatch.correction`` on random batches and on the toys' enumerated batches,
where the gradient gives the catalogue's weights. ``GRPOConfig``'s defaults are the
catalogue's. ``GRPOTrainer.get_gamma_weights`` with TRL's own pipeline (the anchor its
recomputation, the vLLM ratio folded in) gives ``vespo``'s weight where no ratio is truncated.

Marker ``trl``, in ``.venv-trl``.
"""

import dataclasses
import types
from collections import defaultdict

import numpy as np
import pytest
import torch

from opd_literate.mismatch import correction as C
from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.toy import make_ar_toy, make_toy, response_mask
from tests.helpers.batches import random_batch

TRL_VERSION = "1.16.0"
TOYS = {
    "toy": make_toy(T=3, V=3, mismatch=0.6, seed=1),
    "ar_toy": make_ar_toy(T=3, V=4, mismatch=0.8, seed=1),
}
BASELINE = 0.5
# TRL builds the temperatures with torch.where on two Python floats, a float32 tensor whatever
# the log-probabilities' dtype: its 1.05 is 1.0499999523... (test_trls_temperature_is_float32)
TAU_NEG_FLOAT32 = float(np.float32(1.05))
pytestmark = pytest.mark.trl


@pytest.fixture(scope="module")
def trl_grpo():
    trl = pytest.importorskip("trl", reason="trl is not installed: the TRL integration needs "
                              "the optional extra, pip install -e '.[trl]'")
    assert trl.__version__ == TRL_VERSION
    from trl.trainer import grpo_trainer
    return grpo_trainer


def _field(trl_grpo, name):
    return {f.name: f for f in dataclasses.fields(trl_grpo.GRPOConfig)}[name].default


def test_grpo_configs_defaults_are_the_catalogues(trl_grpo):
    assert {"tau_pos": _field(trl_grpo, "sapo_temperature_pos"),
            "tau_neg": _field(trl_grpo, "sapo_temperature_neg")} == E.REGISTRY["sapo"].defaults
    assert {"k_pos": _field(trl_grpo, "vespo_k_pos"),
            "lambda_pos": _field(trl_grpo, "vespo_lambda_pos"),
            "k_neg": _field(trl_grpo, "vespo_k_neg"),
            "lambda_neg": _field(trl_grpo, "vespo_lambda_neg")} == E.REGISTRY["vespo"].defaults
    assert (_field(trl_grpo, "epsilon"), _field(trl_grpo, "epsilon_high")) == (0.2, None)
    assert E.REGISTRY["luspo"].defaults == {"eps_low": 0.2, "eps_high": 0.2}
    assert _field(trl_grpo, "importance_sampling_level") == "token"
    for loss_type in ("sapo", "luspo", "vespo", "cispo", "dapo", "bnpo", "grpo", "dr_grpo"):
        assert f"'{loss_type}'" in str(
            {f.name: f for f in dataclasses.fields(trl_grpo.GRPOConfig)}["loss_type"].metadata)


def _stub(trl_grpo, loss_type, level, **args):
    stub = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
        beta=0.0, loss_type=loss_type, epsilon_low=args.pop("epsilon", 0.2),
        epsilon_high=args.pop("epsilon_high", 0.2), use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(delta=None, steps_per_generation=1, **args),
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x,
                                          reduce=lambda x, reduction: x))
    stub.get_gamma_weights = trl_grpo.GRPOTrainer.get_gamma_weights
    return stub


def _trl(trl_grpo, stub, trainer, sampler, mask, advantages, importance_sampling_ratio=None):
    """TRL's loss and its gradient in log pi(y_t), ``sampler`` as old_per_token_logps (and the
    vLLM weight, where given, as the trainer's generation step passes it)."""
    leaf = trainer.clone().requires_grad_(True)
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    B, T = trainer.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long),
              "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": sampler,
              "num_items_in_batch": mask.sum()}
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    loss = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return loss.item(), leaf.grad


def _ours(loss_fn, trainer, sampler, mask, advantages, **options):
    leaf = trainer.clone().requires_grad_(True)
    loss, _ = loss_fn(leaf, sampler, advantages, mask, **options)
    loss.backward()
    return loss.item(), leaf.grad


CASES = {
    "sapo": ("token", dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
             C.sapo_loss, dict(tau_pos=1.0, tau_neg=TAU_NEG_FLOAT32)),
    "sapo_other": ("token", dict(sapo_temperature_pos=3.0, sapo_temperature_neg=0.5),
                   C.sapo_loss, dict(tau_pos=3.0, tau_neg=0.5)),
    "luspo": ("sequence", dict(epsilon=0.2, epsilon_high=0.2), C.luspo_loss,
              dict(epsilon=0.2)),
    "luspo_other": ("sequence", dict(epsilon=0.05, epsilon_high=0.1), C.luspo_loss,
                    dict(epsilon=0.05, epsilon_high=0.1)),
    "vespo": ("token", dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                            vespo_lambda_neg=2.0), C.vespo_loss, {}),
    # TRL's PPO clip (no dual clip: delta None) in its token-mean and sequence-mean reductions
    "dapo": ("token", dict(epsilon=0.2, epsilon_high=0.28), C.ppo_clip_loss,
             dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=float("inf"))),
    "bnpo": ("token", dict(epsilon=0.2, epsilon_high=0.2), C.ppo_clip_loss,
             dict(clip_ratio_c=float("inf"))),
    "grpo": ("token", dict(epsilon=0.1, epsilon_high=0.3), C.ppo_clip_loss,
             dict(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=float("inf"),
                  reduction="seq-mean-token-mean")),
    # dr_grpo divides the sum by B * max_completion_length (the padded T here)
    "dr_grpo": ("token", dict(epsilon=0.2, epsilon_high=0.2), C.ppo_clip_loss,
                dict(clip_ratio_c=float("inf"), reduction="seq-mean-token-sum-norm")),
    # TRL's cispo caps the ratio at epsilon_high itself (not 1 + epsilon_high) and has no floor:
    # cispo_loss with clip_ratio_low = 1 and clip_ratio_high = epsilon_high - 1
    "cispo": ("token", dict(epsilon_high=5.0), C.cispo_loss,
              dict(clip_ratio_low=1.0, clip_ratio_high=4.0)),
    "cispo_other": ("token", dict(epsilon_high=1.5), C.cispo_loss,
                    dict(clip_ratio_low=1.0, clip_ratio_high=0.5)),
    "vespo_other": ("token", dict(vespo_k_pos=1.0, vespo_lambda_pos=2.0, vespo_k_neg=0.5,
                                  vespo_lambda_neg=1.0), C.vespo_loss,
                    dict(k_pos=1.0, lambda_pos=2.0, k_neg=0.5, lambda_neg=1.0)),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_trls_loss_is_ours(trl_grpo, case, seed):
    level, args, loss_fn, options = CASES[case]
    loss_type = "dr_grpo" if case == "dr_grpo" else case.split("_")[0]
    trainer, sampler, mask, A = random_batch(seed, B=16, scale=0.3)
    stub = _stub(trl_grpo, loss_type, level, **args)
    stub.max_completion_length = trainer.shape[1]
    theirs = _trl(trl_grpo, stub, trainer, sampler, mask, A)
    ours = _ours(loss_fn, trainer, sampler, mask, A, **options)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-12, abs=1e-14)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("processes, accumulation, steps_per_generation",
                         [(1, 1, 1), (2, 1, 1), (1, 4, 4), (2, 4, 4), (2, 2, 4), (1, 1, 3)])
def test_trls_dapo_is_the_token_mean_of_the_optimizer_steps_batch(trl_grpo, processes,
                                                                  accumulation,
                                                                  steps_per_generation):
    """The integration page's dapo row: a micro-batch's token sum over num_items_in_batch (the
    generation's tokens over every process) / num_processes * accumulation /
    steps_per_generation. Summed over the accumulation steps and averaged over the processes
    (DDP), that is the token mean of the optimizer step's batch when a generation is one step
    (steps_per_generation = gradient_accumulation_steps, TRL's default), and otherwise the
    step's token sum over the generation's mean tokens a step."""
    micro = processes * steps_per_generation  # the generation's micro-batches
    batches = [random_batch(seed, B=4, scale=0.3) for seed in range(micro)]
    generation_tokens = sum(float(mask.sum()) for _, _, mask, _ in batches)
    losses = []
    for trainer, sampler, mask, A in batches:
        stub = _stub(trl_grpo, "dapo", "token", epsilon=0.2, epsilon_high=0.28)
        stub.accelerator.num_processes = processes
        stub.current_gradient_accumulation_steps = accumulation
        stub.args.steps_per_generation = steps_per_generation
        leaf = trainer.clone().requires_grad_(True)
        stub._get_per_token_logps_and_entropies = lambda *a, leaf=leaf, **k: (
            leaf, torch.zeros_like(leaf), None)
        B, T = trainer.shape
        inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long),
                  "prompt_mask": torch.ones(B, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
                  "advantages": A, "old_per_token_logps": sampler,
                  "num_items_in_batch": torch.tensor(generation_tokens, dtype=torch.float64)}
        theirs = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs).item()
        token_sum = float(C.ppo_clip_loss(trainer, sampler, A, mask, clip_ratio_low=0.2,
                                          clip_ratio_high=0.28, clip_ratio_c=float("inf"),
                                          reduction="token-mean")[0]) * float(mask.sum())
        losses.append((theirs, token_sum, float(mask.sum())))
    steps = steps_per_generation // accumulation  # optimizer steps a generation
    per_step = processes * accumulation  # micro-batches an optimizer step, over the processes
    for step in range(steps):
        window = losses[step * per_step:(step + 1) * per_step]
        # DDP averages the processes' gradients; accumulation sums the micro-batches
        trained = sum(theirs for theirs, _, _ in window) / processes
        expected = sum(t for _, t, _ in window) / (generation_tokens / steps)
        assert trained == pytest.approx(expected, rel=1e-12, abs=1e-14)
        if steps == 1:  # one generation a step: the exact token mean of its batch
            token_mean = sum(t for _, t, _ in window) / sum(n for _, _, n in window)
            assert trained == pytest.approx(token_mean, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("processes, accumulation", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_trls_bnpo_is_the_mean_of_the_micro_batches_token_means(trl_grpo, processes,
                                                                 accumulation):
    """The integration page's bnpo row: each micro-batch's token mean over
    current_gradient_accumulation_steps, so that the accumulated, DDP-averaged loss is the mean
    of the micro-batches' token means (not the token mean of their union: they hold different
    numbers of tokens here)."""
    batches = [random_batch(seed, B=3 + seed, scale=0.3)
               for seed in range(processes * accumulation)]
    trained, means = 0.0, []
    for trainer, sampler, mask, A in batches:
        stub = _stub(trl_grpo, "bnpo", "token")
        stub.accelerator.num_processes = processes
        stub.current_gradient_accumulation_steps = accumulation
        theirs, _ = _trl(trl_grpo, stub, trainer, sampler, mask, A)
        trained += theirs / processes
        means.append(float(C.ppo_clip_loss(trainer, sampler, A, mask,
                                           clip_ratio_c=float("inf"))[0]))
    assert trained == pytest.approx(sum(means) / len(means), rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("seed", [0, 1])
def test_trls_cispo_at_its_default_caps_every_ratio_at_epsilon(trl_grpo, seed):
    """epsilon_high None means epsilon (0.2, GRPOTrainer.__init__): the weight is
    min(rho_t, 0.2), below 1 for every ratio near 1, a cap the integration page warns of."""
    trainer, sampler, mask, A = random_batch(seed, B=16, scale=0.3)
    assert (_field(trl_grpo, "epsilon"), _field(trl_grpo, "epsilon_high")) == (0.2, None)
    _, grad = _trl(trl_grpo, _stub(trl_grpo, "cispo", "token", epsilon_high=0.2), trainer,
                   sampler, mask, A)
    rho = torch.exp(trainer - sampler)
    expected = -torch.clamp(rho, max=0.2) * A[:, None] * mask / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert float(rho[mask.bool()].min()) > 0.2  # every weight is the cap


@pytest.mark.parametrize("toy_name", sorted(TOYS))
@pytest.mark.parametrize("case", ["sapo", "luspo", "vespo"])
def test_trls_gradient_on_the_toy_is_the_catalogues_weight(trl_grpo, case, toy_name):
    """-grad / A of TRL's loss, rescaled by its reduction, is the estimator's weight."""
    toy = TOYS[toy_name]
    level, args, _, _ = CASES[case]
    trainer = torch.from_numpy(np.array(toy["logp_train"]))
    sampler = torch.from_numpy(np.array(toy["logp_sampler"]))
    mask = torch.from_numpy(response_mask(toy))
    A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - BASELINE)
    _, grad = _trl(trl_grpo, _stub(trl_grpo, case, level, **args), trainer, sampler, mask, A)
    B, n = mask.shape[0], mask.sum(dim=1, keepdim=True)
    scale = {"sapo": B * n, "luspo": B * torch.ones_like(n), "vespo": mask.sum()}[case]
    theirs = (-grad * scale / A[:, None]).numpy()
    params = {"tau_neg": TAU_NEG_FLOAT32} if case == "sapo" else {}
    ours = getattr(E, case)(toy, **params, baseline=BASELINE, return_weights=True)
    ours = np.broadcast_to(ours if ours.ndim == 2 else ours[:, None], theirs.shape)
    keep = response_mask(toy) > 0
    np.testing.assert_allclose(np.where(keep, theirs, 0), np.where(keep, ours, 0),
                               rtol=1e-10, atol=1e-12)


# The loss types as TRL runs them under vLLM: (loss_type, importance_sampling_level, GRPOConfig
# arguments, the factor the loss puts on a ratio of 1, the reduction's divisor per token).
UNDER_VLLM = {
    "sapo": ("sapo", "token", dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05), 1.0,
             "B n"),
    "luspo": ("luspo", "sequence", dict(epsilon=0.2, epsilon_high=0.2), 1.0, "B"),
    "cispo": ("cispo", "token", dict(epsilon_high=5.0), 1.0, "N"),
    "cispo_default": ("cispo", "token", dict(epsilon_high=0.2), 0.2, "N"),  # min(1, 0.2)
    "dapo": ("dapo", "token", dict(epsilon=0.2, epsilon_high=0.28), 1.0, "N"),
    "gspo": ("dapo", "sequence", dict(epsilon=3e-4, epsilon_high=4e-4), 1.0, "N"),
}


@pytest.mark.parametrize("toy_name", sorted(TOYS))
@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
@pytest.mark.parametrize("case", sorted(UNDER_VLLM))
def test_under_vllm_each_loss_type_weighs_by_the_vllm_mode_at_one_update(trl_grpo, case, mode,
                                                                         toy_name):
    """The integration page's TRL rows: with vLLM, TRL's anchor (``old_per_token_logps``) is
    its own recomputation of the sampled tokens, and the sampler enters only through
    ``importance_sampling_ratio``. At the first update after a generation the ratio inside each
    loss is 1, so the gradient's weight is the vLLM mode's estimator, times the loss's factor at
    a ratio of 1 (CISPO's cap min(1, epsilon_high)), whatever the loss type; at the sequence
    level (GSPO, LUSPO) each token gets the mean of its response's weights."""
    toy = TOYS[toy_name]
    loss_type, level, args, factor, divisor = UNDER_VLLM[case]
    trainer = torch.from_numpy(np.array(toy["logp_train"]))
    sampler = torch.from_numpy(np.array(toy["logp_sampler"]))
    mask = torch.from_numpy(response_mask(toy))
    A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - BASELINE)
    weights, _ = C.trl_importance_weights(trainer, sampler, mask, mode)
    stub = _stub(trl_grpo, loss_type, level, **args)
    stub.use_vllm = stub.vllm_importance_sampling_correction = True
    # the anchor is TRL's recomputation: the trainer's own log-probabilities
    _, grad = _trl(trl_grpo, stub, trainer, trainer.clone(), mask, A,
                   importance_sampling_ratio=weights)
    B, n = mask.shape[0], mask.sum(dim=1, keepdim=True)
    scale = {"B n": B * n, "B": B * torch.ones_like(n), "N": mask.sum()}[divisor]
    theirs = (-grad * scale / A[:, None]).numpy()
    estimator = {"sequence_mask": E.trl_sequence_mask,
                 "token_truncate": E.trl_token_truncate}[mode]
    ours = estimator(toy, baseline=BASELINE, return_weights=True)
    ours = factor * np.broadcast_to(ours if ours.ndim == 2 else ours[:, None], theirs.shape)
    keep = response_mask(toy) > 0
    if level == "sequence":
        # the sequence ratio's derivative is shared by the response's tokens: each gets the
        # mean of the response's vLLM weights (the same where the mode is a sequence one)
        mean = np.where(keep, ours, 0).sum(axis=1, keepdims=True) / keep.sum(axis=1,
                                                                             keepdims=True)
        ours = np.broadcast_to(mean, theirs.shape)
    np.testing.assert_allclose(np.where(keep, theirs, 0), np.where(keep, ours, 0),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_trls_pipeline_folds_the_vllm_ratio_into_vespos_weight(trl_grpo, toy_name):
    """With TRL's anchor (its recomputation: log-ratio 0) and the token vLLM ratio rho_t
    (untruncated), get_gamma_weights gives phi(rho): the catalogue's vespo weight."""
    toy = TOYS[toy_name]
    mask = torch.from_numpy(response_mask(toy))
    rho_t = torch.from_numpy(np.exp(np.array(toy["logp_train"]) - np.array(toy["logp_sampler"])))
    rho_t = torch.where(mask > 0, rho_t, torch.ones_like(rho_t))
    A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - BASELINE)[:, None]
    phi = trl_grpo.GRPOTrainer.get_gamma_weights(
        advantages=A, log_ratio_per_token=torch.zeros_like(rho_t), mask=mask,
        importance_sampling_ratio=rho_t)
    np.testing.assert_allclose(phi[:, 0].numpy(),
                               E.vespo(toy, baseline=BASELINE, return_weights=True),
                               rtol=1e-12, atol=1e-300)
    # the page's row: token_mask without a cap is that untruncated ratio, and VESPO refuses
    # the sequence modes
    trainer = torch.from_numpy(np.array(toy["logp_train"]))
    sampler = torch.from_numpy(np.array(toy["logp_sampler"]))
    uncapped, _ = C.trl_importance_weights(trainer, sampler, mask, "token_mask",
                                           vllm_importance_sampling_clip_max=None)
    torch.testing.assert_close(uncapped * mask, rho_t * mask, rtol=1e-12, atol=0)
    import inspect
    init = " ".join(inspect.getsource(trl_grpo.GRPOTrainer.__init__).split())
    assert ('if self.loss_type == "vespo" and self.use_vllm and '
            'self.vllm_importance_sampling_correction: if self.vllm_importance_sampling_mode not '
            'in ["token_truncate", "token_mask"]: raise ValueError(') in init


def test_trls_temperature_is_float32(trl_grpo):
    """With float64 inputs TRL's SAPO gate uses tau_neg = float32(1.05): its loss differs from
    the float64 gate at 1.05 by about 1e-8 relative, and equals the gate at float32(1.05)."""
    trainer, sampler, mask, A = random_batch(0, B=16, scale=0.3)
    level, args, _, _ = CASES["sapo"]
    theirs = _trl(trl_grpo, _stub(trl_grpo, "sapo", level, **args), trainer, sampler, mask, A)
    exact = _ours(C.sapo_loss, trainer, sampler, mask, A, tau_neg=1.05)
    rounded = _ours(C.sapo_loss, trainer, sampler, mask, A, tau_neg=TAU_NEG_FLOAT32)
    assert TAU_NEG_FLOAT32 != 1.05 and abs(TAU_NEG_FLOAT32 - 1.05) < 1e-7
    assert theirs[0] == pytest.approx(rounded[0], rel=1e-12)
    assert theirs[0] != pytest.approx(exact[0], rel=1e-12)
    assert theirs[0] == pytest.approx(exact[0], rel=1e-6)


def test_every_loss_type_trl_lists_is_on_the_integration_page(trl_grpo):
    """The values GRPOConfig's help lists for loss_type, read from the installed release, each
    on the integration page's TRL table: a new loss type fails here until it has its row."""
    import pathlib
    import re

    help_text = {f.name: f for f in dataclasses.fields(trl_grpo.GRPOConfig)}[
        "loss_type"].metadata["help"]
    listed = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    values = re.findall(r"'(\w+)'", listed)
    assert len(values) >= 8, values
    page = (pathlib.Path(__file__).parents[2] / "docs" / "integration.md").read_text()
    table = page.split("**TRL 1.16.0**", 1)[1].split("\n\n**", 1)[0]
    missing = [v for v in values if f'"{v}"' not in table]
    assert missing == [], missing
