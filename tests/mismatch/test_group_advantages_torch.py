"""The torch form of the group baselines, ``correction.group_advantages``, against the numpy
form of ``groups.group_advantages`` (whose values tests/mismatch/test_groups.py checks against
the definitions written out answer by answer); its dtypes, devices and refusals."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch import correction as C
from opd_literate.mismatch import groups

BASELINES = groups.BASELINES


def _random(seed, shape=(5, 4)):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=shape).round(1)  # ties and repeated rewards too
    kept = rng.random(shape) < 0.7
    kept[0] = [True] + [False] * (shape[-1] - 1)  # a group with one kept answer
    kept[1] = False  # and one with none
    return rewards, kept


@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_torch_form_is_the_numpy_form(baseline, seed):
    rewards, kept = _random(seed)
    expected = groups.group_advantages(rewards, kept, baseline)
    got = C.group_advantages(torch.from_numpy(rewards), torch.from_numpy(kept), baseline)
    assert got.dtype == torch.float64 and got.shape == rewards.shape
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-13, atol=1e-15)
    assert (got.numpy()[~kept] == 0).all()


def test_the_docstrings_example_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    kept = torch.tensor([True, True, True, False])
    # GRPO over the kept: mean 2/3, sample std sqrt(1/3)
    expected = ((torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64) - 2 / 3)
                / ((1 / 3) ** 0.5 + groups.VERL_EPSILON))
    got = C.group_advantages(r, kept, "grpo_std_kept")
    torch.testing.assert_close(got[:3], expected, rtol=1e-12, atol=0)
    assert got[3].item() == 0.0


@pytest.mark.parametrize("dtype, out", [(torch.float16, torch.float32),
                                        (torch.bfloat16, torch.float32),
                                        (torch.float32, torch.float32),
                                        (torch.float64, torch.float64)])
def test_half_precision_is_computed_in_float32(dtype, out):
    rewards, kept = _random(3)
    r = torch.from_numpy(rewards).to(dtype)
    got = C.group_advantages(r, torch.from_numpy(kept), "grpo_std_all")
    assert got.dtype == out and got.device == r.device
    # against the numpy form of the rewards as the dtype rounds them
    expected = groups.group_advantages(r.double().numpy(), kept, "grpo_std_all")
    np.testing.assert_allclose(got.double().numpy(), expected,
                               rtol=50 * torch.finfo(out).eps, atol=50 * torch.finfo(out).eps)


def test_the_result_is_detached():
    r = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64, requires_grad=True)
    got = C.group_advantages(r, torch.ones(1, 3, dtype=torch.bool), "rloo_all")
    assert not got.requires_grad


@pytest.mark.parametrize("call, error, match", [
    (lambda: C.group_advantages(np.zeros(3), torch.ones(3, dtype=torch.bool), "rloo_all"),
     TypeError, "rewards must be a torch.Tensor"),
    (lambda: C.group_advantages(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool),
                                "rloo_all"), TypeError, "rewards must have a floating dtype"),
    (lambda: C.group_advantages(torch.zeros(()), torch.ones((), dtype=torch.bool), "rloo_all"),
     ValueError, r"rewards must have shape \(\.\.\., G\) with G >= 1, got \(\)"),
    (lambda: C.group_advantages(torch.zeros(3), torch.ones(3), "rloo_all"), TypeError,
     "kept must be a bool torch.Tensor, got torch.float32"),
    (lambda: C.group_advantages(torch.zeros(3), torch.ones(2, dtype=torch.bool), "rloo_all"),
     ValueError, r"kept must have the same shape as rewards \(3,\), got \(2,\)"),
    (lambda: C.group_advantages(torch.zeros(3), torch.ones(3, dtype=torch.bool), "grpo"),
     ValueError, "baseline must be one of"),
    (lambda: C.group_advantages(torch.zeros(3), torch.ones(3, dtype=torch.bool), "grpo_std_all",
                                eps=0.0), ValueError, "eps must be > 0"),
    (lambda: C.group_advantages(torch.tensor([1.0, float("nan")]),
                                torch.ones(2, dtype=torch.bool), "rloo_all"),
     ValueError, "rewards must be finite, got a NaN or inf"),
    (lambda: C.group_advantages(torch.tensor([1e308, -1e308], dtype=torch.float64),
                                torch.ones(2, dtype=torch.bool), "rloo_all"),
     ValueError, "the advantages overflow torch.float64"),
    # the squared deviations overflow while the rewards are finite: A / inf was a silent 0
    (lambda: C.group_advantages(torch.tensor([2e19, -2e19, 0.0, 0.0]),
                                torch.ones(4, dtype=torch.bool), "grpo_std_all"),
     ValueError, "too large for the group's squared deviations"),
    (lambda: groups.group_advantages([1e155, -1e155, 0.0, 0.0], [True] * 4, "grpo_std_kept"),
     ValueError, "too large for the group's squared deviations"),
])
def test_bad_input_is_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.properties
@given(st.integers(1, 5), st.integers(1, 6), st.sampled_from(BASELINES), st.data())
def test_torch_and_numpy_agree_and_kept_grpo_advantages_sum_to_zero(B, G, baseline, data):
    rewards = np.array(data.draw(st.lists(st.floats(-100, 100), min_size=B * G,
                                          max_size=B * G))).reshape(B, G)
    kept = np.array(data.draw(st.lists(st.booleans(), min_size=B * G,
                                       max_size=B * G))).reshape(B, G)
    got = C.group_advantages(torch.from_numpy(rewards), torch.from_numpy(kept), baseline).numpy()
    expected = groups.group_advantages(rewards, kept, baseline)
    scale = 1 + np.abs(rewards).max()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12 * scale)
    assert np.isfinite(got).all() and (got[~kept] == 0).all()
    if baseline == "grpo_kept":  # R_i - mean over the kept: they sum to 0 where two or more
        many = kept.sum(-1) >= 2
        np.testing.assert_allclose(got[many].sum(-1), 0.0, atol=1e-10 * scale)
