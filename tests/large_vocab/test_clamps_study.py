"""opd_literate.large_vocab.clamps: the studies against a direct float64 loop, their thresholds.

``weighted_clamp_study`` is recomputed position by position in Python floats from its
definitions (clamp_study's docstring): verl's value from its formula, the gradients from their
closed forms (no autograd), the weighted fractions and means by hand. ``clamp_study`` is checked
as the composition it is: ``topk.zipf_pair`` stacked and weighted equally. The thresholds of the
module docstring's "Rounding" section are checked at inputs built on either side of them.
"""

import math

import pytest
import torch

from opd_literate.large_vocab import clamps
from opd_literate.large_vocab.topk import zipf_pair

F64 = torch.float64
EPS64 = torch.finfo(F64).eps


def _log_softmax(z):
    top = max(z)
    log_total = top + math.log(math.fsum(math.exp(x - top) for x in z))
    return [x - log_total for x in z]


def _norm(x):
    return math.sqrt(math.fsum(v * v for v in x))


def _position(z, y, k, low, high):
    """One position of the study in Python floats: verl's value before its clamps, whether it is
    clamped, capped, P > Q, the true gradient p - q and the gradients of (c) and of (b)."""
    V = len(z)
    log_p, log_q = _log_softmax(z), _log_softmax(y)
    p, q = [math.exp(x) for x in log_p], [math.exp(x) for x in log_q]
    S = sorted(range(V), key=lambda v: -log_q[v])[:k]  # the teacher's top-k (no ties here)
    on = set(S)

    def bar(x):
        return x if low is None else max(x, low)

    raw = math.fsum(math.exp(bar(log_q[v])) * (bar(log_q[v]) - bar(log_p[v])) for v in S)
    P, Q = math.fsum(p[v] for v in S), math.fsum(q[v] for v in S)
    # these inputs are chosen far from every threshold, so that the rounding does not decide
    # (at k = V, P = Q = 1 exactly: never P > Q)
    assert abs(raw) > 1e-6 and (k == V or abs(P - Q) > 1e-6)
    assert high is None or abs(raw - high) > 1e-6
    clamped, capped = raw < 0, high is not None and raw > high
    g = [p[j] - q[j] for j in range(V)]
    # (c): d/dz_j sum_S e^{t_bar} (t_bar - s_bar) = W p_j - e^{t_bar_j} [j in S, s_j above c],
    # W the sum of e^{t_bar_v} over those v (s_bar = c is a constant); 0 where clamped or capped
    live = [v for v in S if low is None or log_p[v] > low]
    W = math.fsum(math.exp(bar(log_q[v])) for v in live)
    g_c = [0.0] * V if clamped or capped else [
        W * p[j] - (math.exp(bar(log_q[j])) if j in live else 0.0) for j in range(V)]
    # (b), the KL over S and one tail bucket: p_j - q_j on S, p_j (1 - Q_tail / P_tail) off it
    tail_ratio = (1 - Q) / (1 - P) if k < V else 0.0
    g_b = [p[j] - q[j] if j in on else p[j] * (1 - tail_ratio) for j in range(V)]
    return dict(raw=raw, clamped=clamped, capped=capped, p_above_q=k < V and P > Q, g=g,
                g_c=g_c, g_b=g_b)


def _reference(student, teacher, weights, k, low, high):
    """weighted_clamp_study's row for one k, by its definitions, over the states of weight > 0."""
    rows = [(w, _position(z, y, k, low, high)) for w, z, y in
            zip(weights.tolist(), student.tolist(), teacher.tolist()) if w > 0]
    total_w = math.fsum(w for w, _ in rows)

    def mean(f):
        return math.fsum(w * f(r) for w, r in rows) / total_w

    def relative(name):
        def error(r):
            # every state here moves: ||g|| far above the rounding 6 eps (1 + sqrt V)
            assert _norm(r["g"]) > 1e-6
            return _norm([a - b for a, b in zip(r[name], r["g"])]) / _norm(r["g"])
        return error

    lost = math.fsum(w * _norm(r["g"]) for w, r in rows if r["clamped"] or r["capped"])
    return {"k": k, "clamped": mean(lambda r: r["clamped"]), "capped": mean(lambda r: r["capped"]),
            "p_above_q": mean(lambda r: r["p_above_q"]),
            "lost": lost / math.fsum(w * _norm(r["g"]) for w, r in rows),
            "c_grad_error": mean(relative("g_c")), "b_grad_error": mean(relative("g_b"))}


def _states(seed=11, N=7, V=6, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    student = scale * torch.randn(N, V, generator=g, dtype=F64)
    teacher = scale * torch.randn(N, V, generator=g, dtype=F64)
    teacher[-1] = student[-1]  # of weight 0 below: p = q there, an infinite (c) error at k < V
    return student, teacher


WEIGHTS = [1.0, 3.0, 0.5, 2.0, 1.0, 6.0, 0.0]  # 1/3 and 1/6 of the largest are inexact


@pytest.mark.parametrize("low, high", [(None, None), (-1.0, None), (None, 1.0), (-1.0, 1.0)])
@pytest.mark.parametrize("weight_dtype", [F64, torch.float32])
def test_the_weighted_study_is_its_definitions_computed_position_by_position(low, high,
                                                                              weight_dtype):
    student, teacher = _states()
    weights = torch.tensor(WEIGHTS, dtype=weight_dtype)
    ks = [1, 3, 6]
    got = clamps.weighted_clamp_study(student, teacher, weights, ks, log_prob_min_clamp=low,
                                      loss_max_clamp=high)
    assert [row["k"] for row in got] == ks
    for row in got:
        want = _reference(student, teacher, weights.double(), row["k"], low, high)
        assert set(row) == set(want)
        # the fractions and means are sums of 6 float64 terms (a few ulps); the gradient errors
        # come from autograd against closed forms, each rounded by ~1e-16 of terms of size ~1
        for name, value in want.items():
            assert row[name] == pytest.approx(value, rel=1e-12, abs=1e-13), (row["k"], name)


def test_the_clamps_reach_the_counts():
    """The inputs above are not blind to the clamps: each setting changes some count."""
    student, teacher = _states()
    weights = torch.tensor(WEIGHTS, dtype=F64)
    plain, low, high = (clamps.weighted_clamp_study(student, teacher, weights, [3], **options)[0]
                        for options in ({}, {"log_prob_min_clamp": -1.0},
                                        {"loss_max_clamp": 1.0}))
    assert plain["capped"] == 0 and high["capped"] > 0 and high["lost"] > plain["lost"]
    # c = -1 clamps positions without P > Q (the log-sum argument needs no clamp at c)
    assert low["clamped"] > plain["clamped"] and low["clamped"] > low["p_above_q"]


def test_a_study_in_mixed_or_half_precision_is_the_study_in_the_compute_dtype():
    """Computed in the promoted dtype of the two logits (float32 for half precision): the
    same numbers as with both inputs converted first."""
    student, teacher = _states()
    weights = torch.tensor(WEIGHTS, dtype=F64)
    ks = [1, 3]
    both64 = clamps.weighted_clamp_study(student.float().double(), teacher.float().double(),
                                         weights, ks)
    assert clamps.weighted_clamp_study(student, teacher.float(), weights, ks) == \
        clamps.weighted_clamp_study(student, teacher.float().double(), weights, ks)
    assert clamps.weighted_clamp_study(student.float(), teacher, weights, ks) == \
        clamps.weighted_clamp_study(student.float().double(), teacher, weights, ks)
    assert clamps.weighted_clamp_study(student.float(), teacher.float().double(), weights,
                                       ks) == both64
    assert clamps.weighted_clamp_study(student.bfloat16(), teacher.bfloat16(), weights, ks) == \
        clamps.weighted_clamp_study(student.bfloat16().float(), teacher.bfloat16().float(),
                                    weights, ks)
    # and float32 is not float64: the comparisons above can tell the two apart
    assert clamps.weighted_clamp_study(student.float(), teacher.float(), weights, ks) != both64


# ---------------------------------------------------------------------------------------------
# clamp_study: zipf_pair's positions, weighted equally
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("low, high", [(None, None), (-4.0, 0.05)])
def test_clamp_study_is_the_weighted_study_of_the_zipf_pairs(low, high):
    V, exponent, temperatures, noises, ks, positions, seed = 32, 1.3, (0.7, 1.5), (0.5, 2.0), \
        (1, 4), 3, 5
    rows = clamps.clamp_study(V, exponent, temperatures, noises, ks, positions, seed,
                              log_prob_min_clamp=low, loss_max_clamp=high)
    want = []
    for temperature in temperatures:
        for noise in noises:
            pairs = [zipf_pair(V, exponent, temperature, noise, seed + i)
                     for i in range(positions)]
            student = torch.stack([pair[0] for pair in pairs])
            teacher = torch.stack([pair[1] for pair in pairs])
            for row in clamps.weighted_clamp_study(student, teacher, torch.ones(positions,
                                                                                dtype=F64),
                                                   ks, log_prob_min_clamp=low,
                                                   loss_max_clamp=high):
                want.append({"temperature": temperature, "noise": noise, **row})
    assert rows == want
    assert [(r["temperature"], r["noise"], r["k"]) for r in rows] == [
        (t, n, k) for t in temperatures for n in noises for k in ks]


def test_clamp_study_passes_its_clamps_on():
    common = dict(V=32, temperatures=(1.0,), noises=(2.0,), ks=(4,), positions=4)
    plain = clamps.clamp_study(**common)[0]
    capped = clamps.clamp_study(**common, loss_max_clamp=0.05)[0]
    low = clamps.clamp_study(**common, log_prob_min_clamp=-1.0)[0]
    assert plain["capped"] == 0 and capped["capped"] > 0
    assert low["clamped"] != plain["clamped"] or low["c_grad_error"] != plain["c_grad_error"]


def test_clamp_study_of_one_position_and_its_named_errors():
    [row] = clamps.clamp_study(V=16, temperatures=(1.0,), noises=(1.0,), ks=(1,), positions=1)
    assert row["clamped"] in (0.0, 1.0)
    for bad, error, message in [
        (dict(temperatures=()), ValueError, "temperatures must not be empty"),
        (dict(temperatures=1.0), TypeError, "temperatures must be a sequence"),
        (dict(noises=[]), ValueError, "noises must not be empty"),
        (dict(noises="0.5"), TypeError, "noises must be a sequence"),
        (dict(ks=[]), ValueError, "ks must not be empty"),
        (dict(ks=4), TypeError, "ks must be a sequence"),
        (dict(positions=0), ValueError, "positions must be an integer >= 1, got 0"),
        (dict(seed=-1), ValueError, "seed must be an integer >= 0, got -1"),
        (dict(seed=1.0), ValueError, "seed must be an integer >= 0, got 1.0"),
    ]:
        with pytest.raises(error, match=message):
            clamps.clamp_study(**{"V": 16, "positions": 1, **bad})


def test_the_default_study_is_on_the_topk_modules_pairs():
    """The module docstring: clamp_study measures "on the topk module's Zipf-like pairs", and
    the chapter's supports figure uses "seeds 0 to 15, the pairs of the clamp study"."""
    import inspect

    study = inspect.signature(clamps.clamp_study).parameters
    pair = inspect.signature(zipf_pair).parameters
    for name in ("V", "exponent", "seed"):
        assert study[name].default == pair[name].default, name
    assert study["seed"].default == 0


# ---------------------------------------------------------------------------------------------
# weighted_clamp_study's input checks
# ---------------------------------------------------------------------------------------------


def _bad_study_inputs():
    s, t = torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=F64)
    w = torch.ones(2, dtype=F64)
    inf_t = t.clone()
    inf_t[1, 2] = math.inf
    nan_s = s.clone()
    nan_s[0, 0] = math.nan
    return [
        ((s.long(), t, w), TypeError, "student_logits must have a floating dtype"),
        ((s, t.long(), w), TypeError, "teacher_logits must have a floating dtype"),
        ((s, t, w.long()), TypeError, "weights must have a floating dtype"),
        ((s[0], t[0], w), ValueError, r"student_logits must have 2 dimensions"),
        ((s, t[0], w), ValueError, r"teacher_logits must have 2 dimensions"),
        ((s, t, w[None]), ValueError, r"weights must have 1 dimensions"),
        ((s, torch.zeros(2, 4, dtype=F64), w), ValueError,
         r"teacher_logits must have the shape of student_logits \(2, 3\), got \(2, 4\)"),
        ((s, inf_t, w), ValueError, "student_logits and teacher_logits must be finite"),
        ((nan_s, t, w), ValueError, "student_logits and teacher_logits must be finite"),
        ((s, t, torch.ones(3, dtype=F64)), ValueError,
         r"weights must have shape \(N,\) = \(2,\), got \(3,\)"),
        ((s, t, torch.tensor([1.0, -1.0], dtype=F64)), ValueError,
         "weights must be finite, >= 0 and not all 0"),
        ((s, t, torch.tensor([math.inf, 1.0], dtype=F64)), ValueError,
         "weights must be finite, >= 0 and not all 0"),
        ((s, t, torch.tensor([math.nan, 1.0], dtype=F64)), ValueError,
         "weights must be finite, >= 0 and not all 0"),
        ((s, t, torch.zeros(2, dtype=F64)), ValueError,
         "weights must be finite, >= 0 and not all 0"),
    ]


@pytest.mark.parametrize("arguments, error, message", _bad_study_inputs())
def test_bad_study_input_is_a_named_error(arguments, error, message):
    with pytest.raises(error, match=message):
        clamps.weighted_clamp_study(*arguments, ks=[1])


@pytest.mark.parametrize("options, error, message", [
    (dict(ks=[]), ValueError, "ks must not be empty"),
    (dict(ks="1"), TypeError, "ks must be a sequence"),
    (dict(ks=[torch.tensor(True)]), ValueError, r"every k must be an integer in \[1, V\]"),
    (dict(ks=[4]), ValueError, r"every k must be an integer in \[1, V\] = \[1, 3\], got 4"),
    (dict(log_prob_min_clamp=1.0), ValueError, "log_prob_min_clamp"),
    (dict(log_prob_min_clamp="x"), TypeError, "log_prob_min_clamp must be a real number"),
    (dict(loss_max_clamp=-1.0), ValueError, "loss_max_clamp"),
    (dict(loss_max_clamp="x"), TypeError, "loss_max_clamp must be a real number"),
])
def test_bad_study_options_are_named_errors(options, error, message):
    s = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(error, match=message):
        clamps.weighted_clamp_study(s, s, torch.ones(2, dtype=F64), **{"ks": [1], **options})


def test_the_clamps_signs_are_the_documented_ranges():
    """c <= 0 and M >= 0 (verl_forward_kl_topk's parameters): the dataclass's -10 and 10 and
    the bounds 0 themselves are accepted."""
    student, teacher = _states()
    weights = torch.tensor(WEIGHTS, dtype=F64)
    for low, high in [(clamps.DATACLASS_LOG_PROB_MIN_CLAMP, clamps.DATACLASS_LOSS_MAX_CLAMP),
                      (0.0, 0.0)]:
        [row] = clamps.weighted_clamp_study(student, teacher, weights, [2],
                                            log_prob_min_clamp=low, loss_max_clamp=high)
        assert 0 <= row["clamped"] <= 1


# ---------------------------------------------------------------------------------------------
# The thresholds of "Rounding", from either side
# ---------------------------------------------------------------------------------------------


def test_a_value_at_the_cap_to_rounding_is_no_cap_and_one_beyond_it_is():
    """Capped where the value exceeds M by more than its rounding: at M = the value itself
    (computed apart in Python floats) no position is capped; at M a billionth below, it is."""
    student, teacher = _states()
    weights = torch.tensor([1.0] + [0.0] * 6, dtype=F64)
    raw = _position(student[0].tolist(), teacher[0].tolist(), 3, None, None)["raw"]
    assert raw > 0.1
    at = clamps.weighted_clamp_study(student, teacher, weights, [3], loss_max_clamp=raw)[0]
    below = clamps.weighted_clamp_study(student, teacher, weights, [3],
                                        loss_max_clamp=raw - 1e-9)[0]
    assert at["capped"] == 0.0 and below["capped"] == 1.0


@pytest.mark.parametrize("share, error", [(0.75, 0.0), (1.25, math.inf)])
def test_a_gradient_of_zero_estimated_within_its_rounding_has_no_error(share, error):
    """The student is the teacher (g = 0); (c) at k = 2 of V = 4 sends Q p - q 1_S, of norm
    T (1 - T) for a tail mass T (p = q = ((1 - T)/2, (1 - T)/2, T/2, T/2)). Its error is 0
    where that norm is within 12 eps (1 + sqrt V) + k eps (module docstring), else +inf."""
    V, k = 4, 2
    threshold = 12 * EPS64 * (1 + math.sqrt(V)) + k * EPS64
    # T (1 - T) = share * threshold; the teacher's logits (0, 0, -L, -L) have T = 1/(1 + e^L)
    T = share * threshold  # (1 - T) = 1 to 1e-14, far inside the margin of 25%
    L = math.log((1 - T) / T)
    teacher = torch.tensor([[0.0, 0.0, -L, -L]], dtype=F64)
    [row] = clamps.weighted_clamp_study(teacher.clone(), teacher, torch.ones(1, dtype=F64), [k])
    assert row["c_grad_error"] == error
    assert row["b_grad_error"] == 0.0 and row["clamped"] == 0.0


@pytest.mark.parametrize("share, clamped", [(0.5, 0.0), (2.0, 1.0)])
def test_a_clamp_counts_beyond_the_rounding_of_the_clamped_terms(share, clamped):
    """The threshold of a clamp is 3 eps sum_S q_bar (1 + |t_bar| + |s_bar| + sqrt V + k)
    (1 + |t_bar - s_bar|), of the terms after the log-probability clamp c: here c = -1 lifts
    seven reported log-probabilities of -3.3 (q = 0.037) to -1 (q_bar = 0.37), which raises
    the threshold fourfold. The student is slightly sharper than the teacher on token 0 only,
    so the value before its clamps is t_0 - s_0 (the other terms are e^c (c - c) = 0), built
    at `share` times the threshold, negative."""
    V, b, c = 8, -3.0, -1.0
    # the teacher: logits (0, b, ..., b); log q_0 = -log(1 + 7 e^b), log q_v = b + log q_0
    t0 = -math.log1p(7 * math.exp(b))
    t = [t0] + [b + t0] * 7
    assert all(x < c for x in t[1:]) and t0 > c
    t_bar = [max(x, c) for x in t]  # the student's s_bar equals it to ~1e-13 (below)
    threshold = 3 * EPS64 * math.fsum(
        math.exp(x) * (1 + 2 * abs(x) + math.sqrt(V) + V) for x in t_bar)
    # the student's logits (0, b', ..., b') with s_0 - t_0 = share * threshold
    target = share * threshold
    b_student = math.log(math.expm1(-t0 - target) / 7)
    student = torch.tensor([[0.0] + [b_student] * 7], dtype=F64)
    teacher = torch.tensor([[0.0] + [b] * 7], dtype=F64)
    raw = math.log1p(7 * math.exp(b_student)) - math.log1p(7 * math.exp(b))  # t_0 - s_0
    assert raw == pytest.approx(-target, rel=1e-2)  # 1e-16 of rounding in 1e-14
    [row] = clamps.weighted_clamp_study(student, teacher, torch.ones(1, dtype=F64), [V],
                                        log_prob_min_clamp=c)
    assert row["clamped"] == clamped


def _loop_noises(s, t, s_bar, t_bar, V, eps):
    """The three bounds of the module docstring's "Rounding", one position and term at a time."""
    k = len(s)
    value = 3 * eps * math.fsum(
        math.exp(tb) * (1 + abs(tb) + abs(sb) + math.sqrt(V) + k) * (1 + abs(tb - sb))
        for sb, tb in zip(s_bar, t_bar))
    mass = eps * math.fsum(
        math.exp(sv) * (abs(sv) + math.sqrt(V) + 2 + k) + math.exp(tv) * (abs(tv) + math.sqrt(V)
                                                                           + 2 + k)
        for sv, tv in zip(s, t))
    return value, mass, 6 * eps * (1 + math.sqrt(V))


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_the_rounding_bounds_are_the_docstrings_formulas(dtype):
    g = torch.Generator().manual_seed(12)
    V, k = 50, 5
    eps = torch.finfo(dtype).eps
    logits = 3 * torch.randn(4, V, generator=g, dtype=F64)
    log_p = torch.log_softmax(logits, -1)
    log_q = torch.log_softmax(3 * torch.randn(4, V, generator=g, dtype=F64), -1)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(4)])
    s, t = log_p.gather(-1, ids).to(dtype), log_q.gather(-1, ids).to(dtype)
    s_bar, t_bar = s.clamp_min(-4.0), t.clamp_min(-4.0)
    value = clamps._value_noise(s_bar, t_bar, V)
    mass = clamps._mass_noise(s, t, V)
    # the helpers sum k = 5 terms in the dtype: a relative rounding of ~k eps
    rel = 10 * k * eps
    for i in range(4):
        want = _loop_noises(s[i].tolist(), t[i].tolist(), s_bar[i].tolist(), t_bar[i].tolist(),
                            V, eps)
        assert value[i].item() == pytest.approx(want[0], rel=rel)
        assert mass[i].item() == pytest.approx(want[1], rel=rel)
        assert clamps._gradient_noise(V, dtype) == pytest.approx(want[2], rel=1e-15)
