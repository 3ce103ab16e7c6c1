"""verl 0.9.1's policy losses sapo, gpg, clip_cov, kl_cov and geo_mean against the torch module.

Each loss is taken from verl's registry (``get_policy_loss_fn``, ``verl/trainer/ppo/core_algos.py``)
and called with the sampler's log-probabilities as ``old_log_prob``, as verl's default trainer
does with ``bypass_mode: true``; its value and gradient equal those of the matching loss of
``opd_literate.mismatch.correction`` on random ``(B, T)`` batches. The defaults are read from the
config the trainer composes (``ppo_trainer`` with ``actor/actor.yaml``, via Hydra, as
``test_verl_config.py`` does). Tolerance: verl divides by a count plus ``1e-8`` in
``seq-mean-token-mean``, in GMPO's mean and in ``masked_mean``; the module divides by the count,
a relative difference of ``1e-8`` at most (``REL``).

clip_cov draws the tokens it removes with ``torch.randperm``; the module's loss is the average
over that draw. Where the draw takes every eligible token they are equal; otherwise
``torch.randperm`` is replaced by each cyclic shift in turn (every token is then drawn in the
same number of shifts), and the mean of verl's losses is the module's.

Marker ``verl``, in ``.venv-verl``; skipped where verl or Hydra cannot be imported.
"""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
import torch

try:
    import hydra  # noqa: F401 (skip without it: _verl_trainer composes with it)
    from verl.trainer.ppo import core_algos
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig
except ImportError as error:
    pytest.skip(f"verl is not importable ({error}); build it with tools/env.sh verl .venv-verl",
                allow_module_level=True)

from _verl_trainer import compose_trainer_config

from opd_literate.mismatch import correction as C
from opd_literate.mismatch import estimators as E

pytestmark = pytest.mark.verl
F64 = torch.float64
REL = 1e-7


@pytest.fixture(scope="module")
def actor():
    """The actor section of the trainer's composed config (``ppo_trainer``, no override)."""
    return compose_trainer_config().actor_rollout_ref.actor


def _defaults(fn):
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_the_registry_holds_the_five(actor):
    for name, fn in [("sapo", core_algos.compute_policy_loss_sapo),
                     ("gpg", core_algos.compute_policy_loss_gpg),
                     ("clip_cov", core_algos.compute_policy_loss_clip_cov),
                     ("kl_cov", core_algos.compute_policy_loss_kl_cov),
                     ("geo_mean", core_algos.compute_policy_loss_geo_mean)]:
        assert core_algos.get_policy_loss_fn(name) is fn
        assert core_algos.POLICY_LOSS_REGISTRY[name] is fn


def test_the_composed_defaults_are_the_catalogues_and_the_losses(actor):
    loss = actor.policy_loss
    assert (actor.tau_pos, actor.tau_neg) == (1.0, 1.05)
    assert E.REGISTRY["sapo"].defaults == {"tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg}
    assert {k: _defaults(C.sapo_loss)[k] for k in ("tau_pos", "tau_neg")} == {
        "tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg}
    assert (actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.2, 0.2)
    assert E.REGISTRY["gmpo"].defaults == {"eps_low": actor.clip_ratio_low,
                                           "eps_high": actor.clip_ratio_high}
    assert _defaults(C.geo_mean_loss)["clip_ratio"] == actor.clip_ratio
    clip_cov = {"eps": actor.clip_ratio, "clip_cov_ratio": loss.clip_cov_ratio,
                "clip_cov_lb": loss.clip_cov_lb, "clip_cov_ub": loss.clip_cov_ub}
    assert clip_cov == {"eps": 0.2, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0,
                        "clip_cov_ub": 5.0} == E.REGISTRY["clip_cov"].defaults
    torch_defaults = _defaults(C.clip_cov_loss)
    assert all(torch_defaults[k] == clip_cov[k] for k in clip_cov if k != "eps")
    assert torch_defaults["clip_ratio"] == actor.clip_ratio
    # kl_cov: the composed 0.1, not the code's fallback 1.0 for a config without one
    assert (loss.kl_cov_ratio, loss.ppo_kl_coef) == (2e-4, 0.1)
    for fn in (E.kl_cov, C.kl_cov_loss):
        d = _defaults(fn)
        assert (d["kl_cov_ratio"], d["ppo_kl_coef"]) == (loss.kl_cov_ratio, loss.ppo_kl_coef)
    source = inspect.getsource(core_algos.compute_policy_loss_kl_cov)
    assert "config.policy_loss.ppo_kl_coef is not None else 1.0" in source
    # both ignore loss_agg_mode: sapo reduces by seq-mean-token-mean, geo_mean by a mean
    assert 'loss_agg_mode="seq-mean-token-mean", **config.global_batch_info' in (
        inspect.getsource(core_algos.compute_policy_loss_sapo))
    assert "pg_loss = torch.mean(pg_losses)" in inspect.getsource(
        core_algos.compute_policy_loss_geo_mean)


def _batch(seed, scale=0.4, B=6, T=9, per_token=True):
    g = torch.Generator().manual_seed(seed)
    trainer = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.98 + 0.01)
    sampler = trainer - scale * torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    if per_token:
        advantages = torch.randn(B, T, generator=g, dtype=F64)
    else:
        advantages = torch.randn(B, generator=g, dtype=F64)[:, None].expand(B, T).clone()
    return trainer, sampler, mask, advantages


def _config(B, loss_mode, clip_low=0.2, clip_high=0.2, tau_pos=1.0, tau_neg=1.05, **policy):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                       tau_pos=tau_pos, tau_neg=tau_neg, global_batch_info={"global_batch_size": B},
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy))


def _grad(loss_fn, trainer):
    leaf = trainer.clone().requires_grad_(True)
    loss, *_ = loss_fn(leaf)
    loss.backward()
    return loss.item(), leaf.grad


def _verl(name, sampler, mask, A, config, loss_agg_mode="token-mean"):
    fn = core_algos.get_policy_loss_fn(name)
    return lambda x: fn(old_log_prob=sampler, log_prob=x, advantages=A, response_mask=mask,
                        loss_agg_mode=loss_agg_mode, config=config)


def _assert_equal(ours, theirs):
    assert ours[0] == pytest.approx(theirs[0], rel=REL, abs=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=REL, atol=1e-12)


BATCHES = [(seed, scale) for seed in (0, 1) for scale in (0.05, 0.4, 1.2)]


@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("taus", [(1.0, 1.05), (3.0, 0.5)])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum"])
def test_sapo_is_verls(seed, scale, taus, loss_agg_mode):
    trainer, sampler, mask, A = _batch(seed, scale)
    config = _config(trainer.shape[0], "sapo", tau_pos=taus[0], tau_neg=taus[1])
    theirs = _grad(_verl("sapo", sampler, mask, A, config, loss_agg_mode), trainer)
    ours = _grad(lambda x: C.sapo_loss(x, sampler, A, mask, tau_pos=taus[0], tau_neg=taus[1]),
                 trainer)
    _assert_equal(ours, theirs)


@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.05, 0.1), (0.4, 0.4)])
@pytest.mark.parametrize("per_token", [False, True])
def test_geo_mean_is_verls(seed, scale, clip, per_token):
    trainer, sampler, mask, A = _batch(seed, scale, per_token=per_token)
    config = _config(trainer.shape[0], "geo_mean", clip_low=clip[0], clip_high=clip[1])
    theirs = _grad(_verl("geo_mean", sampler, mask, A, config, "seq-mean-token-sum"), trainer)
    ours = _grad(lambda x: C.geo_mean_loss(x, sampler, A, mask, clip_ratio_low=clip[0],
                                           clip_ratio_high=clip[1]), trainer)
    _assert_equal(ours, theirs)
    if scale > max(clip):  # some token's log-ratio beyond its clip: no gradient there
        assert (theirs[1][mask > 0] == 0).any()


@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_gpg_is_reinforce_without_weights(seed, scale, loss_agg_mode):
    trainer, sampler, mask, A = _batch(seed, scale)
    config = _config(trainer.shape[0], "gpg")
    theirs = _grad(_verl("gpg", sampler, mask, A, config, loss_agg_mode), trainer)
    ours = _grad(lambda x: (C.reinforce_loss(x, A, mask, reduction=loss_agg_mode),), trainer)
    _assert_equal(ours, theirs)


@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("options", [dict(kl_cov_ratio=2e-4, ppo_kl_coef=0.1),
                                     dict(kl_cov_ratio=0.1, ppo_kl_coef=0.1),
                                     dict(kl_cov_ratio=0.3, ppo_kl_coef=1.0)])
def test_kl_cov_is_verls(seed, scale, options):
    trainer, sampler, mask, A = _batch(seed, scale)
    config = _config(trainer.shape[0], "kl_cov", **options)
    theirs = _grad(_verl("kl_cov", sampler, mask, A, config), trainer)
    ours = _grad(lambda x: C.kl_cov_loss(x, sampler, A, mask, **options), trainer)
    _assert_equal(ours, theirs)


def _clip_cov_options(ratio, lb, ub):
    return dict(clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub)


def _eligible(trainer, sampler, mask, A, lb, ub, eps=0.2):
    with torch.no_grad():
        ratio = torch.exp(trainer - sampler)
        clipped = (-A * ratio.clamp(1 - eps, 1 + eps)) > (-A * ratio)
        m = mask > 0
        cov = (A - A[m].mean()) * (trainer - trainer[m].mean())
        return int((m & ~clipped & (cov > lb) & (cov < ub)).sum()), int(m.sum())


@pytest.mark.parametrize("seed, scale", BATCHES)
@pytest.mark.parametrize("band", [(1.0, 5.0), (0.05, 0.5), (-0.2, 0.3)])
def test_clip_cov_is_verls_averaged_over_its_draw(seed, scale, band, monkeypatch):
    trainer, sampler, mask, A = _batch(seed, scale)
    for ratio in (2e-4, 0.1):
        options = _clip_cov_options(ratio, *band)
        config = _config(trainer.shape[0], "clip_cov", **options)
        ours = _grad(lambda x, o=options: C.clip_cov_loss(x, sampler, A, mask, **o), trainer)
        n_eligible, N = _eligible(trainer, sampler, mask, A, *band)
        k = max(int(ratio * N), 1)
        if k >= n_eligible:  # verl removes every eligible token: no draw
            _assert_equal(ours, _grad(_verl("clip_cov", sampler, mask, A, config), trainer))
            continue
        draws = []
        for shift in range(n_eligible):
            monkeypatch.setattr(torch, "randperm", lambda n, *a, s=shift, **kw: torch.roll(
                torch.arange(n), -s))
            draws.append(_grad(_verl("clip_cov", sampler, mask, A, config), trainer))
        monkeypatch.undo()
        mean = (sum(d[0] for d in draws) / len(draws),
                sum(d[1] for d in draws) / len(draws))
        _assert_equal(ours, mean)
        assert len({round(d[0], 12) for d in draws}) > 1  # the draws differ


def test_the_bands_cover_both_branches():
    """Some batches above have more eligible tokens than verl removes, some fewer."""
    cases = set()
    for seed, scale in BATCHES:
        trainer, sampler, mask, A = _batch(seed, scale)
        for band in [(1.0, 5.0), (0.05, 0.5), (-0.2, 0.3)]:
            for ratio in (2e-4, 0.1):
                n_eligible, N = _eligible(trainer, sampler, mask, A, *band)
                cases.add(max(int(ratio * N), 1) >= n_eligible)
    assert cases == {True, False}


def test_every_registered_policy_loss_is_on_the_integration_page():
    """verl's POLICY_LOSS_REGISTRY as installed: every name on the integration page's verl
    table (``bypass_mode`` is the legacy trainer's, the rows of PPO's clip and REINFORCE)."""
    page = (pathlib.Path(__file__).parents[2] / "docs" / "integration.md").read_text()
    table = page.split("**verl 0.9.1**", 1)[1].split("\n\n**", 1)[0]
    names = sorted(core_algos.POLICY_LOSS_REGISTRY)
    assert len(names) >= 12, names
    missing = [n for n in names if n != "bypass_mode" and not re.search(
        rf"`loss_mode: {n}`|/ `{n}`", table)]
    assert missing == [], missing
    assert "bypass_mode" in table
