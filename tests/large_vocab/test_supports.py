"""opd_literate.large_vocab.supports: the support rules, their losses, bounds and study.

Every value is checked against plain-Python sums over an enumerated vocabulary (float64), every
gradient against autograd of the full-vocabulary divergence or a closed form, every bound on
random cases and a counterexample where the docstring says there is none.
``tests/integration/test_trl.py`` calls TRL's own losses on the same supports.
"""

import math
import re

import pytest
import torch

from opd_literate.large_vocab import supports as sp
from opd_literate.large_vocab.supports import (
    CHOICES,
    SUPPORTS,
    Support,
    build_support,
    expected_sampled_divergence,
    forward_kl_upper_bound,
    reinforce_reverse_kl,
    skip_first_tokens,
    support_bias,
    support_divergence,
    trl_support_rule,
)
from opd_literate.large_vocab.topk import topk_kl, zipf_pair
from opd_literate.opd import generalized_jsd_per_position
from tests.helpers.committed import FLOAT64_SUMS, assert_matches_committed

F64 = torch.float64


def _pair(seed, V=7, scale=2.0, shape=()):
    g = torch.Generator().manual_seed(seed)
    s = scale * torch.randn(*shape, V, generator=g, dtype=F64)
    t = scale * torch.randn(*shape, V, generator=g, dtype=F64)
    return s, t, g


def _full(s, t, beta):
    """D_beta over the whole vocabulary (opd's dense loss), per position."""
    flat_s, flat_t = s.reshape(1, -1, s.shape[-1]), t.reshape(1, -1, t.shape[-1])
    return generalized_jsd_per_position(flat_s, flat_t, beta=beta)[0].reshape(s.shape[:-1])


def _plain_divergence(a, b, beta):
    """D_beta between two lists of probabilities (Python floats), 0 log 0 = 0."""
    def kl(x, y):
        return sum(xi * math.log(xi / yi) for xi, yi in zip(x, y) if xi > 0)
    if beta == 0:
        return kl(b, a)
    if beta == 1:
        return kl(a, b)
    m = [beta * bi + (1 - beta) * ai for ai, bi in zip(a, b)]
    return beta * kl(b, m) + (1 - beta) * kl(a, m)


def _plain(s, t, ids, beta, approximation):
    """The support's divergence from the definitions, one position, Python floats."""
    p = torch.softmax(s, -1).tolist()
    q = torch.softmax(t, -1).tolist()
    ps, qs = [p[v] for v in ids], [q[v] for v in ids]
    if approximation == "renormalize":
        return _plain_divergence([x / sum(ps) for x in ps], [x / sum(qs) for x in qs], beta)
    tail_p = sum(p[v] for v in range(len(p)) if v not in ids)
    tail_q = sum(q[v] for v in range(len(q)) if v not in ids)
    return _plain_divergence(ps + [tail_p], qs + [tail_q], beta)


def _support(ids, t):
    ids = torch.as_tensor(ids)
    return Support(ids, torch.ones_like(ids, dtype=torch.bool), torch.log_softmax(t, -1)[ids])


def _grad(fn, z):
    z = z.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(z).sum(), z)
    return g


# ---------------------------------------------------------------------------------------------
# The supports
# ---------------------------------------------------------------------------------------------
def test_every_rule_selects_the_set_its_docstring_names():
    s, t, g = _pair(0, V=9, shape=(3,))
    x = torch.randint(0, 9, (3,), generator=g)
    x[0] = t[0].argmax()  # one position where the sampled token is the teacher's top-1
    for rule in SUPPORTS:
        tokens = x if rule in ("sampled", "teacher_top1_sampled") else None
        support = build_support(rule, 3, s, t, tokens=tokens)
        for row in range(3):
            by_s = sorted(range(9), key=lambda v: -s[row, v].item())
            by_t = sorted(range(9), key=lambda v: -t[row, v].item())
            want = {"teacher_topk": by_t[:3], "student_topk": by_s[:3],
                    "union": by_t[:3] + [v for v in by_s[:3] if v not in by_t[:3]],
                    "sampled": [x[row].item()], "argmax": by_s[:1],
                    "teacher_top1_sampled": list(dict.fromkeys([by_t[0], x[row].item()])),
                    "teacher_top1_argmax": list(dict.fromkeys([by_t[0], by_s[0]]))}[rule]
            ids, valid = support.ids[row].tolist(), support.valid[row].tolist()
            assert [v for v, ok in zip(ids, valid) if ok] == want, (rule, row)
            log_q = torch.log_softmax(t[row], -1)
            for v, ok, lq in zip(ids, valid, support.teacher_logp[row].tolist()):
                if ok:
                    assert lq == pytest.approx(log_q[v].item(), rel=1e-14, abs=1e-15)
    assert build_support("union", 3, s, t).ids.shape == (3, 6)
    assert build_support("teacher_top1_argmax", 3, s, t).ids.shape == (3, 2)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_chunked_equals_unchunked_exactly(dtype):
    s, t, g = _pair(1, V=40, shape=(4, 5))
    s, t = s.to(dtype), t.to(dtype)
    x = torch.randint(0, 40, (4, 5), generator=g)
    for rule in SUPPORTS:
        tokens = x if rule in ("sampled", "teacher_top1_sampled") else None
        whole = build_support(rule, 6, s, t, tokens=tokens, chunk_size=20)
        for chunk in (1, 3, 7, 19):  # dividing N = 20 or not
            part = build_support(rule, 6, s, t, tokens=tokens, chunk_size=chunk)
            assert all(torch.equal(a, b) for a, b in zip(whole, part)), (rule, chunk)
        assert whole.teacher_logp.dtype == (F64 if dtype == F64 else torch.float32)


def test_trls_dispatch():
    V = 10
    cases = {(1.0, 1, "sampled"): ("sampled", 1), (1.0, 1, "argmax"): ("argmax", 1),
             (0.3, 1, "sampled"): ("teacher_top1_sampled", 1),
             (0.3, 1, "argmax"): ("teacher_top1_argmax", 1),
             (0.0, 1, "sampled"): ("teacher_topk", 1), (0.0, 4, "argmax"): ("teacher_topk", 4),
             (1.0, 4, "sampled"): ("student_topk", 4), (0.3, 4, "sampled"): ("union", 4),
             (0.3, 0, "sampled"): ("full", V), (1.0, 10, "sampled"): ("full", V),
             (0.0, 9, "sampled"): ("teacher_topk", 9)}
    for (beta, k, mode), want in cases.items():
        assert trl_support_rule(beta, k, mode, vocab_size=V) == want


# ---------------------------------------------------------------------------------------------
# The divergence on a support: values against enumeration, the bounds
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("approximation", ["renormalize", "tail"])
def test_values_are_the_definitions(beta, approximation):
    for seed in range(6):
        s, t, g = _pair(seed)
        k = 1 + seed % 5
        ids = torch.randperm(7, generator=g)[:k].tolist()
        got = support_divergence(s, _support(ids, t), beta=beta, approximation=approximation,
                                 max_log_mass=None).item()
        assert got == pytest.approx(_plain(s, t, ids, beta, approximation), rel=1e-12,
                                    abs=1e-14)


def test_on_the_teachers_top_k_the_kls_are_the_topk_modules():
    """The same approximations as ``topk.topk_kl``, from the gathered log-probabilities."""
    s, t, _ = _pair(2, V=12, shape=(5,))
    ids = t.topk(4, -1).indices
    report = Support(ids, torch.ones_like(ids, dtype=torch.bool),
                     torch.log_softmax(t, -1).gather(-1, ids))
    for beta, direction in ((0.0, "forward"), (1.0, "reverse")):
        for approximation in ("renormalize", "tail"):
            mine = lambda z: support_divergence(z, report, beta=beta,  # noqa: E731
                                                approximation=approximation, max_log_mass=None)
            theirs = lambda z: topk_kl(z, report.teacher_logp, ids,  # noqa: E731
                                       approximation, direction)
            torch.testing.assert_close(mine(s), theirs(s), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(_grad(mine, s), _grad(theirs, s), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
def test_the_tail_bucket_is_a_lower_bound_with_the_exact_gap(beta):
    """D - (b) = beta (1 - Q) KL(q^ || m^) + (1 - beta)(1 - P) KL(p^ || m^), on any support."""
    for seed in range(20):
        s, t, g = _pair(seed, V=6, scale=3.0)
        k = 1 + seed % 5
        ids = torch.randperm(6, generator=g)[:k].tolist()
        bucket = support_divergence(s, _support(ids, t), beta=beta, max_log_mass=None).item()
        full = _full(s, t, beta).item()
        p, q = torch.softmax(s, -1).tolist(), torch.softmax(t, -1).tolist()
        rest = [v for v in range(6) if v not in ids]
        P_tail, Q_tail = sum(p[v] for v in rest), sum(q[v] for v in rest)
        m = [beta * qv + (1 - beta) * pv for pv, qv in zip(p, q)]
        M_tail = sum(m[v] for v in rest)

        def kl_tail(a, A):
            return sum(a[v] / A * math.log((a[v] / A) / (m[v] / M_tail)) for v in rest
                       if a[v] > 0)
        gap = {0.0: Q_tail * sum(q[v] / Q_tail * math.log((q[v] / Q_tail) / (p[v] / P_tail))
                                 for v in rest),
               1.0: P_tail * sum(p[v] / P_tail * math.log((p[v] / P_tail) / (q[v] / Q_tail))
                                 for v in rest)}.get(
            beta, beta * Q_tail * kl_tail(q, Q_tail) + (1 - beta) * P_tail * kl_tail(p, P_tail))
        assert bucket <= full + 1e-13
        assert full - bucket == pytest.approx(gap, rel=1e-9, abs=1e-13)


def test_trls_cap_can_lift_the_tail_bucket_above_the_kl_by_less_than_1e_7():
    # teacher tail 3.3e-8, student tail 9e-8: both masses above e^(-1e-7), both tails capped
    q = torch.tensor([0.5, 0.5 - 9e-8 / math.e, 9e-8 / math.e], dtype=F64)
    p = torch.tensor([0.5, 0.5 - 9e-8, 9e-8], dtype=F64)
    report = _support([0, 1], q.log())
    capped = support_divergence(p.log(), report, beta=0.0).item()
    exact = support_divergence(p.log(), report, beta=0.0, max_log_mass=None).item()
    full = _full(p.log(), q.log(), 0.0).item()
    assert exact == pytest.approx(full, abs=1e-15)  # one unreported token: (b) is exact
    assert 3e-8 < capped - full < 1e-7
    # below the cap (masses 0.9 and 0.6) the two are the same
    q, p = torch.tensor([0.6, 0.3, 0.1], dtype=F64), torch.tensor([0.3, 0.3, 0.4], dtype=F64)
    report = _support([0, 1], q.log())
    assert support_divergence(p.log(), report, beta=1.0).item() == \
        support_divergence(p.log(), report, beta=1.0, max_log_mass=None).item()


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.8, 1.0])
def test_trls_cap_stays_within_1e_7_of_the_divergence_on_random_near_full_supports(beta):
    c = -math.expm1(sp.TAIL_MAX_LOG_MASS)  # the capped tail, 1e-7
    g = torch.Generator().manual_seed(12)
    # 400 positions, tails of mass 1e-10 to 1e-6 on both sides: the cap binds on one, both or
    # neither; S = the first three tokens
    tails = 10 ** (-10 + 4 * torch.rand(2, 400, 1, generator=g, dtype=F64))
    shape = torch.softmax(torch.rand(2, 400, 3, generator=g, dtype=F64) + 0.1, -1)
    p, q = torch.cat([(1 - tails) * shape, tails], dim=-1)  # (400, 4) each
    ids = torch.arange(3).expand(400, 3)
    report = Support(ids, torch.ones(400, 3, dtype=torch.bool), q.log()[:, :3])
    excess = support_divergence(p.log(), report, beta=beta) - _full(p.log(), q.log(), beta)
    assert bool((excess < c).all())
    if beta in (0.0, 1.0):  # the cases include some the cap lifts above the KL (by 3.6e-8)
        assert excess.max() > 1e-8


def test_renormalizing_is_no_bound_and_one_token_carries_nothing():
    # above the full JSD: a case found by search (0.68 against 0.019)
    s = torch.tensor([-2.4008925350581634, 3.5279250544191614, 7.859784795723463,
                      -2.3775083355464766], dtype=F64)
    t = torch.tensor([-0.0840843150155044, -7.67139240500278, 3.5561413564952513,
                      -0.46774956568969156], dtype=F64)
    assert support_divergence(s, _support([3, 1], t), beta=0.5, approximation="renormalize") \
        > 30 * _full(s, t, 0.5)
    # below it: p~ = q~ on S, different elsewhere
    p, q = torch.tensor([0.2, 0.2, 0.6], dtype=F64), torch.tensor([0.4, 0.4, 0.2], dtype=F64)
    for beta in (0.0, 0.5, 1.0):
        assert support_divergence(p.log(), _support([0, 1], q.log()), beta=beta,
                                  approximation="renormalize").item() == pytest.approx(0, abs=1e-16)
        assert _full(p.log(), q.log(), beta) > 0.05
    # one token: identically 0, value and gradient, whatever beta
    s, t, _ = _pair(3)
    for beta in (0.0, 0.5, 1.0):
        fn = lambda z, b=beta: support_divergence(z, _support([2], t), beta=b,  # noqa: E731
                                                  approximation="renormalize")
        assert fn(s).item() == 0.0 and torch.equal(_grad(fn, s), torch.zeros_like(s))


def test_the_top1_rules_are_their_wider_cousins_at_k_equal_1():
    s, t, _ = _pair(4, V=11, shape=(6,))
    for one, wide, beta in (("argmax", "student_topk", 1.0), ("teacher_top1_argmax", "union", 0.5)):
        a = lambda z, r=one, b=beta: support_divergence(z, build_support(r, 1, s, t), beta=b)  # noqa: E731
        w = lambda z, r=wide, b=beta: support_divergence(z, build_support(r, 1, s, t), beta=b)  # noqa: E731
        torch.testing.assert_close(a(s), w(s), rtol=1e-14, atol=0)
        torch.testing.assert_close(_grad(a, s), _grad(w, s), rtol=1e-12, atol=1e-16)


# ---------------------------------------------------------------------------------------------
# TRL's sampled top-1: a lower bound for every token, its expected gradient
# ---------------------------------------------------------------------------------------------
def test_the_sampled_bucket_is_the_binary_kl_and_below_the_kl_for_every_token():
    s, t, _ = _pair(5, V=8, scale=3.0)
    p, q = torch.softmax(s, -1).tolist(), torch.softmax(t, -1).tolist()
    full = _full(s, t, 1.0).item()
    for x in range(8):
        support = build_support("sampled", 1, s, t, tokens=torch.tensor(x))
        value = support_divergence(s, support, beta=1.0, max_log_mass=None).item()
        kl2 = p[x] * math.log(p[x] / q[x]) + (1 - p[x]) * math.log((1 - p[x]) / (1 - q[x]))
        assert value == pytest.approx(kl2, rel=1e-12) and value <= full


def test_the_expected_sampled_loss_is_the_mean_over_every_token():
    s, t, _ = _pair(6, V=7, scale=2.5)
    p = torch.softmax(s, -1)
    for beta in (1.0, 0.4):
        rule = "sampled" if beta == 1.0 else "teacher_top1_sampled"

        def mean(z, b=beta, r=rule):
            return sum(p[x] * support_divergence(z, build_support(r, 1, s, t,
                                                                  tokens=torch.tensor(x)), beta=b)
                       for x in range(7))
        expected = lambda z, b=beta: expected_sampled_divergence(z, t, beta=b)  # noqa: E731
        torch.testing.assert_close(expected(s), mean(s), rtol=1e-12, atol=0)
        torch.testing.assert_close(_grad(expected, s), _grad(mean, s), rtol=1e-10, atol=1e-15)
        assert expected(s) <= _full(s, t, beta)  # a mean of lower bounds


def test_the_expected_sampled_gradient_is_the_closed_form_and_not_the_kls():
    s, t, _ = _pair(7, V=9, scale=2.0)
    p, q = torch.softmax(s, -1), torch.softmax(t, -1)
    grad = _grad(lambda z: expected_sampled_divergence(z, t, beta=1.0, max_log_mass=None), s)
    # sum_x p_x^2 lambda_x (e_x - p), lambda = logit p - logit q
    lam = torch.log(p / (1 - p)) - torch.log(q / (1 - q))
    closed = p ** 2 * lam - p * (p ** 2 * lam).sum()
    torch.testing.assert_close(grad, closed, rtol=1e-10, atol=1e-15)
    # the sampled-token advantage log p_x - log q_x gives the KL's gradient in expectation
    advantage = p * (p.log() - q.log()) - p * (p * (p.log() - q.log())).sum()
    true = _grad(lambda z: _full(z, t, 1.0), s)
    torch.testing.assert_close(advantage, true, rtol=1e-10, atol=1e-15)
    assert (grad - true).norm() > 0.3 * true.norm()


# ---------------------------------------------------------------------------------------------
# Tinker's REINFORCE reverse KL and its token skip
# ---------------------------------------------------------------------------------------------
def test_reinforce_is_renormalizing_in_value_and_gradient_with_the_chain_rule():
    s, t, _ = _pair(8, V=10, shape=(4,))
    support = build_support("teacher_topk", 3, s, t)
    mine = lambda z: reinforce_reverse_kl(z, support)  # noqa: E731
    renorm = lambda z: support_divergence(z, support, beta=1.0,  # noqa: E731
                                          approximation="renormalize")
    torch.testing.assert_close(mine(s), renorm(s), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(_grad(mine, s), _grad(renorm, s), rtol=1e-10, atol=1e-15)
    # (a) = (KL - kl2(P, Q) - (1 - P) KL(p^ || q^)) / P
    p, q = torch.softmax(s, -1), torch.softmax(t, -1)
    for row in range(4):
        S = support.ids[row].tolist()
        rest = [v for v in range(10) if v not in S]
        P, Q = p[row, S].sum().item(), q[row, S].sum().item()
        kl2 = P * math.log(P / Q) + (1 - P) * math.log((1 - P) / (1 - Q))
        tail = sum(p[row, v].item() / (1 - P) * math.log((p[row, v].item() / (1 - P))
                                                          / (q[row, v].item() / (1 - Q)))
                   for v in rest)
        want = (_full(s[row], t[row], 1.0).item() - kl2 - (1 - P) * tail) / P
        assert mine(s)[row].item() == pytest.approx(want, rel=1e-10)


def test_reinforce_drops_a_slot_the_teacher_gives_no_mass_as_tinker_does():
    s, t, _ = _pair(9, V=6)
    t[4] = -math.inf
    three = _support([0, 1, 4], t)
    two = _support([0, 1], t)
    assert reinforce_reverse_kl(s, three).item() == pytest.approx(
        reinforce_reverse_kl(s, two).item(), rel=1e-14)


def test_skip_first_tokens_is_tinkers_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        mask = (torch.rand(3, 9, generator=g) < 0.6).long()
        for n in (0, 1, 3):
            want = torch.zeros(3, 9, dtype=torch.bool)
            for row in range(3):
                completion = torch.where(mask[row] > 0)[0].tolist()
                for t, position in enumerate(completion):
                    if t < n:  # Tinker: `if t < skip_first_n_tokens: continue`
                        continue
                    want[row, position] = True
            assert torch.equal(skip_first_tokens(mask, n), want)
    assert sp.TINKER_SKIP_FIRST_N_TOKENS == 3 and sp.TINKER_TOPK == 20


# ---------------------------------------------------------------------------------------------
# The upper bound of the forward KL on the teacher's top-k
# ---------------------------------------------------------------------------------------------
def test_the_worst_tail_bounds_every_consistent_teacher_and_is_attained():
    g = torch.Generator().manual_seed(1)
    for trial in range(30):
        V, k = 8, 1 + trial % 6
        s = 2 * torch.randn(V, generator=g, dtype=F64)
        t = 2 * torch.randn(V, generator=g, dtype=F64)
        log_q = torch.log_softmax(t, -1)
        report, ids = log_q.topk(k)
        bound = forward_kl_upper_bound(s, report, ids).item()
        assert _full(s, t, 0.0).item() <= bound * (1 + 1e-12)
        # the worst teacher: mu on the student's smallest tail probabilities, the rest next
        mu, rest = report.min().exp().item(), 1 - report.exp().sum().item()
        worst = torch.zeros(V, dtype=F64)
        worst[ids] = report.exp()
        tail = [v for v in torch.softmax(s, -1).argsort().tolist() if v not in ids.tolist()]
        for v in tail:
            worst[v] = min(mu, max(rest, 0.0))
            rest -= worst[v].item()
        assert worst.sum().item() == pytest.approx(1.0, abs=1e-12)
        assert worst[tail].max() <= mu + 1e-15  # consistent: ids stay a top-k
        assert _full(s, worst.log(), 0.0).item() == pytest.approx(bound, rel=1e-10, abs=1e-13)
        # and the tail bucket is below: the forward KL is bracketed
        assert support_divergence(s, Support(ids, torch.ones(k, dtype=torch.bool), report),
                                  beta=0.0, max_log_mass=None).item() <= bound


def test_the_worst_tail_is_infinite_where_it_can_reach_a_token_the_student_cannot_emit():
    student = torch.tensor([0.0, 0.0, 0.0, -math.inf], dtype=F64)
    report = torch.log(torch.tensor([0.5], dtype=F64))
    assert forward_kl_upper_bound(student, report, torch.tensor([0])).item() == math.inf
    # the worst tail takes the smallest p first, and p_3 = 0 is the smallest; with no such
    # token it is finite
    student = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=F64)
    assert math.isfinite(forward_kl_upper_bound(student, report, torch.tensor([0])).item())


def test_the_reverse_kl_has_no_upper_bound_from_the_teachers_top_k():
    # q = (0.4, 0.3, 0.3, 0): a teacher consistent with the report {0: 0.4}, whose tail puts
    # no mass on token 3, which the (uniform) student can emit
    q = torch.tensor([0.4, 0.3, 0.3, 0.0], dtype=F64)
    assert _full(torch.zeros(4, dtype=F64), q.log(), 1.0).item() == math.inf
    assert math.isfinite(forward_kl_upper_bound(torch.zeros(4, dtype=F64), q.log()[:1],
                                                torch.tensor([0])).item())


# ---------------------------------------------------------------------------------------------
# Conventions: masks, dtypes, refusals
# ---------------------------------------------------------------------------------------------
def test_masked_positions_are_not_read_and_get_exactly_zero():
    s, t, _ = _pair(10, V=6, shape=(2, 3))
    support = build_support("student_topk", 2, s, t)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    garbage_s = torch.where(mask.bool().unsqueeze(-1), s, torch.full_like(s, math.nan))
    garbage = Support(support.ids, torch.where(mask.bool().unsqueeze(-1), support.valid,
                                               torch.zeros_like(support.valid)),
                      torch.where(mask.bool().unsqueeze(-1), support.teacher_logp,
                                  torch.full_like(support.teacher_logp, math.nan)))
    for fn in (lambda z, sup: support_divergence(z, sup, beta=0.5, mask=mask),
               lambda z, sup: reinforce_reverse_kl(z, sup, mask=mask)):
        clean, dirty = fn(s, support), fn(garbage_s, garbage)
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
        assert torch.equal(clean[~mask.bool()], torch.zeros(2, dtype=F64))
        grad = _grad(lambda z, f=fn: f(z, garbage), garbage_s)
        assert not grad.isnan().any() and torch.equal(grad[~mask.bool()], torch.zeros(2, 6,
                                                                                      dtype=F64))
        torch.testing.assert_close(grad, _grad(lambda z, f=fn: f(z, support), s))


def test_half_precision_is_computed_in_float32_and_close_to_float64():
    s, t, _ = _pair(11, V=30, shape=(4,))
    support = build_support("union", 3, s, t)
    half = Support(support.ids, support.valid, support.teacher_logp.bfloat16())
    out = support_divergence(s.bfloat16(), half, beta=0.5)
    assert out.dtype == torch.float32
    assert build_support("union", 3, s.bfloat16(), t.half()).teacher_logp.dtype == torch.float32
    reference = support_divergence(s.bfloat16().double(), Support(
        support.ids, support.valid, support.teacher_logp.bfloat16().double()), beta=0.5)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-6)


def test_impossible_tokens_give_infinities_not_nan():
    s = torch.tensor([0.0, 0.0, -math.inf], dtype=F64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=F64).log()
    # forward: the teacher reports token 2, which the student cannot emit: +inf, zero gradient
    report = _support([2, 0], q)
    for approximation in ("renormalize", "tail"):
        fn = lambda z, a=approximation: support_divergence(z, report, beta=0.0,  # noqa: E731
                                                           approximation=a)
        assert fn(s).item() == math.inf
        grad = _grad(fn, s)
        assert not grad.isnan().any()
    # the student has no mass on S = {2}: renormalising gives its side nothing (0), reverse
    assert support_divergence(s, _support([2], q), beta=1.0,
                              approximation="renormalize").item() == 0.0
    assert math.isfinite(expected_sampled_divergence(s, q, beta=0.5).item())


def _args(**change):
    s = torch.zeros(2, 4)
    support = Support(torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2, dtype=torch.bool),
                      torch.full((2, 2), -1.0))
    base = dict(student_logits=s, support=support, beta=0.5)
    base.update(change)
    return base


_GOOD = Support(torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2, dtype=torch.bool),
                torch.full((2, 2), -1.0))
BAD_LOSS = [
    (dict(student_logits=torch.tensor([[0.0, math.nan, 0, 0], [0.0, 0, 0, 0]])), ValueError,
     "student_logits holds NaN"),
    (dict(student_logits=torch.tensor([[0.0, math.inf, 0, 0], [0.0, 0, 0, 0]])), ValueError,
     r"student_logits holds \+inf"),
    (dict(student_logits=torch.full((2, 4), -math.inf)), ValueError, "all -inf"),
    (dict(student_logits=torch.zeros(2, 4, dtype=torch.long)), TypeError, "floating dtype"),
    (dict(support=(1, 2)), TypeError, "support must be a Support"),
    (dict(support=_GOOD._replace(ids=_GOOD.ids.float())), TypeError, "support.ids must be an "
     "integer"),
    (dict(support=_GOOD._replace(ids=torch.tensor([[0, 4], [2, 3]]))), ValueError,
     r"lie in \[0, V\) = \[0, 4\)"),
    (dict(support=_GOOD._replace(ids=torch.tensor([[0, 0], [2, 3]]))), ValueError, "distinct"),
    (dict(support=_GOOD._replace(ids=torch.tensor([0, 1]))), ValueError, r"shape \(\.\.\., K\)"),
    (dict(support=_GOOD._replace(valid=torch.ones(2, 2))), TypeError, "support.valid must be a "
     "bool"),
    (dict(support=_GOOD._replace(valid=torch.tensor([[True, True], [False, False]]))),
     ValueError, "at least one slot"),
    (dict(support=_GOOD._replace(teacher_logp=torch.full((2, 2), 0.5))), ValueError,
     r"log-probabilities \(<= 0, not NaN\)"),
    (dict(support=_GOOD._replace(teacher_logp=torch.full((2, 2), math.nan))), ValueError,
     "log-probabilities"),
    (dict(support=_GOOD._replace(teacher_logp=torch.full((2, 3), -1.0))), ValueError,
     "support.teacher_logp must have the shape of support.ids"),
    (dict(beta=1.5), ValueError, "beta must be <= 1.0"),
    (dict(beta=math.nan), ValueError, "beta must be a finite number"),
    (dict(approximation="ignore"), ValueError, "approximation must be one of"),
    (dict(max_log_mass=0.1), ValueError, "max_log_mass must be <= 0.0"),
    (dict(mask=torch.tensor([1, 2])), ValueError, "mask values must be 0 or 1"),
    (dict(mask=torch.ones(3)), ValueError, "mask must have the shape"),
    (dict(student_logits=torch.tensor([[3e38, -3e38, 0, 0], [0.0, 0, 0, 0]])), ValueError,
     "span more than the range"),
]


@pytest.mark.parametrize("change, error, message", BAD_LOSS)
def test_bad_input_to_the_loss_is_a_named_error(change, error, message):
    with pytest.raises(error, match=message):
        support_divergence(**_args(**change))


BAD_BUILD = [
    (dict(rule="top_p"), ValueError, "rule must be one of"),
    (dict(k=0), ValueError, r"k must be an int in \[1, V\] = \[1, 4\], got 0"),
    (dict(k=5), ValueError, "k must be an int"),
    (dict(k=True), ValueError, "k must be an int"),
    (dict(rule="sampled"), TypeError, "rule 'sampled' needs tokens"),
    (dict(rule="sampled", tokens=torch.tensor([0.0, 1.0])), TypeError, "needs tokens"),
    (dict(rule="sampled", tokens=torch.tensor([0, 1, 2])), ValueError, "leading shape"),
    (dict(rule="sampled", tokens=torch.tensor([0, 4])), ValueError, r"tokens must lie in"),
    (dict(tokens=torch.tensor([0, 1])), ValueError, "tokens are read by the rules"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(teacher_logits=torch.zeros(2, 5)), ValueError, "teacher_logits must have the shape"),
    (dict(teacher_logits=torch.tensor([[0.0, math.nan, 0, 0], [0.0, 0, 0, 0]])), ValueError,
     "teacher_logits holds NaN"),
    (dict(student_logits=torch.zeros(2, 0), teacher_logits=torch.zeros(2, 0)), ValueError,
     "size >= 1"),
]


@pytest.mark.parametrize("change, error, message", BAD_BUILD)
def test_bad_input_to_the_builder_is_a_named_error(change, error, message):
    arguments = dict(rule="teacher_topk", k=2, student_logits=torch.zeros(2, 4),
                     teacher_logits=torch.zeros(2, 4))
    arguments.update(change)
    with pytest.raises(error, match=message):
        build_support(**arguments)


@pytest.mark.parametrize("call, error, message", [
    (lambda: expected_sampled_divergence(torch.zeros(3), torch.zeros(3), beta=0.0), ValueError,
     "beta must be > 0"),
    (lambda: forward_kl_upper_bound(torch.zeros(4), torch.log(torch.tensor([0.2])),
                                    torch.tensor([0])), ValueError, "not a top-k report"),
    (lambda: forward_kl_upper_bound(torch.zeros(4), torch.tensor([-1.0]), [0]), TypeError,
     "topk_ids must be an integer"),
    (lambda: skip_first_tokens(torch.ones(3), 1), ValueError, r"mask must be a \(B, T\)"),
    (lambda: skip_first_tokens(torch.ones(1, 3), -1), ValueError, "n must be an int >= 0"),
    (lambda: trl_support_rule(0.5, -1, vocab_size=4), ValueError, "loss_top_k must be an int"),
    (lambda: trl_support_rule(0.5, 1, "greedy", vocab_size=4), ValueError,
     "reverse_kl_top_1_mode must be"),
    (lambda: trl_support_rule(0.5, 1, vocab_size=0), ValueError, "vocab_size must be"),
    (lambda: support_bias("tail", 1, torch.zeros(1, 4), torch.zeros(1, 4)), TypeError,
     "choice must be a Choice"),
    (lambda: support_bias(CHOICES[0], 1, torch.zeros(1, 4), torch.zeros(1, 4)), ValueError,
     "nonzero and finite"),
    (lambda: sp.support_study(V=1), ValueError, "V must be an int >= 2"),
    (lambda: sp.support_study(V=8, ks=[9]), ValueError, r"ks must hold ints in \[1, V\]"),
    (lambda: sp.support_study(V=8, positions=0), ValueError, "positions must be"),
])
def test_bad_input_elsewhere_is_a_named_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------------
def test_support_bias_against_its_definition():
    student, teacher = zipf_pair(V=32, noise=1.0, seed=3)
    choice = next(c for c in CHOICES if c.rule == "union")
    bias = support_bias(choice, 4, student[None], teacher[None])
    support = build_support("union", 4, student, teacher)
    value = support_divergence(student, support, beta=0.5).item()
    true = _full(student, teacher, 0.5).item()
    assert bias["rel_bias"].item() == pytest.approx((value - true) / true, rel=1e-12)
    g = _grad(lambda z: support_divergence(z, support, beta=0.5), student)
    g0 = _grad(lambda z: _full(z, teacher, 0.5), student)
    assert bias["rel_grad_error"].item() == pytest.approx(float((g - g0).norm() / g0.norm()),
                                                          rel=1e-10)


def test_the_small_study_is_consistent_with_its_definitions():
    data = sp.support_study(V=64, positions=3, ks=[1, 4, 32])
    rows = {(r["label"], r["k"]): r for r in data["rows"]}
    assert len(rows) == len(data["rows"])
    for choice in CHOICES:
        top1 = choice.rule not in ("teacher_topk", "student_topk", "union")
        assert sorted(k for label, k in rows if label == choice.label) == ([1] if top1
                                                                          else [1, 4, 32])
    for (label, _k), r in rows.items():
        if "tail (b)" in label:  # lower bounds (the cap does not bind at V = 64)
            assert r["lower_bound"] and r["rel_bias"] <= 0
        if "bound" in label:
            assert r["rel_bias"] >= 0 and r["rel_grad_error"] is None
        assert (r["clamped"] is None) == ("verl" not in label)
    verl = [r for r in data["rows"] if "verl" in r["label"]]
    assert all(0 <= r["clamped"] <= r["p_above_q"] <= 1 for r in verl)


# ---------------------------------------------------------------------------------------------
# The chapter's claims, its figure, the benchmark (the slow tier: the study at its defaults)
# ---------------------------------------------------------------------------------------------
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study():
    return sp.support_study()


def _page():
    return " ".join((ROOT / "docs" / "large_vocab.md").read_text().split())


def _assert_page_rounds(page, pattern, computed, digits):
    """The numbers the sentence ``pattern`` finds on the page are ``computed``, rounded to
    ``digits`` decimals: within half a unit of the last digit (a value at the edge may round
    either way on another CPU), the page's minus sign a U+2212."""
    found = re.search(pattern, page)
    assert found, pattern
    stated = [float(text.replace("\u2212", "-")) for text in found.groups()]
    assert_matches_committed(computed, stated, rtol=FLOAT64_SUMS, atol=0.5 * 10.0 ** -digits,
                             where=pattern[:40],
                             why=f"the page rounds to {digits} decimals; float64 torch sums "
                                 "over V = 4,096 in the order of the CPU's vector width")


@pytest.mark.slow
def test_the_chapters_claims_about_the_study(study):
    """docs/large_vocab.md, "Which support": what it reads off the generated table."""
    page = _page()
    rows = {(r["label"], r["k"]): r for r in study["rows"]}
    ks = study["ks"]
    assert (study["V"], study["positions"], study["temperature"], study["noise"]) == \
        (4096, 16, 1.0, 1.0)

    def row(prefix, k):
        (label,) = {lb for lb, _ in rows if lb.startswith(prefix)}
        return rows[label, k]
    # every tail bucket is a lower bound at every position and k
    assert all(r["lower_bound"] for r in study["rows"] if "tail (b)" in r["label"])
    # the reverse KL: the student's top-k beats the teacher's, value and gradient, at every k
    for k in ks:
        student, teacher = row("student top-k, reverse, tail", k), row("teacher top-k, "
                                                                        "reverse, tail", k)
        assert student["rel_grad_error"] < teacher["rel_grad_error"]
        assert abs(student["rel_bias"]) < abs(teacher["rel_bias"])
        assert row("union", k)["rel_grad_error"] < row("student top-k, JSD", k)["rel_grad_error"]
    # TRL's defaults: the sampled token, and the argmax (= the student's top-1)
    sampled, argmax = row("sampled token", 1), row("student argmax", 1)
    _assert_page_rounds(page, r"bucket has value bias (−[0-9.]+) and gradient error ([0-9.]+) "
                              r"\(the argmax: (−[0-9.]+) and ([0-9.]+), the student's top-1\)",
                        [sampled["rel_bias"], sampled["rel_grad_error"], argmax["rel_bias"],
                         argmax["rel_grad_error"]], digits=3)
    assert argmax["rel_bias"] == pytest.approx(row("student top-k, reverse, tail", 1)["rel_bias"])
    below = [k for k in ks if row("student top-k, reverse, tail", k)["rel_grad_error"] < 0.3]
    assert below == [k for k in ks if k >= 64] and "gets below 0.3 from $k = 64$" in page
    # renormalising: above 1 from k = 2 to 16, and above the divergence somewhere
    for prefix in ("teacher top-k, reverse, renormalised", "student top-k, JSD"):
        assert [k for k in ks if row(prefix, k)["rel_grad_error"] > 1] == [2, 4, 8, 16]
        assert not all(row(prefix, k)["lower_bound"] for k in ks)
    assert "from $k = 2$ to 16, and each is above the divergence at some positions" in page
    # verl: clamps exactly the positions with P > Q at k = 1, none from k = 16 on
    verl = {k: row("teacher top-k, forward, verl", k) for k in ks}
    assert verl[1]["clamped"] == verl[1]["p_above_q"] == 7 / 16 and "(7 of the 16)" in page
    assert [k for k in ks if verl[k]["clamped"] == 0] == [k for k in ks if k >= 16]
    assert all(verl[k]["rel_grad_error"] > row("teacher top-k, forward, tail", k)[
        "rel_grad_error"] for k in ks)
    # the worst tail: the ratios the page quotes
    bound = {k: row("teacher top-k, forward, worst", k)["rel_bias"] for k in (1, 512)}
    _assert_page_rounds(page, r"([0-9.]+) times the true forward KL at \$k = 1\$ and ([0-9.]+) "
                              r"times it at \$k = 512\$", [1 + bound[1], 1 + bound[512]], digits=1)


@pytest.mark.slow
def test_the_table_is_the_studys(study):
    table = sp.format_support_table(study).splitlines()
    assert table[0] == "| choice | used by | k = 1 | k = 8 | k = 64 | k = 512 |"
    assert len(table) == 2 + len(CHOICES)
    verl = next(line for line in table if "verl" in line)
    assert verl.count("; clamped") == 4
    sampled = next(line for line in table if line.startswith("| sampled"))
    assert sampled.endswith("|  |  |  |")  # k = 1 only


@pytest.mark.slow
def test_the_figure_shows_what_its_docstring_and_the_chapter_say(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from opd_literate import _figures

    captured = []
    monkeypatch.setattr(plt, "close", lambda fig: captured.append(fig))
    data = sp.support_study(V=64, positions=3, ks=[1, 4, 32])
    svg = sp.plot_support_bias(tmp_path / "s.svg", data).read_text()
    assert svg.startswith("<?xml") and f'width="{_figures.COLUMN_INCHES * 72:g}pt"' in svg
    assert "dc:date" not in svg
    (fig,) = captured
    value, gradient, clamped = fig.axes
    assert value.get_ylabel() == "relative value bias\n(D̂ − D) / D"
    assert gradient.get_ylabel() == "relative gradient error\n‖ĝ − g‖ / ‖g‖"
    assert clamped.get_xlabel() == "k (support size; V = 64, 3 positions)"
    assert value.get_yscale() == "symlog" and gradient.get_yscale() == "log"
    assert all(axis.get_xscale() == "log" for axis in fig.axes)
    choices = {c.label: c for c in CHOICES}
    lines = [line for line in value.get_lines() if line.get_label() in choices]
    assert [line.get_label() for line in lines] == [c.label for c in CHOICES]
    for line in lines:
        choice = choices[line.get_label()]
        # colour = divergence, style = loss, marker = support (the docstring, the chapter)
        assert line.get_color() == {0.0: "C0", 1.0: "C1"}.get(choice.beta, "C2")
        if choice.rule in ("teacher_topk", "student_topk", "union"):
            assert line.get_linestyle() == {"tail": "--", "renormalize": "-", "reinforce": "-",
                                            "verl": ":", "upper_bound": "-."}[choice.loss]
            assert line.get_marker() == {"teacher_topk": "o", "student_topk": "s",
                                         "union": "D"}[choice.rule]
            assert list(line.get_xdata()) == [1, 4, 32]
        else:
            assert line.get_linestyle() == "None" and list(line.get_xdata()) == [1]
            assert line.get_marker() == {"sampled": "*", "argmax": "X",
                                         "teacher_top1_sampled": "*"}[choice.rule]
        rows = [r for r in data["rows"] if r["label"] == choice.label]
        assert list(line.get_ydata()) == [r["rel_bias"] for r in rows]
    # the bound has no gradient: one line fewer in the gradient panel
    assert len([ln for ln in gradient.get_lines() if ln.get_label() in choices]) == \
        len(CHOICES) - 1
    assert [ln.get_label() for ln in clamped.get_lines()] == [
        "teacher top-k, forward, verl's clamped (c)", "fraction with P > Q (a clamp needs it)"]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [c.label for c in CHOICES]
    assert all(t.get_fontsize() == _figures.SMALL_PT for t in legend.get_texts())
    page = _page()
    for phrase in ("blue forward KL, orange reverse KL, green JSD", "dashed the tail bucket (b)",
                   "solid renormalised (a)", "dotted verl's clamped (c)",
                   "dash-dotted the worst-tail upper bound", "circles the teacher's top-$k$",
                   "squares the student's", "diamonds the union",
                   "a star the sampled token and a cross the student's argmax"):
        assert phrase in page, phrase
    monkeypatch.undo()
    plt.close(fig)


def test_the_chapter_quotes_the_committed_benchmark_output():
    output = (ROOT / "benchmarks" / "results" / "supports.txt").read_text().strip()
    page = (ROOT / "docs" / "large_vocab.md").read_text()
    assert f"```text\n{output}\n```" in page  # verbatim
    table = [line.split() for line in output.splitlines()[2:8]]
    assert [(row[0], row[1]) for row in table] == [
        (d, r) for d in ("bfloat16", "float32") for r in ("teacher_topk", "student_topk",
                                                            "union")]
    for row in table:
        assert row[-1] == "yes"  # chunked and unchunked supports are the same bytes
        assert float(row[3]) == pytest.approx(1.0, abs=0.1)  # one chunk's float32 buffer
        assert float(row[5]) == pytest.approx(16.0, abs=0.3)  # 2,048 / 128 of them at once
    chunked = sorted(float(row[3]) for row in table)
    sizes = re.findall(r"([0-9.]+) MiB \(teacher_topk\) to ([0-9.]+) MiB", output)[0]
    joined = " ".join(page.split())
    assert (f"adds one $(128, V)$ float32 buffer ({chunked[0]:.2f} to {chunked[-1]:.2f} of them: "
            f"the support itself is {sizes[0]} to {sizes[1]} MiB)") in joined
    assert "all 2,048 rows at once it adds 16 of them" in joined


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"),
                    reason="needs Linux's clear_refs to reset the peak RSS")
def test_the_peak_memory_is_one_chunk_buffer():
    import json
    import os
    import subprocess
    import sys

    bench = ROOT / "benchmarks" / "bench_supports.py"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    buffer_mib = 32 * 32_768 * 4 / 2**20  # (chunk, V) float32 at the --small sizes
    for dtype in ("bfloat16", "float32"):
        runs = {}
        for chunk in (32, 256):  # 256 = all the rows
            out = subprocess.run([sys.executable, str(bench), "--small", "--child", "union",
                                  dtype, str(chunk)], capture_output=True, text=True, env=env,
                                 check=True).stdout
            runs[chunk] = json.loads(out.strip().splitlines()[-1])
        assert runs[32]["sha256"] == runs[256]["sha256"]
        # pages of a buffer are counted when touched: +-0.3 buffers of bookkeeping
        assert runs[32]["added_mib"] / buffer_mib == pytest.approx(1.0, abs=0.3), runs
        assert runs[256]["added_mib"] / buffer_mib == pytest.approx(8.0, abs=0.3), runs


# ---------------------------------------------------------------------------------------------
# Every refusal in full; the positions the teacher gives no mass; masked positions not read
# ---------------------------------------------------------------------------------------------
def _loss(fn=support_divergence, **change):
    return lambda: fn(**_args(**change)) if fn is support_divergence else fn(
        **{k: v for k, v in _args(**change).items() if k != "beta"})


_PAIR = zipf_pair(V=8, noise=1.0)
_ROWS = [{"label": "a", "framework": "f", "k": k, "rel_bias": 0.0, "rel_grad_error": 0.1,
          "clamped": None} for k in (1, 4)]
EVERY_REFUSAL = [
    # support_divergence, reinforce_reverse_kl (the same checks, _inputs)
    (_loss(student_logits=torch.zeros(())),
     "student_logits must have a last (vocabulary) dimension of size >= 1, got shape ()"),
    (_loss(student_logits=torch.tensor([[0.0, math.nan, 0, 0], [0.0, 0, 0, 0]])),
     "student_logits holds NaN at a position that is read"),
    (_loss(reinforce_reverse_kl, student_logits=torch.tensor([[0.0, math.inf, 0, 0],
                                                              [0.0, 0, 0, 0]])),
     "student_logits holds +inf: a logit must be finite, or -inf for an impossible token"),
    (_loss(student_logits=torch.full((2, 4), -math.inf)),
     "student_logits has a position whose logits are all -inf: at least one token must be "
     "possible"),
    (_loss(student_logits=torch.zeros(2, 4, dtype=torch.long)),
     "student_logits must have a floating dtype, got torch.int64"),
    (_loss(support=(1, 2)), "support must be a Support (ids, valid, teacher_logp), got tuple"),
    (_loss(support=_GOOD._replace(ids=_GOOD.ids.float())),
     "support.ids must be an integer torch.Tensor, got torch.float32"),
    (_loss(support=_GOOD._replace(ids=torch.tensor([0, 1]))),
     "support.ids must have shape (..., K), K >= 1, with the leading shape of student_logits "
     "(2,), got (2,)"),
    (_loss(support=_GOOD._replace(ids=torch.zeros(2, 0, dtype=torch.long))),
     "support.ids must have shape (..., K), K >= 1, with the leading shape of student_logits "
     "(2,), got (2, 0)"),
    (_loss(support=_GOOD._replace(valid=torch.ones(2, 2))),
     "support.valid must be a bool torch.Tensor, got torch.float32"),
    (_loss(support=_GOOD._replace(valid=torch.ones(2, 3, dtype=torch.bool))),
     "support.valid must have the shape of support.ids (2, 2), got (2, 3)"),
    (_loss(support=_GOOD._replace(teacher_logp=torch.zeros(2, 2, dtype=torch.long))),
     "support.teacher_logp must have a floating dtype, got torch.int64"),
    (_loss(support=_GOOD._replace(teacher_logp=torch.full((2, 3), -1.0))),
     "support.teacher_logp must have the shape of support.ids (2, 2), got (2, 3)"),
    (_loss(support=_GOOD._replace(ids=torch.tensor([[0, 4], [2, 3]]))),
     "support.ids must lie in [0, V) = [0, 4), got values from 0 to 4"),
    (_loss(support=_GOOD._replace(ids=torch.tensor([[0, 1], [-1, 3]]))),
     "support.ids must lie in [0, V) = [0, 4), got values from -1 to 3"),
    (_loss(support=_GOOD._replace(valid=torch.tensor([[True, True], [False, False]]))),
     "support.valid must mark at least one slot of every position that is read"),
    (_loss(support=_GOOD._replace(ids=torch.tensor([[0, 0], [2, 3]]))),
     "support.ids must be distinct among the valid slots of a position (a repeated id would "
     "count its probability twice)"),
    (_loss(support=_GOOD._replace(teacher_logp=torch.tensor([[-1.0, 0.5], [-1.0, -1.0]]))),
     "support.teacher_logp must hold log-probabilities (<= 0, not NaN) at the valid slots"),
    (_loss(reinforce_reverse_kl,
           support=_GOOD._replace(teacher_logp=torch.tensor([[-1.0, math.nan], [-1, -1]]))),
     "support.teacher_logp must hold log-probabilities (<= 0, not NaN) at the valid slots"),
    # 0.7 + 0.6 at the two slots of position 0: no distribution has them
    (_loss(support=_GOOD._replace(teacher_logp=torch.log(torch.tensor([[0.7, 0.6],
                                                                        [0.1, 0.1]])))),
     "support.teacher_logp must be log-probabilities of one distribution: its valid slots sum "
     "to 1.3 > 1 in probability at position (0,)"),
    (_loss(beta=1.5), "beta must be <= 1.0, got 1.5"),
    (_loss(beta=math.nan), "beta must be a finite number, got nan"),
    (_loss(approximation="ignore"),
     "approximation must be one of ('renormalize', 'tail'), got 'ignore'"),
    (_loss(max_log_mass=0.1), "max_log_mass must be <= 0.0, got 0.1"),
    (_loss(mask=torch.tensor([1, 2])), "mask values must be 0 or 1, found 2"),
    (_loss(reinforce_reverse_kl, mask=torch.ones(3)),
     "mask must have the shape of the leading shape of student_logits (2,), got (3,)"),
    (_loss(student_logits=torch.tensor([[3e38, -3e38, 0, 0], [0.0, 0, 0, 0]])),
     "student_logits span more than the range of torch.float32 within a position: "
     "log_softmax overflows (shift or rescale them)"),
    # build_support
    (lambda: build_support("top_p", 2, torch.zeros(2, 4), torch.zeros(2, 4)),
     f"rule must be one of {SUPPORTS}, got 'top_p'"),
    (lambda: build_support("union", 5, torch.zeros(2, 4), torch.zeros(2, 4)),
     "k must be an int in [1, V] = [1, 4], got 5"),
    (lambda: build_support("union", 2.0, torch.zeros(2, 4), torch.zeros(2, 4)),
     "k must be an int in [1, V] = [1, 4], got 2.0"),
    (lambda: build_support("teacher_topk", 2, torch.zeros(2, 4), torch.zeros(2, 4),
                           tokens=torch.tensor([0, 1])),
     "tokens are read by the rules ('sampled', 'teacher_top1_sampled') only, not "
     "'teacher_topk'"),
    (lambda: build_support("sampled", 1, torch.zeros(2, 4), torch.zeros(2, 4)),
     "rule 'sampled' needs tokens, an integer torch.Tensor of the sampled ids, got NoneType"),
    (lambda: build_support("sampled", 1, torch.zeros(2, 4), torch.zeros(2, 4),
                           tokens=torch.tensor([0, 1, 2])),
     "tokens must have the leading shape of the logits (2,), got (3,)"),
    (lambda: build_support("teacher_top1_sampled", 1, torch.zeros(2, 4), torch.zeros(2, 4),
                           tokens=torch.tensor([0, 4])),
     "tokens must lie in [0, V) = [0, 4), got values from 0 to 4"),
    (lambda: build_support("union", 2, torch.zeros(2, 4), torch.zeros(2, 4), chunk_size=0),
     "chunk_size must be a positive int, got 0"),
    (lambda: build_support("union", 2, torch.zeros(2, 4), torch.zeros(2, 5)),
     "teacher_logits must have the shape of student_logits (2, 4), got (2, 5)"),
    (lambda: build_support("union", 2, torch.zeros(2, 4),
                           torch.tensor([[0.0, 0, 0, 0], [0, 0, math.nan, 0]])),
     "teacher_logits holds NaN at a position that is read"),
    (lambda: build_support("teacher_topk", 3, torch.zeros(1, 3),
                           torch.tensor([[3e38, -3e38, 0.0]])),
     "teacher_logits span more than the range of torch.float32 within a position: its "
     "log-softmax overflows (shift or rescale them)"),
    # trl_support_rule, skip_first_tokens
    (lambda: trl_support_rule(-0.1, 1, vocab_size=4), "beta must be >= 0.0, got -0.1"),
    (lambda: trl_support_rule(0.5, 1, vocab_size=0), "vocab_size must be a positive int, got 0"),
    (lambda: trl_support_rule(0.5, -1, vocab_size=4), "loss_top_k must be an int >= 0, got -1"),
    (lambda: trl_support_rule(0.5, 1, "greedy", vocab_size=4),
     "reverse_kl_top_1_mode must be 'sampled' or 'argmax', got 'greedy'"),
    (lambda: skip_first_tokens(torch.ones(3)), "mask must be a (B, T) torch.Tensor, got (3,)"),
    (lambda: skip_first_tokens([[1, 0]]), "mask must be a (B, T) torch.Tensor, got list"),
    (lambda: skip_first_tokens(torch.tensor([[1, 2]])), "mask values must be 0 or 1, found 2"),
    (lambda: skip_first_tokens(torch.ones(1, 3), -1), "n must be an int >= 0, got -1"),
    # expected_sampled_divergence
    (lambda: expected_sampled_divergence(torch.zeros(3), torch.zeros(3), beta=0.0),
     "beta must be > 0: TRL takes its top-1 path for beta > 0 only (at beta = 0 the support is "
     "the teacher's top-k)"),
    (lambda: expected_sampled_divergence(torch.zeros(3), torch.zeros(4), beta=1.0),
     "teacher_logits must have the shape of student_logits (3,), got (4,)"),
    (lambda: expected_sampled_divergence(torch.zeros(2, 3), torch.tensor(
        [[0.0, 0.0, 0.0], [-math.inf] * 3]), beta=1.0),
     "teacher_logits has a position whose logits are all -inf: at least one token must be "
     "possible"),
    # forward_kl_upper_bound: the report's own names
    (lambda: forward_kl_upper_bound(torch.zeros(4), torch.tensor([-1.0]), [0]),
     "topk_ids must be an integer torch.Tensor, got list"),
    (lambda: forward_kl_upper_bound(torch.zeros(4), torch.tensor([-1.0, -2.0]),
                                    torch.tensor([0, 4])),
     "topk_ids must lie in [0, V) = [0, 4), got values from 0 to 4"),
    (lambda: forward_kl_upper_bound(torch.zeros(4), torch.tensor([-1.0]), torch.tensor([0, 1])),
     "teacher_topk_logp must have the shape of topk_ids (2,), got (1,)"),
    (lambda: forward_kl_upper_bound(torch.zeros(4), torch.log(torch.tensor([0.7, 0.6])),
                                    torch.tensor([0, 1])),
     "teacher_topk_logp must be log-probabilities of one distribution: its valid slots sum to "
     "1.3 > 1 in probability at position ()"),
    (lambda: forward_kl_upper_bound(torch.zeros(4), torch.log(torch.tensor([0.2])),
                                    torch.tensor([0])),
     "teacher_topk_logp is not a top-k report: its unreported mass 1 - Q exceeds (V - k) "
     "times its smallest reported probability"),
    # a position the teacher reports no mass at: no teacher's top-k
    (lambda: forward_kl_upper_bound(torch.zeros(2, 4), torch.tensor(
        [[math.log(0.4), math.log(0.3)], [-math.inf, -math.inf]]), torch.tensor([[0, 1], [0, 1]])),
     "teacher_topk_logp is not a top-k report: its unreported mass 1 - Q exceeds (V - k) "
     "times its smallest reported probability"),
    # support_bias: the choice must be computable and compared with its own D_beta
    (lambda: support_bias("tail", 1, torch.zeros(1, 4), torch.zeros(1, 4)),
     "choice must be a Choice, got str"),
    (lambda: support_bias(sp.Choice("x", "y", "top_p", 0.0, "tail"), 1, *_PAIR),
     f"choice.rule must be one of {SUPPORTS}, got 'top_p'"),
    (lambda: support_bias(sp.Choice("x", "y", "union", 2.0, "tail"), 1, *_PAIR),
     "choice.beta must be <= 1.0, got 2.0"),
    (lambda: support_bias(sp.Choice("x", "y", "union", 0.5, "ignore"), 1, *_PAIR),
     "choice.loss must be one of ('tail', 'renormalize', 'reinforce', 'verl', 'upper_bound'), "
     "got 'ignore'"),
    (lambda: support_bias(sp.Choice("x", "y", "union", 0.0, "verl"), 1, *_PAIR),
     "choice.loss 'verl' takes the teacher's top-k report and approximates the forward KL: it "
     "needs rule 'teacher_topk' and beta 0, got rule 'union' and beta 0.0"),
    (lambda: support_bias(sp.Choice("x", "y", "teacher_topk", 0.5, "upper_bound"), 1, *_PAIR),
     "choice.loss 'upper_bound' takes the teacher's top-k report and approximates the forward "
     "KL: it needs rule 'teacher_topk' and beta 0, got rule 'teacher_topk' and beta 0.5"),
    (lambda: support_bias(sp.Choice("x", "y", "teacher_topk", 0.5, "reinforce"), 1, *_PAIR),
     "choice.loss 'reinforce' is Tinker's reverse KL: it needs beta 1, got beta 0.5"),
    (lambda: support_bias(sp.Choice("x", "y", "sampled", 1.0, "reinforce"), 1, *_PAIR),
     "choice.rule 'sampled' is TRL's sampled top-1 path: it needs a loss in ('renormalize', "
     "'tail') and beta > 0, got loss 'reinforce' and beta 1.0"),
    (lambda: support_bias(sp.Choice("x", "y", "teacher_top1_sampled", 0.0, "tail"), 1, *_PAIR),
     "choice.rule 'teacher_top1_sampled' is TRL's sampled top-1 path: it needs a loss in "
     "('renormalize', 'tail') and beta > 0, got loss 'tail' and beta 0.0"),
    (lambda: support_bias(CHOICES[0], 1, torch.zeros(4), torch.zeros(4)),
     "student_logits must have 2 dimensions, got shape (4,) (1 dimensions)"),
    (lambda: support_bias(CHOICES[0], 1, torch.zeros(1, 4), torch.zeros(2, 4)),
     "teacher_logits must have the shape of student_logits (1, 4), got (2, 4)"),
    (lambda: support_bias(CHOICES[0], 0, torch.zeros(1, 4), torch.zeros(1, 4)),
     "k must be an int in [1, V] = [1, 4], got 0"),
    (lambda: support_bias(CHOICES[0], 1, torch.zeros(1, 4), torch.zeros(1, 4)),
     "the full divergence and its gradient must be nonzero and finite at every position for a "
     "relative bias (the student equals the teacher, or one side puts mass where the other has "
     "none)"),
    # support_study, format_support_table, plot_support_bias
    (lambda: sp.support_study(V=1), "V must be an int >= 2, got 1"),
    (lambda: sp.support_study(V=8, positions=0), "positions must be a positive int, got 0"),
    (lambda: sp.support_study(V=8, ks=[9]), "ks must hold ints in [1, V] = [1, 8], got 9"),
    (lambda: sp.support_study(V=8, ks=[2, 1, 2]),
     "ks must not repeat a value (one row per choice and k), got [2, 1, 2]"),
    (lambda: sp.support_study(V=8, ks=[2], choices=["tail"]), "choice must be a Choice, got str"),
    (lambda: sp.support_study(V=8, ks=[2], choices=(CHOICES[0], CHOICES[0])),
     f"choices must have distinct labels (the table's rows), got {[CHOICES[0].label] * 2!r}"),
    (lambda: sp.format_support_table({"ks": [1]}),
     "data must be the dict of support_study, with keys ('ks', 'rows') and a list of rows, got "
     "dict with keys ['ks']"),
    (lambda: sp.format_support_table(None),
     "data must be the dict of support_study, with keys ('ks', 'rows') and a list of rows, got "
     "NoneType"),
    (lambda: sp.format_support_table({"ks": [1, 4], "rows": _ROWS}, ks=[2]),
     "k = 2 is not in the data (ks = [1, 4])"),
    (lambda: sp.plot_support_bias("unused.svg", {"V": 8, "rows": []}),
     "data must be the dict of support_study, with keys ('V', 'positions', 'rows') and a list of "
     "rows, got dict with keys ['V', 'rows']"),
    (lambda: sp.plot_support_bias("unused.svg", {"V": 8, "positions": 1, "rows": _ROWS}),
     "data's rows must be those of CHOICES, whose styles the figure draws, got the labels "
     "['a']"),
]


@pytest.mark.parametrize("call,message", EVERY_REFUSAL)
def test_every_refusal_in_full(call, message):
    with pytest.raises((ValueError, TypeError), match="^" + re.escape(message) + "$"):
        call()


def test_a_teacher_without_mass_on_the_support_has_the_documented_value_and_gradient():
    # Position 1's teacher log-probabilities are -inf at both valid slots; by hand (the
    # docstring of support_divergence), with P the student's mass on S = {0, 1}:
    s = torch.tensor([[0.3, -0.2, 0.5, 0.1], [0.0, 1.0, -1.0, 0.2]], dtype=F64)
    t = torch.tensor([[math.log(0.3), math.log(0.2)], [-math.inf, -math.inf]], dtype=F64)
    support = Support(torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2, dtype=torch.bool), t)
    p = torch.softmax(s[1], -1).tolist()
    P = p[0] + p[1]
    want = {(1.0, "renormalize"): math.inf, (1.0, "tail"): math.inf,
            (0.0, "renormalize"): 0.0, (0.0, "tail"): -math.log1p(-P),
            (0.3, "renormalize"): -0.7 * math.log(0.7)}
    for (beta, approximation), value in want.items():
        fn = lambda z, b=beta, a=approximation: support_divergence(  # noqa: E731
            z, support, beta=b, approximation=a, max_log_mass=None)
        got = fn(s)
        assert got[1].item() == pytest.approx(value, rel=1e-14)
        z = s.clone().requires_grad_(True)
        out = fn(z)
        torch.where(torch.isfinite(out), out, torch.zeros_like(out)).sum().backward()
        assert not bool(z.grad.isnan().any())
        if (beta, approximation) == (0.0, "tail"):
            # d(-log(1 - P))/dz_j = p_j (1[j in S] - P) / (1 - P), by hand
            closed = torch.tensor([p[j] * ((j < 2) - P) / (1 - P) for j in range(4)], dtype=F64)
            torch.testing.assert_close(z.grad[1], closed, rtol=1e-12, atol=1e-15)
        else:  # a constant: +inf, 0 or -(1 - beta) log(1 - beta), no gradient (to rounding)
            assert float(z.grad[1].abs().max()) < 1e-15
        # position 0 is the one computed alone
        alone = support_divergence(s[0], Support(support.ids[0], support.valid[0], t[0]),
                                   beta=beta, approximation=approximation, max_log_mass=None)
        assert got[0].item() == alone.item()
    # Tinker's REINFORCE form: no slot with teacher mass is left, and the position adds 0
    z = s.clone().requires_grad_(True)
    value = reinforce_reverse_kl(z, support)
    value.sum().backward()
    assert value[1].item() == 0.0 and torch.equal(z.grad[1], torch.zeros(4, dtype=F64))
    assert value[0].item() == pytest.approx(
        support_divergence(s[0], Support(support.ids[0], support.valid[0], t[0]), beta=1.0,
                           approximation="renormalize").item(), rel=1e-14)


def test_the_ids_of_a_masked_out_position_are_not_read():
    # garbage ids (out of range, repeated), valid slots and teacher log-probabilities in the
    # masked-out positions: the same value and gradient as with a clean support, exactly 0 there
    s, t, _ = _pair(13, V=5, shape=(3,))
    support = build_support("teacher_topk", 2, s, t)
    mask = torch.tensor([1, 0, 1])
    garbage = Support(support.ids.clone(), support.valid.clone(), support.teacher_logp.clone())
    garbage.ids[1] = torch.tensor([-7, 99])
    garbage.valid[1] = False
    garbage.teacher_logp[1] = math.inf
    dirty_s = s.clone()
    dirty_s[1] = math.nan
    for fn in (lambda z, sup: support_divergence(z, sup, beta=0.4, mask=mask),
               lambda z, sup: reinforce_reverse_kl(z, sup, mask=mask)):
        clean, dirty = fn(s, support), fn(dirty_s, garbage)
        assert torch.equal(clean, dirty) and dirty[1].item() == 0.0
        grad = _grad(lambda z, f=fn: f(z, garbage), dirty_s)
        assert torch.equal(grad, _grad(lambda z, f=fn: f(z, support), s))
        assert torch.equal(grad[1], torch.zeros(5, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_support_ids_of_any_integer_dtype_give_the_int64_values(dtype):
    s, t, _ = _pair(14, V=6, shape=(2,))
    support = build_support("union", 2, s, t)
    narrow = support._replace(ids=support.ids.to(dtype))
    for fn in (lambda z, sup: support_divergence(z, sup, beta=0.5),
               lambda z, sup: reinforce_reverse_kl(z, sup),
               lambda z, sup: forward_kl_upper_bound(z, sup.teacher_logp[..., :2],
                                                     sup.ids[..., :2])):
        assert torch.equal(fn(s, narrow), fn(s, support))
        assert torch.equal(_grad(lambda z, f=fn: f(z, narrow), s),
                           _grad(lambda z, f=fn: f(z, support), s))


def test_the_exact_tail_bucket_is_finite_where_a_mass_rounds_to_one():
    # max_log_mass=None: 1 - P and 1 - Q from the rounded sums P and Q made (b) +inf where the
    # divergence is finite. (1) S holds every token: no tail on either side (the forward KL
    # of these two near-uniform rows, 5.4e-7, was +inf: the teacher's 1 - Q rounded to 1e-16,
    # the student's to 0; found by search).
    s = torch.tensor([-0.0013360000000000002, 0.000887, 0.000768, 5.7e-05], dtype=F64)
    t = torch.tensor([0.000224, 0.0005520000000000001, -0.000579, 1.8e-05], dtype=F64)
    every = build_support("teacher_topk", 4, s, t)
    for beta in (0.0, 0.5, 1.0):
        got = support_divergence(s, every, beta=beta, max_log_mass=None)
        assert got.item() == pytest.approx(_full(s, t, beta).item(), rel=1e-9, abs=1e-15)
    # (2) the student's P rounds to 1 (p_0 = 1 - 8.5e-18): its tail is summed from its own
    # entries, 2 e^-40 / (1 + 2 e^-40), by hand; against the teacher's 0.5 the forward bucket
    # is 0.5 log(0.5 / p_0) + 0.5 log(0.5 / (1 - p_0)), finite
    s = torch.tensor([0.0, -40.0, -40.0], dtype=F64)
    q = torch.tensor([0.5, 0.25, 0.25], dtype=F64)
    log_p0 = -math.log1p(2 * math.exp(-40.0))
    log_tail = math.log(2.0) - 40.0 + log_p0
    want = 0.5 * (math.log(0.5) - log_p0) + 0.5 * (math.log(0.5) - log_tail)
    got = support_divergence(s, _support([0], q.log()), beta=0.0, max_log_mass=None)
    assert got.item() == pytest.approx(want, rel=1e-14)
    # (3) the teacher's Q rounds to 1 (1 - 1e-20), the student keeps 0.3 off S: the reverse
    # bucket takes the teacher's tail as K eps, as topk_kl does (its test derives the value)
    log_q = torch.tensor([math.log(0.5), math.log(0.5), math.log(5e-21), math.log(5e-21)],
                         dtype=F64)
    s = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=F64))
    report = _support([0, 1], log_q)
    got = support_divergence(s, report, beta=1.0, max_log_mass=None)
    assert math.isfinite(got.item()) and got.item() <= _full(s, log_q, 1.0).item()
    assert got.item() == pytest.approx(topk_kl(s, report.teacher_logp, report.ids, "tail",
                                               "reverse").item(), rel=1e-14)
    assert bool(torch.isfinite(_grad(lambda z: support_divergence(
        z, report, beta=1.0, max_log_mass=None), s)).all())


def test_the_expected_sampled_reverse_bucket_is_finite_where_a_teacher_mass_rounds_to_one():
    # q_0 = 1 - 3.9e-22: log q_0 rounds to 0, and the bucket of x = 0, whose teacher tail
    # 1 - q_0 read as 0 against the student's 2/3, was +inf (the whole expectation with it).
    # The tail below K eps = eps is taken as eps, as in support_divergence; by hand:
    s = torch.zeros(3, dtype=F64)  # p = (1/3, 1/3, 1/3)
    t = torch.tensor([0.0, -50.0, -50.0], dtype=F64)
    q = torch.softmax(t, -1).tolist()
    assert torch.log_softmax(t, -1)[0].item() == 0.0
    eps = torch.finfo(F64).eps
    third = 1 / 3

    def kl2(p, q_x, tail):
        return p * math.log(p / q_x) + (1 - p) * math.log((1 - p) / tail)
    want = third * kl2(third, 1.0, eps) + 2 * third * kl2(third, q[1], 1 - q[1])
    got = expected_sampled_divergence(s, t, beta=1.0, max_log_mass=None)
    assert got.item() == pytest.approx(want, rel=1e-12)
    assert got.item() <= _full(s, t, 1.0).item()  # still a lower bound
    assert bool(torch.isfinite(_grad(lambda z: expected_sampled_divergence(
        z, t, beta=1.0, max_log_mass=None), s)).all())


@pytest.mark.slow
def test_the_bounds_precision_limit_in_float32_is_as_stated():
    """forward_kl_upper_bound's docstring: past 2^24 tokens float32 cannot resolve the worst
    tail's weights. A tail of 2^24 + 1 tokens, one of them with half the student's mass, and a
    teacher that reports one token of mass mu ~ 1/V: float64 gives the worst tail's bound,
    log 2 (every w_i ~ mu on the uniform half, ~0 on the heavy token) within 1e-6, float32 more
    than 1% below it."""
    import math

    from opd_literate.large_vocab.supports import forward_kl_upper_bound

    V = 2**24 + 2
    z = torch.zeros(V)
    z[1] = math.log(2**24)  # the heaviest tail token: about half the student's mass
    t0 = torch.tensor((1 - 2**-24) / (2**24 + 0.5), dtype=torch.float64).log()
    ids = torch.tensor([0])
    b64 = forward_kl_upper_bound(z.double(), t0[None], ids).item()
    b32 = forward_kl_upper_bound(z, t0.float()[None], ids).item()
    assert abs(b64 - math.log(2)) < 1e-6
    assert b32 < 0.99 * b64


def test_the_forward_kls_worst_tail_on_any_support_is_one_token_and_finite():
    """The chapter: over the teachers consistent with a report on any support, the forward KL's
    worst tail puts all of 1 - Q on the student's least likely unreported token; the reverse
    KL has no bound (a teacher may give an emitted token 0)."""
    g = torch.Generator().manual_seed(5)
    V, S = 12, torch.tensor([0, 3, 7])
    p = torch.softmax(2.0 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2.0 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    off = torch.ones(V, dtype=torch.bool)
    off[S] = False
    Q = float(q[S].sum())

    def forward(teacher):
        return float((teacher * (teacher.log() - p.log())).nan_to_num().sum())

    head = float((q[S] * (q[S].log() - p[S].log())).sum())
    bound = head + (1 - Q) * math.log((1 - Q) / float(p[off].min()))
    worst = q.clone()
    worst[off] = 0.0
    worst[torch.nonzero(off)[p[off].argmin()]] = 1 - Q
    assert forward(worst) == pytest.approx(bound, rel=1e-12)  # the vertex attains it
    for _ in range(200):  # and no consistent tail exceeds it
        tail = torch.distributions.Dirichlet(torch.full((int(off.sum()),), 0.3,
                                                        dtype=torch.float64)).sample()
        teacher = q.clone()
        teacher[off] = (1 - Q) * tail
        assert forward(teacher) <= bound + 1e-12
    # the reverse KL is unbounded: a consistent teacher with q_v -> 0 where p_v > 0
    teacher = q.clone()
    teacher[off] = 0.0
    teacher[torch.nonzero(off)[0]] = 1 - Q
    reverse = (p * (p.log() - teacher.log())).sum()
    assert math.isinf(float(reverse))


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_the_generalized_jsd_is_at_most_the_binary_entropy_of_beta(beta):
    """The chapter: the JSD with 0 < beta < 1 is at most h(beta), whatever the two
    distributions, and nearly attains it on distributions of disjoint supports."""
    g = torch.Generator().manual_seed(7)
    h = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
    student = 6.0 * torch.randn(1, 500, 12, generator=g, dtype=torch.float64)
    teacher = 6.0 * torch.randn(1, 500, 12, generator=g, dtype=torch.float64)
    values = generalized_jsd_per_position(student, teacher, beta=beta)
    assert float(values.max()) <= h + 1e-12
    apart = torch.tensor([[[40.0, -40.0]]], dtype=torch.float64)
    assert float(generalized_jsd_per_position(apart, -apart, beta=beta)[0, 0]) == pytest.approx(
        h, rel=1e-9)
