"""OPD with task rewards (opd_literate.mismatch.task_rewards): what each mixed estimator averages
to, exactly, against gradients computed independently with torch autograd."""

import math
import pathlib
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.mismatch import task_rewards
from opd_literate.mismatch.opd_mismatch import add_teacher
from opd_literate.mismatch.task_rewards import (
    MIXED_ESTIMATORS,
    mixed_estimate,
    mixed_table,
    mixed_targets,
    teacher_estimate,
)
from opd_literate.mismatch.toy import (
    ar_toy_from_logits,
    estimator_moments,
    make_ar_toy,
    make_toy,
    toy_from_logits,
)
from tests.helpers.committed import assert_matches_committed

COEFS = (0.0, 0.1, 0.3, 1.0, 3.0)  # the mismatch chapter's table


def _ar_teacher_toy(**kwargs):
    return add_teacher(make_ar_toy(mismatch=0.0, **kwargs))


def _mean(toy, estimate):
    return np.einsum("m,m...->...", toy["p_sampler"], estimate)


def _autograd_per_sequence(toy, per_token_loss):
    """For each response, d/d theta of sum_t per_token_loss(log pi_t row, log q_t row, y_t)."""
    theta = torch.tensor(toy["theta"], requires_grad=True)
    log_q = torch.log_softmax(torch.as_tensor(toy["phi"]), dim=-1)
    out = []
    for m in range(len(toy["Y"])):
        log_pi = torch.log_softmax(theta, dim=-1)
        total = torch.zeros((), dtype=torch.float64)
        for t in range(toy["T"]):
            if toy["mask"][m, t] == 0:
                continue
            row = (t, int(toy["prev"][m, t]))
            total = total + per_token_loss(log_pi[row], log_q[row], int(toy["Y"][m, t]))
        (grad,) = torch.autograd.grad(total, theta)
        out.append(grad.numpy())
    return np.stack(out)


SMALL = dict(T=3, V=3, seed=2)


def test_k2_backpropagated_is_the_discount_0_reward_sample_for_sample():
    toy = _ar_teacher_toy(**SMALL)
    k2 = _autograd_per_sequence(toy, lambda lp, lq, y: 0.5 * (lp[y] - lq[y]) ** 2)
    np.testing.assert_allclose(teacher_estimate(toy, "k1_reward"), k2, rtol=0, atol=1e-13)


def test_k3_loss_is_the_gradient_of_k3_backpropagated():
    toy = _ar_teacher_toy(**SMALL)
    k3 = _autograd_per_sequence(
        toy, lambda lp, lq, y: torch.exp(lq[y] - lp[y]) - 1 - (lq[y] - lp[y]))
    np.testing.assert_allclose(teacher_estimate(toy, "k3_loss"), k3, rtol=0, atol=1e-13)


def test_full_vocab_is_the_gradient_of_the_visited_states_kl():
    toy = _ar_teacher_toy(**SMALL)
    kl = _autograd_per_sequence(toy, lambda lp, lq, y: (lp.exp() * (lp - lq)).sum())
    np.testing.assert_allclose(teacher_estimate(toy, "full_vocab"), kl, rtol=0, atol=1e-13)


@pytest.mark.parametrize("make", [make_toy, make_ar_toy], ids=["toy", "ar_toy"])
@pytest.mark.parametrize("coef", [0.3, 2.0])
def test_on_policy_what_each_mixture_averages_to(make, coef):
    toy = add_teacher(make(mismatch=0.0))
    targets = mixed_targets(toy, coef)
    for kind, target in [("k1_return", "sequence"), ("k1_reward", "per_state"),
                         ("full_vocab", "per_state")]:
        np.testing.assert_allclose(_mean(toy, mixed_estimate(toy, coef, kind)), targets[target],
                                   rtol=0, atol=1e-13, err_msg=kind)


def test_k3_loss_averages_to_the_per_state_forward_kl_gradient():
    toy = _ar_teacher_toy()
    log_pi, log_q = (torch.log_softmax(torch.as_tensor(toy[key]), -1).numpy()
                     for key in ("theta", "phi"))
    rows = np.exp(log_pi) - np.exp(log_q)  # d KL(q || pi) / d theta of each row
    expected = np.zeros_like(toy["true_grad"])
    for m in range(len(toy["Y"])):
        for t in range(toy["T"]):
            if toy["mask"][m, t]:
                expected[t, toy["prev"][m, t]] += toy["p_train"][m] * rows[t, toy["prev"][m, t]]
    np.testing.assert_allclose(_mean(toy, teacher_estimate(toy, "k3_loss")), expected,
                               rtol=0, atol=1e-13)


def test_the_discount_0_bias_is_lambda_times_the_gap_between_the_two_kl_gradients():
    toy = _ar_teacher_toy()
    gap = float(np.linalg.norm(toy["kl_grad"] - toy["kl_grad_per_state"]))
    assert gap > 0.1
    for row in mixed_table(toy, COEFS, kinds=["k1_reward", "full_vocab"]):
        norm = float(np.linalg.norm(mixed_targets(toy, row["coef"])["sequence"]))
        assert abs(row["rel_bias"] * norm - row["coef"] * gap) < 1e-12
        assert row["rel_bias_per_state"] < 1e-12


def test_for_independent_positions_every_k1_form_is_unbiased():
    toy = add_teacher(make_toy(mismatch=0.0))
    rows = mixed_table(toy, [1.0], kinds=["k1_reward", "k1_return", "full_vocab"])
    assert all(row["rel_bias"] < 1e-12 for row in rows)


def test_only_lambda_0_makes_the_k3_forms_unbiased():
    toy = _ar_teacher_toy()
    for row in mixed_table(toy, COEFS, kinds=["k3_reward", "k3_loss"]):
        if row["coef"] == 0:
            assert row["rel_bias"] < 1e-12
        else:
            assert row["rel_bias"] > 0.01 and row["rel_bias_per_state"] > 0.01


def test_full_vocab_has_less_variance_than_the_sampled_reward_at_the_tables_weights():
    """The chapter's sentence, read off the page, for its toy (T = 5, V = 3) and the weights of
    its table: equal at lambda = 0 (the same estimator), strictly smaller at every lambda > 0."""
    page = " ".join(PAGE.read_text().split())
    assert ("on this toy the full-vocabulary loss has the smaller variance of the two at every "
            "$\\lambda > 0$ of the table; at $\\lambda = 0$ they are the same estimator") in page
    toy = _ar_teacher_toy(T=5, V=3)
    rows = {(r["kind"], r["coef"]): r["var"] for r in mixed_table(toy, COEFS)}
    assert COEFS[0] == 0.0
    assert rows[("full_vocab", 0.0)] == rows[("k1_reward", 0.0)]
    np.testing.assert_array_equal(mixed_estimate(toy, 0.0, "full_vocab"),
                                  mixed_estimate(toy, 0.0, "k1_reward"))
    for coef in COEFS[1:]:
        assert rows[("full_vocab", coef)] < rows[("k1_reward", coef)], coef


def test_the_sampled_reward_can_have_less_variance_than_full_vocab():
    """The module's counterexample, by hand on one position: pi = (0.7, 0.3), pi_T = (0.4, 0.6),
    R = (1, 0), lambda = 1, b = 0.5. Both estimates are a_m (1, -1) with s_0 = 0.3 (1, -1) and
    s_1 = -0.7 (1, -1); full_vocab's teacher term is the same for both responses, so its variance
    is the task's, 2 p_0 p_1 (0.3 (1 - b) - 0.7 b)^2 = 2 (0.21) (0.3 - b)^2 = 0.0168; k1_reward's
    is 2 (0.21) (a_0 - a_1)^2 with a_0 = 0.3 (1 - b - ln 1.75), a_1 = -0.7 (-b + ln 2)."""
    (k1, full) = mixed_table(_hand_toy(), [1.0], kinds=["k1_reward", "full_vocab"], baseline=0.5)
    a_0, a_1 = _k1_reward_by_hand(1.0, 0.5)
    assert abs(k1["var"] - 2 * 0.21 * (a_0 - a_1) ** 2) < 1e-15
    assert abs(full["var"] - 2 * 0.21 * (0.3 - 0.5) ** 2) < 1e-15
    assert round(k1["var"], 5) == 0.00578 and round(full["var"], 4) == 0.0168  # the docstring's
    assert k1["var"] < full["var"]
    doc = " ".join(task_rewards.__doc__.split())
    assert "neither has the smaller variance in general" in doc
    assert "the sampled one has (variance 0.00578 against 0.0168" in doc


def test_under_mismatch_no_mixture_is_unbiased_without_a_correction():
    toy = add_teacher(make_ar_toy(mismatch=0.3))
    assert all(row["rel_bias"] > 1e-3 for row in mixed_table(toy, [1.0]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(coef=-1.0), "coef must be >= 0.0"),
    (dict(coef=math.nan), "coef must be a finite number"),
    (dict(coef=1.0, kind="k2_loss"), "kind must be one of"),
    (dict(coef=1.0, baseline=math.inf), "baseline must be a finite number"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        mixed_estimate(_ar_teacher_toy(T=2, V=2), **kwargs)


def test_a_toy_without_a_teacher_is_refused():
    with pytest.raises(ValueError, match=r"missing the keys \['logp_teacher', 'phi'\]"):
        teacher_estimate(make_ar_toy(), "k1_reward")


@pytest.mark.properties
@given(T=st.integers(1, 3), V=st.integers(2, 4), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-3, 1.0, 5.0]), coef=st.sampled_from([0.0, 0.5, 10.0]),
       kind=st.sampled_from(MIXED_ESTIMATORS))
def test_every_mixture_is_finite_and_the_return_is_unbiased(T, V, seed, scale, coef, kind):
    g = np.random.default_rng(seed)
    theta = g.normal(0, scale, (T, V + 1, V))
    toy = add_teacher(ar_toy_from_logits(theta, theta), phi=g.normal(0, scale, theta.shape))
    estimate = mixed_estimate(toy, coef, kind)
    assert np.isfinite(estimate).all()
    if kind == "k1_return":
        target = mixed_targets(toy, coef)["sequence"]
        moments = estimator_moments(dict(toy, true_grad=target), estimate)
        assert moments["bias"] <= 1e-10 * max(1.0, float(np.abs(target).max()))


def test_at_lambda_1_the_return_has_the_smallest_error_of_a_batch_of_64():
    """The chapter's sentence under its table (the default autoregressive toy, on-policy)."""
    rows = mixed_table(_ar_teacher_toy(), [1.0], N=64)
    best = min(rows, key=lambda row: row["rel_rmse"])
    assert best["kind"] == "k1_return"
    assert best["var"] > min(row["var"] for row in rows)  # not the smallest variance: the bias


# ---------------------------------------------------------------------------------------------
# verl's configurations as the chapter names them (verl itself: tests/integration/
# test_verl_config.py and test_verl_task_rewards.py), and the numbers it reads from the table
# ---------------------------------------------------------------------------------------------

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "mismatch.md"


def test_the_chapter_names_k3_loss_as_the_stock_run_and_k3_reward_as_the_dataclass():
    assert (task_rewards.VERL_KIND, task_rewards.DATACLASS_KIND) == ("k3_loss", "k3_reward")
    page = " ".join(PAGE.read_text().split())
    assert (f"* `{task_rewards.VERL_KIND}`: $k_3$ backpropagated, what a stock verl run computes "
            "(`use_policy_gradient: false` in the composed config);") in page
    assert ("The two $k_3$ kinds are verl's wherever $k_3 \\le 10$ at every token, as on this "
            "toy (its largest $k_3$ is 1.67)") in page
    assert (f"* `{task_rewards.DATACLASS_KIND}`: $k_3$ as the per-token cost (the dataclass's "
            "`use_policy_gradient: true`);") in page
    assert "verl's default;" not in page
    doc = " ".join(task_rewards.__doc__.split())
    assert "what a stock ``python -m verl.trainer.main_ppo`` run computes" in doc
    assert "wherever $k_{3,t} \\le 10$ at every token (verl's clamps, below)" in doc


def test_the_chapters_k3_numbers_at_lambda_1_are_the_tables():
    """The sentence under the table, against mixed_table on the chapter's toy (docs/hooks/
    generate.py: the autoregressive toy with T = 5, V = 3, on-policy)."""
    page = " ".join(PAGE.read_text().split())
    found = re.search(r"at \$\\lambda = 1\$ `k3_loss` has relative bias ([0-9.]+) against "
                      r"\$\\nabla F_1\$ and ([0-9.]+) against the per-state objective, "
                      r"`k3_reward` ([0-9.]+) and ([0-9.]+)\.", page)
    assert found, "the sentence on k3 at lambda = 1 is not on the page"
    rows = {r["kind"]: r for r in mixed_table(_ar_teacher_toy(T=5, V=3), [1.0],
                                              kinds=["k3_loss", "k3_reward"])}
    stated = [float(x) for x in found.groups()]
    table = [rows["k3_loss"]["rel_bias"], rows["k3_loss"]["rel_bias_per_state"],
             rows["k3_reward"]["rel_bias"], rows["k3_reward"]["rel_bias_per_state"]]
    assert_matches_committed(table, stated, rtol=0, atol=5e-4,
                             why="the page gives three decimals: half a unit of the last one")


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def _broken(change):
    toy = dict(_ar_teacher_toy(T=2, V=2))
    change(toy)
    return toy


@pytest.mark.parametrize("change, error, message", [
    (lambda t: t.update(logp_teacher=t["logp_teacher"][:, :1]), ValueError,
     r"toy\['logp_teacher'\] must have shape \(\d+, 2\)"),
    (lambda t: t.update(logp_train=t["logp_train"].astype(complex)), TypeError,
     r"toy\['logp_train'\] must hold real numbers"),
    (lambda t: t.update(logp_teacher=np.where(t["mask"] > 0, 0.5, 0.0)), ValueError,
     r"toy\['logp_teacher'\] must hold finite log-probabilities \(<= 0\)"),
    (lambda t: t.update(logp_train=np.where(t["mask"] > 0, np.nan, 0.0)), ValueError,
     r"toy\['logp_train'\] must hold finite log-probabilities"),
    (lambda t: t.update(phi=t["phi"][:1]), ValueError, r"toy\['phi'\] must have shape"),
    (lambda t: t.update(theta=np.full_like(t["theta"], np.inf)), ValueError,
     r"toy\['theta'\] must be finite"),
    (lambda t: t.update(score=t["score"][:1]), ValueError, r"toy\['score'\] must have shape"),
    (lambda t: t.update(score=np.where(t["score"] != 0, t["score"], np.nan)), ValueError,
     r"toy\['score'\] must be finite"),
    (lambda t: t.update(mask=t["mask"] * 0.5), ValueError, r"toy\['mask'\] must be 0/1"),
])
@pytest.mark.parametrize("kind", MIXED_ESTIMATORS)
def test_a_broken_toy_is_refused_with_the_key_named(change, error, message, kind):
    with pytest.raises(error, match=message):
        teacher_estimate(_broken(change), kind)


def test_padding_may_hold_anything():
    toy = _ar_teacher_toy(T=3, V=2)
    assert (toy["mask"] == 0).any()
    padded = dict(toy, logp_teacher=np.where(toy["mask"] > 0, toy["logp_teacher"], np.nan))
    for kind in MIXED_ESTIMATORS:
        np.testing.assert_array_equal(teacher_estimate(padded, kind), teacher_estimate(toy, kind))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(coefs=1.0), TypeError, "coefs must be a sequence, got float"),
    (dict(coefs=[]), ValueError, "coefs must not be empty"),
    (dict(coefs=[1.0], kinds="k3_loss"), TypeError, "kinds must be a sequence, got str"),
    (dict(coefs=[1.0], N=0), ValueError, "N must be an integer >= 1, got 0"),
    (dict(coefs=[1.0], N=2.5), ValueError, "N must be an integer >= 1, got 2.5"),
    (dict(coefs=[True]), TypeError, "coef must be a real number"),
])
def test_mixed_table_names_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        mixed_table(_ar_teacher_toy(T=2, V=2), **kwargs)


@pytest.mark.properties
@given(T=st.integers(1, 3), V=st.integers(2, 4), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-3, 1.0, 5.0]))
def test_k3_loss_averages_to_the_per_state_forward_kl_gradient_on_random_toys(T, V, seed, scale):
    """A stock verl run's teacher part, on any autoregressive toy: the visited states' forward
    KL gradient, sum over (m, t) of p(m) (pi - q) in the row of the state (one autograd-free
    sum, independent of teacher_estimate's closed form)."""
    g = np.random.default_rng(seed)
    theta = g.normal(0, scale, (T, V + 1, V))
    toy = add_teacher(ar_toy_from_logits(theta, theta), phi=g.normal(0, scale, theta.shape))
    pi = np.exp(theta - np.logaddexp.reduce(theta, axis=-1, keepdims=True))
    q = np.exp(toy["phi"] - np.logaddexp.reduce(toy["phi"], axis=-1, keepdims=True))
    expected = np.zeros_like(theta)
    for m in range(len(toy["Y"])):
        for t in range(T):
            if toy["mask"][m, t]:
                row = (t, toy["prev"][m, t])
                expected[row] += toy["p_train"][m] * (pi[row] - q[row])
    np.testing.assert_allclose(_mean(toy, teacher_estimate(toy, task_rewards.VERL_KIND)),
                               expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# verl's clamp of k3 (verl itself: tests/integration/test_verl_task_rewards.py), overflow, and
# the refusals of the targets, the batch size and the rows of the autoregressive toy
# ---------------------------------------------------------------------------------------------

K3_KINDS = ("k3_reward", "k3_loss")


def _k3_by_hand(d):
    return math.exp(-d) - 1.0 + d


def test_the_chapters_toy_never_reaches_verls_clamp():
    """The page's "largest k3 is 1.67" on its toy (T = 5, V = 3), so the clamp is idle there and
    the table's numbers are verl's, with or without verl_clamps."""
    toy = _ar_teacher_toy(T=5, V=3)
    real = toy["mask"] > 0
    k3 = [_k3_by_hand(d) for d in (toy["logp_train"] - toy["logp_teacher"])[real]]
    assert round(max(k3), 2) == 1.67 and max(k3) < task_rewards.VERL_K3_CLAMP
    for kind in K3_KINDS:
        np.testing.assert_array_equal(teacher_estimate(toy, kind, verl_clamps=True),
                                      teacher_estimate(toy, kind))
    assert (mixed_table(toy, COEFS, kinds=K3_KINDS, verl_clamps=True)
            == mixed_table(toy, COEFS, kinds=K3_KINDS))


def test_the_clamps_bounds_are_the_roots_of_k3_equal_10():
    """The docstring's d_- ~ -2.61087 and d_+ ~ 10.99998, by hand on either side."""
    doc = " ".join(task_rewards.__doc__.split())
    assert "$d_- \\approx -2.61087$ and $d_+ \\approx 10.99998$" in doc
    assert _k3_by_hand(-2.61088) > 10 > _k3_by_hand(-2.61086)
    assert _k3_by_hand(10.99997) < 10 < _k3_by_hand(10.99999)
    assert _k3_by_hand(20.0) > 10 and _k3_by_hand(-20.0) > 10  # the clamp of -d at 20 is idle


@pytest.mark.parametrize("d, inside", [(-2.61086, True), (-2.61088, False), (10.99997, True),
                                       (10.99999, False), (0.5, True), (-800.0, False)])
def test_verl_clamps_give_the_cost_min_k3_10_and_slope_0_beyond(d, inside):
    """One position, the hand toy with its log-probabilities replaced: d at both responses'
    tokens, so each estimate is (factor) times the score s_m."""
    toy = dict(_hand_toy(), logp_train=np.full((2, 1), min(d, 0.0) - 1.0),
               logp_teacher=np.full((2, 1), min(d, 0.0) - 1.0 - d))
    score = toy["score"]
    cost = teacher_estimate(toy, "k3_reward", verl_clamps=True)
    slope = teacher_estimate(toy, "k3_loss", verl_clamps=True)
    if inside:
        np.testing.assert_allclose(cost, _k3_by_hand(d) * score, rtol=1e-12, atol=0)
        np.testing.assert_allclose(slope, (1 - math.exp(-d)) * score, rtol=1e-12, atol=0)
    else:
        np.testing.assert_array_equal(cost, 10.0 * score)
        np.testing.assert_array_equal(slope, 0.0 * score)


@pytest.mark.parametrize("kind", K3_KINDS)
def test_an_unrepresentable_k3_is_an_error_not_nan(kind):
    """A finite trainer log-probability of -800 against a certain teacher token: d = -800,
    e^800 beyond float64. Unclamped it is refused by name; with verl's clamp it is finite."""
    toy = _ar_teacher_toy(T=3, V=2)
    real = toy["mask"] > 0
    far = dict(toy, logp_train=np.where(real, -800.0, 0.0), logp_teacher=np.zeros_like(
        toy["logp_teacher"]))
    with pytest.raises(ValueError, match=r"e\^\(-d\) overflows float64 at d = -800"):
        teacher_estimate(far, kind)
    with pytest.raises(ValueError, match=r"overflows float64"):
        mixed_table(far, [1.0], kinds=[kind])
    assert np.isfinite(teacher_estimate(far, kind, verl_clamps=True)).all()
    for other in ("k1_reward", "k1_return", "full_vocab"):
        assert np.isfinite(teacher_estimate(far, other)).all()


@pytest.mark.parametrize("kind", ["k1_reward", "k3_reward"])
def test_a_product_beyond_float64_is_refused(kind):
    """Finite factors (d = 1e300) times a finite score of 1e10: the estimate is not
    representable."""
    toy = _ar_teacher_toy(T=2, V=2)
    real = toy["mask"] > 0
    big = dict(toy, logp_teacher=np.where(real, -1e300, 0.0), score=toy["score"] * 1e10)
    with pytest.raises(ValueError, match=r"overflows float64"):
        teacher_estimate(big, kind)


def test_a_mixing_weight_whose_product_overflows_is_refused():
    """d_1 = ln 0.3 + 1000 (a teacher with phi = (0, -1000)): k1_reward's estimate at response 1
    is 0.7 d_1 (1, -1) ~ 699 (1, -1), times 1e308 beyond float64."""
    logits = np.log([[0.7, 0.3]])
    far = add_teacher(toy_from_logits(logits, logits), phi=np.array([[0.0, -1000.0]]))
    with pytest.raises(ValueError, match=r"task - coef \* teacher overflows float64"):
        mixed_estimate(far, 1e308, "k1_reward")
    assert np.isfinite(mixed_estimate(far, 1e300, "k1_reward")).all()
    toy = _ar_teacher_toy(T=2, V=2)
    with pytest.raises(ValueError, match=r"overflows float64"):
        mixed_targets(dict(toy, kl_grad=np.full_like(toy["kl_grad"], 10.0)), 1e308)


def test_padding_is_selected_away_from_the_product_with_the_score():
    """_per_token selects with np.where: a NaN or inf in a padded row of the score (refused at
    the public door) would not become 0 * inf = NaN."""
    real = np.array([[True, False]])
    score = np.array([[[0.5, -0.5], [np.nan, np.inf]]])
    out = task_rewards._per_token(np.array([[2.0, 0.0]]), score, real)
    np.testing.assert_array_equal(out, [[[1.0, -1.0], [0.0, 0.0]]])


@pytest.mark.parametrize("prev, message", [
    (lambda p: p + 10, r"toy\['prev'\] must hold rows in \[0, 3\) at the response's tokens"),
    (lambda p: p - 5, r"toy\['prev'\] must hold rows in \[0, 3\)"),
    (lambda p: p.astype(float), r"toy\['prev'\] must be integers of the shape of toy\['Y'\]"),
    (lambda p: p[:, :1], r"toy\['prev'\] must be integers of the shape of toy\['Y'\]"),
])
def test_rows_out_of_range_are_refused_by_name(prev, message):
    toy = _ar_teacher_toy(T=2, V=2)
    with pytest.raises(ValueError, match=message):
        teacher_estimate(dict(toy, prev=prev(toy["prev"])), "full_vocab")


def test_independent_positions_visit_only_their_real_rows():
    """make_toy's rows with a mask: a masked position is no state, so full_vocab is 0 there."""
    toy = add_teacher(make_toy(T=2, V=2, mismatch=0.0))
    mask = np.ones(np.shape(toy["Y"]))
    mask[0, 1] = 0.0
    masked = teacher_estimate(dict(toy, mask=mask), "full_vocab")
    full = teacher_estimate(toy, "full_vocab")
    np.testing.assert_array_equal(masked[0, 1], 0.0)
    np.testing.assert_array_equal(masked[1:], full[1:])
    np.testing.assert_array_equal(masked[0, 0], full[0, 0])


@pytest.mark.parametrize("change, message", [
    (lambda t: dict(t, kl_grad=t["kl_grad"][:1]),
     r"toy\['kl_grad'\] must have shape \(\d+, 3, 2\), got \(1, 3, 2\)"),
    (lambda t: dict(t, kl_grad=0.0), r"toy\['kl_grad'\] must have shape \(\d+, 3, 2\), got \(\)"),
    (lambda t: dict(t, kl_grad_per_state=t["kl_grad_per_state"][None]),
     r"toy\['kl_grad_per_state'\] must have shape"),
    (lambda t: dict(t, kl_grad=t["kl_grad"] * np.nan), r"toy\['kl_grad'\] must be finite"),
    (lambda t: dict(t, true_grad=np.full_like(t["true_grad"], np.inf)),
     r"toy\['true_grad'\] must be finite"),
])
def test_mixed_targets_refuses_broadcasting_and_nan(change, message):
    with pytest.raises(ValueError, match=message):
        mixed_targets(change(_ar_teacher_toy(T=2, V=2)), 1.0)


def test_the_batch_size_is_bounded_by_2_53():
    toy = _ar_teacher_toy(T=2, V=2)
    (row,) = mixed_table(toy, [1.0], kinds=["k1_return"], N=2**53)
    assert 0 <= row["rel_rmse"] < 1e-6
    for N, shown in [(2**53 + 1, str(2**53 + 1)), (10**400, "an int of 401 digits")]:
        with pytest.raises(ValueError, match=rf"N must be <= 2\*\*53 .*got {shown}"):
            mixed_table(toy, [1.0], kinds=["k1_return"], N=N)


@pytest.mark.parametrize("call", [
    lambda toy: teacher_estimate(toy, "k3_loss", verl_clamps=1),
    lambda toy: mixed_estimate(toy, 1.0, "k3_loss", verl_clamps="yes"),
    lambda toy: mixed_table(toy, [1.0], kinds=["k3_loss"], verl_clamps=None),
])
def test_verl_clamps_must_be_a_bool(call):
    with pytest.raises(TypeError, match="verl_clamps must be a bool"):
        call(_ar_teacher_toy(T=2, V=2))


# ---------------------------------------------------------------------------------------------
# Found by mutation testing (tools/mutation.sh mismatch.task_rewards; docs/mutation.md)
# ---------------------------------------------------------------------------------------------

LN_1_75, LN_2, LN_3_5 = math.log(1.75), math.log(2.0), math.log(3.5)


def _hand_toy():
    """One position, two tokens, on-policy: pi = (0.7, 0.3), teacher q = (0.4, 0.6), R = (1, 0).

    By hand: the scores are s_0 = e_0 - pi = 0.3 (1, -1) and s_1 = -0.7 (1, -1); the gaps
    d_0 = ln(0.7 / 0.4) = ln 1.75 and d_1 = ln(0.3 / 0.6) = -ln 2; grad J = 0.7 s_0 = 0.21 (1, -1)
    and grad KL = pi_0 (ln 1.75 - KL) (1, -1) = 0.21 (ln 1.75 + ln 2) (1, -1) = 0.21 ln 3.5 (1, -1).
    """
    logits = np.log([[0.7, 0.3]])
    return add_teacher(toy_from_logits(logits, logits), phi=np.log([[0.4, 0.6]]))


def _k1_reward_by_hand(coef, baseline):
    """(a_0, a_1) of the k1_reward mixture g_m = (R_m - b) s_m - coef d_m s_m = a_m (1, -1)."""
    return (0.3 * (1.0 - baseline - coef * LN_1_75), -0.7 * (-baseline + coef * LN_2))


def test_the_default_kind_is_k1_reward_and_the_default_baseline_0():
    toy = _hand_toy()
    direction = np.array([[1.0, -1.0]])
    # teacher_estimate(toy): d_m s_m, (0.3 ln 1.75, 0.7 ln 2) times (1, -1)
    expected = np.stack([0.3 * LN_1_75 * direction, 0.7 * LN_2 * direction])
    np.testing.assert_allclose(teacher_estimate(toy), expected, rtol=0, atol=1e-15)
    a_0, a_1 = _k1_reward_by_hand(0.5, 0.0)
    np.testing.assert_allclose(mixed_estimate(toy, 0.5), np.stack([a_0 * direction,
                                                                  a_1 * direction]),
                               rtol=0, atol=1e-15)


@pytest.mark.parametrize("N", [1, 64])
@pytest.mark.parametrize("baseline", [0.0, 0.25])
def test_the_tables_moments_on_the_hand_toy(N, baseline):
    """On-policy k1_reward is unbiased here (one position: the per-state gradient is the
    sequence one); its variance is p_0 p_1 (a_0 - a_1)^2 per coordinate, two coordinates, and
    rel_rmse(N) = sqrt(var / N) / ||grad J - coef grad KL||, the norm 0.21 |1 - coef ln 3.5| sqrt 2.
    N = 1 is the smallest batch; N = 64 and baseline 0 are the defaults."""
    coef = 0.5
    a_0, a_1 = _k1_reward_by_hand(coef, baseline)
    var = 2 * 0.7 * 0.3 * (a_0 - a_1) ** 2
    norm = 0.21 * abs(1.0 - coef * LN_3_5) * math.sqrt(2.0)
    kwargs = {} if N == 64 else dict(N=N)
    kwargs.update({} if baseline == 0.0 else dict(baseline=baseline))
    (row,) = mixed_table(_hand_toy(), [coef], kinds=["k1_reward"], **kwargs)
    assert (row["kind"], row["coef"]) == ("k1_reward", coef)
    assert row["rel_bias"] < 1e-12 and row["rel_bias_per_state"] < 1e-12
    assert abs(row["var"] - var) < 1e-14
    assert abs(row["rel_rmse"] - math.sqrt(var / N) / norm) < 1e-13


def test_a_log_probability_of_exactly_0_is_accepted():
    """A teacher with phi = (0, -1000) gives its token 0 log-probability 0.0 exactly (ln(1 +
    e^-1000) rounds to 0): a certain token, not an error. k1_reward there, by hand:
    d_0 = ln 0.7 - 0 and d_1 = ln 0.3 + 1000, times s_0 = 0.3 (1, -1), s_1 = -0.7 (1, -1)."""
    logits = np.log([[0.7, 0.3]])
    toy = add_teacher(toy_from_logits(logits, logits), phi=np.array([[0.0, -1000.0]]))
    assert toy["logp_teacher"][0, 0] == 0.0
    expected = np.array([[[0.3, -0.3]], [[-0.7, 0.7]]]) * np.array(
        [math.log(0.7), math.log(0.3) + 1000.0])[:, None, None]
    np.testing.assert_allclose(teacher_estimate(toy, "k1_reward"), expected, rtol=1e-13, atol=0)
    certain = dict(toy, logp_train=np.zeros_like(toy["logp_train"]))
    assert np.isfinite(teacher_estimate(certain, "k3_loss")).all()


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_float32_and_integer_parameters_are_real_numbers(dtype):
    """theta and phi hold small integers, exact in float32 and int64: the same estimates."""
    theta = np.array([[0.0, 1.0, -2.0], [3.0, 0.0, 1.0]])
    toy = add_teacher(toy_from_logits(theta, theta), phi=np.array([[1.0, 0.0, 0.0],
                                                                   [0.0, -1.0, 2.0]]))
    cast = dict(toy, theta=toy["theta"].astype(dtype), phi=toy["phi"].astype(dtype))
    for kind in MIXED_ESTIMATORS:
        np.testing.assert_array_equal(teacher_estimate(cast, kind), teacher_estimate(toy, kind))


def test_a_complex_theta_is_refused_with_the_whole_message():
    toy = dict(_ar_teacher_toy(T=2, V=2))
    toy["theta"] = toy["theta"].astype(complex)
    with pytest.raises(TypeError) as info:
        teacher_estimate(toy)
    assert str(info.value) == "toy['theta'] must hold real numbers, got dtype complex128"


@pytest.mark.parametrize("missing", ["kl_grad", "kl_grad_per_state", "true_grad"])
def test_mixed_targets_names_a_missing_gradient(missing):
    toy = {key: value for key, value in _hand_toy().items() if key != missing}
    with pytest.raises(ValueError) as info:
        mixed_targets(toy, 1.0)
    how = ("build it with make_toy or make_ar_toy" if missing == "true_grad"
           else "add a teacher with opd_literate.mismatch.opd_mismatch.add_teacher(toy)")
    assert str(info.value) == f"toy is missing the keys {[missing]}; {how}"


def test_a_toy_without_a_teacher_is_told_to_add_one():
    with pytest.raises(ValueError) as info:
        teacher_estimate(make_ar_toy(T=2, V=2))
    assert str(info.value).endswith(
        "; add a teacher with opd_literate.mismatch.opd_mismatch.add_teacher(toy)")


def test_a_padded_position_carries_no_cost_in_any_kind():
    """No token at a padded position, so no per-token factor there (0, whatever kind): finite
    values in the score's padded rows (0 in a consistent toy) reach no estimate."""
    toy = _ar_teacher_toy(T=3, V=2)
    padding = toy["mask"] == 0
    assert padding.any()
    score = toy["score"].copy()
    score[padding] = 7.0
    garbled = dict(toy, score=score)
    for kind in MIXED_ESTIMATORS:
        np.testing.assert_array_equal(teacher_estimate(garbled, kind), teacher_estimate(toy, kind),
                                      err_msg=kind)
