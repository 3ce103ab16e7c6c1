"""opd_literate.large_vocab.clamps: the report's checks, their whole messages, and their edges.

A refused report names the argument and what was expected; with a mask, where the bad row is
("at a position that the mask selects"). The edges: the ids 0 and V - 1 and the log-probability
0 are valid, V and a positive one are not; k = 1 and k = V, V = 1.
"""

import math
import re

import pytest
import torch

from opd_literate.large_vocab import clamps

F64 = torch.float64
WHERE = " at a position that the mask selects"


def _report(**change):
    arguments = dict(student_logits=torch.zeros(3, dtype=F64),
                     teacher_topk_logp=torch.log(torch.tensor([0.5, 0.25], dtype=F64)),
                     teacher_topk_ids=torch.tensor([0, 1]))
    arguments.update(change)
    return arguments


CASES = [
    (dict(teacher_topk_ids=torch.tensor([0, 3])), "teacher_topk_ids must lie in [0, V) = [0, 3)",
     ""),
    (dict(teacher_topk_ids=torch.tensor([2, 2])),
     "teacher_topk_ids must not repeat an id within a position", " (a top-k report names k "
     "different tokens)"),
    (dict(student_logits=torch.tensor([0.0, math.inf, 0.0], dtype=F64)),
     "student_logits must be finite or -inf (no NaN, no +inf)", ""),
    (dict(student_logits=torch.full((3,), -math.inf, dtype=F64)),
     "student_logits must not be -inf at every token of a position", " (the softmax of such a "
     "row is NaN)"),
    (dict(teacher_topk_logp=torch.tensor([1e-3, -1.0], dtype=F64)),
     "teacher_topk_logp must hold log-probabilities (<= 0, not NaN)", ""),
    (dict(teacher_topk_logp=torch.full((2,), -math.inf, dtype=F64)),
     "teacher_topk_logp must not be -inf at every reported token of a position",
     " (a report that holds no probability, Q = 0)"),
]


@pytest.mark.parametrize("change, head, tail", CASES)
def test_a_refused_report_says_what_and_where(change, head, tail):
    """The whole message, with a mask and without: the mask adds where the row is."""
    bare = _report(**change)
    with pytest.raises(ValueError, match="^" + re.escape(head + tail) + "$"):
        clamps.verl_forward_kl_topk(**bare)
    with pytest.raises(ValueError, match="^" + re.escape(head + tail) + "$"):
        clamps.topk_diagnostics(**bare)
    # the same row second in a batch of two, masked in
    good = _report()
    batch = {name: torch.stack([good[name], value]) for name, value in bare.items()}
    for mask in (torch.tensor([1, 1]), torch.tensor([0, 1])):
        with pytest.raises(ValueError, match="^" + re.escape(head + WHERE + tail) + "$"):
            clamps.verl_forward_kl_topk(**batch, mask=mask)
    # masked out, it is not looked at
    assert clamps.verl_forward_kl_topk(**batch, mask=torch.tensor([1, 0]))[1].item() == 0.0


def test_the_edges_of_a_valid_report():
    # the ids 0 and V - 1; a log-probability of 0 (q = 1) at k = 1; k = V; V = 1
    z = torch.tensor([0.5, 0.0, -0.5], dtype=F64)
    p = torch.softmax(z, -1)
    both = clamps.verl_forward_kl_topk(z, torch.log(torch.tensor([0.5, 0.5], dtype=F64)),
                                       torch.tensor([0, 2])).item()
    want = 0.5 * math.log(0.5 / p[0].item()) + 0.5 * math.log(0.5 / p[2].item())
    assert both == pytest.approx(want, rel=1e-14)
    one = clamps.verl_forward_kl_topk(z, torch.zeros(1, dtype=F64), torch.tensor([1])).item()
    assert one == pytest.approx(-math.log(p[1].item()), rel=1e-14)  # 1 * (0 - log p_1)
    full = clamps.verl_forward_kl_topk(z, torch.log(p), torch.tensor([0, 1, 2])).item()
    assert full == pytest.approx(0.0, abs=1e-15)  # KL(p || p)
    single = clamps.verl_forward_kl_topk(torch.tensor([4.0], dtype=F64),
                                         torch.zeros(1, dtype=F64), torch.tensor([0]))
    assert single.item() == 0.0
    d = clamps.topk_diagnostics(torch.tensor([4.0], dtype=F64), torch.zeros(1, dtype=F64),
                                torch.tensor([0]))
    assert d["overlap_count"].item() == 1 and d["student_mass"].item() == 1.0


def test_the_shape_checks_name_both_shapes():
    z = torch.zeros(2, 4, dtype=F64)
    report, ids = torch.log(torch.full((2, 2), 0.25, dtype=F64)), torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=re.escape(
            "teacher_topk_logp must have shape (..., k) with the leading shape of student_logits "
            "(2,), got (3, 2)")):
        clamps.verl_forward_kl_topk(z, torch.cat([report, report[:1]]), ids)
    with pytest.raises(ValueError, match=re.escape(
            "teacher_topk_ids must have the shape of teacher_topk_logp (2, 2), got (2, 3)")):
        clamps.verl_forward_kl_topk(z, report, torch.tensor([[0, 1, 2], [1, 2, 3]]))
    with pytest.raises(ValueError, match=re.escape(
            "the report must hold 1 <= k <= V = 4 tokens, got k = 5")):
        clamps.verl_forward_kl_topk(z[:1, :4], torch.full((1, 5), -2.0, dtype=F64),
                                    torch.arange(5)[None])
    with pytest.raises(ValueError, match=re.escape(
            "student_logits must have a last (vocabulary) dimension of size >= 1, got shape ()")):
        clamps.verl_forward_kl_topk(torch.tensor(0.0, dtype=F64), report[0], ids[0])
    with pytest.raises(TypeError, match=re.escape(
            "teacher_topk_ids must be an integer torch.Tensor, got list")):
        clamps.verl_forward_kl_topk(z, report, [[0, 1], [2, 3]])
    with pytest.raises(TypeError, match=re.escape(
            "teacher_topk_ids must be an integer torch.Tensor, got torch.bool")):
        clamps.verl_forward_kl_topk(z, report, torch.ones(2, 2, dtype=torch.bool))


def test_a_batch_of_three_dimensions_is_checked_row_by_row():
    """(2, 2, V): one bad row among four, with and without a mask."""
    z = torch.zeros(2, 2, 3, dtype=F64)
    report = torch.log(torch.tensor([0.5, 0.25], dtype=F64)).expand(2, 2, 2).clone()
    ids = torch.tensor([0, 1]).expand(2, 2, 2).clone()
    value = clamps.verl_forward_kl_topk(z, report, ids)
    assert value.shape == (2, 2)
    assert torch.allclose(value, torch.full((2, 2), 0.5 * math.log(1.5) + 0.25 * math.log(0.75),
                                            dtype=F64), rtol=1e-14, atol=0)
    z[1, 0] = -math.inf
    with pytest.raises(ValueError, match=r"-inf at every token of a position \(the softmax "
                                         r"of such a row is NaN\)$"):
        clamps.verl_forward_kl_topk(z, report, ids)
    mask = torch.tensor([[1, 1], [0, 1]])
    out = clamps.verl_forward_kl_topk(z, report, ids, mask)
    assert out[1, 0].item() == 0.0 and out[1, 1].item() == value[1, 1].item()
