"""opd_literate.large_vocab.clamps.topk_diagnostics: verl's logged quantities, by hand.

Every per-position output and every batch metric is recomputed in Python floats from its
definition (the function's docstring) on a batch built to hold an overlap of 2, of 1 and of 0
and a masked-out position of garbage; then the log-probability clamp, masks and shapes.
"""

import math

import pytest
import torch

from opd_literate.large_vocab import clamps

F64 = torch.float64
K = 2


def _batch():
    """Four positions over V = 6, k = 2: the student's top-2 is {0, 1} at the first three; the
    teacher reports {0, 1} (overlap 2), {2, 3} (overlap 0), {4, 1} (overlap 1); the fourth,
    masked out, holds NaN."""
    student = torch.tensor([[3.0, 2.0, 0.0, -1.0, -2.0, -3.0],
                            [3.0, 2.5, 0.0, -1.0, -4.0, -3.0],
                            [2.0, 3.0, -1.0, 0.0, -3.0, -5.0],
                            [math.nan] * 6], dtype=F64)
    report = torch.log(torch.tensor([[0.5, 0.3], [0.6, 0.2], [0.7, 0.05], [0.5, 0.5]],
                                    dtype=F64))
    ids = torch.tensor([[0, 1], [2, 3], [4, 1], [0, 1]])
    return student, report, ids, torch.tensor([1, 1, 1, 0])


def _by_hand(student, report, ids, mask, low):
    rows = []
    for z, t_row, id_row, m in zip(student.tolist(), report.tolist(), ids.tolist(),
                                   mask.tolist()):
        if not m:
            rows.append(None)
            continue
        top = max(z)
        log_total = top + math.log(math.fsum(math.exp(x - top) for x in z))
        log_p = [x - log_total for x in z]
        mine = set(sorted(range(len(z)), key=lambda v: -z[v])[:K])

        def bar(x):
            return x if low is None else max(x, low)

        shared = [(t, v) for t, v in zip(t_row, id_row) if v in mine]
        terms = [-math.exp(bar(t)) * (bar(t) - bar(log_p[v])) for t, v in shared]
        rows.append(dict(student_mass=math.fsum(math.exp(log_p[v]) for v in id_row),
                         teacher_mass=math.fsum(math.exp(t) for t in t_row),
                         overlap_count=len(shared),
                         advantage=math.fsum(terms) / len(terms) if terms else 0.0))
    return rows


@pytest.mark.parametrize("low", [None, -1.5])
def test_every_output_and_metric_is_its_definition(low):
    student, report, ids, mask = _batch()
    d = clamps.topk_diagnostics(student, report, ids, mask, log_prob_min_clamp=low)
    want = _by_hand(student, report, ids, mask, low)
    assert [r["overlap_count"] for r in want[:3]] == [2, 0, 1]  # the batch is what it says
    # sums of two float64 terms of size <= 1, against fsum: a few ulps
    tol = dict(rel=1e-13, abs=1e-15)
    for i, r in enumerate(want):
        got = {name: d[name][i].item() for name in ("student_mass", "teacher_mass",
                                                    "overlap_count", "overlap_token_advantage")}
        if r is None:
            assert all(v == 0 for v in got.values())
            continue
        assert got["overlap_count"] == r["overlap_count"]
        assert got["student_mass"] == pytest.approx(r["student_mass"], **tol)
        assert got["teacher_mass"] == pytest.approx(r["teacher_mass"], **tol)
        assert got["overlap_token_advantage"] == pytest.approx(r["advantage"], **tol)
    kept = [r for r in want if r is not None]
    metrics = d["metrics"]
    assert set(metrics) == {"student_mass", "student_mass_min", "student_mass_max",
                            "teacher_mass", "teacher_mass_min", "teacher_mass_max",
                            "overlap_ratio", "overlap_token_advantage"}
    for name in ("student_mass", "teacher_mass"):
        values = [r[name] for r in kept]
        assert metrics[name] == pytest.approx(math.fsum(values) / len(values), **tol)
        assert metrics[name + "_min"] == pytest.approx(min(values), **tol)
        assert metrics[name + "_max"] == pytest.approx(max(values), **tol)
    assert metrics["overlap_ratio"] == pytest.approx(3 / 3 / K, **tol)
    # the mean over the positions that have an overlap (not the one with none, nor the
    # masked-out one)
    with_overlap = [r["advantage"] for r in kept if r["overlap_count"] > 0]
    assert len(with_overlap) == 2
    assert metrics["overlap_token_advantage"] == pytest.approx(
        math.fsum(with_overlap) / len(with_overlap), **tol)


def test_the_log_probability_clamp_changes_the_advantage():
    student, report, ids, mask = _batch()
    plain = clamps.topk_diagnostics(student, report, ids, mask)
    clamped = clamps.topk_diagnostics(student, report, ids, mask, log_prob_min_clamp=-1.5)
    assert plain["metrics"]["overlap_token_advantage"] != pytest.approx(
        clamped["metrics"]["overlap_token_advantage"], rel=1e-3)
    with pytest.raises(ValueError, match="log_prob_min_clamp"):
        clamps.topk_diagnostics(student, report, ids, mask, log_prob_min_clamp=0.5)
    with pytest.raises(TypeError, match="log_prob_min_clamp must be a real number"):
        clamps.topk_diagnostics(student, report, ids, mask, log_prob_min_clamp="-1")


def test_without_any_overlap_the_advantage_metric_is_zero():
    student, report, ids, mask = _batch()
    # only the position whose report misses the student's top-2 counts
    d = clamps.topk_diagnostics(student, report, ids, torch.tensor([0, 1, 0, 0]))
    assert d["overlap_count"].tolist() == [0, 0, 0, 0]
    assert d["metrics"]["overlap_token_advantage"] == 0.0
    assert d["metrics"]["overlap_ratio"] == 0.0


def test_a_masked_out_position_of_garbage_sends_no_gradient():
    student, report, ids, mask = _batch()
    for garbage in (math.nan, -math.inf):
        student[3] = garbage
        z = student.clone().requires_grad_(True)
        d = clamps.topk_diagnostics(z, report, ids, mask)
        (d["overlap_token_advantage"].sum() + d["student_mass"].sum()).backward()
        assert bool(torch.isfinite(z.grad).all())
        assert torch.equal(z.grad[3], torch.zeros(6, dtype=F64))
        assert bool((z.grad[:3] != 0).any())
    # a masked-out position whose spread overflows float32 is never computed either
    rows = torch.stack([torch.tensor([3e38, -3e38, 0.0]), torch.zeros(3)])
    d = clamps.topk_diagnostics(rows, torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.25]])),
                                torch.tensor([[0, 1], [0, 1]]), torch.tensor([0, 1]))
    assert d["student_mass"][0].item() == 0.0


def test_without_a_mask_every_position_of_a_batch_of_any_shape_counts():
    g = torch.Generator().manual_seed(8)
    student = torch.randn(2, 3, 7, generator=g, dtype=F64)
    report, ids = torch.log_softmax(torch.randn(2, 3, 7, generator=g, dtype=F64), -1).topk(3, -1)
    free = clamps.topk_diagnostics(student, report, ids)
    full = clamps.topk_diagnostics(student, report, ids, torch.ones(2, 3))
    for name in ("student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"):
        assert free[name].shape == (2, 3) and torch.equal(free[name], full[name]), name
    assert free["metrics"] == full["metrics"]
    one = clamps.topk_diagnostics(student[0, 0], report[0, 0], ids[0, 0])
    assert one["metrics"]["student_mass"] == free["student_mass"][0, 0].item()
