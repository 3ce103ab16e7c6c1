"""The mismatch chapter's "engine's log-probs" claims about TRL and verl, against the installed
releases: which log-probs they ask vLLM for, and that their trainers score a token with the
full-vocabulary softmax at the sampling temperature (``engine_toy``'s default trainer), not the
renormalised one of a replayed sampling mask.

TRL (marker ``trl``) is the trl extra's 1.16.0; verl (marker ``verl``) the verl extra's 0.9.1 in
``.venv-verl`` (``bash tools/env.sh verl .venv-verl``). Each test skips where its framework is
not importable. The log-prob comparisons are float64 on both sides: equal to ``1e-12``.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import numpy as np
import pytest
import torch

from opd_literate.mismatch.engine import engine_toy
from opd_literate.mismatch.toy import toy_from_logits

TAU, TOP_P = 0.7, 0.8
LOGITS = np.array([[1.3, 0.9, 0.2, -0.4, -1.1]])  # one position, five tokens


def _engine(trainer_mask):
    return engine_toy(toy_from_logits(LOGITS, LOGITS), temperature=TAU, top_p=TOP_P,
                      trainer_mask=trainer_mask)


def _installed_file(package, relative):
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.skip(f"{package} is not installed")
    return (pathlib.Path(spec.origin).parent / relative).read_text()


def _check_full_vocabulary_tempered(trainer_logp):
    """trainer_logp: (written tokens,) from a framework, for engine["Y"][:, 0]."""
    full, masked = _engine(False), _engine(True)
    np.testing.assert_allclose(trainer_logp, full["logp_train"][:, 0], rtol=0, atol=1e-12)
    # ... and not the replayed mask's: those differ by the log of the kept mass.
    kept_mass = float(np.exp(full["logp_train"][:, 0]).sum())
    assert kept_mass < 0.95
    np.testing.assert_allclose(masked["logp_train"][:, 0] - trainer_logp, -math.log(kept_mass),
                               rtol=0, atol=1e-12)


@pytest.mark.trl
def test_trls_trainer_scores_with_the_full_tempered_softmax():
    utils = pytest.importorskip("trl.trainer.utils")
    written = torch.as_tensor(_engine(False)["Y"][:, 0])
    logits = torch.as_tensor(LOGITS).expand(len(written), -1)
    trl_logp = utils.selective_log_softmax(logits, written, temperature=TAU)
    _check_full_vocabulary_tempered(trl_logp.numpy())


@pytest.mark.trl
def test_trl_asks_vllm_for_the_processed_log_probs():
    pytest.importorskip("trl")
    colocate = _installed_file("trl", "generation/vllm_generation.py")
    assert 'logprobs_mode="processed_logprobs"' in colocate
    serve = _installed_file("trl", "scripts/vllm_serve.py")
    assert "'--logprobs-mode', 'processed_logprobs'" in serve


@pytest.mark.verl
def test_verls_trainer_scores_with_the_full_tempered_softmax():
    impl = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
    written = _engine(False)["Y"][:, 0]
    scaled = impl._scale_logits_by_temperature(torch.as_tensor(LOGITS),
                                               torch.tensor(TAU, dtype=torch.float64),
                                               is_unit_temperature=False)
    verl_logp = torch.log_softmax(scaled, dim=-1)[0, torch.as_tensor(written)]
    _check_full_vocabulary_tempered(verl_logp.numpy())


@pytest.mark.verl
def test_verls_rollout_asks_for_the_processed_log_probs():
    rollout = pytest.importorskip("verl.workers.config.rollout")
    assert rollout.RolloutConfig.__dataclass_fields__["logprobs_mode"].default == (
        "processed_logprobs")
    server = _installed_file("verl", "workers/rollout/vllm_rollout/vllm_async_server.py")
    assert '"logprobs_mode": self.config.logprobs_mode' in server
