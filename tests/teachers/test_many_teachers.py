r"""Many teachers (opd_literate.teachers.many_teachers): every objective and its gradient against
torch autograd of an independent float64 implementation, the identities between them, and the
exact means of the sampled-token estimators, on enumerable toys.

The torch side never uses the score-function identity: it computes each objective as
$\sum_x \rho(x) \sum_y \pi_x(y) (\log \pi_x(y) - \log q^\star_x(y))$ from the logits, with
$q^\star$ built at the sequence level (the sequence mixture as $\sum_k w_k q_k(y)$, not from
its per-token conditionals), and differentiates it. Tolerance ``1e-12``: sums of at most a few
hundred float64 terms of size below 10.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch.opd_mismatch import add_teacher
from opd_literate.mismatch.toy import ar_toy_from_logits, toy_from_logits
from opd_literate.teachers.many_teachers import (
    KINDS,
    bias_table,
    expected_estimate,
    geometric_mean_logits,
    make_prompts,
    misrouting_curve,
    misrouting_matrix,
    mixture_gap,
    objective,
    prompts_from_logits,
    routing_weights,
    target_token_logprobs,
)

ATOL = 1e-12
F64 = torch.float64


def _close(a, b, atol=ATOL):
    return np.allclose(a, b, rtol=0, atol=atol)


def _random_weights(prompts, seed, zero=False):
    w = np.random.default_rng(seed).dirichlet(np.ones(prompts["K"]), size=prompts["P"])
    if zero and prompts["K"] > 1:  # a teacher with weight 0 on the first prompt
        w[0, 0] = 0.0
        w[0] /= w[0].sum()
    return w


# ---------------------------------------------------------------------------------------------
# The torch reference: the objectives from the logits, at the sequence level
# ---------------------------------------------------------------------------------------------
def _torch_token_logp(logits, toy):
    """(M, T) log p(y_t | y_<t) from logits (T, V) or (T, V + 1, V); 0 on the padding."""
    log_p = torch.log_softmax(logits, dim=-1)
    Y = torch.as_tensor(toy["Y"])
    positions = torch.arange(Y.shape[1])[None, :]
    if "prev" in toy:
        mask = torch.as_tensor(toy["mask"]) > 0
        picked = log_p[positions, torch.as_tensor(toy["prev"]), Y]
        return torch.where(mask, picked, torch.zeros((), dtype=F64))
    return log_p[positions, Y]


def _torch_objective(prompts, kind, weights):
    """(value, gradient) by autograd; weights (P, K)."""
    theta = torch.tensor(prompts["theta"], dtype=F64, requires_grad=True)
    phi = torch.tensor(prompts["phi"], dtype=F64)
    value = torch.zeros((), dtype=F64)
    for x, toy in enumerate(prompts["toys"]):
        logp = _torch_token_logp(theta[x], toy).sum(dim=1)  # (M,) log pi(y)
        per_token = torch.stack([_torch_token_logp(phi[x, k], toy) for k in range(prompts["K"])])
        w = torch.tensor(weights[x], dtype=F64)
        log_w = torch.log(w)[:, None]
        if kind in ("routed", "weighted_kl"):
            log_q = (w[:, None] * per_token.sum(dim=2)).sum(dim=0)
        elif kind == "token_mixture":  # prod_t sum_k w_k q_k(y_t | y_<t)
            mask = torch.as_tensor(response_mask_of(toy)) > 0
            mixed = torch.logsumexp(log_w[:, :, None] + per_token, dim=0)
            log_q = torch.where(mask, mixed, torch.zeros((), dtype=F64)).sum(dim=1)
        else:  # sum_k w_k q_k(y), at the sequence level
            log_q = torch.logsumexp(log_w + per_token.sum(dim=2), dim=0)
        value = value + prompts["prompt_probs"][x] * (logp.exp() * (logp - log_q)).sum()
    value.backward()
    grad = theta.grad.numpy()
    if prompts["shared_student"]:
        # theta[x] are P copies of one student: d/d(student) is the sum of the copies' gradients
        grad = grad.sum(axis=0)
    return float(value.detach()), grad


def response_mask_of(toy):
    return toy["mask"] if "mask" in toy else np.ones(toy["Y"].shape)


def _weights_for(prompts, kind, weights):
    return routing_weights(prompts) if kind == "routed" else weights


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("autoregressive", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_objectives_and_gradients_are_autograds(kind, autoregressive, shared):
    prompts = make_prompts(P=3, K=3, T=3, V=3, autoregressive=autoregressive, seed=4,
                           prompt_probs=[0.5, 0.3, 0.2], shared_student=shared)
    weights = _random_weights(prompts, 1, zero=True)
    ours = objective(prompts, kind, None if kind == "routed" else weights)
    value, grad = _torch_objective(prompts, kind, _weights_for(prompts, kind, weights))
    assert ours["grad"].shape == grad.shape
    assert math.isclose(ours["value"], value, rel_tol=0, abs_tol=ATOL)
    assert _close(ours["grad"], grad)


def test_gradients_agree_with_finite_differences():
    prompts = make_prompts(P=2, K=2, T=2, V=2, autoregressive=True, seed=3)
    g = objective(prompts, "sequence_mixture")["grad"]
    h, index = 1e-6, (1, 1, 1, 1)  # prompt 1, position 1, row 1 + 0 (after token 0), token 1
    values = []
    for sign in (1, -1):
        theta = prompts["theta"].copy()
        theta[index] += sign * h
        moved = prompts_from_logits(theta, prompts["phi"], prompts["prompt_probs"],
                                    prompts["routes"])
        values.append(objective(moved, "sequence_mixture")["value"])
    assert abs((values[0] - values[1]) / (2 * h) - g[index]) < 1e-8
    assert abs(g[index]) > 1e-3  # a visited parameter, not a zero compared with a zero


def test_routed_is_add_teachers_kl_prompt_by_prompt():
    """(a) against the single-teacher OPD chapter: each prompt's KL and gradient are
    ``add_teacher``'s for the routed teacher."""
    for autoregressive in (False, True):
        prompts = make_prompts(P=3, K=2, T=3, V=3, autoregressive=autoregressive, seed=2,
                               prompt_probs=[0.2, 0.3, 0.5])
        ours = objective(prompts, "routed")
        value, grads = 0.0, []
        for x, toy in enumerate(prompts["toys"]):
            single = add_teacher(toy, phi=prompts["phi"][x, prompts["routes"][x]])
            value += prompts["prompt_probs"][x] * single["kl"]
            grads.append(prompts["prompt_probs"][x] * single["kl_grad"])
        assert math.isclose(ours["value"], value, abs_tol=ATOL)
        assert _close(ours["grad"], np.stack(grads))


# ---------------------------------------------------------------------------------------------
# The identities between the objectives
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("autoregressive", [False, True])
def test_weighted_sum_minus_sequence_mixture_is_the_posterior_gap(autoregressive):
    prompts = make_prompts(P=2, K=3, T=3, V=3, autoregressive=autoregressive, seed=5)
    w = _random_weights(prompts, 2)
    gap = mixture_gap(prompts, w)
    s, m = objective(prompts, "weighted_kl", w), objective(prompts, "sequence_mixture", w)
    assert gap["value"] > 0.01
    assert math.isclose(s["value"] - m["value"], gap["value"], abs_tol=ATOL)
    assert _close(s["grad"] - m["grad"], gap["grad"])


def test_the_per_token_mixture_is_not_the_sequence_mixture_beyond_one_token():
    for autoregressive in (False, True):
        prompts = make_prompts(T=3, V=3, autoregressive=autoregressive, seed=1)
        token = target_token_logprobs(prompts, "token_mixture")
        seq = target_token_logprobs(prompts, "sequence_mixture")
        for a, b in zip(token, seq):
            assert _close(a[:, 0], b[:, 0])  # the first token: posterior = prior
            assert np.abs(a[:, 1:] - b[:, 1:]).max() > 0.01
        gap = abs(objective(prompts, "token_mixture")["value"]
                  - objective(prompts, "sequence_mixture")["value"])
        assert gap > 1e-3
    one = make_prompts(T=1, V=4, seed=1)  # one token: the two mixtures are the same
    assert _close(objective(one, "token_mixture")["grad"],
                  objective(one, "sequence_mixture")["grad"])


def test_one_teacher_makes_every_objective_the_routed_one():
    prompts = make_prompts(P=2, K=1, T=3, V=3, autoregressive=True, seed=6)
    routed = objective(prompts, "routed")
    for kind in KINDS[1:]:
        other = objective(prompts, kind)
        assert math.isclose(other["value"], routed["value"], abs_tol=ATOL)
        assert _close(other["grad"], routed["grad"])
    assert mixture_gap(prompts)["value"] == 0.0


def test_the_product_of_experts_minimises_the_weighted_sum_at_minus_log_z():
    """Independent positions: at theta = sum_k w_k phi_k the gradient of (c) is 0 and its value
    is -log Z, with Z = sum_y prod_k q_k(y)^w_k enumerated."""
    prompts = make_prompts(P=2, K=3, T=2, V=3, seed=7)
    w = _random_weights(prompts, 3)
    at_g = prompts_from_logits(geometric_mean_logits(prompts, w), prompts["phi"],
                               prompts["prompt_probs"], prompts["routes"])
    result = objective(at_g, "weighted_kl", w)
    assert np.abs(result["grad"]).max() < 1e-15
    log_z = [np.log(np.exp(np.einsum("k,kmt->m", w[x], toy["logp_teachers"])).sum())
             for x, toy in enumerate(prompts["toys"])]
    assert max(log_z) < -0.01  # Z < 1: the teachers disagree
    assert math.isclose(result["value"], -float(prompts["prompt_probs"] @ log_z), abs_tol=ATOL)
    # and it is a minimum: any other student is worse
    rng = np.random.default_rng(0)
    for _ in range(5):
        other = prompts_from_logits(at_g["theta"] + 0.3 * rng.normal(size=at_g["theta"].shape),
                                    prompts["phi"], prompts["prompt_probs"], prompts["routes"])
        assert objective(other, "weighted_kl", w)["value"] > result["value"]


def test_on_the_autoregressive_toy_the_per_state_geometric_mean_is_not_the_minimiser():
    """It zeroes the discount-0 estimate (each state's KL to its geometric mean) but not the
    gradient of (c), which also rewards the prefixes where the teachers agree."""
    prompts = make_prompts(P=2, K=2, T=3, V=3, autoregressive=True, seed=8)
    w = _random_weights(prompts, 4)
    at_g = prompts_from_logits(geometric_mean_logits(prompts, w), prompts["phi"],
                               prompts["prompt_probs"], prompts["routes"])
    assert np.abs(expected_estimate(at_g, "weighted_kl", w, gamma=0.0)).max() < 1e-15
    assert np.abs(objective(at_g, "weighted_kl", w)["grad"]).max() > 1e-3


def test_a_shared_student_routed_by_source_minimises_a_weighted_sum():
    """A student that cannot tell the prompts apart, teachers that do not depend on the
    prompt: routing by source is (c) with w_k = rho(r(x) = k), a product of experts."""
    base = make_prompts(P=3, K=2, T=2, V=3, autoregressive=True, seed=9, shared_student=True)
    phi = np.broadcast_to(base["phi"][:1], base["phi"].shape).copy()  # teacher k on any prompt
    rho, routes = np.array([0.5, 0.3, 0.2]), np.array([0, 1, 0])
    prompts = prompts_from_logits(base["theta"][0], phi, rho, routes, shared_student=True)
    w = np.array([0.7, 0.3])  # rho of the prompts of source 0, of source 1
    routed, weighted = objective(prompts, "routed"), objective(prompts, "weighted_kl", w)
    assert routed["grad"].shape == prompts["theta"].shape[1:]
    assert math.isclose(routed["value"], weighted["value"], abs_tol=ATOL)
    assert _close(routed["grad"], weighted["grad"])


# ---------------------------------------------------------------------------------------------
# The estimators: exact means
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("autoregressive", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_discount_one_is_unbiased_for_its_own_objective(kind, autoregressive):
    prompts = make_prompts(P=2, K=3, T=3, V=3, autoregressive=autoregressive, seed=10)
    w = None if kind == "routed" else _random_weights(prompts, 5, zero=True)
    assert _close(expected_estimate(prompts, kind, w, gamma=1.0),
                  objective(prompts, kind, w)["grad"])


def test_discount_zero_on_independent_positions():
    """Unbiased where d_t depends on y_t alone; the sequence mixture's depends on the prefix."""
    rows = bias_table(make_prompts(P=3, K=3, T=3, V=3, seed=0), gammas=[0.0])
    own = {r["estimator"]: r["rel_bias"] for r in rows if r["estimator"] == r["objective"]}
    assert max(own["routed"], own["weighted_kl"], own["token_mixture"]) < 1e-12
    assert own["sequence_mixture"] > 0.01


def test_discount_zero_on_the_autoregressive_toy_is_biased_for_every_objective():
    rows = bias_table(make_prompts(P=3, K=3, T=3, V=3, autoregressive=True, seed=0),
                      gammas=[0.0, 1.0])
    for r in rows:
        if r["estimator"] == r["objective"]:
            assert (r["rel_bias"] > 0.01) if r["gamma"] == 0.0 else (r["rel_bias"] < 1e-12)


def test_the_routed_estimator_is_the_average_reward_estimator_in_expectation():
    """Drawing the teacher from C and using its reward has the mean of the estimator whose
    reward is the C-weighted average of the K teachers' log-probabilities."""
    prompts = make_prompts(P=3, K=3, T=3, V=2, autoregressive=True, seed=11)
    C = _random_weights(prompts, 6)
    for gamma in (0.0, 0.5, 1.0):
        assert _close(expected_estimate(prompts, "routed", C, gamma),
                      expected_estimate(prompts, "weighted_kl", C, gamma))


@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_misrouting_adds_a_bias_linear_in_epsilon(gamma):
    prompts = make_prompts(P=3, K=3, T=3, V=3, autoregressive=True, seed=12)
    right = expected_estimate(prompts, "routed", gamma=gamma)
    wrong = expected_estimate(prompts, "routed", misrouting_matrix(prompts, 1.0), gamma)
    for eps in (0.05, 0.3, 0.8):
        mean = expected_estimate(prompts, "routed", misrouting_matrix(prompts, eps), gamma)
        assert _close(mean, right + eps * (wrong - right))
    rows = misrouting_curve(prompts, [0.0, 0.05, 0.3, 1.0], gamma=gamma)
    unit = rows[-1]["rel_misrouting"]
    assert unit > 0.1
    for r in rows:
        assert math.isclose(r["rel_misrouting"], r["epsilon"] * unit, rel_tol=1e-10, abs_tol=ATOL)
    if gamma == 1.0:  # the routed estimator is then exact: all the bias is misrouting's
        assert all(math.isclose(r["rel_bias"], r["rel_misrouting"], rel_tol=1e-10, abs_tol=ATOL)
                   for r in rows)
    else:
        assert rows[0]["rel_bias"] > 0.01  # discount 0 on the prefix-dependent toy


def test_the_misrouted_fixed_point_is_the_geometric_mean_and_moves_away_with_epsilon():
    prompts = make_prompts(P=3, K=3, T=3, V=3, seed=13)
    for eps in (0.1, 0.4):
        C = misrouting_matrix(prompts, eps)
        fixed = prompts_from_logits(geometric_mean_logits(prompts, C), prompts["phi"],
                                    prompts["prompt_probs"], prompts["routes"])
        for gamma in (0.0, 1.0):
            assert np.abs(expected_estimate(fixed, "routed", C, gamma)).max() < 1e-14
    kls = [r["fixed_point_kl"] for r in misrouting_curve(prompts, np.linspace(0, 1, 6))]
    assert kls[0] < 1e-15 and all(b > a for a, b in zip(kls, kls[1:]))


def test_misrouting_with_two_teachers_swaps_them_at_epsilon_one():
    prompts = make_prompts(P=2, K=2, T=2, V=3, seed=14)
    C = misrouting_matrix(prompts, 1.0)
    assert C.tolist() == [[0.0, 1.0], [1.0, 0.0]]
    swapped = prompts_from_logits(prompts["theta"], prompts["phi"], prompts["prompt_probs"],
                                  1 - prompts["routes"])
    assert _close(expected_estimate(prompts, "routed", C), expected_estimate(swapped, "routed"))


# ---------------------------------------------------------------------------------------------
# A property test over small random toys
# ---------------------------------------------------------------------------------------------
@pytest.mark.properties  # the example count from the profile: 25, or 1,000 with "ci"
@given(P=st.integers(1, 3), K=st.integers(1, 3), T=st.integers(1, 3), V=st.integers(2, 3),
       autoregressive=st.booleans(), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.1, 1.0, 3.0]), eps=st.floats(0.0, 1.0))
def test_identities_on_random_toys(P, K, T, V, autoregressive, seed, scale, eps):
    prompts = make_prompts(P=P, K=K, T=T, V=V, autoregressive=autoregressive, seed=seed,
                           teacher_scale=scale)
    w = _random_weights(prompts, seed)
    values = {kind: objective(prompts, kind, None if kind == "routed" else w) for kind in KINDS}
    for result in values.values():
        assert np.isfinite(result["value"]) and np.isfinite(result["grad"]).all()
        assert result["value"] >= -ATOL  # a KL (the weighted sum: of KLs)
    gap = mixture_gap(prompts, w)
    assert gap["value"] >= -ATOL
    assert math.isclose(values["weighted_kl"]["value"] - values["sequence_mixture"]["value"],
                        gap["value"], abs_tol=1e-11)
    assert _close(values["weighted_kl"]["grad"] - values["sequence_mixture"]["grad"],
                  gap["grad"], atol=1e-11)
    for kind in KINDS:
        weights = None if kind == "routed" else w
        assert _close(expected_estimate(prompts, kind, weights, 1.0), values[kind]["grad"],
                      atol=1e-11)
    if T == 1:
        assert _close(values["token_mixture"]["grad"], values["sequence_mixture"]["grad"])
    if K > 1:
        C = misrouting_matrix(prompts, eps)
        assert _close(expected_estimate(prompts, "routed", C, 0.0),
                      expected_estimate(prompts, "weighted_kl", C, 0.0))


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_hand_built_prompts_read_like_the_toys():
    theta, phi = np.zeros((1, 2, 2)), np.log([[[[0.9, 0.1], [0.9, 0.1]]]])
    prompts = prompts_from_logits(theta, phi, [1.0], [0])
    toy = toy_from_logits(theta[0], theta[0])
    assert (prompts["toys"][0]["Y"] == toy["Y"]).all()
    ar = ar_toy_from_logits(np.zeros((2, 3, 2)), np.zeros((2, 3, 2)))
    built = prompts_from_logits(np.zeros((1, 2, 3, 2)), np.zeros((1, 2, 2, 3, 2)), [1.0], [1])
    assert (built["toys"][0]["mask"] == ar["mask"]).all() and built["autoregressive"]


@pytest.mark.parametrize("call, error, message", [
    (lambda p: objective(p, "mixture"), ValueError, "kind must be one of"),
    (lambda p: objective(p, "weighted_kl", [0.5, 0.5]), ValueError, r"shape \(3,\) or \(2, 3\)"),
    (lambda p: objective(p, "weighted_kl", [0.5, 0.6, -0.1]), ValueError, "non-negative"),
    (lambda p: objective(p, "weighted_kl", [0.5, 0.4, 0.0]), ValueError, "sum to 1"),
    (lambda p: objective(p, "weighted_kl", [0.5, np.nan, 0.5]), ValueError, "finite"),
    (lambda p: objective(p, "weighted_kl", [True, False, False]), TypeError, "real numbers"),
    (lambda p: target_token_logprobs(p, "routed", [1.0, 0.0, 0.0]), ValueError, "no weights"),
    (lambda p: expected_estimate(p, "routed", gamma=1.5), ValueError, "gamma must be <= 1"),
    (lambda p: misrouting_matrix(p, -0.1), ValueError, "epsilon must be >= 0"),
    (lambda p: bias_table(p, gammas=[]), ValueError, "gammas must not be empty"),
    (lambda p: objective({"toys": []}, "routed"), TypeError, "prompts must be the dict"),
])
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call(make_prompts(P=2, K=3, T=1, V=2))


@pytest.mark.parametrize("kwargs, message", [
    (dict(theta=np.zeros((2, 1, 2))), r"theta must have shape \(1, 1, 2\)"),
    (dict(phi=np.zeros((1, 2, 2))), "phi must have shape"),
    (dict(phi=np.zeros((1, 2, 1, 2, 2))), r"\(P, K, T, V \+ 1, V\)"),
    (dict(prompt_probs=[0.5]), "prompt_probs must be 1 non-negative numbers summing to 1"),
    (dict(routes=[2]), r"routes must be 1 integers in \[0, 2\)"),
    (dict(routes=[0.0]), "routes must be"),
    (dict(phi=np.full((1, 2, 1, 2), np.inf)), "phi must be finite"),
])
def test_bad_prompts_are_named(kwargs, message):
    args = dict(theta=np.zeros((1, 1, 2)), phi=np.zeros((1, 2, 1, 2)), prompt_probs=[1.0],
                routes=[0])
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        prompts_from_logits(**args)


def test_one_teacher_cannot_be_misrouted():
    prompts = make_prompts(P=2, K=1, T=1, V=2)
    assert misrouting_matrix(prompts, 0.0).tolist() == [[1.0], [1.0]]
    with pytest.raises(ValueError, match="no wrong teacher"):
        misrouting_matrix(prompts, 0.1)


# ---------------------------------------------------------------------------------------------
# The chapter's sentences (docs/teachers.md, "Several teachers"), read back against bias_table
# and misrouting_curve, the functions its generated tables are computed by
# (docs/hooks/generate.py, _many_teachers)
# ---------------------------------------------------------------------------------------------
def _page():
    import pathlib

    return " ".join((pathlib.Path(__file__).parents[2] / "docs" / "teachers.md").read_text()
                    .split())


def _numbers(pattern, page):
    import re

    found = re.search(pattern.replace("N", r"([0-9.]+)"), page)
    assert found, f"the sentence {pattern!r} is not on the page"
    return [float(x) for x in found.groups()]


def _cells(autoregressive):
    rows = bias_table(make_prompts(autoregressive=autoregressive))
    return {(r["gamma"], r["estimator"], r["objective"]): r["rel_bias"] for r in rows}


def test_the_chapters_sentences_on_which_estimator_estimates_which_objective():
    from tests.helpers.committed import assert_matches_committed

    page = _page()
    why = "three decimals on the page"
    independent, autoregressive = _cells(False), _cells(True)
    for cells in (independent, autoregressive):  # "With gamma = 1 each ... is unbiased"
        assert all(cells[1.0, kind, kind] < 1e-12 for kind in KINDS)
    [seq_bias, routed_ar] = _numbers(
        r"the sequence mixture's does not \(bias N\), as its target depends on the whole prefix "
        r"through the posterior weights\. On the autoregressive toy none is unbiased "
        r"\(routed: N\)\.", page)
    assert all(independent[0.0, kind, kind] < 1e-12
               for kind in ("routed", "weighted_kl", "token_mixture"))
    assert min(autoregressive[0.0, kind, kind] for kind in KINDS) > 0.1
    assert_matches_committed([independent[0.0, "sequence_mixture", "sequence_mixture"],
                              autoregressive[0.0, "routed", "routed"]], [seq_bias, routed_ar],
                             rtol=0, atol=5e-4, why=why)
    [within, low, high] = _numbers(
        r"an estimator of a mixture or of the weighted sum has a bias of at most N against "
        r"either of the other two, and between routing and any of the three the bias is N to N, "
        r"at either discount", page)
    others = ("weighted_kl", "token_mixture", "sequence_mixture")
    apart = [v for (g, e, o), v in independent.items() if e != o and e in others and o in others]
    routed = [v for (g, e, o), v in independent.items() if (e == "routed") != (o == "routed")]
    assert_matches_committed([max(apart), min(routed), max(routed)], [within, low, high],
                             rtol=0, atol=5e-4, why=why)


def test_the_chapters_sentences_on_misrouting():
    from tests.helpers.committed import assert_matches_committed

    page = _page()
    why = "three decimals on the page"
    epsilons = [0.0, 0.05, 0.1, 0.2, 1.0]
    independent = misrouting_curve(make_prompts(), epsilons)
    autoregressive = misrouting_curve(make_prompts(autoregressive=True), epsilons)
    [slope_i, slope_ar] = _numbers(
        r"The bias misrouting adds is linear\*\*: N \$\\varepsilon\$ on independent positions "
        r"and N \$\\varepsilon\$ on the autoregressive toy", page)
    assert_matches_committed([independent[-1]["rel_misrouting"],
                              autoregressive[-1]["rel_misrouting"]], [slope_i, slope_ar],
                             rtol=0, atol=5e-4, why=why)
    for curve in (independent, autoregressive):  # linear: epsilon times its value at 1
        for row in curve:
            assert abs(row["rel_misrouting"] - row["epsilon"] * curve[-1]["rel_misrouting"]) \
                < 1e-12
    [own, at_tenth] = _numbers(r"0\.670 without misrouting, N at \$\\varepsilon = 0\.1\$"
                               .replace("0\\.670", "N"), page)
    assert_matches_committed([autoregressive[0]["rel_bias"], autoregressive[2]["rel_bias"]],
                             [own, at_tenth], rtol=0, atol=5e-4, why=why)
    # "not aligned": the biases do not add up (a triangle, not a line)
    assert autoregressive[2]["rel_bias"] < own + autoregressive[2]["rel_misrouting"] - 0.1
    kls = _numbers(r"its routed KL is N, N and N at \$\\varepsilon\$ = 0\.05, 0\.1 and 0\.2", page)
    assert_matches_committed([r["fixed_point_kl"] for r in independent[1:4]], kls, rtol=0,
                             atol=5e-4, why=why)
    # "about four times larger for each doubling"
    for small, large in ((1, 2), (2, 3)):
        ratio = independent[large]["fixed_point_kl"] / independent[small]["fixed_point_kl"]
        assert 3.5 < ratio < 4.5, ratio


def test_the_chapters_toy_is_make_prompts_with_its_defaults():
    """"three positions over three tokens; ... where the third token ends the response"."""
    page = _page()
    assert ("three positions over three tokens; independent positions, or each token "
            "conditioned on the previous one, where the third token ends the response") in page
    independent, autoregressive = make_prompts(), make_prompts(autoregressive=True)
    for toy in independent["toys"]:
        assert toy["Y"].shape == (27, 3) and toy["Y"].max() == 2 and toy.get("eos") is None
    for toy in autoregressive["toys"]:
        assert toy["Y"].shape[1] == 3 and toy["Y"].max() == 2 and toy["eos"] == 2


def test_the_chapters_misrouted_fixed_point_minimises_only_on_independent_positions():
    """"the student the gamma = 0 estimate drives to is the geometric mean ..., state by state:
    on independent positions also the minimiser of the misrouted objective, on the
    autoregressive toy not"."""
    assert "on independent positions also the minimiser of the misrouted objective, on the " \
           "autoregressive toy not" in _page()
    for autoregressive, minimises in ((False, True), (True, False)):
        prompts = make_prompts(autoregressive=autoregressive)
        C = misrouting_matrix(prompts, 0.2)
        fixed = prompts_from_logits(geometric_mean_logits(prompts, C), prompts["phi"],
                                    prompts["prompt_probs"], prompts["routes"])
        assert np.abs(expected_estimate(fixed, "routed", C, gamma=0.0)).max() < 1e-14
        gradient = np.abs(objective(fixed, "weighted_kl", C)["grad"]).max()
        assert (gradient < 1e-12) if minimises else (gradient > 1e-2), gradient
