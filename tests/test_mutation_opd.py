r"""opd: the lines that mutation testing found unchecked (docs/mutation.md).

Error messages are matched in full, so that each names the right argument; defaults are the
ones the signatures document, checked against values computed here in float64 (softmax,
KL, JSD and the reductions written out by hand).
"""

import math
import re

import pytest
import torch

from opd_literate import opd

D = torch.float64


def _logits(B=2, T=3, V=4, seed=0, dtype=D):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g, dtype=D).to(dtype)


def _logp(B=2, T=3, seed=0):
    return torch.log_softmax(_logits(B, T, 4, seed), -1)[..., 0]


ONES = torch.ones(2, 3)

# (name, call taking the arguments by name, the valid arguments)
TOKEN = {"student_logp": _logp(seed=1), "teacher_logp": _logp(seed=2), "mask": ONES}
LOGITS = {"student_logits": _logits(seed=1), "teacher_logits": _logits(seed=2), "mask": ONES}
FUNCTIONS = {
    "reverse_kl_rewards": (lambda a: opd.reverse_kl_rewards(
        a["student_logp"], a["teacher_logp"], a["mask"]), TOKEN),
    "sampled_token_opd_loss": (lambda a: opd.sampled_token_opd_loss(
        a["student_logp"], a["teacher_logp"], a["mask"]), TOKEN),
    "opd_pg_loss": (lambda a: opd.opd_pg_loss(a["student_logp"], a["rewards"], a["mask"]),
                    {"student_logp": _logp(seed=1), "rewards": _logp(seed=2), "mask": ONES}),
    "full_vocab_reverse_kl": (lambda a: opd.full_vocab_reverse_kl(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "reverse_kl_per_position": (lambda a: opd.reverse_kl_per_position(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "forward_kl": (lambda a: opd.forward_kl(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "forward_kl_per_position": (lambda a: opd.forward_kl_per_position(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "generalized_jsd": (lambda a: opd.generalized_jsd(
        a["student_logits"], a["teacher_logits"], a["mask"]), LOGITS),
    "generalized_jsd_per_position": (lambda a: opd.generalized_jsd_per_position(
        a["student_logits"], a["teacher_logits"], mask=a["mask"]), LOGITS),
    "discounted_returns": (lambda a: opd.discounted_returns(a["rewards"], a["mask"], 0.5),
                           {"rewards": _logp(seed=1), "mask": ONES}),
    "aggregate_loss": (lambda a: opd.aggregate_loss(a["per_token_loss"], a["mask"]),
                       {"per_token_loss": _logp(seed=1), "mask": ONES}),
}


def _cases():
    """Every tensor argument of every function, each broken in every way a check catches."""
    for fn_name, (_call, args) in FUNCTIONS.items():
        names = [n for n in args if n != "mask"]
        first = names[0]
        shape = tuple(args[first].shape)
        for name in names:
            x = args[name]
            yield fn_name, name, "int", x.to(torch.int64), TypeError, (
                f"{name} must have a floating dtype, got torch.int64")
            yield fn_name, name, "list", x.tolist(), TypeError, (
                f"{name} must be a torch.Tensor, got list")
            bigger = x[..., None]
            yield fn_name, name, "ndim", bigger, ValueError, (
                f"{name} must have {x.ndim} dimensions, got shape {tuple(bigger.shape)} "
                f"({bigger.ndim} dimensions)")
        for name in names[1:]:
            other = torch.cat([args[name], args[name][:, :1]], dim=1)
            yield fn_name, name, "shape", other, ValueError, (
                f"{name} must have the same shape as {first} {shape}, got {tuple(other.shape)}")
        like = first + ("[..., 0]" if args[first].ndim == 3 else "")
        yield fn_name, "mask", "shape", torch.ones(2, 4), ValueError, (
            f"mask must have the shape of {like} {shape[:2]}, got (2, 4)")


CASES = list(_cases())


@pytest.mark.parametrize("fn_name, name, how, bad, error, message", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_every_error_names_its_argument(fn_name, name, how, bad, error, message):
    call, args = FUNCTIONS[fn_name]
    call(args)  # the valid arguments pass
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        call({**args, name: bad})


def test_ndim_message_of_a_three_d_logits_pair():
    # 4-d teacher logits: the teacher's own ndim check speaks first
    with pytest.raises(ValueError, match=r"^teacher_logits must have 3 dimensions, got shape "
                       r"\(2, 3, 4, 1\) \(4 dimensions\)$"):
        opd.full_vocab_reverse_kl(LOGITS["student_logits"], LOGITS["teacher_logits"][..., None],
                                  ONES)


@pytest.mark.parametrize("call, message", [
    (lambda: opd.full_vocab_reverse_kl(_logits(V=4), _logits(V=5), ONES),
     r"teacher_logits must have the vocabulary size of student_logits \(V = 4\), got V = 5; "
     "student and teacher must share one tokenizer"),
    (lambda: opd.forward_kl(_logits(V=0), _logits(V=0), ONES),
     r"student_logits must have a vocabulary of at least 1 entry, got shape \(2, 3, 0\) "
     r"\(V = 0\)"),
    (lambda: opd.expected_kl_estimator_gradient(_logits(), _logits(), "k1", "grad"),
     "mode must be 'loss' or 'reward', got 'grad'"),
    (lambda: opd.expected_kl_estimator_gradient(_logits(), _logits(), "k4"),
     r"kind must be one of \('k1', 'k2', 'k3'\), got 'k4'"),
    (lambda: opd.expected_kl_estimator_gradient(torch.tensor(1.0, dtype=D),
                                                torch.tensor(1.0, dtype=D)),
     "student_logits must have a vocabulary axis, got a 0-d tensor"),
    (lambda: opd.expected_kl_estimator_gradient(_logits(), _logits(V=5)),
     r"teacher_logits must have the same shape as student_logits \(2, 3, 4\), got \(2, 3, 5\)"),
    (lambda: opd.kl_estimator(_logp(), _logp(), "K1"),
     r"kind must be one of \('k1', 'k2', 'k3'\), got 'K1'"),
    (lambda: opd.kl_estimator(_logp(), _logp()[:, :2]),
     r"teacher_logp must have the same shape as student_logp \(2, 3\), got \(2, 2\)"),
    (lambda: opd.kl_estimator(_logp().long(), _logp()),
     "student_logp must have a floating dtype, got torch.int64"),
    (lambda: opd.kl_estimator(_logp(), _logp().long()),
     "teacher_logp must have a floating dtype, got torch.int64"),
    (lambda: opd.expected_kl_estimator_gradient(_logits().long(), _logits()),
     "student_logits must have a floating dtype, got torch.int64"),
    (lambda: opd.expected_kl_estimator_gradient(_logits(), _logits().long()),
     "teacher_logits must have a floating dtype, got torch.int64"),
    (lambda: opd.aggregate_loss(_logp(), ONES, "mean"),
     r"reduction must be one of \('token-mean', 'seq-mean-token-sum', "),
    (lambda: opd.sampled_token_opd_loss(_logp(), _logp(), ONES, reduction="mean"),
     r"reduction must be one of \('token-mean', 'seq-mean-token-sum', "),
    (lambda: opd.discounted_returns(_logp(), ONES, 1.5), "gamma must be <= 1.0, got 1.5"),
    (lambda: opd.discounted_returns(_logp(), ONES, -0.5), "gamma must be >= 0.0, got -0.5"),
    (lambda: opd.generalized_jsd_per_position(_logits(), _logits(), beta=-0.1),
     "beta must be >= 0.0, got -0.1"),
    (lambda: opd.generalized_jsd_per_position(_logits(), _logits(), beta=1.1),
     "beta must be <= 1.0, got 1.1"),
    (lambda: opd.generalized_jsd(_logits(), _logits(), ONES, beta=float("nan")),
     "beta must be a finite number, got nan"),
    (lambda: opd.generalized_jsd_per_position(_logits(), _logits(), normalize=1),
     "normalize must be a bool, got int 1"),
    (lambda: opd.reverse_kl_per_position(_logits(), _logits(), temperature=0.0),
     "temperature must be > 0, got 0.0"),
    (lambda: opd.forward_kl(_logits(), _logits(), ONES, temperature=float("inf")),
     "temperature must be a finite number, got inf"),
])
def test_messages_in_full(call, message):
    with pytest.raises((ValueError, TypeError), match="^" + message):
        call()


# -------------------------------------------------------------------------------------------
# Defaults, against float64 formulas
# -------------------------------------------------------------------------------------------
def _softmax_logs(z):
    z = z.to(D)
    return z - torch.logsumexp(z, -1, keepdim=True)


def _kl(log_a, log_b):
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def test_kl_estimator_default_is_k1_and_each_kind_is_its_formula():
    s, t = _logp(seed=1), _logp(seed=2)
    d = s - t
    torch.testing.assert_close(opd.kl_estimator(s, t), d, rtol=0, atol=0)
    torch.testing.assert_close(opd.kl_estimator(s, t, "k2"), d**2 / 2)
    torch.testing.assert_close(opd.kl_estimator(s, t, "k3"), torch.exp(-d) - 1 + d)


def test_jsd_default_beta_is_one_half():
    s, t = _logits(seed=1), _logits(seed=2)
    log_p, log_q = _softmax_logs(s), _softmax_logs(t)
    log_m = torch.log(0.5 * log_p.exp() + 0.5 * log_q.exp())
    jsd = 0.5 * _kl(log_q, log_m) + 0.5 * _kl(log_p, log_m)
    torch.testing.assert_close(opd.generalized_jsd_per_position(s, t), jsd)
    torch.testing.assert_close(opd.generalized_jsd(s, t, ONES), jsd.mean())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_default_temperature_is_one(temperature):
    s, t = _logits(seed=1), _logits(seed=2)
    want = _kl(_softmax_logs(s / temperature), _softmax_logs(t / temperature))
    kwargs = {} if temperature == 1.0 else {"temperature": temperature}
    torch.testing.assert_close(opd.reverse_kl_per_position(s, t, **kwargs), want)
    torch.testing.assert_close(opd.full_vocab_reverse_kl(s, t, ONES, **kwargs), want.mean())


def test_expected_gradient_defaults_are_k1_and_loss():
    s, t = _logits(seed=1), _logits(seed=2)
    torch.testing.assert_close(opd.expected_kl_estimator_gradient(s, t),
                               opd.expected_kl_estimator_gradient(s, t, "k1", "loss"), rtol=0,
                               atol=0)
    # k1 as a loss has expected gradient 0: E_p[grad log p] = 0 (the score has mean zero)
    assert opd.expected_kl_estimator_gradient(s, t).abs().max() < 1e-14
    # k1 as a reward (REINFORCE) gives the gradient of KL(p || q)
    s_var = s.clone().requires_grad_(True)
    _kl(_softmax_logs(s_var), _softmax_logs(t)).sum().backward()
    torch.testing.assert_close(opd.expected_kl_estimator_gradient(s, t, "k1", "reward"),
                               s_var.grad)


def _hand_reductions(x, m):
    n = m.sum(1)
    return {
        "token-mean": (x * m).sum() / m.sum(),
        "seq-mean-token-sum": (x * m).sum(1).mean(),
        "seq-mean-token-mean": ((x * m).sum(1) / n).mean(),
        "seq-mean-token-sum-norm": (x * m).sum() / x.shape[1],
        "sum": (x * m).sum(),
    }


@pytest.mark.parametrize("B", [1, 2])
def test_every_reduction_by_hand(B):
    x = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], dtype=D)[:B]
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=D)[:B]
    want = _hand_reductions(x, m)
    for reduction, value in want.items():
        assert opd.aggregate_loss(x, m, reduction).item() == value.item(), reduction
    assert opd.aggregate_loss(x, m).item() == want["token-mean"].item()  # the default


def test_sampled_token_loss_defaults():
    s, t = _logp(seed=1), _logp(seed=2)
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # gamma 0, token-mean: -sum m * sg(t - s) * s / sum m
    want = -((t - s) * s * m).sum() / m.sum()
    torch.testing.assert_close(opd.sampled_token_opd_loss(s, t, m), want)


def test_discounted_returns_of_one_position():
    r = torch.tensor([[2.0], [-3.0]])
    assert opd.discounted_returns(r, torch.ones(2, 1), 0.5).tolist() == [[2.0], [-3.0]]
    assert opd.discounted_returns(r, torch.ones(2, 1), 1.0).tolist() == [[2.0], [-3.0]]


def test_gamma_one_and_beta_bounds_are_accepted():
    r = torch.tensor([[1.0, 2.0, 4.0]])
    assert opd.discounted_returns(r, torch.ones(1, 3), 1.0).tolist() == [[7.0, 6.0, 4.0]]
    s, t = _logits(seed=1), _logits(seed=2)
    # the mixture is beta q + (1 - beta) p: beta = 0 is KL(q || p), beta = 1 is KL(p || q)
    torch.testing.assert_close(opd.generalized_jsd_per_position(s, t, beta=0.0),
                               _kl(_softmax_logs(t), _softmax_logs(s)))
    torch.testing.assert_close(opd.generalized_jsd_per_position(s, t, beta=1.0),
                               _kl(_softmax_logs(s), _softmax_logs(t)))


# -------------------------------------------------------------------------------------------
# Mixed precision: the promoted dtype
# -------------------------------------------------------------------------------------------
def test_mixed_precision_computes_in_the_wider_dtype():
    s32, t64 = _logits(seed=1, dtype=torch.float32), _logits(seed=2)
    want = _kl(_softmax_logs(s32.to(D)), _softmax_logs(t64))
    for got in (opd.reverse_kl_per_position(s32, t64), opd.forward_kl_per_position(t64, s32)):
        assert got.dtype == D
    torch.testing.assert_close(opd.reverse_kl_per_position(s32, t64), want, rtol=1e-12,
                               atol=1e-14)
    torch.testing.assert_close(opd.full_vocab_reverse_kl(s32, t64, ONES), want.mean(),
                               rtol=1e-12, atol=1e-14)


def test_pg_loss_computes_in_the_promoted_dtype():
    s32 = _logp(seed=1).to(torch.float32)
    r64 = _logp(seed=2)
    loss = opd.opd_pg_loss(s32, r64, ONES)
    assert loss.dtype == D
    torch.testing.assert_close(loss, -(r64 * s32.to(D)).sum() / 6, rtol=1e-15, atol=0)


# -------------------------------------------------------------------------------------------
# Survivors of the measurement on the current code
# -------------------------------------------------------------------------------------------
def test_temperature_with_huge_and_impossible_logits():
    # z / tau would overflow for z = 1e308, tau = 0.5: each row is shifted by its own largest
    # finite entry first. Rows: p = (1, 0, 0) twice, then softmax((0, 1, 2) / 0.5).
    s = torch.tensor([[[1e308, 0.0, 0.0], [1e308, -math.inf, 0.0], [0.0, 1.0, 2.0]]], dtype=D)
    t = torch.zeros(1, 3, 3, dtype=D)  # a uniform teacher
    log_p2 = torch.log_softmax(torch.tensor([0.0, 2.0, 4.0], dtype=D), -1)
    want = [math.log(3.0), math.log(3.0), float((log_p2.exp() * (log_p2 + math.log(3))).sum())]
    got = opd.reverse_kl_per_position(s, t, temperature=0.5)
    assert torch.allclose(got[0], torch.tensor(want, dtype=D), rtol=1e-12, atol=0)


@pytest.mark.parametrize("call", [
    lambda: opd.full_vocab_reverse_kl(_logits(), _logits(), ONES, temperature=0.0),
    lambda: opd.generalized_jsd_per_position(_logits(), _logits(), temperature=0.0),
    lambda: opd.generalized_jsd(_logits(), _logits(), ONES, temperature=-1.0),
    lambda: opd.forward_kl_per_position(_logits(), _logits(), temperature=0.0),
])
def test_temperature_is_named(call):
    with pytest.raises(ValueError, match="^temperature must be > 0, got "):
        call()


@pytest.mark.parametrize("beta", [0.3, 0.5])
def test_masked_jsd_positions_are_exactly_zero(beta):
    s, t = _logits(V=7, seed=3), _logits(V=7, seed=4)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    got = opd.generalized_jsd_per_position(s, t, beta=beta, mask=mask)
    assert (got[mask == 0] == 0).all() and (got[mask == 1] > 0).all()


@pytest.mark.parametrize("student, teacher", [(torch.float32, D), (D, torch.float32),
                                              (torch.float16, torch.float16)])
def test_kl_estimators_compute_in_the_promoted_dtype(student, teacher):
    s, t = _logp(seed=1).to(student), _logp(seed=2).to(teacher)
    want_dtype = D if D in (student, teacher) else torch.float32
    d = s.to(D) - t.to(D)  # exact: float16/32 values are float64 values
    for kind, value in (("k1", d), ("k2", d**2 / 2), ("k3", torch.expm1(-d) + d)):
        got = opd.kl_estimator(s, t, kind)
        assert got.dtype == want_dtype
        tol = 1e-15 if want_dtype == D else 1e-6
        torch.testing.assert_close(got.to(D), value, rtol=tol, atol=tol)
    zs, zt = _logits(seed=1, dtype=student), _logits(seed=2, dtype=teacher)
    for kind in ("k1", "k2", "k3"):
        got = opd.expected_kl_estimator_gradient(zs, zt, kind, "reward")
        assert got.dtype == want_dtype
        want = opd.expected_kl_estimator_gradient(zs.to(D), zt.to(D), kind, "reward")
        tol = 1e-14 if want_dtype == D else 1e-6
        torch.testing.assert_close(got.to(D), want, rtol=tol, atol=tol)


def test_the_smallest_temperature_is_one_over_the_largest_number():
    big = torch.finfo(torch.float32).max
    s = torch.tensor([[[0.0, 1.0]]])
    t = torch.tensor([[[0.5, 1.0]]])
    # 1 / tau = big exactly, and 1 / tau = big / 1.5: accepted; the limit tau -> 0 is the argmax,
    # the same token for both, so the KL is 0
    for tau in (1.0 / big, 1.5 / big):
        assert 1.0 / tau <= big
        assert opd.reverse_kl_per_position(s, t, temperature=tau).tolist() == [[0.0]]
    with pytest.raises(ValueError, match=r"^temperature must be at least 1 / \(the largest "
                       r"torch.float32 number\), got "):
        opd.reverse_kl_per_position(s, t, temperature=0.5 / big)


@pytest.mark.parametrize("student, other", [(torch.float32, D), (D, torch.float32)])
def test_rewards_and_pg_loss_in_the_promoted_dtype(student, other):
    s, t = _logp(seed=1).to(student), _logp(seed=2).to(other)
    rewards = opd.reverse_kl_rewards(s, t, ONES)
    assert rewards.dtype == D
    assert torch.equal(rewards, t.to(D) - s.to(D))  # exact: both are float64 values
    loss = opd.opd_pg_loss(s, t, ONES)
    assert loss.dtype == D
    torch.testing.assert_close(loss, -(t.to(D) * s.to(D)).sum() / 6, rtol=1e-15, atol=0)
