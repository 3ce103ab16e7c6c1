"""The cases the full mutation run of opd_literate/large_vocab/clamps.py found no test held
(docs/mutation.md): refusals and their messages, the mass tolerance in the promoted dtype, the
output dtype, a 0-d mask, the gradient at an impossible token, the devices of created tensors,
the softmax dimension named, clamp_study's defaults, a cap exactly at the rounding.

Each test names the mutants it kills (``clamps.x_FUNCTION__mutmut_N``). Expected values come from
the docstrings' definitions and hand arithmetic, not from the module's output.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import opd_literate.large_vocab.clamps as C

LOG_Q2 = torch.log(torch.tensor([0.5, 0.25]))  # a two-token report, Q = 0.75
# 0.5 log(0.5 / (1/3)) + 0.25 log(0.25 / (1/3)): the value against a uniform student on V = 3
UNIFORM_VALUE = 0.5 * math.log(1.5) + 0.25 * math.log(0.75)


# --- _check_report ---------------------------------------------------------------------------

def test_shape_message_names_the_leading_shape_of_a_1d_student():
    # _check_report 48 (shape[:+1] in the message): the leading shape of a (3,) student is ()
    with pytest.raises(ValueError, match=r"leading shape of student_logits \(\), got \(1, 2\)"):
        C.verl_forward_kl_topk(torch.zeros(3), LOG_Q2[None], torch.tensor([[0, 1]]))


def test_repeated_id_that_is_not_the_smallest_is_refused():
    # _check_report 117 (the timeout; ordered[..., :+1] compares every id with the smallest only)
    with pytest.raises(ValueError, match="must not repeat an id"):
        C.verl_forward_kl_topk(torch.zeros(3), torch.log(torch.tensor([0.5, 0.25, 0.125])),
                               torch.tensor([0, 1, 1]))


@pytest.mark.parametrize("student_dtype, teacher_dtype",
                         [(torch.float64, torch.float32),   # _check_report 164
                          (torch.float32, torch.float64)])  # _check_report 165
def test_mass_tolerance_uses_the_compute_dtype_of_both_inputs(student_dtype, teacher_dtype):
    # k = V = 1000 reported probabilities of 1.0006 / 1000 each: Q = 1.0006. In the compute
    # dtype float64 the tolerance is sqrt(eps32) + 4 k eps64 = 3.45e-4 + 9e-13, so Q is refused;
    # computed in float32 it would be sqrt(eps32) + 4 k eps32 = 8.2e-4, and Q would pass.
    V = 1000
    report = torch.full((V,), math.log(1.0006 / V), dtype=teacher_dtype)
    with pytest.raises(ValueError, match="sum to 1.0006"):
        C.verl_forward_kl_topk(torch.zeros(V, dtype=student_dtype), report, torch.arange(V))


# --- _selected -------------------------------------------------------------------------------

def test_zero_dimensional_mask_of_a_single_position():
    # _selected 11 (arange(shape[+1])): a (V,) student with a 0-d mask has ids of shape (k,)
    value = C.verl_forward_kl_topk(torch.zeros(3), LOG_Q2, torch.tensor([0, 1]), torch.tensor(1))
    assert value.shape == ()
    assert value.item() == pytest.approx(UNIFORM_VALUE, rel=1e-6)
    assert C.verl_forward_kl_topk(torch.zeros(3), LOG_Q2, torch.tensor([0, 1]),
                                  torch.tensor(0)).item() == 0.0


# --- _clamped_terms --------------------------------------------------------------------------

@pytest.mark.parametrize("student_dtype, teacher_dtype",
                         [(torch.float64, torch.float32),   # _clamped_terms 4
                          (torch.float32, torch.float64)])  # _clamped_terms 5
def test_value_is_in_the_promoted_dtype(student_dtype, teacher_dtype):
    value = C.verl_forward_kl_topk(torch.zeros(3, dtype=student_dtype), LOG_Q2.to(teacher_dtype),
                                   torch.tensor([0, 1]))
    assert value.dtype == torch.float64
    assert value.item() == pytest.approx(UNIFORM_VALUE, rel=1e-6)


# --- _token_terms ----------------------------------------------------------------------------

def test_impossible_token_has_zero_gradient_also_in_the_teacher():
    # _token_terms 8 (s_bar == +inf: the -inf student term goes through q (t - s) = q * inf,
    # whose gradient in q is 0 * inf = NaN). The module docstring: value +inf, zero gradient.
    teacher = LOG_Q2.clone().requires_grad_(True)
    student = torch.tensor([0.0, -math.inf, 0.0], requires_grad=True)
    value = C.verl_forward_kl_topk(student, teacher, torch.tensor([0, 1]))
    value.sum().backward()
    assert value.item() == math.inf
    assert teacher.grad.tolist() == [0.0, 0.0]
    assert student.grad.tolist() == [0.0, 0.0, 0.0]


# --- error messages --------------------------------------------------------------------------

def test_loss_max_clamp_message_names_the_argument():
    # verl_forward_kl_topk 28
    with pytest.raises(ValueError, match=r"^loss_max_clamp must be >= 0"):
        C.verl_forward_kl_topk(torch.zeros(3), LOG_Q2, torch.tensor([0, 1]), loss_max_clamp=-1.0)


def test_weighted_study_messages():
    s = torch.zeros(2, 3, dtype=torch.float64)
    bad = torch.tensor([[0.0, 1.0, math.nan]] * 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^student_logits and teacher_logits must be finite$"):
        C.weighted_clamp_study(s, bad, torch.ones(2), ks=[1])  # weighted_clamp_study 30
    with pytest.raises(ValueError, match=r"^weights must be finite, >= 0 and not all 0$"):
        C.weighted_clamp_study(s, s, torch.zeros(2), ks=[1])  # weighted_clamp_study 59


# --- softmax dimension -----------------------------------------------------------------------

def test_weighted_study_names_the_softmax_dimension():
    # weighted_clamp_study 118, 120 (log_softmax dim None/omitted), 127, 129 (softmax): same
    # values on 2-d inputs, but torch warns "Implicit dimension choice ... deprecated".
    s = torch.zeros(2, 3, dtype=torch.float64)
    t = torch.tensor([[0.0, 1.0, 2.0]] * 2, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.weighted_clamp_study(s, t, torch.ones(2), ks=[1])


# --- devices: a default device other than the inputs' ----------------------------------------

def test_tensors_are_created_on_the_inputs_device():
    # Under a meta default device with CPU inputs, a factory without device= lands on meta:
    # _check_report 85, 88 (rows), _selected 6, 9 (ids), topk_diagnostics 34, 37 (keep).
    student = torch.zeros(2, 3)
    teacher = LOG_Q2.expand(2, 2)
    ids = torch.tensor([[0, 1], [0, 1]])
    mask = torch.tensor([1, 0])
    with torch.device("meta"):
        plain = C.verl_forward_kl_topk(student, teacher, ids)
        masked = C.verl_forward_kl_topk(student, teacher, ids, mask)
        d = C.topk_diagnostics(student, teacher, ids)
    assert plain.device.type == masked.device.type == "cpu"
    assert plain.tolist() == pytest.approx([UNIFORM_VALUE] * 2, rel=1e-6)
    assert masked.tolist() == pytest.approx([UNIFORM_VALUE, 0.0], rel=1e-6)
    assert d["metrics"]["student_mass"] == pytest.approx(2 / 3, rel=1e-6)


def test_clamp_study_weights_on_the_pairs_device(monkeypatch):
    # clamp_study 66, 69: the weights it passes are on the pairs' device (here CPU pairs under a
    # meta default device), in their dtype
    seen = []
    original = C.zipf_pair

    def cpu_pair(*args):
        with torch.device("cpu"):
            return original(*args)

    def record(student, teacher, weights, ks, **kwargs):
        seen.append((weights.device.type, weights.dtype, weights.tolist() if
                     weights.device.type == "cpu" else None))
        return []

    monkeypatch.setattr(C, "zipf_pair", cpu_pair)
    monkeypatch.setattr(C, "weighted_clamp_study", record)
    with torch.device("meta"):
        C.clamp_study(V=8, temperatures=(1.0,), noises=(1.0,), ks=(1,), positions=2)
    assert seen == [("cpu", torch.float64, [1.0, 1.0])]


# --- clamp_study's defaults ------------------------------------------------------------------

def test_clamp_study_defaults(monkeypatch):
    # clamp_study 1 (V), 2 (exponent), 3 (positions), 4 (seed): the documented defaults reach
    # zipf_pair, 64 seeds 0..63 for each of the 2 x 3 (temperature, noise) pairs
    calls = []

    def fake_pair(V, exponent, temperature, noise, seed):
        calls.append((V, exponent, temperature, noise, seed))
        return torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)

    monkeypatch.setattr(C, "zipf_pair", fake_pair)
    monkeypatch.setattr(C, "weighted_clamp_study", lambda *a, **k: [])
    C.clamp_study()
    expected = [(4096, 1.1, temperature, noise, seed) for temperature in (0.7, 1.0)
                for noise in (0.5, 1.0, 2.0) for seed in range(64)]
    assert calls == expected


# --- ties at the rounding bounds -------------------------------------------------------------

def test_capped_only_beyond_the_rounding_at_an_exact_tie():
    # weighted_clamp_study 243 (raw >= M + noise): with M chosen so that M + value_noise equals
    # the value exactly, the value does not exceed M beyond its rounding: capped = 0
    d = torch.float64
    student = torch.zeros(1, 3, dtype=d)
    teacher = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=d))
    report, ids = F.log_softmax(teacher, -1).topk(2, -1)
    _, _, s_bar, t_bar = C._clamped_terms(student, report, ids, None)
    raw = C._value(student, report, ids, None, None)[1].item()
    noise = C._value_noise(s_bar, t_bar, 3).item()
    high = raw - noise
    for _ in range(64):
        if high + noise == raw:
            break
        high = math.nextafter(high, math.inf if high + noise < raw else -math.inf)
    assert high + noise == raw  # the tie exists
    assert raw == pytest.approx(UNIFORM_VALUE)
    [row] = C.weighted_clamp_study(student, teacher, torch.ones(1), ks=[2], loss_max_clamp=high)
    assert row["capped"] == 0.0
    [row] = C.weighted_clamp_study(student, teacher, torch.ones(1), ks=[2],
                                   loss_max_clamp=math.nextafter(high, -math.inf))
    assert row["capped"] == 1.0
