"""opd_literate.mismatch.correction against verl itself: verl's own functions on the same batches.

Every option and preset that ``correction.py`` attributes to verl is run twice on the same
random float64 ``(B, T)`` batches with ragged masks: once through this package, once through
verl's ``verl.trainer.ppo.rollout_corr_helper`` and ``verl.trainer.ppo.core_algos``. Weights,
masks, losses, gradients and metrics must agree.

Tolerance: ``rel=1e-6, abs=1e-8``. Both sides compute in float64 from the same inputs; the only
systematic difference is verl's ``masked_mean``, which divides by ``count + 1e-8`` (a relative
error below ``1e-8`` for a count of 1 or more, so an absolute one of that size on a metric that
is a difference of values near 1, such as ``rollout_is_seq_max_deviation``), and its ESS, which
divides by ``mean + 1e-8``.
Masks are compared exactly: a threshold would have to fall within ``1e-8`` of a statistic drawn
from a continuous distribution for the two to disagree.

Marker ``verl``: deselected by the README's command, run by ``.ci/run`` in the environment that
``bash tools/env.sh verl .venv-verl`` builds (verl's pins conflict with the ``trl`` extra's
transformers). The module is skipped when verl cannot be imported.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import math
import pathlib
import re
import sys

import pytest
import torch

try:
    import verl
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo import rollout_corr_helper as helper
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig
except ImportError as error:  # the fast tier, or a machine without the verl environment
    pytest.skip(f"verl is not importable ({error}); build it with tools/env.sh verl .venv-verl",
                allow_module_level=True)

from opd_literate.mismatch import correction as C
from opd_literate.opd import aggregate_loss

pytestmark = pytest.mark.verl

ROOT = pathlib.Path(__file__).resolve().parents[2]
F64 = torch.float64
REL, ABS = 1e-6, 1e-8
VERL_REDUCTIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                   "seq-mean-token-sum-norm")


# ---------------------------------------------------------------------------------------------
# Batches and the two sides
# ---------------------------------------------------------------------------------------------
def _batch(seed, scale=0.4, B=6, T=9, empty_row=False):
    """Random (B, T) log-probabilities, a ragged mask (every row has a token unless empty_row),
    per-token advantages of both signs. The padding holds finite values, as verl requires."""
    g = torch.Generator().manual_seed(seed)
    trainer = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.98 + 0.01)
    sampler = trainer - scale * torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    if empty_row:
        mask[1] = 0.0
    advantages = torch.randn(B, T, generator=g, dtype=F64)
    return trainer, sampler, mask, advantages


BATCHES = [(seed, scale) for seed in (0, 1) for scale in (0.05, 0.4, 1.2)]
# 0.002: mean log-ratios inside and outside the geometric presets' band (0.999, 1.001)
GEO_BATCHES = BATCHES + [(2, 0.002)]


def _ours(c):
    return {k.removeprefix("rollout_corr/"): v for k, v in c.metrics.items()}


def _verl(trainer, sampler, mask, **options):
    weights, keep, metrics = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=trainer, rollout_log_prob=sampler, response_mask=mask, **options)
    weights = None if weights is None else weights.batch["rollout_is_weights"]
    return weights, keep, {k.removeprefix("rollout_corr/"): v for k, v in metrics.items()}


def _assert_metrics_equal(ours, theirs):
    assert set(ours) == set(theirs), (set(ours) ^ set(theirs))
    for name, value in theirs.items():
        if name.endswith("_std") and not name.endswith("_seq_std"):
            # both sides compute sqrt(E[s^2] - E[s]^2), whose variance carries verl's
            # 1e-8 / count in each mean as an absolute error of about 1e-8 E[s^2]: compare the
            # variances (statistics here are below 10, so 1e-6 bounds it)
            assert ours[name] ** 2 == pytest.approx(value ** 2, rel=REL, abs=1e-6), name
        else:
            assert ours[name] == pytest.approx(value, rel=REL, abs=ABS), name


def _actor(B, clip_low=0.2, clip_high=0.2, clip_c=3.0, rollout_correction=None,
           loss_mode="vanilla", dro_beta=None):
    """verl's ActorConfig with the trainer's global batch size (every row counts in 1/B)."""
    policy_loss = PolicyLossConfig(loss_mode=loss_mode,
                                   rollout_correction=rollout_correction
                                   or RolloutCorrectionConfig(), dro_beta=dro_beta)
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                       clip_ratio_c=clip_c, global_batch_info={"global_batch_size": B},
                       policy_loss=policy_loss)


def _grad(loss_fn, trainer):
    """The loss and its gradient with respect to a fresh leaf copy of trainer."""
    leaf = trainer.clone().requires_grad_(True)
    loss, *rest = loss_fn(leaf)
    loss.backward()
    return loss.item(), leaf.grad, (rest[0] if rest else None)


# ---------------------------------------------------------------------------------------------
# The release and the citations
# ---------------------------------------------------------------------------------------------
def test_the_installed_verl_is_the_pinned_release():
    assert verl.__version__ == C.VERL_VERSION
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"verl=={C.VERL_VERSION}"' in pyproject


def test_the_cited_files_are_the_installed_ones():
    """docs/provenance.md gives the sha256 of each verl file it cites; the installed release
    must hold exactly those files (a newer verl fails here until the page is read again)."""
    page = (ROOT / "docs" / "provenance.md").read_text()
    rows = re.findall(r"\| `(verl/[\w/]+\.(?:py|yaml))` \| `([0-9a-f]{64})` \|", page)
    assert len(rows) >= 5
    package = pathlib.Path(verl.__file__).parent
    for path, digest in rows:
        installed = package / pathlib.Path(path).relative_to("verl")
        assert hashlib.sha256(installed.read_bytes()).hexdigest() == digest, path


def test_the_fixture_is_read_from_the_installed_verl():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import verl_fixture
    finally:
        sys.path.pop(0)
    committed = json.loads((ROOT / "tests" / "fixtures" / "verl_rollout_correction.json")
                           .read_text())
    # committed-exact: verl's names and its defaults, literals of its source (2.0, 0.2, 0.01)
    assert json.loads(json.dumps(verl_fixture.build())) == committed


def test_presets_are_verls():
    fields = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
              "rollout_rs_threshold", "bypass_mode", "loss_type")
    base = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                rollout_rs=None, rollout_rs_threshold=None, bypass_mode=False,
                loss_type="ppo_clip")
    verl_presets = {name for name, value in vars(RolloutCorrectionConfig).items()
                    if isinstance(value, classmethod) and name != "from_dict"}
    assert set(C.PRESETS) == verl_presets
    for name, ours in C.PRESETS.items():
        theirs = getattr(RolloutCorrectionConfig, name)()
        assert {**base, **ours} == {f: getattr(theirs, f) for f in fields}, name


# ---------------------------------------------------------------------------------------------
# Importance weights, rejection, diagnostics
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.5, "1.5", "0.5_5.0", "0.8_1.25"])
@pytest.mark.parametrize("normalize", [False, True])
def test_importance_weights_and_metrics_are_verls(seed, scale, rollout_is, threshold,
                                                  normalize):
    trainer, sampler, mask, _ = _batch(seed, scale)
    c = C.rollout_correction(trainer, sampler, mask, rollout_is=rollout_is,
                             rollout_is_threshold=threshold,
                             rollout_is_batch_normalize=normalize)
    weights, keep, metrics = _verl(trainer, sampler, mask, rollout_is=rollout_is,
                                   rollout_is_threshold=threshold,
                                   rollout_is_batch_normalize=normalize)
    torch.testing.assert_close(c.weights, weights, rtol=REL, atol=ABS)
    assert torch.equal(c.keep, keep > 0)
    _assert_metrics_equal(_ours(c), metrics)


RS_CASES = [(option, threshold) for option in C.RS_OPTIONS
            for threshold in (("0.5_2.0", 1.5, "0.9_1.3") if option.endswith("k1")
                              else (0.02, 0.3))]
# A repeated criterion ("token_k2,token_k2,...") verl accepts and this module refuses (a
# ValueError naming it: tests/mismatch/test_correction_properties.py), so it is not compared.
RS_CASES += [("token_k1,seq_mean_k3", "0.5_2.0,0.1"), ("seq_max_k2,seq_sum_k1", "0.4,0.2_5"),
             ("token_k2,seq_mean_k1", 0.5 * 4.0),
             # an infinite bound is no bound: "0.5_inf" keeps rho <= 2 (token_mis' and
             # seq_mis' default band [0, 2]), a k2 or k3 cap of inf rejects nothing
             ("token_k1", "0.5_inf"), ("seq_sum_k1", "0.5_inf"), ("token_k2", math.inf),
             ("seq_mean_k3", "inf")]


@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("option, threshold", RS_CASES)
def test_rejection_masks_and_metrics_are_verls(seed, scale, option, threshold):
    trainer, sampler, mask, _ = _batch(seed, scale)
    c = C.rollout_correction(trainer, sampler, mask, rollout_rs=option,
                             rollout_rs_threshold=threshold)
    _, keep, metrics = _verl(trainer, sampler, mask, rollout_rs=option,
                             rollout_rs_threshold=threshold)
    assert torch.equal(c.keep, keep > 0)
    _assert_metrics_equal(_ours(c), metrics)


@pytest.mark.parametrize("seed, scale", GEO_BATCHES)
@pytest.mark.parametrize("preset", sorted(C.PRESETS))
def test_every_preset_is_verls(seed, scale, preset):
    """The weights, the mask and every metric of each preset; for the bypass presets also
    verl's bypass-mode loss (PPO's clip or REINFORCE over the kept tokens), its gradient and
    its actor metrics."""
    trainer, sampler, mask, advantages = _batch(seed, scale)
    fields = dict(C.PRESETS[preset])
    bypass, loss_type = fields.pop("bypass_mode", False), fields.pop("loss_type", "ppo_clip")
    c = C.rollout_correction(trainer, sampler, mask, **fields)
    weights, keep, metrics = _verl(trainer, sampler, mask, **fields)
    if weights is not None:
        torch.testing.assert_close(c.weights, weights, rtol=REL, atol=ABS)
    assert torch.equal(c.keep, keep > 0)
    _assert_metrics_equal(_ours(c), metrics)
    if not bypass:
        return
    B = trainer.shape[0]
    config = _actor(B, rollout_correction=getattr(RolloutCorrectionConfig, preset)(),
                    loss_mode="bypass_mode")

    def theirs(leaf):
        return core_algos.compute_policy_loss_bypass_mode(
            sampler, leaf, advantages, mask, loss_agg_mode="token-mean", config=config)

    def ours(leaf):
        kept = C.rollout_correction(leaf.detach(), sampler, mask, **fields)
        if loss_type == "ppo_clip":
            return C.ppo_clip_loss(leaf, sampler, advantages, kept.keep)
        w = kept.weights if fields.get("rollout_is") else None
        return (C.reinforce_loss(leaf, advantages, kept.keep, weights=w),)

    loss, grad, their_metrics = _grad(theirs, trainer)
    our_loss, our_grad, our_metrics = _grad(ours, trainer)
    if not bool(c.keep.any()):
        # every token rejected: verl's token-mean divides 0 by 0 tokens, a NaN loss (and NaN
        # gradients); here an empty mean is 0 with a zero gradient
        assert math.isnan(loss) and our_loss == 0.0 and not bool(our_grad.any())
        return
    assert our_loss == pytest.approx(loss, rel=REL, abs=ABS)
    torch.testing.assert_close(our_grad, grad, rtol=REL, atol=ABS)
    for name, value in (our_metrics or {}).items():
        assert their_metrics[name] == pytest.approx(value, rel=REL, abs=ABS), name


@pytest.mark.parametrize("seed, scale", BATCHES)
def test_offpolicy_metrics_are_verls(seed, scale):
    trainer, sampler, mask, _ = _batch(seed, scale)
    theirs = helper.compute_offpolicy_metrics(trainer, sampler, mask)
    _assert_metrics_equal(C.offpolicy_metrics(trainer, sampler, mask), theirs)


def test_a_row_with_no_token_changes_only_the_documented_metrics():
    """With a fully masked row, weights, masks and token metrics still agree; the metrics that
    verl averages over all B rows (documented in correction's docstrings) do not."""
    trainer, sampler, mask, _ = _batch(3, 0.4, empty_row=True)
    options = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="token_k1",
                   rollout_rs_threshold=2.0)
    c = C.rollout_correction(trainer, sampler, mask, **options)
    weights, keep, metrics = _verl(trainer, sampler, mask, **options)
    torch.testing.assert_close(c.weights, weights, rtol=REL, atol=ABS)
    assert torch.equal(c.keep, keep > 0)
    ours = _ours(c)
    per_row = {"rollout_is_max", "rollout_is_min", "rollout_is_ratio_fraction_high",
               "rollout_is_ratio_fraction_low", "rollout_rs_seq_masked_fraction", "chi2_seq",
               "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl",
               "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min",
               "ppl_ratio"}
    differ = {n for n in metrics if ours[n] != pytest.approx(metrics[n], rel=REL, abs=ABS)}
    assert differ <= per_row | {n for n in metrics if n.startswith("rollout_is_seq_")}
    assert "rollout_rs_masked_fraction" not in differ and "rollout_is_mean" not in differ


# ---------------------------------------------------------------------------------------------
# Bad thresholds: refused on both sides
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option, threshold", [("token_k1", "2.0_0.5"), ("seq_mean_k1", 0.5),
                                               ("seq_sum_k1", "0_2"), ("token_k3", "0.1_0.2"),
                                               ("token_k2", -1.0)])
def test_a_band_verl_refuses_is_refused(option, threshold):
    trainer, sampler, mask, _ = _batch(0)
    with pytest.raises(ValueError):
        _verl(trainer, sampler, mask, rollout_rs=option, rollout_rs_threshold=threshold)
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        C.rollout_correction(trainer, sampler, mask, rollout_rs=option,
                             rollout_rs_threshold=threshold)


@pytest.mark.parametrize("threshold", ["5.0_0.5", "0_2", "-1_2", "a_b", 0.0])
def test_an_is_threshold_verl_refuses_is_refused(threshold):
    trainer, sampler, mask, _ = _batch(0)
    with pytest.raises(ValueError):
        _verl(trainer, sampler, mask, rollout_is="token", rollout_is_threshold=threshold)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        C.rollout_correction(trainer, sampler, mask, rollout_is="token",
                             rollout_is_threshold=threshold)


# ---------------------------------------------------------------------------------------------
# Losses, reductions, KL penalties
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("reduction", VERL_REDUCTIONS)
def test_aggregate_loss_is_verls_agg_loss(seed, scale, reduction):
    _, _, mask, loss = _batch(seed, scale, empty_row=True)
    B = mask.shape[0]
    theirs = core_algos.agg_loss(loss, mask, reduction, global_batch_size=B)
    assert aggregate_loss(loss, mask, reduction).item() == pytest.approx(theirs.item(),
                                                                         rel=REL, abs=ABS)
    if reduction in ("token-mean", "token-sum"):  # the normaliser does not count rows
        assert core_algos.agg_loss(loss, mask, reduction).item() == pytest.approx(
            theirs.item(), rel=REL, abs=ABS)


LOSS_CASES = [
    ("ppo_clip", dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)),
    ("ppo_clip", dict(clip_ratio_low=0.1, clip_ratio_high=0.1, clip_ratio_c=1.5)),
    ("cispo", dict(clip_ratio_low=0.2, clip_ratio_high=0.2)),
    ("cispo", dict(clip_ratio_low=1.0, clip_ratio_high=4.0)),
    ("gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4)),
    ("gspo", dict(clip_ratio_low=0.2, clip_ratio_high=0.2)),
    ("reinforce", dict()),
]


@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("reduction", VERL_REDUCTIONS)
@pytest.mark.parametrize("loss_name, clip", LOSS_CASES)
def test_losses_gradients_and_metrics_are_verls(seed, scale, reduction, loss_name, clip):
    """Each loss with the sampler as the anchor (verl's old_log_prob = rollout_log_prob)."""
    trainer, sampler, mask, advantages = _batch(seed, scale, empty_row=(seed == 1))
    B = trainer.shape[0]
    config = _actor(B, clip.get("clip_ratio_low", 0.2), clip.get("clip_ratio_high", 0.2),
                    clip.get("clip_ratio_c", 3.0))
    verl_fn = {"ppo_clip": core_algos.compute_policy_loss_vanilla,
               "cispo": core_algos.compute_policy_loss_cispo,
               "gspo": core_algos.compute_policy_loss_gspo}.get(loss_name)
    if loss_name == "reinforce":
        weights, _ = C.importance_weights(trainer, sampler, mask)

        def theirs(leaf):
            return core_algos.compute_policy_loss_reinforce(
                sampler, leaf, advantages, mask, loss_agg_mode=reduction, config=config,
                rollout_is_weights=weights)

        def ours(leaf):
            return (C.reinforce_loss(leaf, advantages, mask, weights=weights,
                                     reduction=reduction),)
    else:
        def theirs(leaf):
            return verl_fn(sampler, leaf, advantages, mask, loss_agg_mode=reduction,
                           config=config)

        def ours(leaf):
            ours_fn = getattr(C, f"{loss_name}_loss")
            return ours_fn(leaf, sampler, advantages, mask, reduction=reduction, **clip)

    loss, grad, their_metrics = _grad(theirs, trainer)
    our_loss, our_grad, our_metrics = _grad(ours, trainer)
    assert our_loss == pytest.approx(loss, rel=REL, abs=ABS)
    torch.testing.assert_close(our_grad, grad, rtol=REL, atol=ABS)
    if our_metrics is not None:
        assert set(our_metrics) == set(their_metrics)
        for name, value in their_metrics.items():
            assert our_metrics[name] == pytest.approx(value, rel=REL, abs=ABS), name


def test_gspos_missing_bound_is_the_actors_clip_ratio_in_verl_and_0_here():
    """gspo_loss's docstring: verl reads a clip_ratio_low of None as the actor's clip_ratio
    (0.2 here), where gspo_loss reads it as 0."""
    trainer, sampler, mask, advantages = _batch(0, 0.4)
    config = _actor(trainer.shape[0], clip_low=None, clip_high=4e-4)
    assert config.clip_ratio == 0.2 and config.clip_ratio_low is None

    def theirs(leaf):
        return core_algos.compute_policy_loss_gspo(sampler, leaf, advantages, mask,
                                                   loss_agg_mode="token-mean", config=config)

    def ours(leaf, low):
        return C.gspo_loss(leaf, sampler, advantages, mask, clip_ratio_low=low,
                           clip_ratio_high=4e-4, reduction="token-mean")

    _, grad, _ = _grad(theirs, trainer)
    _, with_clip_ratio, _ = _grad(lambda leaf: ours(leaf, 0.2), trainer)
    _, with_none, _ = _grad(lambda leaf: ours(leaf, None), trainer)
    torch.testing.assert_close(with_clip_ratio, grad, rtol=REL, atol=ABS)
    assert (with_none - grad).abs().max() > 1e-3  # the floor at 1 clips what 0.8 leaves


# DPPO's thresholds (verl's clip_ratio_low / _high) and cap (clip_ratio_c): the ActorConfig
# defaults, the example script's (0.15 or 0.05 and 10000), and asymmetric ones that bite more.
DPPO_CASES = [
    ("dppo_tv", dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)),
    ("dppo_tv", dict(clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=10000.0)),
    ("dppo_tv", dict(clip_ratio_low=0.05, clip_ratio_high=0.1, clip_ratio_c=1.5)),
    ("dppo_kl", dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)),
    ("dppo_kl", dict(clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=10000.0)),
    ("dppo_kl", dict(clip_ratio_low=0.01, clip_ratio_high=0.03, clip_ratio_c=1.5)),
    ("dro", dict(dro_beta=0.05)),
    ("dro", dict(dro_beta=2.0)),
]


def _log_probabilities(seed, scale):
    """_batch with the sampler's log-probabilities reflected to <= 0 (_batch's sampler is the
    trainer plus noise, above 0 in places, where DPPO-KL's 1 - p would be negative)."""
    trainer, sampler, mask, advantages = _batch(seed, scale, empty_row=(seed == 1))
    return trainer, -sampler.abs(), mask, advantages


def _dppo_or_dro(loss_mode, options, B):
    """verl's registered loss for loss_mode, its config, and this package's loss and options."""
    if loss_mode == "dro":
        config = _actor(B, loss_mode="dro", dro_beta=options["dro_beta"])
    else:
        config = _actor(B, options["clip_ratio_low"], options["clip_ratio_high"],
                        options["clip_ratio_c"], loss_mode=loss_mode)
    return core_algos.get_policy_loss_fn(loss_mode), config, getattr(C, f"{loss_mode}_loss")


@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("reduction", VERL_REDUCTIONS)
@pytest.mark.parametrize("loss_mode, options", DPPO_CASES)
def test_dppo_and_dro_losses_gradients_and_metrics_are_verls(seed, scale, reduction, loss_mode,
                                                             options):
    """verl's loss_mode dppo_tv, dppo_kl and dro (through get_policy_loss_fn) with the sampler
    as old_log_prob, as its default trainer's bypass mode passes it."""
    trainer, sampler, mask, advantages = _log_probabilities(seed, scale)
    verl_fn, config, ours_fn = _dppo_or_dro(loss_mode, options, trainer.shape[0])

    def theirs(leaf):
        return verl_fn(sampler, leaf, advantages, mask, loss_agg_mode=reduction, config=config)

    def ours(leaf):
        return ours_fn(leaf, sampler, advantages, mask, reduction=reduction, **options)

    loss, grad, their_metrics = _grad(theirs, trainer)
    our_loss, our_grad, our_metrics = _grad(ours, trainer)
    assert our_loss == pytest.approx(loss, rel=REL, abs=ABS)
    torch.testing.assert_close(our_grad, grad, rtol=REL, atol=ABS)
    assert set(our_metrics) == set(their_metrics)
    for name, value in their_metrics.items():
        assert our_metrics[name] == pytest.approx(value, rel=REL, abs=ABS), name


def test_the_dppo_cases_exercise_both_sides_of_the_trust_region_and_the_cap():
    """The comparison above is not vacuous: on the batch of scale 0.4 every DPPO case removes
    some tokens and keeps others (verl's pg_clipfrac), the tight cases also truncate."""
    trainer, sampler, mask, advantages = _log_probabilities(0, 0.4)
    for loss_mode, options in DPPO_CASES:
        if loss_mode == "dro":
            continue
        verl_fn, config, _ = _dppo_or_dro(loss_mode, options, trainer.shape[0])
        _, metrics = verl_fn(sampler, trainer, advantages, mask, config=config)
        assert 0 < metrics["actor/pg_clipfrac"] < 1, (loss_mode, options)
        if options["clip_ratio_c"] == 1.5:
            assert metrics["actor/pg_clipfrac_lower"] > 0, (loss_mode, options)


def test_dppo_reads_clip_ratio_c_from_the_actor_config_not_its_fallback_of_20():
    """ActorConfig has clip_ratio_c = 3.0, so verl's config.get("clip_ratio_c", 20.0) is 3.0:
    the default of dppo_tv_loss and dppo_kl_loss."""
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    assert config.get("clip_ratio_c", 20.0) == 3.0
    assert (config.clip_ratio, config.clip_ratio_low, config.clip_ratio_high) == (0.2, 0.2, 0.2)
    assert config.loss_agg_mode == "token-mean" and config.policy_loss.dro_beta is None
    for name in ("dppo_tv_loss", "dppo_kl_loss"):
        defaults = {k: v.default for k, v in inspect.signature(getattr(C, name)).parameters.items()}
        assert (defaults["clip_ratio"], defaults["clip_ratio_c"]) == (0.2, 3.0)
        assert defaults["reduction"] == "token-mean"


def test_dro_without_a_positive_beta_is_refused_on_both_sides():
    trainer, sampler, mask, advantages = _log_probabilities(0, 0.4)
    config = _actor(trainer.shape[0], loss_mode="dro")  # dro_beta None, verl's default
    with pytest.raises(ValueError, match="dro_beta"):
        core_algos.compute_policy_loss_dro(sampler, trainer, advantages, mask, config=config)
    with pytest.raises(TypeError, match="dro_beta"):
        C.dro_loss(trainer, sampler, advantages, mask)


def _function_source(path, name):
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(path.read_text(), node)


def test_bypass_mode_substitutes_the_anchor_and_only_the_legacy_trainer_replaces_the_loss():
    """What correction's module docstring says of bypass_mode in verl 0.9.1: the default trainer
    is the v1 one, whose bypass mode sets old_log_probs = rollout_log_probs, leaves loss_mode
    alone (so dppo_tv, dppo_kl, dro, cispo and gspo run with the sampler as their anchor) and
    skips the rollout correction; the legacy trainer's apply_bypass_mode also sets loss_mode
    to bypass_mode and passes the rollout-correction options to it."""
    package = pathlib.Path(verl.__file__).parent
    trainer_yaml = (package / "trainer" / "config" / "ppo_trainer.yaml").read_text()
    assert re.search(r"^  use_v1: true$", trainer_yaml, re.MULTILINE)
    main = _function_source(package / "trainer" / "main_ppo.py", "main")
    assert "if config.trainer.use_v1:" in main and "TaskRunnerV1" in main
    v1 = _function_source(package / "trainer" / "ppo" / "v1" / "trainer_base.py",
                          "_compute_old_log_prob")
    assert 'data["old_log_probs"] = data.pop("rollout_log_probs")' in v1
    assert "loss_mode" not in v1 and "apply_bypass_mode" not in v1
    # and its rollout correction (weights, rejection) runs only without bypass mode
    advantage = _function_source(package / "trainer" / "ppo" / "v1" / "trainer_base.py",
                                 "_compute_advantage")
    assert "and not bypass_recomputing_logprobs" in advantage
    assert "apply_bypass_mode" in (package / "trainer" / "ppo" / "ray_trainer.py").read_text()
    from omegaconf import OmegaConf
    from verl import DataProto

    batch = DataProto.from_dict({"rollout_log_probs": torch.zeros(2, 3)})
    policy_loss = OmegaConf.create({"loss_mode": "dppo_tv"})
    helper.apply_bypass_mode(batch, RolloutCorrectionConfig.bypass_ppo_clip(), policy_loss)
    assert policy_loss.loss_mode == "bypass_mode"
    assert policy_loss.rollout_correction.loss_type == "ppo_clip"
    assert torch.equal(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"])


@pytest.mark.parametrize("kind", C.KL_PENALTIES)
def test_kl_penalties_and_their_gradients_are_verls(kind):
    """Values and gradients; |d| < 20 here, where verl's clamps of k3 are inactive."""
    trainer, ref, mask, _ = _batch(4, 0.8)
    mask = torch.ones_like(mask)  # verl's kl_penalty takes no mask

    def theirs(leaf):
        return (core_algos.kl_penalty(leaf, ref, kind).sum(),)

    def ours(leaf):
        return (C.kl_penalty(leaf, ref, mask, kind).sum(),)

    loss, grad, _ = _grad(theirs, trainer)
    our_loss, our_grad, _ = _grad(ours, trainer)
    assert our_loss == pytest.approx(loss, rel=REL, abs=ABS)
    torch.testing.assert_close(our_grad, grad, rtol=REL, atol=ABS)


# ---------------------------------------------------------------------------------------------
# Where verl and this package differ on purpose (correction's docstrings): IcePop's effective
# sample size, DPPO-KL's epsilon against the full-vocabulary KL, log-probabilities above 0
# ---------------------------------------------------------------------------------------------
def _helper_line(number):
    path = pathlib.Path(helper.__file__)
    return path.read_text().splitlines()[number - 1]


def test_verls_icepop_ess_raises_zero_division_where_every_weight_is_0():
    """Every ratio is 10, outside the preset's band [0.5, 5]: every IcePop weight is 0. verl's
    trainer call (compute_rollout_correction_and_add_to_batch, decoupled mode) raises
    ZeroDivisionError at rollout_corr_helper.py line 758, 1.0 / <a Python float 0.0>; this
    package reports an effective sample size of 0."""
    from verl import DataProto

    assert _helper_line(758).strip() == (
        "1.0 / verl_F.masked_mean(is_weights_normalized.square(), response_mask).item()")
    f64 = torch.float64
    trainer = torch.full((2, 3), math.log(10.0), dtype=f64)
    sampler, mask = torch.zeros(2, 3, dtype=f64), torch.tensor([[1.0, 1, 1], [1, 1, 0]], dtype=f64)
    batch = DataProto.from_dict({"old_log_probs": trainer, "rollout_log_probs": sampler,
                                 "response_mask": mask})
    config = RolloutCorrectionConfig.decoupled_token_icepop()
    with pytest.raises(ZeroDivisionError):
        helper.compute_rollout_correction_and_add_to_batch(batch, config)
    c = C.rollout_correction(trainer, sampler, mask, **C.PRESETS["decoupled_token_icepop"])
    assert c.metrics["rollout_corr/rollout_is_eff_sample_size"] == 0.0
    assert not bool(c.weights.any())


@pytest.mark.parametrize("cap", [1e-6, 2.0])
def test_verls_ess_is_the_documented_formula(cap):
    """verl's ESS is (mean_v(u) + 1e-8)^2 / mean_v(u^2), mean_v dividing by n + 1e-8; this
    package's mean(u)^2 / mean(u^2); their ratio is importance_weights' factor
    (1 + 1e-8 (1 + 1e-8 / n) / mean(u))^2 / (1 + 1e-8 / n), to first order 1 + 2e-8 / mean(u)
    - 1e-8 / n. At the cap 1e-6 every weight is 1e-6: 1 here, 1.0201 in verl."""
    trainer, sampler, mask, _ = _batch(0, 0.4)
    c = C.rollout_correction(trainer, sampler, mask, rollout_is="token",
                             rollout_is_threshold=cap)
    _, _, metrics = _verl(trainer, sampler, mask, rollout_is="token", rollout_is_threshold=cap)
    u, n, eps = c.weights[mask > 0], float(mask.sum()), 1e-8
    assert torch.all(u <= cap)
    theirs = (float(u.sum()) / (n + eps) + eps) ** 2 / (float(u.square().sum()) / (n + eps))
    ours = float(u.sum()) ** 2 / (n * float(u.square().sum()))
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(theirs, rel=1e-12)
    assert _ours(c)["rollout_is_eff_sample_size"] == pytest.approx(ours, rel=1e-12)
    mean = float(u.mean())
    factor = (1 + eps * (1 + eps / n) / mean) ** 2 / (1 + eps / n)
    assert metrics["rollout_is_eff_sample_size"] / _ours(c)["rollout_is_eff_sample_size"] == (
        pytest.approx(factor, rel=1e-12))
    if cap == 2.0:  # the first-order form, where (1e-8 / mean)^2 is negligible
        assert factor - 1 == pytest.approx(2 * eps / mean - eps / n, rel=1e-6)
    if cap == 1e-6:
        assert torch.all(u == cap) and ours == pytest.approx(1.0, rel=1e-15)
        assert theirs == pytest.approx(1.0201, abs=1e-4)


def test_verls_dppo_kl_removes_a_fallen_token_whose_full_kl_is_delta_low():
    """Two tokens, so the exact binary KL is the full-vocabulary one. A token that fell from
    q = 0.6 to p = 0.5 with A = -1: at clip_ratio_low = its full KL verl's 1e-8 puts it 2e-9
    outside the region; at clip_ratio_low + 1e-8 it is inside (the bound of dppo_kl_loss's
    docstring). This package does the same."""
    source = inspect.getsource(core_algos.compute_policy_loss_dppo_kl)
    assert "(1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)" in source
    assert C.BINARY_KL_EPS == 1e-8
    f64 = torch.float64
    trainer = torch.tensor([[math.log(0.5)]], dtype=f64)
    sampler = torch.tensor([[math.log(0.6)]], dtype=f64)
    A, mask = torch.tensor([[-1.0]], dtype=f64), torch.ones(1, 1, dtype=f64)
    kl = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5)
    for delta, outside in ((kl, 1.0), (kl + 1e-8, 0.0)):
        config = _actor(1, clip_low=delta, clip_high=0.2, loss_mode="dppo_kl")
        _, theirs = core_algos.compute_policy_loss_dppo_kl(sampler, trainer, A, mask,
                                                           config=config)
        _, ours = C.dppo_kl_loss(trainer, sampler, A, mask, clip_ratio_low=delta)
        # verl's masked mean divides by the count + 1e-8
        assert ours["actor/pg_clipfrac"] == outside, delta
        assert theirs["actor/pg_clipfrac"] == pytest.approx(outside, rel=REL, abs=ABS), delta


@pytest.mark.parametrize("loss_mode, options", [("dppo_tv", DPPO_CASES[0][1]),
                                                ("dppo_kl", DPPO_CASES[3][1]),
                                                ("dro", DPPO_CASES[6][1])])
def test_a_log_probability_above_0_verl_takes_is_refused_here(loss_mode, options):
    """verl computes DPPO and DRO on log pi = 0.3 without a word (DPPO-KL then takes the
    logarithm of a negative 1 - p + 1e-8); this package names the argument and the position."""
    trainer, sampler, mask, advantages = _log_probabilities(0, 0.4)
    trainer = trainer.clone()
    trainer[0, 0] = 0.3
    verl_fn, config, ours_fn = _dppo_or_dro(loss_mode, options, trainer.shape[0])
    loss, _ = verl_fn(sampler, trainer, advantages, mask, config=config)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"^trainer_logp must be <= 0 where mask is 1 \(a "
                                         r"log-probability: .*\), got 0.3 at position \(0, 0\)$"):
        ours_fn(trainer, sampler, advantages, mask, **options)
