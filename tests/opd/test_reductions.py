"""The reductions and discounts of ``opd_literate.opd``: ``discounted_returns``,
``aggregate_loss`` and ``sampled_token_opd_loss``, on an enumerable two-step model with
``<eos>`` and by hand.
"""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from opd_literate import opd
from opd_literate.opd import (
    REDUCTIONS,
    aggregate_loss,
    discounted_returns,
    full_vocab_reverse_kl,
    opd_pg_loss,
    reverse_kl_per_position,
    reverse_kl_rewards,
    sampled_token_opd_loss,
)
from tests.opd._inputs import D, _grad_of, _kl, _logits, _logp, _softmax_logs
from tests.opd.test_lab_opd import random_batch

# The claims of the reductions, on an enumerable two-step model with <eos>: the student writes
# token 1 from row 0; if it is <eos> the response ends, otherwise token 2 comes from row 1 + y_1.
# Every response and every pair of responses is enumerated, so expected gradients are exact.


DOUBLE = torch.float64


V, EOS, T = 3, 2, 2


SEQUENCES = [(EOS,)] + [(a, b) for a in (0, 1) for b in range(V)]  # the 7 responses


def model():
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(1 + V, V, generator=g, dtype=DOUBLE)  # rows 0 (step 1), 1 + y_1
    phi = torch.randn(1 + V, V, generator=g, dtype=DOUBLE)
    return theta, phi


def rows_of(y):
    """The logit row of each position of response y."""
    return [0] if len(y) == 1 else [0, 1 + y[0]]


def seq_logp(log_probs, y):
    return sum(log_probs[row, tok] for row, tok in zip(rows_of(y), y))


def sequence_kl_gradient(theta, phi):
    """grad of KL(pi_theta(y) || pi_T(y)) over the 7 responses, by autograd (no opd code)."""
    th = theta.clone().requires_grad_(True)
    lp, lq = F.log_softmax(th, -1), F.log_softmax(phi, -1)
    total = sum(seq_logp(lp, y).exp() * (seq_logp(lp, y) - seq_logp(lq, y)) for y in SEQUENCES)
    total.backward()
    return th.grad


def token_tensors(theta, phi, batch):
    """(B, T) student log-probs (with grad through theta), teacher log-probs and mask.

    Padding holds -inf in both models: the functions must select it away.
    """
    th = theta.clone().requires_grad_(True)
    lp, lq = F.log_softmax(th, -1), F.log_softmax(phi, -1)
    pad = torch.tensor(-math.inf, dtype=DOUBLE)
    s_rows, t_rows, masks = [], [], []
    for y in batch:
        s = [lp[row, tok] for row, tok in zip(rows_of(y), y)] + [pad] * (T - len(y))
        t = [lq[row, tok] for row, tok in zip(rows_of(y), y)] + [pad] * (T - len(y))
        s_rows.append(torch.stack(s))
        t_rows.append(torch.stack(t))
        masks.append([1.0] * len(y) + [0.0] * (T - len(y)))
    return th, torch.stack(s_rows), torch.stack(t_rows), torch.tensor(masks, dtype=DOUBLE)


def batch_probability(theta, batch):
    lp = F.log_softmax(theta, -1)
    return math.exp(sum(seq_logp(lp, y).item() for y in batch))


def expected_gradient(theta, phi, loss_of, B):
    """sum over all B-tuples of responses of P(batch) * grad_theta loss_of(batch)."""
    total = torch.zeros_like(theta)
    for batch in itertools.product(SEQUENCES, repeat=B):
        th, s, t, mask = token_tensors(theta, phi, batch)
        loss_of(th, s, t, mask, batch).backward()
        total += batch_probability(theta, batch) * th.grad
    return total


# ------------------------------------------------------------ independent numpy reference
def numpy_reference(theta, phi, weight, advantage):
    """sum_batch P(batch) sum_b weight(batch, b) sum_t A_bt (e_{y_t} - p_row), by hand."""
    lp = theta.log_softmax(-1).numpy()
    lq = phi.log_softmax(-1).numpy()
    p = np.exp(lp)
    out = np.zeros_like(lp)

    def expectation(B):
        for batch in itertools.product(SEQUENCES, repeat=B):
            prob = math.exp(sum(sum(lp[r, k] for r, k in zip(rows_of(y), y)) for y in batch))
            for b, y in enumerate(batch):
                w = weight(batch, b)
                for t, (row, tok) in enumerate(zip(rows_of(y), y)):
                    score = -p[row].copy()
                    score[tok] += 1.0  # grad of log p(tok | row) w.r.t. the row's logits
                    out[row] += prob * w * advantage(y, t, lp, lq, row, p) * score
        return out
    return expectation


def reward_to_go(y, t, lp, lq, row, p):
    """A_t with gamma = 1 times -1: sum_{k >= t} (log p - log q) of the response."""
    pairs = list(zip(rows_of(y), y))[t:]
    return sum(lp[r, k] - lq[r, k] for r, k in pairs)


def angle_degrees(a, b):
    """The angle between two gradients: 0 for a rescaled copy, so a scale-free bias."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    cos = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    return math.degrees(math.acos(min(1.0, cos)))


def gamma_one(reduction):
    def loss_of(th, s, t, mask, batch):
        return sampled_token_opd_loss(s, t, mask, gamma=1.0, reduction=reduction)
    return loss_of


# --------------------------------------------------------------------- item: gamma = 1
@pytest.mark.parametrize("B", [1, 2])
def test_gamma_one_is_unbiased_with_a_length_independent_normaliser(B):
    theta, phi = model()
    true = sequence_kl_gradient(theta, phi)
    # E[sum over the batch] = B * grad KL; seq-mean-token-sum divides by B; -norm by B T
    # (T = 2); token-sum-norm (verl's -norm before b8d91ef) by T
    for reduction, scale in [("sum", B), ("token-sum", B), ("seq-mean-token-sum", 1.0),
                             ("seq-mean-token-sum-norm", 1.0 / T), ("token-sum-norm", B / T)]:
        got = expected_gradient(theta, phi, gamma_one(reduction), B)
        torch.testing.assert_close(got, scale * true, rtol=1e-12, atol=1e-13)


# The figures the docs quote: the angle between the expected gradient and the true one (0 for
# an unbiased reduction, whatever its scale), from the numpy reference.
TOKEN_MEAN_ANGLE = {1: 7.26, 2: 3.42}


@pytest.mark.parametrize("B", [1, 2])
def test_gamma_one_is_biased_with_token_mean(B):
    theta, phi = model()
    true = sequence_kl_gradient(theta, phi).numpy()
    got = expected_gradient(theta, phi, gamma_one("token-mean"), B).numpy()

    ref = numpy_reference(theta, phi, lambda batch, b: 1.0 / sum(len(y) for y in batch),
                          reward_to_go)
    out = ref(B)
    np.testing.assert_allclose(got, out, rtol=1e-12, atol=1e-13)
    # not a rescaled true gradient: the direction is off
    assert angle_degrees(out, true) == pytest.approx(TOKEN_MEAN_ANGLE[B], abs=0.01)
    assert angle_degrees(true, 2.0 * true) < 1e-6  # the measure ignores the scale


def test_gamma_one_is_biased_with_seq_mean_token_mean():
    theta, phi = model()
    true = sequence_kl_gradient(theta, phi).numpy()
    got = expected_gradient(theta, phi, gamma_one("seq-mean-token-mean"), 2).numpy()
    ref = numpy_reference(theta, phi, lambda batch, b: 1.0 / (2 * len(batch[b])), reward_to_go)
    out = ref(2)
    np.testing.assert_allclose(got, out, rtol=1e-12, atol=1e-13)
    # with 1 / n_b per sequence the batch size does not matter: the B = 1 token-mean figure
    assert angle_degrees(out, true) == pytest.approx(TOKEN_MEAN_ANGLE[1], abs=0.01)


# ----------------------------------------------------- item: E[Task-2] = Task-3 gradient
def full_vocab_tensors(theta, phi, y):
    """(1, T, V) logits at the visited states; padding rows are -inf in the teacher."""
    th = theta.clone().requires_grad_(True)
    rows = rows_of(y)
    student = torch.stack([th[r] for r in rows] + [th[0]] * (T - len(y)))[None]
    teacher = torch.stack([phi[r] for r in rows]
                          + [torch.full((V,), -math.inf, dtype=DOUBLE)] * (T - len(y)))[None]
    mask = torch.tensor([[1.0] * len(y) + [0.0] * (T - len(y))], dtype=DOUBLE)
    return th, student, teacher, mask


def expected_task3(theta, phi, reduce):
    total = torch.zeros_like(theta)
    for y in SEQUENCES:
        th, student, teacher, mask = full_vocab_tensors(theta, phi, y)
        reduce(student, teacher, mask).backward()
        total += batch_probability(theta, [y]) * th.grad
    return total


def test_task2_equals_task3_in_expectation_with_a_fixed_normaliser():
    theta, phi = model()
    task2 = expected_gradient(
        theta, phi, lambda th, s, t, m, b: sampled_token_opd_loss(s, t, m, 0.0, "sum"), 1)
    task3 = expected_task3(
        theta, phi, lambda s, t, m: aggregate_loss(reverse_kl_per_position(s, t, m), m, "sum"))
    torch.testing.assert_close(task2, task3, rtol=1e-12, atol=1e-14)


TASK2_VS_TASK3_TOKEN_MEAN = 0.215  # |E[Task-2] - E[Task-3]| / |E[Task-3]|, same scale


def test_task2_differs_from_task3_in_expectation_with_token_mean():
    theta, phi = model()

    def task2_loss(th, s, t, m, b):
        return opd_pg_loss(s, reverse_kl_rewards(s, t, m), m)

    task2 = expected_gradient(theta, phi, task2_loss, 1).numpy()
    task3 = expected_task3(theta, phi, full_vocab_reverse_kl).numpy()

    # independent: the same sums with the per-state gradients written by hand
    lp, lq = theta.log_softmax(-1).numpy(), phi.log_softmax(-1).numpy()
    p = np.exp(lp)
    ref2, ref3 = np.zeros_like(lp), np.zeros_like(lp)
    for y in SEQUENCES:
        prob = math.exp(sum(lp[r, k] for r, k in zip(rows_of(y), y)))
        for row, tok in zip(rows_of(y), y):
            d = lp[row] - lq[row]
            score = -p[row].copy()
            score[tok] += 1.0
            ref2[row] += prob / len(y) * d[tok] * score
            ref3[row] += prob / len(y) * p[row] * (d - p[row] @ d)
    np.testing.assert_allclose(task2, ref2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(task3, ref3, rtol=1e-12, atol=1e-14)
    relative = np.linalg.norm(ref2 - ref3) / np.linalg.norm(ref3)
    assert relative == pytest.approx(TASK2_VS_TASK3_TOKEN_MEAN, abs=1e-3)


# Discounts and reductions on random batches.


# ------------------------------------------------------------------- k1, k2, k3 gradients


# ------------------------------------------------------------------- discount, reductions
class TestDiscountAndReductions:
    def test_discounted_returns_by_hand(self):
        r = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 7.0]])
        mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
        out = discounted_returns(r, mask, 0.5)
        expected = torch.tensor([[1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0, 0.0],
                                 [4 + 2.5 + 1.5 + 0.875, 5 + 3 + 1.75, 6 + 3.5, 7.0]])
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(discounted_returns(r, mask, 0.0), r * mask)

    def test_gamma_zero_token_mean_is_the_lab_loss(self):
        student, teacher, mask = random_batch(seed=14)
        s_logp = F.log_softmax(student, -1)[..., 0].clone().requires_grad_(True)
        t_logp = F.log_softmax(teacher, -1)[..., 0]
        lab = opd_pg_loss(s_logp, reverse_kl_rewards(s_logp, t_logp, mask), mask)
        ours = sampled_token_opd_loss(s_logp, t_logp, mask, gamma=0.0)
        torch.testing.assert_close(ours, lab, rtol=0, atol=0)

    def test_gamma_one_is_unbiased_for_the_sequence_reverse_kl_gradient(self):
        """Two-step toy LM, enumerated: E[grad of gamma=1 loss] = grad of sequence KL."""
        g = torch.Generator().manual_seed(15)
        V = 3
        theta = torch.randn(1 + V, V, generator=g, dtype=DOUBLE)  # row 0: first step; 1+y1
        phi = torch.randn(1 + V, V, generator=g, dtype=DOUBLE)

        def seq_kl(th):
            lp, lq = F.log_softmax(th, -1), F.log_softmax(phi, -1)
            total = 0
            for y1 in range(V):
                for y2 in range(V):
                    logp = lp[0, y1] + lp[1 + y1, y2]
                    total = total + logp.exp() * (logp - lq[0, y1] - lq[1 + y1, y2])
            return total

        true_grad = _grad_of(seq_kl, theta)
        expected_grad = torch.zeros_like(theta)
        lp = F.log_softmax(theta, -1).detach()
        for y1 in range(V):
            for y2 in range(V):
                th = theta.clone().requires_grad_(True)
                l_s = F.log_softmax(th, -1)
                l_t = F.log_softmax(phi, -1)
                s = torch.stack([l_s[0, y1], l_s[1 + y1, y2]]).reshape(1, 2)
                t = torch.stack([l_t[0, y1], l_t[1 + y1, y2]]).reshape(1, 2)
                sampled_token_opd_loss(s, t, torch.ones(1, 2), gamma=1.0,
                                       reduction="sum").backward()
                expected_grad += (lp[0, y1] + lp[1 + y1, y2]).exp() * th.grad
        torch.testing.assert_close(expected_grad, true_grad, rtol=1e-12, atol=1e-14)

    def test_reductions_on_a_ragged_mask(self):
        loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0],
                             [5.0, 5.0, 5.0, 5.0]])
        mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
        # tokens: 1+2+3+4 = 10, 10+20 = 30, none
        assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(40 / 6)
        assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(40 / 3)
        assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(
            (10 / 4 + 30 / 2 + 0) / 3
        )
        assert aggregate_loss(loss, mask, "sum").item() == pytest.approx(40.0)
        assert aggregate_loss(loss, mask, "token-sum").item() == pytest.approx(40.0)
        # a constant 1 / (B T) (B = 3 rows, T = 4, the padded length), not 1 / (tokens)
        assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(
            40 / 12)
        # the old meaning, a constant 1 / T
        assert aggregate_loss(loss, mask, "token-sum-norm").item() == pytest.approx(10.0)
        # the fully masked third sequence counts in 1 / B (verl's agg_loss would divide by 2)
        assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() != pytest.approx(20.0)

    @pytest.mark.parametrize("reduction", REDUCTIONS)
    def test_masked_tokens_never_contribute(self, reduction):
        loss = torch.tensor([[1.0, 2.0, math.inf], [3.0, math.nan, -math.inf]],
                            requires_grad=True)
        mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
        out = aggregate_loss(loss, mask, reduction)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(loss.grad).all()
        assert (loss.grad[mask == 0] == 0).all()
        assert aggregate_loss(loss.detach(), torch.zeros(2, 3), reduction).item() == 0.0


# Found by mutation testing (docs/mutation.md): each reduction written out by hand, the defaults.










# -------------------------------------------------------------------------------------------
# Defaults, against float64 formulas
# -------------------------------------------------------------------------------------------




def _hand_reductions(x, m):
    n = m.sum(1)
    return {
        "token-mean": (x * m).sum() / m.sum(),
        "seq-mean-token-sum": (x * m).sum(1).mean(),
        "seq-mean-token-mean": ((x * m).sum(1) / n).mean(),
        "seq-mean-token-sum-norm": (x * m).sum(1).mean() / x.shape[1],
        "sum": (x * m).sum(),
        "token-sum": (x * m).sum(),
        "token-sum-norm": (x * m).sum() / x.shape[1],
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
