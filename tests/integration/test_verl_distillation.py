"""opd_literate.large_vocab.clamps against verl's on-policy distillation trainer, installed.

verl 0.9.1's ``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk`` is called on the
same float64 top-k reports as ``clamps.verl_forward_kl_topk`` and ``topk_diagnostics``: its
per-position value (before the clamps that ``verl/trainer/distillation/losses.py`` applies
after it, at 0 always and at ``loss_max_clamp`` when it is set, whose lines are checked in the
installed file), the masses, the overlap counts and the overlap advantage must agree, and so
must the gradients with respect to the student's logits, with each clamp set and unset. The
whole path with the config the trainer composes is in ``test_verl_config.py``.

Tolerance ``rtol=atol=2e-6``: verl casts the log-probabilities to float32 before its sum
(``kl_divergence``: ``log_p.float()``), this module keeps float64 inputs in float64; the sums
have at most ``k = 4`` terms of magnitude below 30 here, so float32's rounding (``6e-8``
relative) stays below ``2e-6`` absolute. Counts are compared exactly.
Marker ``verl``, like ``test_verl.py``: run by ``.ci/run`` in the environment of
``bash tools/env.sh verl .venv-verl``; skipped where verl cannot be imported.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

try:
    from verl.trainer.distillation import losses as verl_losses
    from verl.trainer.distillation.fsdp import losses as verl_fsdp
    from verl.workers.config.distillation import DistillationLossConfig
except ImportError as error:
    pytest.skip(f"verl is not importable ({error}); build it with tools/env.sh verl .venv-verl",
                allow_module_level=True)

from opd_literate.large_vocab import clamps

pytestmark = pytest.mark.verl
F64 = torch.float64
TOL = 2e-6


def _report(seed, T=7, V=11, k=4, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    student = (scale * torch.randn(1, T, V, generator=g, dtype=F64))
    teacher = torch.log_softmax(scale * torch.randn(T, V, generator=g, dtype=F64), -1)
    values, ids = teacher.topk(k, -1)
    return student, values, ids


def _verl(student, values, ids, log_prob_min_clamp):
    config = types.SimpleNamespace(distillation_loss=DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=ids.shape[-1], log_prob_min_clamp=log_prob_min_clamp))
    nested = [torch.nested.nested_tensor([x], layout=torch.jagged) for x in (values, ids)]
    return verl_fsdp.compute_forward_kl_topk(student, *nested, config, "thd")


def test_the_log_probability_clamp_is_applied_only_when_set():
    processor = inspect.getsource(verl_fsdp.compute_forward_kl_topk)
    assert "if loss_config.log_prob_min_clamp is not None:" in processor
    applied = inspect.getsource(verl_losses.distillation_loss)
    assert "if loss_config.loss_max_clamp is not None:" in applied


def test_verl_clamps_its_value_at_zero_then_at_loss_max_clamp():
    """The two clamps of the wrapper, as this module applies them after the logits processor."""
    wrapper = inspect.getsource(verl_losses.compute_forward_kl_topk)
    assert "distillation_losses = distillation_losses.clamp_min(0.0)" in wrapper
    applied = inspect.getsource(verl_losses.distillation_loss)
    assert ("distillation_losses.clamp(min=-loss_config.loss_max_clamp, "
            "max=loss_config.loss_max_clamp)") in applied


@pytest.mark.parametrize("loss_max_clamp", [10.0, None])
@pytest.mark.parametrize("log_prob_min_clamp", [-10.0, -2.0, None])
@pytest.mark.parametrize("seed", range(6))
def test_values_gradients_and_diagnostics_are_verls(seed, log_prob_min_clamp, loss_max_clamp):
    student, values, ids = _report(seed)
    z_verl = student.clone().requires_grad_(True)
    out = _verl(z_verl, values, ids, log_prob_min_clamp)
    theirs = out["distillation_losses"].clamp_min(0.0)
    if loss_max_clamp is not None:
        theirs = theirs.clamp(-loss_max_clamp, loss_max_clamp)
    z_ours = student.clone().requires_grad_(True)
    ours = clamps.verl_forward_kl_topk(z_ours, values[None], ids[None],
                                       log_prob_min_clamp=log_prob_min_clamp,
                                       loss_max_clamp=loss_max_clamp)
    torch.testing.assert_close(ours.to(theirs.dtype), theirs, rtol=TOL, atol=TOL)
    weights = torch.linspace(0.5, 1.5, ours.shape[-1], dtype=F64)  # a gradient of every value
    (theirs * weights).sum().backward()
    (ours * weights).sum().backward()
    torch.testing.assert_close(z_ours.grad, z_verl.grad, rtol=TOL, atol=TOL)
    d = clamps.topk_diagnostics(student, values[None], ids[None], torch.ones(1, ids.shape[0]),
                                log_prob_min_clamp=log_prob_min_clamp)
    assert torch.equal(d["overlap_count"], out["overlap_count"])
    for name in ("student_mass", "teacher_mass", "overlap_token_advantage"):
        torch.testing.assert_close(d[name].to(out[name].dtype), out[name].detach(),
                                   rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("seed", range(3))
def test_with_bfloat16_logits_verl_rounds_its_log_softmax_in_bfloat16_and_this_module_does_not(
        seed):
    """The chapter's condition on "the same values": float32 or float64 logits. verl's
    ``compute_forward_kl_topk`` takes ``log_softmax`` in the logits' own dtype; this module
    computes a bfloat16 input in float32. On bfloat16 logits verl's value is therefore off the
    exact value of those same inputs (their float64 computation) by bfloat16's rounding of
    log-probabilities (unit roundoff 2**-9 of values up to about 20 here), this module's by
    float32's, and the two differ by more than float32's rounding (the figures of
    ``docs/large_vocab.md`` and of ``clamps.py``)."""
    student, values, ids = _report(seed, T=64, V=512, k=32, scale=3.0)
    student, values = student.to(torch.bfloat16), values.to(torch.bfloat16)
    exact = clamps.verl_forward_kl_topk(student.double()[0], values.double(), ids)
    theirs = _verl(student, values, ids, None)["distillation_losses"][0].clamp_min(0.0).double()
    ours = clamps.verl_forward_kl_topk(student[0], values, ids)
    assert ours.dtype == torch.float32  # the output of a half input, as in verl
    ours_error = float((ours.double() - exact).abs().max())
    theirs_error = float((theirs - exact).abs().max())
    scale = float(exact.abs().max())
    # the figures of the chapter and of clamps.py: below 1e-6 of the largest value, and 0.1 to
    # 0.4 % (measured 0.14 to 0.29 % on these seeds)
    assert ours_error <= 1e-6 * scale  # float32's rounding of the sums
    assert 1e-3 * scale <= theirs_error <= 4e-3 * scale  # bfloat16's, not float32's
