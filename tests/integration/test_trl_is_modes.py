"""The other frameworks' switches against the frameworks: TRL's installed code, fetched rules.

**TRL** (the tests marked ``trl``, run in ``.venv-trl`` with TRL 1.16.0; deselected in the dev
environment by pyproject's ``-m 'not trl'``). TRL computes its vLLM importance weights inline in
``GRPOTrainer._generate_and_score_completions``, which needs a model and a vLLM server: the
block that computes them (from ``# Compute the importance sampling ratio when using vLLM`` to
``# Compute the per-token log probabilities for the reference model``) and the block that logs
them are read from the installed method's source and executed as they are, in the module's own
namespace, on the toy's enumerated batch; a test fails if either block is no longer found.
``GRPOTrainer.get_off_policy_mask`` and ``GRPOTrainer._compute_loss`` are called directly, the
latter on a stub holding the attributes it reads, so that the gradient of TRL's own loss gives
the weight of each token.

**OpenRLHF, NeMo-RL, prime-rl, AReaL** (not installable here: their pins conflict with the
environments, or they need GPUs). Their rules are restated from their sources at the commits
cited, each as a short function written for this test, and compared with
``opd_literate.mismatch.correction`` on random batches (these run in the dev environment):

* OpenRLHF ``openrlhf/models/loss.py`` at 3c3be6234e0c (``PolicyLoss.forward``,
  ``vllm_is_correction_type == "seq-mask-tis"``): the mean of the log-ratios over the response
  (``masked_mean``, sum over count), exponentiated, kept if ``low <= . <= high``; the token weight
  is ``exp(log-ratio)``, not clamped (the comment above says it is).
* NeMo-RL ``nemo_rl/algorithms/loss/loss_functions.py`` at 7ea279abfbeb (``ClippedPGLossFn``,
  ``truncated_importance_sampling_type == "seq-mask-tis"``): the same, the mean dividing by
  ``count + 1e-8`` (``nemo_rl/algorithms/utils.py``'s ``masked_mean``).
* prime-rl ``src/prime_rl/trainer/rl/loss.py`` at b9ba0608ddf1 (branch ``feat/algo-ablations``,
  ``kpop_loss_fn``): probabilities clamped to ``[1e-6, 1 - 1e-6]``, a token masked when either
  binary KL is ``> kpop_threshold``; the policy term ``-keep * A * exp(log-ratio)``.
* AReaL ``areal/utils/functional/functional.py`` at cbff54d645d2 (``apply_rejection_sampling``
  with ``metric == "binary_kl"``, ``compute_binary_kl_divergence``): clamped to
  ``[1e-8, 1 - 1e-8]``, kept when the larger of the two KLs is ``<= upper``.
"""

import dataclasses
import inspect
import math
import pathlib
import re
import textwrap
import types
from collections import defaultdict

import numpy as np
import pytest
import torch

from opd_literate.mismatch import correction as C
from opd_literate.mismatch import estimators as E
from opd_literate.mismatch.toy import make_ar_toy, make_toy, response_mask
from tests.helpers.batches import as_batch, random_batch

TRL_VERSION = "1.16.0"
INF = math.inf
ROOT = pathlib.Path(__file__).resolve().parents[2]

TOYS = {
    "toy": make_toy(T=3, V=3, mismatch=0.6, seed=1),
    "ar_toy": make_ar_toy(T=3, V=4, mismatch=0.8, seed=1),  # ragged responses with padding
}
BASELINE = 0.5


# ---------------------------------------------------------------------------------------------
# TRL 1.16.0, installed
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trl_grpo():
    trl = pytest.importorskip("trl", reason="trl is not installed: the TRL integration needs "
                              "the optional extra, pip install -e '.[trl]'")
    assert trl.__version__ == TRL_VERSION
    from trl.trainer import grpo_trainer
    return grpo_trainer


def _block(source, start, end):
    """The lines of ``source`` from the one holding ``start`` to the one before ``end``."""
    lines = source.splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i in range(first + 1, len(lines)) if end in lines[i])
    return textwrap.dedent("\n".join(lines[first:last]))


@pytest.fixture(scope="module")
def trl_blocks(trl_grpo):
    """TRL's importance-weight block and its logging block, compiled from the installed source."""
    source = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions)
    weights = _block(source, "# Compute the importance sampling ratio when using vLLM",
                     "# Compute the per-token log probabilities for the reference model")
    assert "vllm_importance_sampling_ratio = torch.exp(logps_diff)" in weights
    logged = _block(source, "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)",
                    "output = {")
    assert 'sampling/importance_sampling_ratio/min' in logged
    return (compile(weights, "grpo_trainer.py (IS block)", "exec"),
            compile("if True:\n" + textwrap.indent(logged, "    "), "grpo_trainer.py (log)",
                    "exec"))


def _trl_weights(trl_grpo, trl_blocks, trainer, sampler, mask, mode, clip_min, clip_max):
    """TRL's own block on a batch: its ratio (B, T) or (B, 1), and what it logs."""
    metrics = defaultdict(list)
    stub = types.SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max, _metrics={"train": metrics},
        accelerator=types.SimpleNamespace(gather=lambda x: x))
    local = dict(self=stub, old_per_token_logps=trainer, sampling_per_token_logps=sampler,
                 completion_mask=mask, tool_mask=None, mode="train", device=trainer.device)
    namespace = dict(vars(trl_grpo))
    exec(trl_blocks[0], namespace, local)
    exec(trl_blocks[1], namespace, local)
    ratio = local["vllm_importance_sampling_ratio"]
    return ratio, {name: values[0] for name, values in metrics.items()}


def _config_field(trl_grpo, name):
    return {f.name: f for f in dataclasses.fields(trl_grpo.GRPOConfig)}[name]


@pytest.mark.trl
def test_trls_defaults_are_ours_and_its_docstring_disagrees_on_the_mode(trl_grpo):
    for name, default in [("vllm_importance_sampling_correction", True),
                          ("vllm_importance_sampling_mode", "sequence_mask"),
                          ("vllm_importance_sampling_clip_min", None),
                          ("vllm_importance_sampling_clip_max", 3.0),
                          ("vllm_importance_sampling_cap", None),  # deprecated: clip_max
                          ("off_policy_mask_threshold", None),
                          ("use_bias_correction_kl", True)]:
        assert _config_field(trl_grpo, name).default == default, name
    signature = inspect.signature(C.trl_importance_weights)
    for name in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                 "vllm_importance_sampling_clip_max"):
        assert signature.parameters[name].default == _config_field(trl_grpo, name).default
    # GRPOConfig's docstring: "defaults to sequence_mask" (line 327), and in its list of the
    # modes "token_truncate ... (default)" (line 331), which the field's default contradicts
    config_source = inspect.getsource(trl_grpo.GRPOConfig)
    assert 'vllm_importance_sampling_mode (`str`, *optional*, defaults to `"sequence_mask"`)' \
        in config_source
    assert re.search(r'`"token_truncate"`: Token-level truncated IS \(default\)', config_source)
    module_lines = inspect.getsource(inspect.getmodule(trl_grpo.GRPOConfig)).splitlines()
    assert "defaults to `\"sequence_mask\"`" in module_lines[327 - 1]
    assert "(default)" in module_lines[331 - 1] and "token_truncate" in module_lines[331 - 1]
    assert 'default="sequence_mask"' in module_lines[935 - 1]


BOUNDS = [(None, 3.0), (0.5, 1.5), (0.7, None), (None, 1.2)]


@pytest.mark.trl
@pytest.mark.parametrize("clip_min, clip_max", BOUNDS)
@pytest.mark.parametrize("mode", C.TRL_IS_MODES)
@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_trls_importance_weights_are_ours_and_the_catalogues(trl_grpo, trl_blocks, toy_name,
                                                              mode, clip_min, clip_max):
    toy = TOYS[toy_name]
    trainer, sampler, mask = as_batch(toy)
    ratio, logged = _trl_weights(trl_grpo, trl_blocks, trainer, sampler, mask, mode, clip_min,
                                 clip_max)
    theirs = (ratio * mask).numpy()  # TRL multiplies the loss by it, then reduces over mask
    ours, metrics = C.trl_importance_weights(
        trainer, sampler, mask, mode, vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max)
    np.testing.assert_array_equal(ours.numpy() == 0, theirs == 0)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-13, atol=0)
    catalogue = E.estimator_weights(toy, f"trl_{mode}",
                                    clip_min=0.0 if clip_min is None else clip_min,
                                    clip_max=INF if clip_max is None else clip_max)
    np.testing.assert_allclose(catalogue * response_mask(toy), theirs, rtol=1e-13, atol=0)
    # what TRL logs: every response here has a token, so TRL's rows are ours
    assert set(logged) == set(metrics)
    for name, value in logged.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


@pytest.mark.trl
def test_trl_takes_the_exponential_unclamped_and_the_bounds_bite(trl_grpo, trl_blocks):
    """Where the two differ by design: a sequence log-ratio of 30, and which bounds bite."""
    trainer, sampler = torch.zeros(1, 3, dtype=torch.float64), torch.full((1, 3), -10.0,
                                                                            dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    ratio, _ = _trl_weights(trl_grpo, trl_blocks, trainer, sampler, mask, "sequence_mask",
                            None, None)
    ours, _ = C.trl_importance_weights(trainer, sampler, mask,
                                       vllm_importance_sampling_clip_max=None)
    assert float(ratio) == pytest.approx(math.exp(30.0)) and float(ours[0, 0]) == math.exp(20.0)
    for mode in ("sequence_mask", "sequence_truncate"):  # the same once a cap is set
        ratio, _ = _trl_weights(trl_grpo, trl_blocks, trainer, sampler, mask, mode, None, 3.0)
        ours, _ = C.trl_importance_weights(trainer, sampler, mask, mode)
        torch.testing.assert_close(ours, ratio.expand(1, 3), rtol=0, atol=0)


def _opsm_batch(seed):
    trainer, sampler, mask, advantages = random_batch(seed, scale=0.6)
    return trainer, sampler, mask, advantages


@pytest.mark.trl
@pytest.mark.parametrize("threshold", [0.05, 0.2, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_trls_off_policy_mask_is_ours(trl_grpo, seed, threshold):
    trainer, sampler, mask, advantages = _opsm_batch(seed)
    theirs = trl_grpo.GRPOTrainer.get_off_policy_mask(
        advantages=advantages[:, None], per_token_logps=trainer, sampling_per_token_logps=sampler,
        mask=mask, off_policy_threshold=threshold)  # (B, 1)
    ours = C.off_policy_sequence_mask(trainer, sampler, advantages, mask, threshold)
    expected = (theirs.bool() & mask.bool())
    assert 0 < int((~theirs.bool()).sum()) < len(theirs)  # the threshold bites
    assert torch.equal(ours, expected)


@pytest.mark.trl
@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_trls_off_policy_mask_is_the_catalogues(trl_grpo, toy_name):
    toy = TOYS[toy_name]
    trainer, sampler, mask = as_batch(toy)
    A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - BASELINE)
    theirs = trl_grpo.GRPOTrainer.get_off_policy_mask(
        advantages=A[:, None], per_token_logps=trainer, sampling_per_token_logps=sampler,
        mask=mask, off_policy_threshold=0.05)
    ours = E.off_policy_mask(toy, threshold=0.05, baseline=BASELINE, return_weights=True)
    np.testing.assert_array_equal(theirs[:, 0].numpy(), ours)
    assert (ours == 0).any() and (ours == 1).any()


def _compute_loss_stub(trl_grpo, *, beta=0.0, off_policy_mask_threshold=None,
                       use_bias_correction_kl=True):
    """The attributes GRPOTrainer._compute_loss reads, and a model that returns given log-probs."""
    stub = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=off_policy_mask_threshold,
        importance_sampling_level="token", beta=beta, loss_type="dapo",
        epsilon_low=0.2, epsilon_high=0.2, use_vllm=True, vllm_importance_sampling_correction=True,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=use_bias_correction_kl,
                                   steps_per_generation=1),
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x,
                                          reduce=lambda x, reduction: x))
    stub.get_off_policy_mask = trl_grpo.GRPOTrainer.get_off_policy_mask
    return stub


def _trl_loss_gradient(trl_grpo, stub, trainer, sampler, mask, advantages, weights, ref=None):
    """d loss / d log pi(y_t) of TRL's _compute_loss, with pi_old = pi (one update a batch)."""
    leaf = trainer.clone().requires_grad_(True)
    stub._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    B, T = trainer.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long),
              "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": trainer.clone(),
              "sampling_per_token_logps": sampler, "importance_sampling_ratio": weights,
              "num_items_in_batch": mask.sum()}
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return leaf.grad, mask.sum()


@pytest.mark.trl
@pytest.mark.parametrize("toy_name", sorted(TOYS))
def test_trls_loss_weighs_each_token_by_the_is_weight_times_the_off_policy_mask(
        trl_grpo, trl_blocks, toy_name):
    """TRL's default mode (sequence_mask at 3) with off_policy_mask_threshold: the gradient of
    its dapo loss is -w_t A / N on each token, w_t = trl_sequence_mask * off_policy_mask."""
    toy = TOYS[toy_name]
    trainer, sampler, mask = as_batch(toy)
    A = torch.from_numpy(np.asarray(toy["R"], dtype=float) - BASELINE)
    ratio, _ = _trl_weights(trl_grpo, trl_blocks, trainer, sampler, mask, "sequence_mask",
                            None, 3.0)
    stub = _compute_loss_stub(trl_grpo, off_policy_mask_threshold=0.05)
    grad, N = _trl_loss_gradient(trl_grpo, stub, trainer, sampler, mask, A, ratio)
    theirs = (-grad * N / A[:, None]).numpy()
    kept = E.off_policy_mask(toy, threshold=0.05, baseline=BASELINE, return_weights=True)
    ours = E.trl_sequence_mask(toy, return_weights=True)[:, None] * kept[:, None] \
        * response_mask(toy)
    assert (ours > 0).any() and (ours == 0).any()
    np.testing.assert_allclose(theirs, ours, rtol=1e-12, atol=1e-15)


@pytest.mark.trl
@pytest.mark.parametrize("use_bias_correction_kl", [True, False])
def test_trls_kl_term_is_not_weighted_by_the_vllm_ratio(trl_grpo, trl_blocks,
                                                        use_bias_correction_kl):
    r"""With beta > 0, TRL adds beta * k3 after the importance weight has multiplied the policy
    term: d/d log pi of TRL's loss, times N, is -w_t A + beta (k3 c + 1 - e^{ref - log pi}), with
    k3 = e^{ref - log pi} - (ref - log pi) - 1 and c = 1 with use_bias_correction_kl (the
    derivative of the ratio pi / pi_old, whose value is 1 at one update), 0 without: the vLLM
    weight w_t never touches the KL term."""
    trainer, sampler, mask, advantages = random_batch(3, scale=0.5)
    ref = trainer - 0.3 * torch.randn(trainer.shape, generator=torch.Generator().manual_seed(9),
                                      dtype=torch.float64)
    beta = 0.25
    ratio, _ = _trl_weights(trl_grpo, trl_blocks, trainer, sampler, mask, "token_truncate",
                            None, 3.0)
    stub = _compute_loss_stub(trl_grpo, beta=beta, use_bias_correction_kl=use_bias_correction_kl)
    grad, N = _trl_loss_gradient(trl_grpo, stub, trainer, sampler, mask, advantages, ratio, ref)
    w, _ = C.trl_importance_weights(trainer, sampler, mask, "token_truncate")
    k3 = torch.exp(ref - trainer) - (ref - trainer) - 1
    kl_grad = (k3 if use_bias_correction_kl else 0.0) + 1 - torch.exp(ref - trainer)
    expected = (-w * advantages[:, None] + beta * kl_grad) * mask / N
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert float((w - 1).abs().max()) > 0.1  # the weights are not 1, and not on the KL term
    # the page's torch form of the KL term: kl_penalty's k3, times pi / pi_old with the bias
    # correction (1 in value, the score k3 in the gradient)
    leaf = trainer.clone().requires_grad_(True)
    term = C.kl_penalty(leaf, ref, mask, "k3")
    if use_bias_correction_kl:
        term = term * torch.exp(leaf - leaf.detach())
    (ours,) = torch.autograd.grad(term.sum(), leaf)
    torch.testing.assert_close(ours, kl_grad * mask, rtol=1e-12, atol=1e-15)


@pytest.mark.trl
def test_the_integration_pages_lines_of_trl_are_the_installed_ones(trl_grpo):
    """docs/integration.md cites TRL 1.16.0 by file and line for use_bias_correction_kl: the
    help that calls it unbiased, the KL weight, and the vLLM weight on the policy term only."""
    from trl.trainer import grpo_config

    page = " ".join((ROOT / "docs" / "integration.md").read_text().split())
    assert ("(`trl/trainer/grpo_config.py`, lines 351 to 357) says the weighted KL term gives "
            "\"the unbiased reverse-KL gradient\"") in page
    assert ("(`trl/trainer/grpo_trainer.py`, lines 3104 and 3105), while the vLLM importance "
            "weight multiplies only the policy term (line 3147) and the KL term is added after it "
            "(line 3150)") in page
    config = inspect.getsource(grpo_config).split("\n")
    trainer = inspect.getsource(trl_grpo).split("\n")
    help_text = " ".join(line.strip() for line in config[350:357])
    assert help_text.startswith("use_bias_correction_kl (`bool`, *optional*, defaults to `True`):")
    assert "so that the KL gradient becomes the unbiased reverse-KL gradient" in help_text
    assert trainer[3103].strip() == "if self.args.use_bias_correction_kl:"
    assert trainer[3104].strip() == "per_token_kl = per_token_kl * coef_1"
    assert (trainer[3146].strip()
            == 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]')
    assert trainer[3148].strip() == "if self.beta != 0.0:"
    # the server-mode warning: the correction is biased without processed log-probs
    assert "(`grpo_trainer.py`, lines 1141 to 1152)" in page
    warning = " ".join(line.strip() for line in trainer[1140:1152])
    assert warning.startswith("# The importance sampling correction needs logprobs")
    assert 'self.vllm_mode == "server"' in warning and "biases the importance" in warning
    assert "--logprobs-mode processed_logprobs" in warning
    assert trainer[3149].strip() == "per_token_loss = per_token_loss + self.beta * per_token_kl"


# ---------------------------------------------------------------------------------------------
# OpenRLHF, NeMo-RL (seq-mask-tis), prime-rl, AReaL (KPop): their rules at the cited commits
# ---------------------------------------------------------------------------------------------
def _seq_mask_tis_rule(trainer, sampler, mask, low, high, count_eps):
    """The geometric mean of the token ratios over the response (count + count_eps in the
    denominator: 0 in OpenRLHF, 1e-8 in NeMo-RL) kept inside [low, high], raw token ratios."""
    log_ratio = (trainer - sampler) * mask
    seq_mean = log_ratio.sum(-1) / (mask.sum(-1) + count_eps)
    kept = (torch.exp(seq_mean) >= low) & (torch.exp(seq_mean) <= high)
    return kept[:, None] * torch.exp(trainer - sampler) * mask


@pytest.mark.parametrize("framework, count_eps, low, high, scale", [
    ("OpenRLHF 3c3be6234e0c", 0.0, 0.5, 5.0, 1.5),  # --algo.advantage.is_correction_threshold
    ("OpenRLHF 3c3be6234e0c", 0.0, 0.9, 1.1, 0.3),
    ("NeMo-RL 7ea279abfbeb", 1e-8, 0.999, 1.002, 0.05),  # the reference bounds of its comment
    ("NeMo-RL 7ea279abfbeb", 1e-8, 0.9, 1.1, 0.3),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_seq_mask_tis_is_openrlhfs_and_nemo_rls_rule(framework, count_eps, low, high, scale,
                                                     seed):
    trainer, sampler, mask, _ = random_batch(seed, scale=scale)
    theirs = _seq_mask_tis_rule(trainer, sampler, mask, low, high, count_eps)
    ours, metrics = C.seq_mask_tis_weights(trainer, sampler, mask, low=low, high=high)
    kept = theirs.sum(-1) > 0
    assert 0 < int(kept.sum()) < len(kept), framework  # the band bites
    assert (theirs > 1.0001 * high).any() or (theirs < 0.9999 * low).any()  # no token clamp
    np.testing.assert_array_equal(ours.numpy() == 0, theirs.numpy() == 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=0)
    assert metrics["is_oob_ratio"] == pytest.approx(1 - float(kept.double().mean()))


def _binary_kl_rule(trainer, sampler, eps):
    p = torch.exp(trainer).clamp(eps, 1 - eps)
    q = torch.exp(sampler).clamp(eps, 1 - eps)

    def kl(a, b):
        return a * torch.log(a / b) + (1 - a) * torch.log((1 - a) / (1 - b))

    return kl(p, q), kl(q, p)


@pytest.mark.parametrize("threshold", [0.002, 0.01, 0.1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kpop_is_prime_rls_rule(seed, threshold):
    """prime-rl b9ba0608ddf1: masked where kl(p, q) > phi or kl(q, p) > phi (eps 1e-6); the
    policy term -keep A exp(log pi - log mu) has the gradient -keep A rho_t."""
    trainer, sampler, mask, advantages = random_batch(seed, scale=0.4)
    forward, reverse = _binary_kl_rule(trainer, sampler, 1e-6)
    masked = (forward > threshold) | (reverse > threshold)
    keep = mask.bool() & ~masked
    ours, metrics = C.kpop_mask(trainer, sampler, mask, threshold)
    assert torch.equal(ours, keep) and 0 < int(masked[mask.bool()].sum()) < int(mask.sum())
    assert metrics["is_masked"] == pytest.approx(float(masked[mask.bool()].double().mean()))
    leaf = trainer.clone().requires_grad_(True)
    (-(keep * advantages[:, None] * torch.exp(leaf - sampler)).sum()).backward()
    weights, _ = C.importance_weights(trainer, sampler, mask, "token", rollout_is_threshold=INF)
    torch.testing.assert_close(-leaf.grad / advantages[:, None], weights * ours, rtol=1e-13,
                               atol=0)


@pytest.mark.parametrize("upper", [0.01, 0.1, 2.0])
def test_kpop_with_eps_1e_8_is_areals_rule(upper):
    """AReaL cbff54d645d2: kept where max(kl(p, q), kl(q, p)) <= upper, probabilities clamped
    to [1e-8, 1 - 1e-8]; its example config sets upper = 2.0."""
    trainer, sampler, mask, _ = random_batch(5, scale=2.0)
    forward, reverse = _binary_kl_rule(trainer, sampler, 1e-8)
    keep = mask.bool() & (torch.maximum(forward, reverse) <= upper)
    ours, _ = C.kpop_mask(trainer, sampler, mask, upper, eps=1e-8)
    assert torch.equal(ours, keep) and not bool(keep[mask.bool()].all())
