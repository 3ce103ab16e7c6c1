r"""The grading cases: what the grader asks of a student's functions, and how it judges the answer.

A lab test is a pytest function that calls the student's code and asserts on the result in the
same interpreter. The grader splits each one in two. The **calls** (a function of the student's
module, its inputs as plain arrays, ``backward()`` or not) run in the sandbox
(``course/_runner.py``); the **judge** runs in the grader's own process, on the values and
gradients that came back, with the library's reference functions and the same assertions and
tolerances as the lab test. A case has the name of the lab test it stands for
(``tests/test_lab_opd.py::TestTask1Rewards::test_values_and_zeros_where_masked``) and belongs
to one task; a test marked with several tasks is one case per task, in which only that task's
function is the student's and the others' part is computed here with the reference
(``tests/course/test_grade.py`` checks that every lab test of every task has its case).

The student-facing lab tests stay pytest files in the lab folder; these tables are the
grader's parallel definition of them. Inputs are drawn here from seeded generators (numpy's
``default_rng``), so a case asks the same of every student.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .labs import LABS

__all__ = ["Tensor", "Array", "Toy", "Call", "Raised", "Case", "Output", "TORCH_DTYPES", "CASES",
           "cases_of"]

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}
"""The dtypes a tensor input or output may have, by the name the runner reports."""


@dataclass(frozen=True)
class Tensor:
    """An input that the runner builds as a torch tensor (a fresh one for every call)."""

    values: np.ndarray
    dtype: str = "float64"
    requires_grad: bool = False


@dataclass(frozen=True)
class Array:
    """An input that the runner builds as a numpy array (a fresh copy for every call), of the
    dtype of ``values`` (float64, float32, int64 or bool)."""

    values: np.ndarray


@dataclass(frozen=True)
class Toy:
    """An input that the runner builds as a toy dictionary (the keys of ``make_toy``)."""

    toy: dict


@dataclass(frozen=True)
class Call:
    """One call of a student's function: ``function(*args, **kwargs)``, then ``backward()`` on
    the result when ``backward`` (a scalar that requires a gradient). An exception fails the
    case, unless ``raises``: then the judge receives it as a
    [Raised][opd_literate.course.cases.Raised] (a check such as "a bad mask is a ValueError")."""

    function: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    backward: bool = False
    raises: bool = False


@dataclass(frozen=True)
class Raised:
    """What a call with ``raises`` raised, as the sandbox reports it: the exception's type name
    and the first line of its message (``raised`` is False when it returned instead)."""

    type: str = ""
    message: str = ""
    raised: bool = True


@dataclass(frozen=True)
class Case:
    """One lab test of one task: the calls the sandbox makes, and the judge that asserts on
    what came back: ``judge(outputs)``, with ``outputs[key]`` an
    [Output][opd_literate.course.cases.Output] for each key of ``calls``, raises AssertionError
    when the answer is wrong."""

    name: str
    task: int
    calls: dict
    judge: Callable


@dataclass(frozen=True)
class Output:
    """What one call returned, validated by the grader: the values (a numeric array), the dtype
    the runner reported, whether the result required a gradient or had a ``grad_fn``, and the
    gradient of each input that required one, ``(values, dtype)`` (absent where none reached
    it)."""

    function: str
    values: np.ndarray
    dtype: str
    requires_grad: bool = False
    grad_fn: bool = False
    grads: dict = field(default_factory=dict)

    def tensor(self) -> torch.Tensor:
        """The values as the torch tensor the student's function returned."""
        values = torch.from_numpy(self.values.copy())  # CPU by design: the judge's own copy
        return values.to(TORCH_DTYPES.get(self.dtype, torch.float64))

    def item(self) -> float:
        if self.values.size != 1:
            raise AssertionError(f"{self.function} returned shape {self.values.shape}, "
                                 "expected a single value")
        return self.values.reshape(()).item()

    def grad(self, argument) -> torch.Tensor:
        """The gradient of input ``argument`` (its position, or its keyword), in its dtype."""
        found = self.grads.get(str(argument))
        if found is None:
            raise AssertionError(f"no gradient of {self.function}'s result reached its input "
                                 f"{argument}")
        values, dtype = found
        grad = torch.from_numpy(values.copy())  # CPU by design: the judge's own copy
        return grad.to(TORCH_DTYPES[dtype])


def _tensor(values) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.float64))  # CPU by design: the judge's own


def _normal(rng, *shape):
    return rng.standard_normal(shape)


def _cases(name, tasks, build):
    """One case per task of a lab test checking several: ``build(task)`` -> (calls, judge)."""
    return [Case(name, task, *build(task)) for task in tasks]


# ------------------------------------------------------------------------------ the OPD lab
OPD_TESTS = "tests/test_lab_opd.py::"


def _random_batch(seed=0, B=3, T=4, V=5):
    rng = np.random.default_rng(seed)
    student, teacher = _normal(rng, B, T, V), _normal(rng, B, T, V)
    mask = np.ones((B, T))
    mask[0, 2:] = 0  # a ragged batch: response 0 ends after two tokens
    mask[1, 3:] = 0
    return student, teacher, mask


def _analytic_reverse_kl_grad(z, zt):
    """d KL(p||q) / d z_j = p_j (log p_j - log q_j - KL), derived by hand."""
    p = F.softmax(z, -1)
    log_ratio = F.log_softmax(z, -1) - F.log_softmax(zt, -1)
    return p * (log_ratio - (p * log_ratio).sum(-1, keepdim=True))


def _sampled_token_inputs(z, zt):
    """For every token v: the (1, 1) log-probabilities of the student and the teacher."""
    logp, logq = F.log_softmax(_tensor(z), -1), F.log_softmax(_tensor(zt), -1)
    return [(logp[v].reshape(1, 1).numpy(), logq[v].reshape(1, 1).numpy())
            for v in range(len(z))]


def _per_token_gradients(z, zt, rewards=None, logp_grads=None):
    """(V, V): row v is the gradient w.r.t. the logits ``z`` of the Task-2 loss with the Task-1
    rewards when the student sampled token v, through autograd. The reference functions compute
    it, except the part given: the student's rewards (``rewards[v]``, Task 1) or the student's
    gradient w.r.t. the sampled log-probability (``logp_grads[v]``, Task 2)."""
    from ..opd import opd_pg_loss, reverse_kl_rewards

    rows = []
    for v in range(len(z)):
        zv = _tensor(z).requires_grad_(True)
        logp = F.log_softmax(zv, -1)[v].reshape(1, 1)
        if logp_grads is not None:
            logp.backward(logp_grads[v])
        else:
            mask = torch.ones_like(logp)
            logq = F.log_softmax(_tensor(zt), -1)[v].reshape(1, 1)
            r = rewards[v] if rewards is not None else reverse_kl_rewards(logp, logq, mask)
            opd_pg_loss(logp, r, mask).backward()
        rows.append(zv.grad)
    return torch.stack(rows)


def _full_vocab_gradient(z, zt):
    from ..opd import full_vocab_reverse_kl

    z_full = _tensor(z).reshape(1, 1, -1).requires_grad_(True)
    mask = torch.ones(1, 1)  # CPU by design: the judge's own input, as the lab test's
    full_vocab_reverse_kl(z_full, _tensor(zt).reshape(1, 1, -1), mask).backward()
    return z_full.grad.reshape(-1)


def _sampled_token_build(z, zt):
    """The calls of one task for the sampled-token identity, and a function of the outputs that
    returns (the (V, V) per-token gradients, the full-vocabulary gradient): the student's
    function is the task's own, the others are the reference."""
    from ..opd import reverse_kl_rewards

    tokens = _sampled_token_inputs(z, zt)
    ones = np.ones((1, 1))

    def build(task):
        if task == 1:
            calls = {f"rewards{v}": Call("reverse_kl_rewards", (
                Tensor(logp, requires_grad=True), Tensor(logq), Tensor(ones)))
                for v, (logp, logq) in enumerate(tokens)}

            def gradients(out):
                rewards = [out[f"rewards{v}"].tensor() for v in range(len(z))]
                return _per_token_gradients(z, zt, rewards=rewards), _full_vocab_gradient(z, zt)
        elif task == 2:
            calls = {}
            for v, (logp, logq) in enumerate(tokens):
                r = reverse_kl_rewards(_tensor(logp), _tensor(logq), _tensor(ones)).numpy()
                calls[f"loss{v}"] = Call("opd_pg_loss", (Tensor(logp, requires_grad=True),
                                                         Tensor(r), Tensor(ones)), backward=True)

            def gradients(out):
                grads = [out[f"loss{v}"].grad(0) for v in range(len(z))]
                return _per_token_gradients(z, zt, logp_grads=grads), _full_vocab_gradient(z, zt)
        else:
            calls = {"full": Call("full_vocab_reverse_kl", (
                Tensor(z.reshape(1, 1, -1), requires_grad=True), Tensor(zt.reshape(1, 1, -1)),
                Tensor(np.ones((1, 1), np.float32), "float32")), backward=True)}

            def gradients(out):
                return _per_token_gradients(z, zt), out["full"].grad(0).reshape(-1)
        return calls, gradients

    return build


def _opd_task1():
    name = OPD_TESTS + "TestTask1Rewards::"
    rng = np.random.default_rng(101)
    s = np.array([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]], np.float32)
    t = np.array([[-1.5, -0.25, -9.0], [-0.4, -0.2, -0.0]], np.float32)
    m = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], np.float32)

    def values(out):
        r = out["r"].tensor()
        expected = torch.tensor([[-1.0, 0.75, 0.0], [-0.3, 0.0, 0.0]])  # CPU by design
        torch.testing.assert_close(r, expected)
        assert (r[_tensor(m) == 0] == 0).all()

    def detached(out):
        assert not out["r"].requires_grad and not out["r"].grad_fn

    def padding(out):
        r = out["r"].tensor()
        assert r[0, 1].item() == 0.0 and torch.isfinite(r).all()

    def bool_mask(out):
        torch.testing.assert_close(out["bool"].tensor(), out["float"].tensor())

    f32 = dict(dtype="float32")
    s2, t2 = _normal(rng, 2, 3).astype(np.float32), _normal(rng, 2, 3).astype(np.float32)
    m2 = np.array([[1, 1, 0], [1, 0, 0]])
    inf = math.inf
    return [
        Case(name + "test_values_and_zeros_where_masked", 1, {"r": Call(
            "reverse_kl_rewards", (Tensor(s, **f32), Tensor(t, **f32), Tensor(m, **f32)))},
            values),
        Case(name + "test_no_gradient_attached", 1, {"r": Call("reverse_kl_rewards", (
            Tensor(s2, "float32", requires_grad=True), Tensor(t2, **f32),
            Tensor(np.ones((2, 3), np.float32), **f32)))}, detached),
        Case(name + "test_padding_with_minus_inf_gives_exact_zero", 1, {"r": Call(
            "reverse_kl_rewards", (Tensor(np.array([[-0.5, -inf]], np.float32), **f32),
                                   Tensor(np.array([[-0.7, -inf]], np.float32), **f32),
                                   Tensor(np.array([[1.0, 0.0]], np.float32), **f32)))},
            padding),
        Case(name + "test_bool_mask_equals_float_mask", 1, {
            "bool": Call("reverse_kl_rewards", (Tensor(s2, **f32), Tensor(t2, **f32),
                                                Tensor(m2.astype(bool), "bool"))),
            "float": Call("reverse_kl_rewards", (Tensor(s2, **f32), Tensor(t2, **f32),
                                                 Tensor(m2.astype(np.float32), **f32)))},
            bool_mask),
    ]


def _opd_task2():
    name = OPD_TESTS + "TestTask2PolicyGradientLoss::"
    rng = np.random.default_rng(202)
    _, _, mask = _random_batch()
    logp, rewards = _normal(rng, 3, 4), _normal(rng, 3, 4)
    f32 = dict(dtype="float32")
    inf = math.inf

    def gradient(out):
        expected = -_tensor(rewards) * _tensor(mask) / _tensor(mask).sum()
        torch.testing.assert_close(out["loss"].grad(0), expected)

    def value(out):
        # -(1 * -1 + 2 * -2 + 3 * -3) / 3 = 14 / 3
        assert math.isclose(out["loss"].item(), 14 / 3, rel_tol=1e-6), out["loss"].item()

    def no_reward_gradient(out):
        assert out["loss"].grads.get("1") is None, "a gradient reached the rewards"
        out["loss"].grad(0)

    def zero_mask(out):
        assert out["loss"].item() == 0.0
        assert torch.equal(out["loss"].grad(0), torch.zeros(2, 3))  # CPU by design

    def padding(out):
        assert math.isclose(out["loss"].item(), 0.5, rel_tol=1e-6), out["loss"].item()
        assert out["loss"].grad(0).tolist() == [[-1.0, 0.0]]

    ones23 = np.ones((2, 3), np.float32)
    return [
        Case(name + "test_gradient_is_minus_reward_times_mask_over_count", 2, {"loss": Call(
            "opd_pg_loss", (Tensor(logp, requires_grad=True), Tensor(rewards), Tensor(mask)),
            backward=True)}, gradient),
        Case(name + "test_loss_value", 2, {"loss": Call("opd_pg_loss", (
            Tensor(np.array([[-1.0, -2.0], [-3.0, -4.0]], np.float32), **f32),
            Tensor(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), **f32),
            Tensor(np.array([[1.0, 1.0], [1.0, 0.0]], np.float32), **f32)))}, value),
        Case(name + "test_no_gradient_reaches_rewards", 2, {"loss": Call("opd_pg_loss", (
            Tensor(_normal(rng, 2, 3).astype(np.float32), "float32", requires_grad=True),
            Tensor(_normal(rng, 2, 3).astype(np.float32), "float32", requires_grad=True),
            Tensor(ones23, **f32)), backward=True)}, no_reward_gradient),
        Case(name + "test_all_zero_mask_gives_zero_loss_and_finite_zero_gradient", 2, {
            "loss": Call("opd_pg_loss", (
                Tensor(_normal(rng, 2, 3).astype(np.float32), "float32", requires_grad=True),
                Tensor(_normal(rng, 2, 3).astype(np.float32), **f32),
                Tensor(np.zeros((2, 3), np.float32), **f32)), backward=True)}, zero_mask),
        Case(name + "test_minus_inf_logp_in_padding_gives_no_nan", 2, {"loss": Call(
            "opd_pg_loss", (Tensor(np.array([[-0.5, -inf]], np.float32), "float32",
                                   requires_grad=True),
                            Tensor(np.array([[1.0, inf]], np.float32), **f32),
                            Tensor(np.array([[1.0, 0.0]], np.float32), **f32)), backward=True)},
            padding),
    ]


def _opd_task3():
    name = OPD_TESTS + "TestTask3FullVocabReverseKL::"
    student, teacher, mask = _random_batch()
    equal_student, _, equal_mask = _random_batch(seed=3)
    other = _random_batch(seed=4)
    grad_student, grad_teacher, grad_mask = _random_batch(seed=1)

    def kl_div(out):
        per_position = F.kl_div(F.log_softmax(_tensor(teacher), -1),
                                F.log_softmax(_tensor(student), -1), reduction="none",
                                log_target=True).sum(-1)
        reference = (per_position * _tensor(mask)).sum() / _tensor(mask).sum()
        torch.testing.assert_close(out["kl"].tensor(), reference, rtol=1e-12, atol=1e-12)

    def equal(out):
        assert abs(out["same"].item()) <= 1e-14, out["same"].item()
        # Adding a constant to a row of logits leaves the distribution unchanged.
        assert abs(out["shifted"].item()) <= 1e-12, out["shifted"].item()
        assert out["positive"].item() > 0

    def gradient(out):
        expected = _analytic_reverse_kl_grad(_tensor(grad_student), _tensor(grad_teacher))
        expected = expected * _tensor(grad_mask)[..., None] / _tensor(grad_mask).sum()
        torch.testing.assert_close(out["kl"].grad(0), expected, rtol=1e-12, atol=1e-14)
        assert out["kl"].grads.get("1") is None, "a gradient reached the teacher"

    def zero_mask(out):
        assert out["kl"].item() == 0.0
        assert torch.equal(out["kl"].grad(0), torch.zeros_like(_tensor(student)))

    return [
        Case(name + "test_matches_torch_kl_div", 3, {"kl": Call("full_vocab_reverse_kl", (
            Tensor(student), Tensor(teacher), Tensor(mask)))}, kl_div),
        Case(name + "test_nonnegative_and_zero_when_equal", 3, {
            "same": Call("full_vocab_reverse_kl", (Tensor(equal_student), Tensor(equal_student),
                                                   Tensor(equal_mask))),
            "shifted": Call("full_vocab_reverse_kl", (Tensor(equal_student),
                                                      Tensor(equal_student + 7.5),
                                                      Tensor(equal_mask))),
            "positive": Call("full_vocab_reverse_kl", tuple(Tensor(x) for x in other))}, equal),
        Case(name + "test_autograd_equals_analytic_softmax_kl_gradient", 3, {"kl": Call(
            "full_vocab_reverse_kl", (Tensor(grad_student, requires_grad=True),
                                      Tensor(grad_teacher, requires_grad=True),
                                      Tensor(grad_mask)), backward=True)}, gradient),
        Case(name + "test_all_zero_mask", 3, {"kl": Call("full_vocab_reverse_kl", (
            Tensor(student, requires_grad=True), Tensor(teacher),
            Tensor(np.zeros((3, 4), np.float32), "float32")), backward=True)}, zero_mask),
    ]


def _opd_identities():
    cases = []
    rng = np.random.default_rng(505)
    z, zt = 2 * _normal(rng, 6), 2 * _normal(rng, 6)
    tokens = _sampled_token_inputs(z, zt)
    hand = {f"loss{v}": Call("opd_pg_loss", (
        Tensor(logp, requires_grad=True), Tensor(logq - logp), Tensor(np.ones((1, 1)))),
        backward=True) for v, (logp, logq) in enumerate(tokens)}

    def hand_judge(out, z=z, zt=zt):
        p = F.softmax(_tensor(z), -1)
        per_token = _per_token_gradients(z, zt, logp_grads=[out[f"loss{v}"].grad(0)
                                                            for v in range(6)])
        torch.testing.assert_close((p[:, None] * per_token).sum(0),
                                   _analytic_reverse_kl_grad(_tensor(z), _tensor(zt)),
                                   rtol=1e-12, atol=1e-14)

    cases.append(Case(OPD_TESTS + "test_expected_policy_gradient_with_hand_rewards_is_the_"
                      "analytic_kl_gradient", 2, hand, hand_judge))

    for seed in range(5):
        rng = np.random.default_rng(seed)
        z, zt = 2 * _normal(rng, 7), 2 * _normal(rng, 7)
        build = _sampled_token_build(z, zt)

        def exact(task, build=build, z=z):
            calls, gradients = build(task)

            def judge(out):
                per_token, full = gradients(out)
                p = F.softmax(_tensor(z), -1)
                torch.testing.assert_close((p[:, None] * per_token).sum(0), full,
                                           rtol=1e-12, atol=1e-14)
            return calls, judge

        cases += _cases(OPD_TESTS + f"test_expected_sampled_token_gradient_equals_full_vocab_"
                        f"gradient[{seed}]", (1, 2, 3), exact)

    rng = np.random.default_rng(11)
    z, zt = _normal(rng, 6), _normal(rng, 6)
    build = _sampled_token_build(z, zt)

    def monte_carlo(task, build=build, z=z):
        calls, gradients = build(task)

        def judge(out):
            """Average N sampled-token gradients; tolerance = 5 exact standard errors."""
            per_token, full = gradients(out)
            p = F.softmax(_tensor(z), -1)
            exact_mean = (p[:, None] * per_token).sum(0)
            exact_var = (p[:, None] * (per_token - exact_mean) ** 2).sum(0)  # per coordinate
            assert (exact_var > 0).all()  # the sampled-token estimator is noisy...
            n = 20_000
            tokens = np.random.default_rng(12).choice(len(z), size=n, p=p.numpy())
            mc_mean = per_token[tokens].mean(0)
            tolerance = 5 * torch.sqrt(exact_var / n)  # P(|z| > 5) < 6e-7 per coordinate
            assert ((mc_mean - exact_mean).abs() < tolerance).all()
            # ...while the full-vocabulary gradient at this state is its mean, with no variance.
            torch.testing.assert_close(exact_mean, full, rtol=1e-12, atol=1e-14)
        return calls, judge

    cases += _cases(OPD_TESTS + "test_monte_carlo_sampled_token_gradient_agrees_within_variance",
                    (1, 2, 3), monte_carlo)
    return cases


# ------------------------------------------------------------------------- the mismatch lab
MISMATCH_TESTS = "tests/test_lab_estimators.py::"
SWEEP = [0.0, 0.1, 0.3, 0.6, 1.0, 1.5]


def _ratios(toy):
    """(rho_t (M, T), rho (M,)) straight from the toy's log-probabilities."""
    rho_t = np.exp(toy["logp_train"] - toy["logp_sampler"])
    return rho_t, np.exp(np.log(rho_t).sum(axis=1))


def _expected_estimate(toy, weights, baseline=0.0):
    """w_t * (R - b) * s_t for (M, T) or (M,) weights."""
    w = weights if weights.ndim == 2 else weights[:, None]
    return (w * (toy["R"] - baseline)[:, None])[:, :, None] * toy["score"]


def _matches(name, task, function, toy, expected_weights, **params):
    """The estimator's weights, and its (M, T, V) estimate, against independent values."""
    calls = {"weights": Call(function, (Toy(toy),), dict(params, return_weights=True)),
             "estimate": Call(function, (Toy(toy),), params)}

    def judge(out):
        np.testing.assert_allclose(out["weights"].values, expected_weights, rtol=1e-12)
        np.testing.assert_allclose(out["estimate"].values,
                                   _expected_estimate(toy, expected_weights), rtol=1e-12,
                                   atol=1e-15)

    return Case(name, task, calls, judge)


def _mismatch_cases():
    from ..mismatch.toy import estimator_moments, make_toy, sample_from_sampler

    toys = {}

    def toy_of(**params):  # each toy is built once, and sent once
        key = tuple(sorted(params.items()))
        if key not in toys:
            toys[key] = make_toy(**params)
        return toys[key]

    toy = toy_of(mismatch=0.8, seed=3)
    clean = toy_of(mismatch=0.0)
    sweep = [toy_of(mismatch=m) for m in SWEEP]
    rho_t, rho = _ratios(toy)
    n = MISMATCH_TESTS
    cases = []

    def naive_judge(out):
        ones = np.ones(len(toy["R"]))
        np.testing.assert_allclose(out["toy"].values, _expected_estimate(toy, ones))
        np.testing.assert_allclose(out["baseline"].values, _expected_estimate(toy, ones, 0.3))
        assert estimator_moments(clean, out["clean"].values)["rel_bias"] < 1e-12
        biases = [estimator_moments(t, out[f"sweep{i}"].values)["bias"]
                  for i, t in enumerate(sweep)]
        assert all(a < b for a, b in zip(biases, biases[1:]))  # grows with the mismatch

    cases.append(Case(n + "test_naive", 1, {
        "toy": Call("naive", (Toy(toy),)), "baseline": Call("naive", (Toy(toy),),
                                                             {"baseline": 0.3}),
        "clean": Call("naive", (Toy(clean),)),
        **{f"sweep{i}": Call("naive", (Toy(t),)) for i, t in enumerate(sweep)}}, naive_judge))

    token_is_case = _matches(n + "test_token_is", 2, "token_is", toy, rho_t)

    def token_is_judge(out, matches=token_is_case.judge):
        matches(out)
        assert estimator_moments(toy, out["estimate"].values)["rel_bias"] > 1e-3  # biased

    cases.append(Case(token_is_case.name, 2, token_is_case.calls, token_is_judge))

    for baseline in (0.0, 0.4):
        for T, V, seed in [(6, 4, 0), (4, 3, 1), (3, 5, 2), (5, 2, 3)]:
            sweep_toys = [toy_of(T=T, V=V, mismatch=m, seed=seed) for m in SWEEP]

            def unbiased(out, sweep_toys=sweep_toys):
                for i, t in enumerate(sweep_toys):
                    assert estimator_moments(t, out[f"m{i}"].values)["rel_bias"] < 1e-9, SWEEP[i]

            cases.append(Case(n + f"test_seq_is_is_unbiased_everywhere[{baseline}-{T}-{V}-"
                              f"{seed}]", 3, {f"m{i}": Call("seq_is", (Toy(t),),
                                                            {"baseline": baseline})
                                              for i, t in enumerate(sweep_toys)}, unbiased))

    def seq_is_monte_carlo(out):
        per_seq = out["seq_is"].values
        exact = estimator_moments(toy, per_seq)["mean"]
        draws = sample_from_sampler(toy, 40_000, np.random.default_rng(0))
        per_coordinate_var = np.einsum("m,mtv->tv", toy["p_sampler"], (per_seq - exact) ** 2)
        se = np.sqrt(per_coordinate_var / len(draws))
        assert (np.abs(per_seq[draws].mean(axis=0) - exact) <= 4 * se + 1e-15).all()

    cases.append(Case(n + "test_seq_is_monte_carlo_within_four_standard_errors", 3,
                      {"seq_is": Call("seq_is", (Toy(toy),))}, seq_is_monte_carlo))
    for cap in (0.5, 2.0, math.inf):
        cases.append(_matches(n + f"test_token_tis[{cap}]", 4, "token_tis", toy,
                              np.minimum(rho_t, cap), cap=cap))
    for cap in (0.5, 2.0):
        cases.append(_matches(n + f"test_seq_tis[{cap}]", 5, "seq_tis", toy,
                              np.minimum(rho, cap), cap=cap))

    def seq_tis_unbiased(out):
        assert estimator_moments(toy, out["seq_tis"].values)["rel_bias"] < 1e-9

    cases.append(Case(n + "test_seq_tis_without_cap_is_unbiased", 5, {
        "seq_tis": Call("seq_tis", (Toy(toy),), {"cap": math.inf})}, seq_tis_unbiased))
    for low, high in [(0.0, 2.0), (0.5, 1.5), (0.0, math.inf)]:
        expected = np.where((rho_t >= low) & (rho_t <= high), rho_t, 0.0)
        cases.append(_matches(n + f"test_token_mis[{low}-{high}]", 6, "token_mis", toy,
                              expected, low=low, high=high))
    for low, high in [(0.0, 2.0), (0.5, 1.5)]:
        expected = np.where((rho >= low) & (rho <= high), rho, 0.0)
        cases.append(_matches(n + f"test_seq_mis[{low}-{high}]", 7, "seq_mis", toy, expected,
                              low=low, high=high))

    def seq_mis_unbiased(out):
        assert estimator_moments(toy, out["seq_mis"].values)["rel_bias"] < 1e-9

    cases.append(Case(n + "test_seq_mis_with_a_band_containing_every_ratio_is_unbiased", 7, {
        "seq_mis": Call("seq_mis", (Toy(toy),), {"low": rho.min() * 0.999,
                                                 "high": rho.max() * 1.001})},
        seq_mis_unbiased))
    for low, high in [(0.999, 1.001), (0.9, 1.1), (0.0, math.inf)]:
        geo = rho ** (1 / toy["T"])
        keep = ((geo >= low) & (geo <= high)).astype(float)
        cases.append(_matches(n + f"test_geo_rs[{low}-{high}]", 8, "geo_rs", toy, keep,
                              low=low, high=high))

    def geo_rs_clean(out):
        np.testing.assert_allclose(out["geo_rs"].values,
                                   _expected_estimate(clean, np.ones(len(clean["R"]))),
                                   rtol=1e-12, atol=1e-15)

    cases.append(Case(n + "test_geo_rs_keeps_everything_without_mismatch", 8,
                      {"geo_rs": Call("geo_rs", (Toy(clean),))}, geo_rs_clean))
    return cases


# ------------------------------------------------------- the OPD lab's hidden tests (Gradescope)
OPD_HIDDEN = "tests/test_lab_opd_hidden.py::"


def _reference_reverse_kl(student_logits, teacher_logits, mask):
    """sum_{b,t} mask * KL(p || q) / max(sum mask, 1), in float64, from log_softmax."""
    log_p = torch.log_softmax(_tensor(student_logits), -1)
    log_q = torch.log_softmax(_tensor(teacher_logits), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl = torch.where(_tensor(mask) != 0, kl, torch.zeros_like(kl))
    return kl.sum() / max(float(np.sum(mask)), 1.0)


def _opd_hidden():
    """The cases of tests/opd/test_lab_opd_hidden.py, its inputs drawn here with numpy."""
    rng = np.random.default_rng(707)
    inf = math.inf
    # Task 1: float16 in, float32 out: the float16 difference, rounded once to float32
    s16 = (-rng.random((3, 5)) * 4).astype(np.float16)
    t16 = (-rng.random((3, 5)) * 4).astype(np.float16)

    def half_rewards(out):
        assert out["r"].dtype == "float32", out["r"].dtype
        expected = (t16.astype(np.float64) - s16.astype(np.float64)).astype(np.float32)
        np.testing.assert_allclose(out["r"].values, expected, rtol=1e-6, atol=0)

    s_pad = np.array([[-0.5, -inf, -inf], [-1.5, -0.25, -inf]])
    t_pad = np.array([[-0.75, -inf, -2.0], [-1.0, -3.0, -inf]])
    m_pad = np.array([[True, False, False], [True, True, False]])

    def padded_rewards(out):
        assert out["r"].values.tolist() == [[-0.25, 0.0, 0.0], [0.5, -2.75, 0.0]]

    # Task 2: float16 in, a float32 loss
    logp16 = (-rng.random((4, 6)) * 5).astype(np.float16)
    rewards16 = rng.standard_normal((4, 6)).astype(np.float16)
    mask2 = np.ones((4, 6), np.float32)
    mask2[2, 3:] = 0

    def half_loss(out):
        assert out["loss"].dtype == "float32", out["loss"].dtype
        expected = -(mask2 * rewards16.astype(np.float64) * logp16.astype(np.float64)).sum()
        expected /= mask2.sum()
        assert abs(out["loss"].item() - expected) <= 1e-5 * abs(expected)

    logp_inf = np.array([[-0.5, -inf], [-2.0, -1.0]])
    rewards_inf = np.array([[2.0, 1.0], [inf, -1.0]])

    def infinite_padding(out):
        assert out["loss"].item() == 0.0
        assert out["loss"].grad(0).tolist() == [[-1.0, 0.0], [0.0, 0.5]]

    # Task 3: large logits, float16 logits, a masked row of -inf
    big_s, big_t = 1e4 * rng.standard_normal((2, 3, 7)), 1e4 * rng.standard_normal((2, 3, 7))
    big_m = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])

    def large(out):
        value = out["kl"].item()
        expected = _reference_reverse_kl(big_s, big_t, big_m).item()
        assert math.isfinite(value) and abs(value - expected) <= 1e-12 * abs(expected)

    h_s = (3 * rng.standard_normal((2, 4, 9))).astype(np.float16)
    h_t = (3 * rng.standard_normal((2, 4, 9))).astype(np.float16)

    def half_kl(out):
        assert out["kl"].dtype == "float32", out["kl"].dtype
        expected = _reference_reverse_kl(h_s, h_t, np.ones((2, 4))).item()
        assert abs(out["kl"].item() - expected) <= 1e-4 * abs(expected)

    row_s, row_t = rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 2, 4))
    row_s[0, 1] = -inf

    def masked_row(out):
        expected = _reference_reverse_kl(row_s[:, :1], row_t[:, :1], np.ones((1, 1))).item()
        assert abs(out["kl"].item() - expected) <= 1e-12 * abs(expected)
        grad = out["kl"].grad(0)
        assert torch.isfinite(grad).all() and grad[0, 1].tolist() == [0.0] * 4

    return [
        Case(OPD_HIDDEN + "test_half_precision_rewards_are_float32_differences", 1, {"r": Call(
            "reverse_kl_rewards", (Tensor(s16, "float16"), Tensor(t16, "float16"),
                                   Tensor(np.ones((3, 5)))))}, half_rewards),
        Case(OPD_HIDDEN + "test_rewards_with_a_bool_mask_and_minus_inf_padding", 1, {"r": Call(
            "reverse_kl_rewards", (Tensor(s_pad), Tensor(t_pad), Tensor(m_pad, "bool")))},
            padded_rewards),
        Case(OPD_HIDDEN + "test_half_precision_loss_is_computed_in_float32", 2, {"loss": Call(
            "opd_pg_loss", (Tensor(logp16, "float16", requires_grad=True),
                            Tensor(rewards16, "float16"), Tensor(mask2, "float32")))},
            half_loss),
        Case(OPD_HIDDEN + "test_padding_with_infinities_reaches_neither_loss_nor_gradient", 2,
             {"loss": Call("opd_pg_loss", (Tensor(logp_inf, requires_grad=True),
                                           Tensor(rewards_inf),
                                           Tensor(np.array([[1, 0], [0, 1]]), "int64")),
                           backward=True)}, infinite_padding),
        Case(OPD_HIDDEN + "test_large_logits_stay_finite_and_exact", 3, {"kl": Call(
            "full_vocab_reverse_kl", (Tensor(big_s), Tensor(big_t), Tensor(big_m)))}, large),
        Case(OPD_HIDDEN + "test_half_precision_logits_give_a_float32_loss", 3, {"kl": Call(
            "full_vocab_reverse_kl", (Tensor(h_s, "float16"), Tensor(h_t, "float16"),
                                      Tensor(np.ones((2, 4)), "float32")))}, half_kl),
        Case(OPD_HIDDEN + "test_a_masked_row_of_minus_inf_reaches_neither_value_nor_gradient",
             3, {"kl": Call("full_vocab_reverse_kl", (Tensor(row_s, requires_grad=True),
                                                      Tensor(row_t), Tensor(np.array([[1.0,
                                                                                       0.0]]))),
                            backward=True)}, masked_row),
    ]


# --------------------------------------------------------------------------- the engine lab
ENGINE_TESTS = "tests/test_lab_engine.py::"
ENGINE_BOUNDARY = [0.5, 0.3, 0.15, 0.05]


def _engine_rows(seed, rows=40, V=6):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(V), size=rows)
    return probs, np.argsort(-probs, axis=-1, kind="stable")


def _framework_cut(sums, top_p, sampler):
    """The top-p cut as the framework's torch code writes it, on its float32 statistic."""
    s = torch.from_numpy(np.asarray(sums, dtype=np.float32))  # CPU by design: numpy's
    if sampler == "sglang":
        return (~(s > s.new_tensor(top_p))).numpy()
    if sampler == "vllm":
        cut = s <= 1 - s.new_tensor(top_p)
    else:
        cut = s <= (1 - top_p)
    cut[..., -1] = False
    return (~cut).numpy()


def _engine_cases():
    from ..mismatch.engine import NUCLEUS_TOLERANCE

    n = ENGINE_TESTS
    cases = []

    probs = np.array([[0.15, 0.5, 0.05, 0.3]])
    order = np.array([[1, 3, 0, 2]])

    def by_hand(out):
        np.testing.assert_allclose(out["above"].values, [[0.0, 0.5, 0.8, 0.95]], rtol=1e-15,
                                   atol=1e-16)

    cases.append(Case(n + "test_mass_above_by_hand", 1, {
        "above": Call("_mass_above", (Array(probs), Array(order)))}, by_hand))

    rows, ranking = _engine_rows(0)
    expected = np.zeros_like(rows)
    for row in range(len(rows)):
        for rank in range(rows.shape[1]):
            expected[row, rank] = sum(rows[row, ranking[row, r]] for r in range(rank))

    def ranked_before(out):
        np.testing.assert_allclose(out["above"].values, expected, rtol=1e-12, atol=1e-15)

    cases.append(Case(n + "test_mass_above_sums_what_is_ranked_before", 1, {
        "above": Call("_mass_above", (Array(rows), Array(ranking)))}, ranked_before))

    above = np.array([[0.0, 0.5, 0.8, 0.95]])
    for top_p, count in [(0.8, 2), (0.81, 3), (0.5, 1), (0.500000001, 2), (0.01, 1),
                         (1e-13, 1)]:
        def boundary(out, count=count):
            kept = [rank < count for rank in range(4)]
            assert out["rows"].values.tolist() == [kept]
            assert out["columns"].values.tolist() == [[k] for k in kept]

        cases.append(Case(n + f"test_cut_exact_at_the_boundary[{top_p}-{count}]", 1, {
            "rows": Call("_cut_exact", (Array(above), top_p)),
            "columns": Call("_cut_exact", (Array(above.T.copy()), top_p), {"axis": 0})},
            boundary))

    rows, ranking = _engine_rows(1)
    ranked = np.take_along_axis(rows, ranking, axis=-1)
    mass_above = np.cumsum(ranked, axis=-1) - ranked
    nucleus_levels = (0.3, 0.6, 0.9, 0.99)

    def smallest_set(out, ranked=ranked):
        for top_p in nucleus_levels:
            kept = out[str(top_p)].values
            for row, ranked_row in enumerate(ranked):
                count = 1 + int((np.cumsum(ranked_row) < top_p - NUCLEUS_TOLERANCE).sum())
                assert kept[row].tolist() == [r < count for r in range(len(ranked_row))], (
                    row, top_p)

    cases.append(Case(n + "test_cut_exact_keeps_the_smallest_top_set_that_reaches_top_p", 1,
                      {str(p): Call("_cut_exact", (Array(mass_above), p))
                       for p in nucleus_levels},
                      smallest_set))

    p32 = np.array(ENGINE_BOUNDARY, dtype=np.float32)
    for sampler, count in [("vllm", 3), ("transformers", 2), ("sglang", 2)]:
        in_order = p32[::-1].copy() if sampler != "sglang" else p32
        sums = np.cumsum(in_order, dtype=float).astype(np.float32)
        if sampler == "sglang":
            sums = sums - in_order

        def framework_boundary(out, sums=sums, sampler=sampler, count=count):
            kept = out["kept"]
            assert kept.dtype == "bool" and int(kept.values.sum()) == count
            assert kept.values.tolist() == _framework_cut(sums, 0.8, sampler).tolist()

        cases.append(Case(n + f"test_cut_framework_at_the_boundary_by_hand[{sampler}-{count}]",
                          2, {"kept": Call("_cut_framework", (Array(sums), 0.8, sampler))},
                          framework_boundary))

    for sampler, kept_rank in [("vllm", -1), ("transformers", -1), ("sglang", 0)]:
        in_order = p32[::-1].copy() if sampler == "sglang" else p32
        sums = np.cumsum(in_order, dtype=float).astype(np.float32)
        if sampler == "sglang":
            sums = sums - in_order

        def one_token(out, sums=sums, sampler=sampler, kept_rank=kept_rank):
            kept = out["kept"].values.tolist()
            assert kept == [rank == kept_rank % 4 for rank in range(4)]
            assert kept == _framework_cut(sums, 1e-8, sampler).tolist()

        cases.append(Case(n + f"test_cut_framework_keeps_one_token_at_a_tiny_top_p[{sampler}-"
                          f"{kept_rank}]", 2,
                          {"kept": Call("_cut_framework", (Array(sums), 1e-8, sampler))},
                          one_token))

    dyadic = np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32)
    dyadic_above = np.cumsum(dyadic, dtype=float).astype(np.float32) - dyadic

    def equal_to_top_p(out):
        assert out["kept"].values.tolist() == [True, True, True, False]

    cases.append(Case(n + "test_cut_framework_sglang_keeps_a_mass_above_equal_to_top_p", 2,
                      {"kept": Call("_cut_framework", (Array(dyadic_above), 0.75, "sglang"))},
                      equal_to_top_p))

    rows, _ = _engine_rows(2, rows=200, V=5)
    cut_levels = (0.2, 0.5, 0.75, 0.9, 0.95)
    for sampler in ("vllm", "transformers", "sglang"):
        r32 = rows.astype(np.float32)
        framework_order = np.argsort(-r32 if sampler == "sglang" else r32, axis=-1,
                                     kind="stable")
        in_order = np.take_along_axis(r32, framework_order, axis=-1)
        # CPU by design: the judge's own float32 sums, as torch's CPU kernel adds them
        sums = torch.cumsum(torch.from_numpy(in_order), dim=-1).numpy()
        if sampler == "sglang":
            sums = sums - in_order

        def float32_arithmetic(out, sums=sums, sampler=sampler):
            for top_p in cut_levels:
                expected = _framework_cut(sums, top_p, sampler)
                assert np.array_equal(out[f"{top_p}"].values, expected), top_p
                assert np.array_equal(out[f"{top_p}.T"].values, expected.T), top_p

        calls = {}
        for top_p in cut_levels:
            calls[f"{top_p}"] = Call("_cut_framework", (Array(sums), top_p, sampler))
            calls[f"{top_p}.T"] = Call("_cut_framework", (Array(sums.T.copy()), top_p, sampler),
                                       {"axis": 0})
        cases.append(Case(n + f"test_cut_framework_is_the_frameworks_float32_arithmetic"
                          f"[{sampler}]", 2, calls, float32_arithmetic))

    logits = np.array([[2.0, 0.5, -1.0, 0.0], [0.3, 0.3, 0.3, 0.3]])
    kept = np.array([[True, False, True, False], [False, True, True, True]])
    p = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)

    def kept_mass(out):
        np.testing.assert_allclose(out["log_kept"].values,
                                   [math.log(p[0, 0] + p[0, 2]), math.log(0.75)], rtol=1e-12)

    cases.append(Case(n + "test_log_kept_mass", 3, {
        "log_kept": Call("_log_kept", (Array(logits), Array(kept)))}, kept_mass))

    every = np.random.default_rng(3).normal(size=(5, 7)) * 4

    def every_token(out):
        np.testing.assert_allclose(out["log_kept"].values, 0.0, atol=1e-15)

    cases.append(Case(n + "test_log_kept_mass_of_every_token_is_zero", 3, {
        "log_kept": Call("_log_kept", (Array(every), Array(np.ones(every.shape, dtype=bool))))},
        every_token))

    tiny = np.array([[0.0, -800.0, -801.0]])
    tiny_kept = np.array([[False, True, True]])

    def no_underflow(out):
        expected = -800.0 + math.log1p(math.exp(-1.0))
        np.testing.assert_allclose(out["small"].values, [expected], rtol=1e-14)
        np.testing.assert_allclose(out["large"].values, [expected], rtol=1e-12)

    cases.append(Case(n + "test_log_kept_mass_does_not_underflow", 3, {
        "small": Call("_log_kept", (Array(tiny), Array(tiny_kept))),
        "large": Call("_log_kept", (Array(tiny + 1000.0), Array(tiny_kept)))}, no_underflow))
    return cases


CASES = {
    "tests/mismatch/test_lab_engine.py": _engine_cases,
    "tests/opd/test_lab_opd.py": lambda: (_opd_task1() + _opd_task2() + _opd_task3()
                                          + _opd_identities()),
    "tests/mismatch/test_lab_estimators.py": _mismatch_cases,
    "tests/opd/test_lab_opd_hidden.py": _opd_hidden,
}
"""The cases of each lab test file, by its path in the repository: a builder of its cases."""


def cases_of(lab) -> list[Case]:
    """Every case of a lab (a [Lab][opd_literate.course.labs.Lab], or its name), those of each
    of its test files in turn, each task's in the order of its lab tests. A test file without
    cases is a ValueError: its tests would otherwise go unjudged."""
    if isinstance(lab, str):
        if lab not in LABS:
            raise ValueError(f"unknown lab {lab!r}; choose from {', '.join(LABS)}")
        lab = LABS[lab]
    cases = []
    for test in lab.tests:
        if test not in CASES:
            raise ValueError(f"lab {lab.name!r}: no grading cases for {test}; write them in "
                             "opd_literate/course/cases.py (CASES)")
        cases += CASES[test]()
    return sorted(cases, key=lambda case: case.task)  # stable: each task's in test order
