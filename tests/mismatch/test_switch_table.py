"""The integration page's table of every framework's switches (``docs/integration.md``, "Every
switch, framework by framework"): each estimator it names is the catalogue's, every estimator of
the catalogue that a framework ships is on it, and the rows that set arguments other than the
estimator's defaults hold on the toy's enumerated batch (the torch form with the framework's
arguments equals the numpy estimator with the stated ones)."""

from __future__ import annotations

import math
import pathlib
import re

import numpy as np
import pytest

from opd_literate.mismatch import correction as C
from opd_literate.mismatch import estimators as E
from opd_literate.mismatch import groups as G
from opd_literate.mismatch.toy import make_ar_toy, make_toy, response_mask
from tests.helpers.batches import as_batch

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "integration.md"
# The catalogue's estimators that no framework ships as an option: the unbiased sequence ratio,
# a removed verl option (the uncorrected gradient is verl's gpg), and LUSPO with the sampler as
# its anchor (TRL's luspo has its own recomputation there, so under a mismatch its weight at
# one update is the vLLM mode's: tests/integration/test_trl_policy_losses.py).
NOT_A_SWITCH = {"seq_is", "token_veto", "luspo"}


def _section():
    text = PAGE.read_text()
    start = text.index("## Every switch, framework by framework")
    return text[start:]


def test_every_estimator_named_is_the_catalogues_and_every_shipped_one_is_named():
    named = set(re.findall(r"\[`(\w+)`\]\[opd_literate\.mismatch\.estimators\.(\w+)\]",
                           _section()))
    assert all(label == target for label, target in named)
    names = {target for _, target in named}
    # kl_cov is an estimate without a weight, outside the registry (estimators' docstring)
    assert names <= set(E.REGISTRY) | {"kl_cov"} and callable(E.kl_cov)
    assert set(E.REGISTRY) - names == NOT_A_SWITCH


def test_every_torch_form_named_exists():
    for module, name in re.findall(r"\]\[opd_literate\.mismatch\.(correction|groups)\.(\w+)\]",
                                   _section()):
        assert callable(getattr({"correction": C, "groups": G}[module], name)), name


def _weights(toy, torch_weights):
    """The torch weights on the enumerated batch, against the numpy estimator's (M, T)."""
    return torch_weights.numpy() * response_mask(toy)


@pytest.mark.parametrize("make", [make_toy, make_ar_toy])
@pytest.mark.parametrize("mismatch", [0.3, 1.0])
def test_the_rows_with_their_own_arguments_hold_on_the_toys(make, mismatch):
    toy = make(mismatch=mismatch)
    batch = as_batch(toy)
    real = response_mask(toy)
    # OpenRLHF `tis`: the token ratio clamped to its band [0.5, 5]
    openrlhf_tis, _ = C.importance_weights(*batch, "token", rollout_is_threshold=5.0,
                                           mode="clamp", lower=0.5)
    np.testing.assert_allclose(_weights(toy, openrlhf_tis),
                               E.token_clamp(toy, low=0.5, high=5.0, return_weights=True) * real,
                               rtol=1e-12, atol=1e-14)
    # NeMo-RL without a truncation type: the raw token ratio
    raw, _ = C.importance_weights(*batch, "token", rollout_is_threshold=math.inf)
    np.testing.assert_allclose(_weights(toy, raw), E.token_is(toy, return_weights=True) * real,
                               rtol=1e-12, atol=1e-14)
    # OpenRLHF `seq-mask-tis` and `icepop` at its band
    seq_mask, _ = C.seq_mask_tis_weights(*batch, low=0.5, high=5.0)
    np.testing.assert_allclose(
        _weights(toy, seq_mask),
        E.seq_mask_tis(toy, low=0.5, high=5.0, return_weights=True) * real,
        rtol=1e-12, atol=1e-14)
    icepop, _ = C.importance_weights(*batch, "token", rollout_is_threshold="0.5_5.0")
    np.testing.assert_allclose(_weights(toy, icepop), E.icepop(toy, return_weights=True) * real,
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("make", [make_toy, make_ar_toy])
@pytest.mark.parametrize("mismatch", [0.3, 1.0])
def test_verls_rejection_rows_need_the_ratio_of_rollout_is(make, mismatch):
    """token_mis and seq_mis at their defaults (the band [0, 2]) are rollout_is with a cap of 2
    and rollout_rs at "0.5_inf"; rollout_rs alone keeps the tokens at weight 1."""
    toy = make(mismatch=mismatch)
    batch = as_batch(toy)
    real = response_mask(toy)
    for level, option, name in (("token", "token_k1", "token_mis"),
                                ("sequence", "seq_sum_k1", "seq_mis")):
        both = C.rollout_correction(*batch, rollout_is=level, rollout_is_threshold=2.0,
                                    rollout_rs=option, rollout_rs_threshold="0.5_inf")
        expected = getattr(E, name)(toy, return_weights=True)
        expected = expected if expected.ndim == 2 else expected[:, None] * real
        np.testing.assert_allclose(_weights(toy, both.weights * both.keep), expected * real,
                                   rtol=1e-12, atol=1e-14)
        alone = C.rollout_correction(*batch, rollout_rs=option, rollout_rs_threshold="0.5_inf")
        np.testing.assert_array_equal(_weights(toy, alone.weights * alone.keep),
                                      (expected > 0) * real)
    # verl's cispo at the actor's clip_ratio 0.2 is the ratio clamped to [0.8, 1.2]
    np.testing.assert_allclose(
        E.cispo(toy, eps_low=0.2, eps_high=0.2, return_weights=True),
        E.token_clamp(toy, low=0.8, high=1.2, return_weights=True), rtol=1e-15, atol=0)


def test_the_page_states_the_frameworks_defaults_the_catalogue_uses():
    section = " ".join(_section().split())
    assert E.REGISTRY["icepop"].defaults == {"low": 0.5, "high": 5.0}
    assert "`tis` (the default type) | [`token_clamp`]" in section
    assert E.REGISTRY["trl_sequence_mask"].defaults == {"clip_min": 0.0, "clip_max": 3.0}
    assert ('`vllm_importance_sampling_mode="sequence_mask"` (the default), '
            "`vllm_importance_sampling_clip_max=3.0`") in section


def test_no_bypass_estimator_is_given_as_a_switch_of_trl_or_nemo_rl():
    """TRL's and NeMo-RL's anchor is their recomputation: SAPO, LUSPO, CISPO and GSPO with the
    sampler as the anchor are none of their switches (verl's bypass_mode only); the mismatch
    chapter's "Which switch to flip" says so of its winners."""
    section = _section()
    trl = section.split("**TRL 1.16.0**", 1)[1].split("\n**NeMo-RL**", 1)[0]
    nemo = section.split("\n**NeMo-RL**", 1)[1].split("\n**OpenRLHF**", 1)[0]
    verl = section.split("**verl 0.9.1**", 1)[1].split("**TRL 1.16.0**", 1)[0]
    for name in ("sapo", "luspo", "cispo", "gspo"):
        link = f"[`{name}`][opd_literate.mismatch.estimators.{name}]"
        assert link not in trl and link not in nemo, name
    for name in ("sapo", "cispo", "gspo"):
        assert f"[`{name}`][opd_literate.mismatch.estimators.{name}]" in verl, name
    assert "[`vespo`][opd_literate.mismatch.estimators.vespo]" in trl
    chapter = " ".join((PAGE.parent / "mismatch.md").read_text().split())
    assert ("`sapo` and `gspo` are verl's losses in `bypass_mode`, the sampler their anchor "
            "(TRL's loss types of those names weigh by their vLLM mode at the first update, "
            "their anchor TRL's recomputation)") in chapter
