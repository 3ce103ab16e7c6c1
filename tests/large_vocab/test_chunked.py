"""The chunked losses of ``large_vocab.chunked`` against the dense reference in ``opd.py``.

The reference is independent: the dense losses build the full ``(N, V)`` logits
``hidden @ weight.T + bias`` and let autograd differentiate ``opd.py``'s formulas, while the
chunked losses never build them and use hand-derived gradients.
"""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opd_literate import opd
from opd_literate.large_vocab.chunked import (
    chunked_divergence,
    chunked_forward_kl,
    chunked_generalized_jsd,
    chunked_reverse_kl,
)

# (divergence, beta, normalize) and the dense reference of each
CASES = {
    "reverse_kl": ("reverse_kl", 0.5, False, lambda s, t, m: opd.full_vocab_reverse_kl(s, t, m)),
    "forward_kl": ("forward_kl", 0.5, False, lambda s, t, m: opd.forward_kl(s, t, m)),
    "jsd_0.3": ("jsd", 0.3, False, lambda s, t, m: opd.generalized_jsd(s, t, m, beta=0.3)),
    "jsd_0.7_norm": ("jsd", 0.7, True,
                     lambda s, t, m: opd.generalized_jsd(s, t, m, beta=0.7, normalize=True)),
    "jsd_1": ("jsd", 1.0, False, lambda s, t, m: opd.generalized_jsd(s, t, m, beta=1.0)),
    "jsd_0": ("jsd", 0.0, False, lambda s, t, m: opd.generalized_jsd(s, t, m, beta=0.0)),
}
MASKS = {
    "ones": [1] * 10,
    "partial": [1, 0, 1, 1, 0, 0, 1, 0, 1, 1],
    "zeros": [0] * 10,
}


def make_inputs(N=10, H=4, V=13, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    bias = torch.randn(V, generator=g, dtype=dtype)
    teacher = 2 * torch.randn(N, V, generator=g, dtype=dtype)
    return hidden, weight, bias, teacher


def value_and_grads(fn, hidden, weight, bias):
    """fn(h, W, b) and its gradients with respect to h, W, b (fresh leaves)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (hidden, weight, bias)]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [x.grad for x in leaves]


def dense(case, hidden, weight, bias, teacher, mask):
    reference = CASES[case][3]
    return value_and_grads(
        lambda h, W, b: reference((h @ W.T + b)[None], teacher[None], mask[None]),
        hidden, weight, bias)


def chunked(case, hidden, weight, bias, teacher, mask, chunk_size, **teacher_kw):
    divergence, beta, normalize, _ = CASES[case]
    if not teacher_kw:
        teacher_kw = {"teacher_logits": teacher}
    return value_and_grads(
        lambda h, W, b: chunked_divergence(h, W, mask, student_bias=b, divergence=divergence,
                                           beta=beta, normalize=normalize,
                                           chunk_size=chunk_size, **teacher_kw),
        hidden, weight, bias)


def assert_same(a, b, rtol, atol):
    (va, ga), (vb, gb) = a, b
    torch.testing.assert_close(va, vb, rtol=rtol, atol=atol)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mask_name", MASKS)
def test_float64_matches_the_dense_loss(case, mask_name):
    hidden, weight, bias, teacher = make_inputs()
    mask = torch.tensor(MASKS[mask_name], dtype=torch.float64)
    expected = dense(case, hidden, weight, bias, teacher, mask)
    # chunk sizes that divide N = 10, that do not, of one row, and larger than N
    for chunk_size in (1, 3, 4, 5, 10, 64):
        got = chunked(case, hidden, weight, bias, teacher, mask, chunk_size)
        assert_same(got, expected, rtol=1e-10, atol=1e-12)
    if mask_name == "zeros":  # an all-zero mask: loss 0 with zero gradients, as in opd.py
        assert got[0].item() == 0.0 and all((g == 0).all() for g in got[1])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_size", [3, 7])
def test_float32_matches_the_dense_loss(case, chunk_size):
    hidden, weight, bias, teacher = make_inputs(dtype=torch.float32, seed=1)
    mask = torch.tensor(MASKS["partial"], dtype=torch.float32)
    expected = dense(case, hidden, weight, bias, teacher, mask)
    got = chunked(case, hidden, weight, bias, teacher, mask, chunk_size)
    assert got[0].dtype == torch.float32
    assert_same(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["reverse_kl", "forward_kl", "jsd_0.3"])
def test_teacher_hidden_states_and_head_give_the_teacher_logits(case):
    hidden, weight, bias, _ = make_inputs(seed=2)
    g = torch.Generator().manual_seed(3)
    t_hidden = torch.randn(10, 6, generator=g, dtype=torch.float64)
    t_weight = torch.randn(13, 6, generator=g, dtype=torch.float64)
    t_bias = torch.randn(13, generator=g, dtype=torch.float64)
    mask = torch.tensor(MASKS["partial"])
    expected = dense(case, hidden, weight, bias, t_hidden @ t_weight.T + t_bias, mask)
    got = chunked(case, hidden, weight, bias, None, mask, 4, teacher_hidden=t_hidden,
                  teacher_weight=t_weight, teacher_bias=t_bias)
    assert_same(got, expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(N=st.integers(1, 9), V=st.integers(1, 8), chunk_size=st.integers(1, 12),
       scale=st.sampled_from([0.1, 1.0, 20.0]), seed=st.integers(0, 2**31 - 1),
       case=st.sampled_from(["reverse_kl", "forward_kl", "jsd_0.3"]))
def test_random_shapes_masks_and_chunks_match_the_dense_loss(N, V, chunk_size, scale, seed, case):
    g = torch.Generator().manual_seed(seed)
    hidden = scale * torch.randn(N, 3, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    teacher = scale * torch.randn(N, V, generator=g, dtype=torch.float64)
    mask = torch.rand(N, generator=g) < 0.6
    expected = dense(case, hidden, weight, bias, teacher, mask)
    got = chunked(case, hidden, weight, bias, teacher, mask, chunk_size)
    assert_same(got, expected, rtol=1e-9, atol=1e-12)


def test_masked_rows_are_never_read_and_get_exactly_zero_gradient():
    hidden, weight, bias, teacher = make_inputs()
    mask = torch.tensor(MASKS["partial"], dtype=torch.bool)
    hidden[~mask] = math.nan
    teacher[~mask] = -math.inf
    for case in CASES:
        value, (g_hidden, g_weight, g_bias) = chunked(case, hidden, weight, bias, teacher,
                                                      mask, 3)
        assert torch.isfinite(value)
        assert (g_hidden[~mask] == 0).all() and torch.isfinite(g_hidden[mask]).all()
        assert torch.isfinite(g_weight).all() and torch.isfinite(g_bias).all()


def test_minus_infinity_logits_follow_opd_conventions():
    hidden, weight, bias, teacher = make_inputs(N=4)
    mask = torch.ones(4)
    # Entry 0 impossible for the student (bias -inf): 0 log 0 = 0, a finite reverse KL.
    student_bias = bias.clone()
    student_bias[0] = -math.inf
    # Position 1: the teacher excludes entry 5, which the student can emit.
    teacher = teacher.clone()
    teacher[1, 5] = -math.inf
    logits = hidden @ weight.T + student_bias
    per_position = opd.reverse_kl_per_position(logits[None], teacher[None])[0]
    assert torch.isinf(per_position[1]) and torch.isfinite(per_position[[0, 2, 3]]).all()
    value, (g_hidden, g_weight, g_bias) = value_and_grads(
        lambda h, W, b: chunked_reverse_kl(h, W, mask, teacher_logits=teacher, student_bias=b,
                                           chunk_size=3),
        hidden, weight, student_bias)
    assert value.item() == math.inf
    # The +inf position sends no gradient (as in opd.py); the others send the dense one.
    finite = torch.tensor([1.0, 0.0, 1.0, 1.0])
    expected = value_and_grads(
        lambda h, W, b: opd.full_vocab_reverse_kl((h @ W.T + b)[None], teacher[None],
                                                  finite[None]) * 3 / 4,
        hidden, weight, student_bias)
    assert (g_hidden[1] == 0).all()
    for got, want in zip((g_hidden, g_weight, g_bias), expected[1]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # The impossible entry's bias gets exactly 0: d/dz_0 = p_0 (...) with p_0 = 0.
    assert g_bias[0] == 0
    # Forward KL: the teacher's excluded entry costs nothing; the student's excluded entry 0
    # (which the teacher can say) makes every position +inf.
    assert chunked_forward_kl(hidden, weight, mask, teacher_logits=teacher,
                              student_bias=student_bias).item() == math.inf


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32(half):
    hidden, weight, bias, teacher = (x.to(half) for x in make_inputs(seed=4))
    mask = torch.tensor(MASKS["partial"])
    got = chunked("reverse_kl", hidden, weight, bias, teacher, mask, 3)
    expected = chunked("reverse_kl", *(x.float() for x in (hidden, weight, bias, teacher)),
                       mask, 3)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-7)
    for g_half, g_float in zip(got[1], expected[1]):
        assert g_half.dtype == half
        assert torch.equal(g_half, g_float.to(half))  # the float32 gradient, rounded once


def test_the_teacher_gets_no_gradient_and_backward_scales_the_stored_gradients():
    hidden, weight, bias, teacher = make_inputs()
    h = hidden.clone().requires_grad_(True)
    t = teacher.clone().requires_grad_(True)
    t_hidden = hidden.clone().requires_grad_(True)
    t_weight = weight.clone().requires_grad_(True)
    mask = torch.ones(10)
    (3.0 * chunked_reverse_kl(h, weight, mask, teacher_logits=t)).backward()
    assert t.grad is None
    once = value_and_grads(
        lambda x, W, b: chunked_reverse_kl(x, W, mask, teacher_logits=teacher), hidden, weight,
        bias)[1][0]
    torch.testing.assert_close(h.grad, 3.0 * once, rtol=1e-12, atol=0)
    chunked_reverse_kl(hidden, weight, mask, teacher_hidden=t_hidden,
                       teacher_weight=t_weight).backward()
    assert t_hidden.grad is None and t_weight.grad is None


@pytest.mark.parametrize("divergence,beta", [("reverse_kl", 0.5), ("forward_kl", 0.5),
                                             ("jsd", 0.4)])
def test_gradcheck(divergence, beta):
    hidden, weight, bias, teacher = make_inputs(N=3, H=2, V=4, seed=5)
    mask = torch.tensor([1.0, 0.0, 1.0])
    inputs = tuple(x.requires_grad_(True) for x in (hidden, weight, bias))
    assert torch.autograd.gradcheck(
        lambda h, W, b: chunked_divergence(h, W, mask, teacher_logits=teacher, student_bias=b,
                                           divergence=divergence, beta=beta, chunk_size=2),
        inputs, fast_mode=True)


def test_no_grad_gives_the_same_value():
    hidden, weight, bias, teacher = make_inputs()
    mask = torch.tensor(MASKS["partial"])
    h = hidden.clone().requires_grad_(True)
    with torch.no_grad():
        value = chunked_reverse_kl(h, weight, mask, teacher_logits=teacher)
    assert not value.requires_grad
    assert value.item() == chunked_reverse_kl(h, weight, mask, teacher_logits=teacher).item()


def test_jsd_wrapper_passes_beta_and_normalize():
    hidden, weight, bias, teacher = make_inputs()
    mask = torch.ones(10)
    got = chunked_generalized_jsd(hidden, weight, mask, beta=0.2, normalize=True,
                                  teacher_logits=teacher, student_bias=bias)
    want = opd.generalized_jsd((hidden @ weight.T + bias)[None], teacher[None], mask[None],
                               beta=0.2, normalize=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


BAD = [
    (dict(student_hidden=torch.zeros(10)), "student_hidden must have 2 dimensions"),
    (dict(student_hidden=torch.zeros(10, 4, dtype=torch.long)),
     "student_hidden must have a floating"),
    (dict(student_weight=torch.zeros(13, 5)),
     "student_weight must have shape \\(V, H\\) with H = 4"),
    (dict(student_bias=torch.zeros(12)), "student_bias must have shape \\(13,\\)"),
    (dict(teacher_logits=torch.zeros(10, 12)), "teacher_logits must have shape \\(N, V\\)"),
    (dict(teacher_logits=None), "either as teacher_logits"),
    (dict(teacher_hidden=torch.zeros(10, 2), teacher_weight=torch.zeros(13, 2)),
     "not both and not neither"),
    (dict(teacher_logits=None, teacher_hidden=torch.zeros(10, 2)), "must be given together"),
    (dict(teacher_logits=None, teacher_hidden=torch.zeros(9, 2),
          teacher_weight=torch.zeros(13, 2)),
     "teacher_hidden must have N = 10 rows"),
    (dict(teacher_logits=None, teacher_hidden=torch.zeros(10, 2),
          teacher_weight=torch.zeros(13, 3)),
     "teacher_weight must have shape \\(V, H_T\\)"),
    (dict(mask=torch.ones(9)), "mask must have the shape of student_hidden"),
    (dict(mask=torch.full((10,), 0.5)), "mask values must be 0 or 1"),
    (dict(chunk_size=0), "chunk_size must be a positive int, got 0"),
    (dict(chunk_size=2.0), "chunk_size must be a positive int"),
    (dict(divergence="kl"), "divergence must be one of"),
    (dict(divergence="jsd", beta=1.5), "beta must be <= 1.0"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_input_raises_a_clear_error(change, message):
    hidden, weight, bias, teacher = make_inputs()
    kwargs = dict(student_hidden=hidden, student_weight=weight, mask=torch.ones(10),
                  teacher_logits=teacher, student_bias=bias)
    kwargs.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        chunked_divergence(**kwargs)


def test_the_chapter_quotes_the_committed_benchmark_output():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    output = (root / "benchmarks" / "results" / "large_vocab.txt").read_text().strip()
    page = (root / "docs" / "large_vocab.md").read_text()
    assert f"```text\n{output}\n```" in page  # verbatim
    last = output.splitlines()[-1]
    memory, time = re.fullmatch(r"chunked/dense: memory ([0-9.]+), time ([0-9.]+)", last).groups()
    # the prose quotes the same ratios
    assert f"memory ratio {memory}" in page and f"time ratio {time}" in page
    trl = re.search(r"^trl/dense: memory ([0-9.]+), time ([0-9.]+)$", output, re.M)
    assert trl, "the committed output has no TRL variant"
    assert f"a memory ratio {trl[1]}" in page and f"(ratio {trl[2]})" in page
    joined = " ".join(page.split())  # the prose, its line breaks as spaces
    added = {m[1]: float(m[2]) for m in re.finditer(r"^(dense|chunked|trl)\s+\S+\s+([0-9.]+)",
                                                    output, re.M)}
    assert f"chunked loss adds {added['chunked'] / 1024:.2f} GiB" in joined
    assert f"TRL's chunked loss adds {added['trl'] / 1024:.1f} GiB" in page
    cpu = {m[1]: (m[2], m[3]) for m in re.finditer(r"(dense|chunked|trl) ([0-9.]+), ([0-9.]+)",
                                                   output.split("(user, system): ")[1]
                                                   .splitlines()[0])}
    (dense_user, dense_system), (chunked_user, chunked_system) = cpu["dense"], cpu["chunked"]
    assert float(dense_system) > float(dense_user)  # "more of its time in the kernel"
    assert (f"{dense_system} s of system CPU time against {dense_user} s of user time in its "
            f"timed pass, where the chunked loss spends {chunked_system} s and {chunked_user} s"
            ) in joined


def test_the_module_docstring_quotes_the_benchmark_figure():
    import pathlib
    import re

    from opd_literate.large_vocab import chunked

    root = pathlib.Path(__file__).resolve().parents[2]
    output = (root / "benchmarks" / "results" / "large_vocab.txt").read_text()
    dense_mib = float(re.search(r"^dense\s+\S+\s+([0-9.]+)", output, re.M).group(1))
    doc = " ".join(chunked.__doc__.split())
    assert f"adds {dense_mib:,.0f} MiB" in doc
    per_token = dense_mib / 2048
    assert f"{per_token:.1f} MiB" in doc
    vectors = per_token * 2**20 / (151_936 * 4)  # float32 vocabulary vectors a token
    assert f"about {vectors:.1f} float32 vocabulary vectors" in doc


def test_normalized_jsd_near_the_endpoints_keeps_float32_precision():
    # At beta = 1e-6 the JSD is O(beta) and normalize divides by beta: summed as
    # a (log a - log m) in float32 it lost about 0.4% (4.372 against 4.389).
    from opd_literate.large_vocab.chunked import chunked_generalized_jsd
    from opd_literate.opd import generalized_jsd

    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(4, 8, generator=g), torch.randn(50, 8, generator=g)
    teacher = 2 * torch.randn(4, 50, generator=g)
    for beta in (1e-6, 1 - 1e-6):
        chunked = chunked_generalized_jsd(h, W, torch.ones(4), teacher_logits=teacher, beta=beta,
                                          normalize=True, chunk_size=3)
        dense64 = generalized_jsd((h @ W.T).double()[None], teacher.double()[None],
                                  torch.ones(1, 4), beta=beta, normalize=True)
        assert chunked.item() == pytest.approx(dense64.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Claims read again (issue 22)
# ---------------------------------------------------------------------------------------------
PEAK_SCRIPT = r"""
import sys
import torch
from opd_literate.large_vocab.chunked import chunked_divergence

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

divergence, beta, c, V = sys.argv[1], float(sys.argv[2]), 64, 65536
g = torch.Generator().manual_seed(0)
h, W = torch.randn(4 * c, 8, generator=g), torch.randn(V, 8, generator=g)
t = torch.randn(4 * c, V, generator=g)
kw = dict(teacher_logits=t, divergence=divergence, beta=beta, chunk_size=c)
chunked_divergence(h[:c], W, torch.ones(c), **{**kw, "teacher_logits": t[:c]})  # warm up
with open("/proc/self/clear_refs", "w") as clear_refs:
    clear_refs.write("5")  # peak RSS := current RSS
base = kib("VmRSS")
chunked_divergence(h, W, torch.ones(4 * c), **kw)
print((kib("VmHWM") - base) * 1024 / (c * V * 4))
"""


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"),
                    reason="needs Linux's clear_refs to reset the peak RSS")
def test_the_documented_peak_memory_in_chunk_buffers():
    import os
    import pathlib
    import re
    import subprocess
    import sys

    from opd_literate.large_vocab import chunked

    doc = " ".join(chunked.chunked_divergence.__doc__.split())
    claimed = re.search(r"is ([0-9.]+) ``\(chunk_size, V\)`` buffers of the compute dtype for "
                        r"the reverse KL, ([0-9.]+) for the forward KL and ([0-9.]+) for the JSD",
                        doc)
    assert claimed, "the docstring no longer states the measured buffers"
    page = " ".join((pathlib.Path(__file__).resolve().parents[2] / "docs" / "large_vocab.md")
                    .read_text().split())
    reverse, forward, jsd = claimed.groups()
    assert (f"its peak is {reverse} $(c, V)$ buffers for a chunk of $c$ rows for the reverse KL, "
            f"{forward} for the forward KL and {jsd} for the JSD") in page
    # Every large block its own mmap, unmapped when freed (glibc would otherwise keep freed
    # blocks resident and reuse them unseen), one thread: the RSS then follows the live tensors.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    for (divergence, beta), want in zip([("reverse_kl", 1.0), ("forward_kl", 0.0),
                                          ("jsd", 0.3)], claimed.groups()):
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, divergence, str(beta)],
                             capture_output=True, text=True, env=env, check=True).stdout
        # pages of a buffer are counted when touched: +-0.3 buffers of bookkeeping
        assert float(out) == pytest.approx(float(want), abs=0.3), (divergence, out)


def test_beta_and_normalize_are_checked_whatever_the_divergence():
    hidden, weight, _, teacher = make_inputs()
    for divergence in ("reverse_kl", "forward_kl"):
        with pytest.raises(ValueError, match="beta must be <= 1.0"):
            chunked_divergence(hidden, weight, torch.ones(10), teacher_logits=teacher,
                               divergence=divergence, beta=1.5)
        with pytest.raises(TypeError, match="normalize must be a bool"):
            chunked_divergence(hidden, weight, torch.ones(10), teacher_logits=teacher,
                               divergence=divergence, normalize=1)
        # ... and do not change the value
        values = {chunked_divergence(hidden, weight, torch.ones(10), teacher_logits=teacher,
                                     divergence=divergence, beta=beta, normalize=normalize).item()
                  for beta in (0.0, 0.5, 1.0) for normalize in (False, True)}
        assert len(values) == 1


def poke(x, row, value):
    """A copy of ``x`` with row (or entry) ``row`` set to ``value``."""
    x = x.clone()
    x[row] = value
    return x


NAN_INPUTS = [
    ("student_hidden", lambda h, W, b, t: (poke(h, 2, math.nan), W, b, t)),
    ("student_hidden", lambda h, W, b, t: (poke(h, 9, -math.inf), W, b, t)),
    ("student_weight", lambda h, W, b, t: (h, poke(W, 0, math.nan), b, t)),
    ("student_weight", lambda h, W, b, t: (h, poke(W, 0, -math.inf), b, t)),
    ("student_bias", lambda h, W, b, t: (h, W, poke(b, 1, math.nan), t)),
    ("student_bias", lambda h, W, b, t: (h, W, poke(b, 1, math.inf), t)),
    ("student_bias", lambda h, W, b, t: (h, W, torch.full_like(b, -math.inf), t)),
    ("teacher_logits", lambda h, W, b, t: (h, W, b, poke(t, 3, math.nan))),
    ("teacher_logits", lambda h, W, b, t: (h, W, b, poke(t, 3, -math.inf))),
    ("teacher_logits", lambda h, W, b, t: (h, W, b, poke(t, (3, 0), math.inf))),
    ("student's logits", lambda h, W, b, t: (h * 1e200, W * 1e200, b, t)),
]


@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "jsd"])
@pytest.mark.parametrize("name,poison", NAN_INPUTS)
def test_nan_where_it_is_read_is_a_named_error_and_not_a_loss(divergence, name, poison):
    # NaN student rows gave a NaN loss, and a NaN teacher row in the JSD a loss of 0
    hidden, weight, bias, teacher = poison(*make_inputs())
    with pytest.raises(ValueError, match=name):
        chunked_divergence(hidden, weight, torch.ones(10), teacher_logits=teacher,
                           student_bias=bias, divergence=divergence, chunk_size=3)


def test_nan_in_masked_out_rows_is_never_read():
    hidden, weight, bias, teacher = make_inputs()
    mask = torch.tensor(MASKS["partial"], dtype=torch.bool)
    want = chunked_divergence(hidden, weight, mask, teacher_logits=teacher, student_bias=bias)
    hidden[~mask], teacher[~mask] = math.nan, math.inf
    got = chunked_divergence(hidden, weight, mask, teacher_logits=teacher, student_bias=bias)
    assert torch.equal(got, want)


def test_the_teacher_from_hidden_states_is_checked_too():
    hidden, weight, _, _ = make_inputs()
    t_hidden, t_weight = torch.randn(10, 2, dtype=torch.float64), torch.randn(13, 2,
                                                                               dtype=torch.float64)
    for name, args in [("teacher_hidden", (t_hidden.clone().index_fill_(0, torch.tensor([4]),
                                                                         math.nan), t_weight)),
                       ("teacher_weight", (t_hidden, t_weight.clone().fill_(math.inf))),
                       ("teacher's logits", (t_hidden * 1e200, t_weight * 1e200))]:
        with pytest.raises(ValueError, match=name):
            chunked_divergence(hidden, weight, torch.ones(10), teacher_hidden=args[0],
                               teacher_weight=args[1], chunk_size=4)
    with pytest.raises(ValueError, match="teacher_bias is -inf everywhere"):
        chunked_divergence(hidden, weight, torch.ones(10), teacher_hidden=t_hidden,
                           teacher_weight=t_weight, teacher_bias=torch.full((13,), -math.inf,
                                                                            dtype=torch.float64))


# Found by mutation testing
def test_the_wrappers_pass_every_argument_on_and_share_the_documented_defaults():
    import inspect

    hidden, weight, bias, teacher = make_inputs()
    g = torch.Generator().manual_seed(7)
    t_hidden = torch.randn(10, 3, generator=g, dtype=torch.float64)
    t_weight = torch.randn(13, 3, generator=g, dtype=torch.float64)
    t_bias = torch.randn(13, generator=g, dtype=torch.float64)
    t_bias[4] = -math.inf
    mask = torch.tensor(MASKS["partial"])
    wrappers = {"reverse_kl": chunked_reverse_kl, "forward_kl": chunked_forward_kl,
                "jsd": lambda *a, **k: chunked_generalized_jsd(*a, beta=0.3, normalize=True,
                                                               **k)}
    for divergence, wrapper in wrappers.items():
        extra = dict(beta=0.3, normalize=True) if divergence == "jsd" else {}
        for teacher_kw in (dict(teacher_logits=teacher),
                           dict(teacher_hidden=t_hidden, teacher_weight=t_weight,
                                teacher_bias=t_bias)):
            for chunk_size in (3, 256):
                want = value_and_grads(
                    lambda h, W, b: chunked_divergence(h, W, mask, student_bias=b,
                                                       divergence=divergence,
                                                       chunk_size=chunk_size, **extra,
                                                       **teacher_kw), hidden, weight, bias)
                got = value_and_grads(
                    lambda h, W, b: wrapper(h, W, mask, student_bias=b, chunk_size=chunk_size,
                                            **teacher_kw), hidden, weight, bias)
                assert torch.equal(got[0], want[0])
                assert all(torch.equal(x, y) for x, y in zip(got[1], want[1]))
    # the documented defaults: chunk_size 256, beta 1/2, no normalisation
    for function in (chunked_divergence, chunked_reverse_kl, chunked_forward_kl,
                     chunked_generalized_jsd):
        assert inspect.signature(function).parameters["chunk_size"].default == 256
    jsd = inspect.signature(chunked_generalized_jsd).parameters
    assert jsd["beta"].default == 0.5 and jsd["normalize"].default is False
    divergence = inspect.signature(chunked_divergence).parameters
    assert divergence["divergence"].default == "reverse_kl" and divergence["beta"].default == 0.5
    assert divergence["normalize"].default is False


def test_backward_scales_by_every_upstream_gradient_but_one():
    # the stored gradient is returned as it is only for an upstream gradient of exactly 1
    hidden, weight, bias, teacher = make_inputs()
    once = value_and_grads(lambda h, W, b: chunked_reverse_kl(h, W, torch.ones(10),
                                                             teacher_logits=teacher,
                                                             student_bias=b), hidden, weight,
                           bias)[1]
    for scale in (2.0, 1.0, 0.0, -1.0):
        scaled = value_and_grads(lambda h, W, b: scale * chunked_reverse_kl(
            h, W, torch.ones(10), teacher_logits=teacher, student_bias=b), hidden, weight,
            bias)[1]
        for x, y in zip(scaled, once):
            torch.testing.assert_close(x, scale * y, rtol=1e-15, atol=0)


@pytest.mark.parametrize("divergence,student,teacher", [
    # float32 logits a few ulps apart, found by search: their KL rounds to -1.3e-7 and -3.0e-8
    ("reverse_kl", [0.06271910667419434, -0.7663062810897827, 1.0992504358291626],
     [0.06271883100271225, -0.7663062810897827, 1.0992505550384521]),
    ("forward_kl", [0.1994086503982544, 2.0393941402435303, -0.21475854516029358],
     [0.1994086354970932, 2.0393941402435303, -0.21475854516029358]),
])
def test_a_kl_that_rounds_below_zero_is_zero_with_no_gradient(divergence, student, teacher):
    # as opd.py's clamp_min: the row is clamped to 0 and sends no gradient
    h = torch.tensor([student], requires_grad=True)
    W = torch.eye(3, requires_grad=True)
    loss = chunked_divergence(h, W, torch.ones(1), teacher_logits=torch.tensor([teacher]),
                              divergence=divergence)
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad.abs().max().item() == 0.0 and W.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("beta,case", [(0.0, "forward_kl"), (1.0, "reverse_kl")])
def test_normalize_leaves_the_jsd_endpoints_unscaled(beta, case):
    # beta (1 - beta) = 0 there: the JSD is the plain KL, as in opd.generalized_jsd
    hidden, weight, bias, teacher = make_inputs()
    mask = torch.tensor(MASKS["partial"])
    want = chunked(case, hidden, weight, bias, teacher, mask, 4)
    for normalize in (False, True):
        got = value_and_grads(
            lambda h, W, b: chunked_generalized_jsd(h, W, mask, beta=beta, normalize=normalize,
                                                    teacher_logits=teacher, student_bias=b,
                                                    chunk_size=4), hidden, weight, bias)
        assert_same(got, want, rtol=1e-12, atol=1e-14)


def test_a_float32_teacher_head_with_a_float64_student_is_computed_in_float64():
    hidden, weight, bias, _ = make_inputs(seed=4)
    g = torch.Generator().manual_seed(5)
    t_hidden, t_weight = torch.randn(10, 3, generator=g), torch.randn(13, 3, generator=g)
    t_bias = torch.randn(13, generator=g)
    mask = torch.tensor(MASKS["partial"])
    t_logits = t_hidden.double() @ t_weight.double().T + t_bias.double()
    want = chunked("reverse_kl", hidden, weight, bias, t_logits, mask, 4)
    got = chunked("reverse_kl", hidden, weight, bias, None, mask, 4, teacher_hidden=t_hidden,
                  teacher_weight=t_weight, teacher_bias=t_bias)
    assert got[0].dtype == torch.float64
    assert_same(got, want, rtol=1e-12, atol=1e-14)


OVERFLOW_MESSAGE = (" (masked in) holds {what}: the logits must be finite, or -inf for tokens "
                    "that cannot be emitted, with at least one finite (a product of finite "
                    "hidden states and head that is not finite overflowed the compute dtype)")


@pytest.mark.parametrize("head,bias,what", [
    ([[1e200], [1.0]], None, "+inf"),                         # +inf only
    ([[-1e200], [1.0]], None, "-inf where the bias is finite"),  # -inf only
    ([[-1e200], [1.0]], [0.0, 0.0], "-inf where the bias is finite"),
    ([[-1e200], [1.0], [1.0]], [0.0, -math.inf, 0.0], "-inf where the bias is finite"),
    ([[-1e200], [-1e200]], None, "-inf everywhere"),
    ([[1e200], [-1e200]], [0.0, 0.0], "+inf"),
])
def test_overflowing_logits_name_what_overflowed(head, bias, what):
    h = torch.tensor([[0.5], [1e200]], dtype=torch.float64)
    W = torch.tensor(head, dtype=torch.float64)
    b = None if bias is None else torch.tensor(bias, dtype=torch.float64)
    t = torch.zeros(2, W.shape[0], dtype=torch.float64)
    student = ("the student's logits student_hidden @ student_weight.T at row 1"
               + OVERFLOW_MESSAGE.format(what=what))
    with pytest.raises(ValueError, match="^" + re.escape(student) + "$"):
        chunked_divergence(h, W, torch.ones(2), teacher_logits=t, student_bias=b)
    # the teacher's head, likewise
    teacher = ("the teacher's logits teacher_hidden @ teacher_weight.T at row 1"
               + OVERFLOW_MESSAGE.format(what=what))
    with pytest.raises(ValueError, match="^" + re.escape(teacher) + "$"):
        chunked_divergence(torch.zeros(2, 1, dtype=torch.float64), torch.zeros_like(W),
                           torch.ones(2), teacher_hidden=h, teacher_weight=W, teacher_bias=b)


@pytest.mark.parametrize("value,what", [(math.nan, "NaN"), (math.inf, "+inf"),
                                        (-math.inf, "-inf everywhere")])
def test_bad_teacher_logits_name_what_they_hold(value, what):
    hidden, weight, _, teacher = make_inputs()
    teacher[6] = value
    message = ("teacher_logits at row 6 (masked in) holds " + what + ": the logits must be "
               "finite, or -inf for tokens that cannot be emitted, with at least one finite "
               "(a product of finite hidden states and head that is not finite overflowed the "
               "compute dtype)")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        chunked_divergence(hidden, weight, torch.ones(10), teacher_logits=teacher, chunk_size=4)


@pytest.mark.parametrize("change,message", [
    (dict(student_weight="nan"), "student_weight holds NaN; it must be finite"),
    (dict(student_weight="inf"), "student_weight holds an infinite entry; it must be finite"),
    (dict(student_weight="-inf"), "student_weight holds an infinite entry; it must be finite"),
    (dict(student_hidden="nan"), "student_hidden (rows 3 to 5) holds NaN; it must be finite"),
    (dict(student_hidden="inf"),
     "student_hidden (rows 3 to 5) holds an infinite entry; it must be finite"),
    (dict(teacher_hidden="nan"), "teacher_hidden (rows 3 to 5) holds NaN; it must be finite"),
    (dict(teacher_weight="-inf"), "teacher_weight holds an infinite entry; it must be finite"),
    (dict(student_bias="nan"), "student_bias holds NaN"),
    (dict(student_bias="inf"), "student_bias holds +inf: an entry must be finite, or -inf for a "
                               "token that cannot be emitted"),
    (dict(student_bias="all -inf"), "student_bias is -inf everywhere: no token could be "
                                    "emitted"),
    (dict(teacher_bias="inf"), "teacher_bias holds +inf: an entry must be finite, or -inf for a "
                               "token that cannot be emitted"),
    (dict(student_bias="long"), "student_bias must have a floating dtype, got torch.int64"),
    (dict(student_bias="2-D"), "student_bias must have 1 dimensions, got shape (1, 13) "
                               "(2 dimensions)"),
    (dict(student_weight="long"), "student_weight must have a floating dtype, got torch.int64"),
    (dict(student_weight="1-D"), "student_weight must have 2 dimensions, got shape (13,) "
                                 "(1 dimensions)"),
])
def test_every_refusal_says_what_and_where(change, message):
    hidden, weight, bias, _ = make_inputs()
    g = torch.Generator().manual_seed(8)
    tensors = dict(student_hidden=hidden, student_weight=weight, student_bias=bias,
                   teacher_hidden=torch.randn(10, 2, generator=g, dtype=torch.float64),
                   teacher_weight=torch.randn(13, 2, generator=g, dtype=torch.float64),
                   teacher_bias=torch.zeros(13, dtype=torch.float64))
    (name, how), = change.items()
    x = tensors[name].clone()
    if how in ("nan", "inf", "-inf"):
        value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[how]
        if name.endswith("hidden"):
            x[4, 0] = value  # row 4: the chunk of rows 3 to 5 (chunk_size 3)
        else:
            x.view(-1)[5] = value
    elif how == "all -inf":
        x = torch.full_like(x, -math.inf)
    elif how == "long":
        x = x.long()
    elif how == "2-D":
        x = x[None]
    elif how == "1-D":
        x = x[:, 0]
    tensors[name] = x
    with pytest.raises((ValueError, TypeError), match="^" + re.escape(message) + "$"):
        chunked_divergence(tensors.pop("student_hidden"), tensors.pop("student_weight"),
                           torch.ones(10), chunk_size=3, **tensors)


def test_a_bias_of_another_dtype_gets_a_gradient_of_its_own_dtype():
    hidden, weight, bias, teacher = make_inputs()
    b = bias.float().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    chunked_reverse_kl(h, weight, torch.ones(10), teacher_logits=teacher, student_bias=b
                       ).backward()
    assert b.grad.dtype == torch.float32 and h.grad.dtype == torch.float64
    want = chunked("reverse_kl", hidden, weight, b.detach().double(), teacher, torch.ones(10), 4)
    torch.testing.assert_close(b.grad, want[1][2].float(), rtol=1e-6, atol=1e-7)


def _teacher_head(N=10, V=13, H_T=2):
    g = torch.Generator().manual_seed(9)
    return (torch.randn(N, H_T, generator=g, dtype=torch.float64),
            torch.randn(V, H_T, generator=g, dtype=torch.float64))


# Each argument's refusal in full: its name, the shape or value it got and what it must be
# (N = 10 positions, H = 4, V = 13, the teacher's head H_T = 2; make_inputs and _teacher_head).
ARGUMENT_REFUSALS = [
    (dict(student_hidden=torch.zeros(10)),
     "student_hidden must have 2 dimensions, got shape (10,) (1 dimensions)"),
    (dict(student_hidden=torch.zeros(10, 4, 1)),
     "student_hidden must have 2 dimensions, got shape (10, 4, 1) (3 dimensions)"),
    (dict(student_hidden=torch.zeros(10, 4, dtype=torch.long)),
     "student_hidden must have a floating dtype, got torch.int64"),
    (dict(student_weight=torch.zeros(13, 4, 1)),
     "student_weight must have 2 dimensions, got shape (13, 4, 1) (3 dimensions)"),
    (dict(student_weight=torch.zeros(13, 5)),
     "student_weight must have shape (V, H) with H = 4 (student_hidden's last dimension), "
     "got (13, 5)"),
    (dict(student_weight=torch.zeros(0, 4), student_bias=None),
     "student_weight must have at least one row (V >= 1), got shape (0, 4)"),
    (dict(student_weight=torch.zeros(13, 4).index_fill_(0, torch.tensor([2]), math.nan)),
     "student_weight holds NaN; it must be finite"),
    (dict(student_bias=torch.zeros(12)), "student_bias must have shape (13,), got (12,)"),
    (dict(student_bias=torch.zeros(13).index_fill_(0, torch.tensor([2]), math.nan)),
     "student_bias holds NaN"),
    (dict(teacher_logits=None),
     "give the teacher either as teacher_logits (N, V) or as teacher_hidden (N, H_T) with "
     "teacher_weight (V, H_T), not both and not neither"),
    (dict(teacher_hidden="head", teacher_weight="head"),
     "give the teacher either as teacher_logits (N, V) or as teacher_hidden (N, H_T) with "
     "teacher_weight (V, H_T), not both and not neither"),
    (dict(teacher_hidden="head"),
     "give the teacher either as teacher_logits (N, V) or as teacher_hidden (N, H_T) with "
     "teacher_weight (V, H_T), not both and not neither"),
    (dict(teacher_weight="head"),
     "give the teacher either as teacher_logits (N, V) or as teacher_hidden (N, H_T) with "
     "teacher_weight (V, H_T), not both and not neither"),
    (dict(teacher_logits=torch.zeros(13)),
     "teacher_logits must have 2 dimensions, got shape (13,) (1 dimensions)"),
    (dict(teacher_logits=torch.zeros(10, 13, 1)),
     "teacher_logits must have 2 dimensions, got shape (10, 13, 1) (3 dimensions)"),
    (dict(teacher_logits=torch.zeros(10, 13, dtype=torch.long)),
     "teacher_logits must have a floating dtype, got torch.int64"),
    (dict(teacher_logits=torch.zeros(10, 12)),
     "teacher_logits must have shape (N, V) = (10, 13), got (10, 12)"),
    (dict(teacher_logits=torch.zeros(9, 13)),
     "teacher_logits must have shape (N, V) = (10, 13), got (9, 13)"),
    (dict(teacher_bias=torch.zeros(13)),
     "teacher_bias is only used with teacher_hidden and teacher_weight"),
    (dict(teacher_logits=None, teacher_hidden="head"),
     "teacher_hidden and teacher_weight must be given together"),
    (dict(teacher_logits=None, teacher_weight="head"),
     "teacher_hidden and teacher_weight must be given together"),
    (dict(teacher_logits=None, teacher_hidden=torch.zeros(10), teacher_weight="head"),
     "teacher_hidden must have 2 dimensions, got shape (10,) (1 dimensions)"),
    (dict(teacher_logits=None, teacher_hidden=torch.zeros(10, 2, 1), teacher_weight="head"),
     "teacher_hidden must have 2 dimensions, got shape (10, 2, 1) (3 dimensions)"),
    (dict(teacher_logits=None, teacher_hidden=torch.zeros(10, 2, dtype=torch.long),
          teacher_weight="head"),
     "teacher_hidden must have a floating dtype, got torch.int64"),
    (dict(teacher_logits=None, teacher_hidden="head", teacher_weight=torch.zeros(13)),
     "teacher_weight must have 2 dimensions, got shape (13,) (1 dimensions)"),
    (dict(teacher_logits=None, teacher_hidden="head", teacher_weight=torch.zeros(13, 2, 1)),
     "teacher_weight must have 2 dimensions, got shape (13, 2, 1) (3 dimensions)"),
    (dict(teacher_logits=None, teacher_hidden="head",
          teacher_weight=torch.zeros(13, 2, dtype=torch.long)),
     "teacher_weight must have a floating dtype, got torch.int64"),
    (dict(teacher_logits=None, teacher_hidden=torch.zeros(9, 2), teacher_weight="head"),
     "teacher_hidden must have N = 10 rows (one per student position), got shape (9, 2)"),
    (dict(teacher_logits=None, teacher_hidden="head", teacher_weight=torch.zeros(13, 3)),
     "teacher_weight must have shape (V, H_T) = (13, 2), got (13, 3)"),
    (dict(teacher_logits=None, teacher_hidden="head", teacher_weight=torch.zeros(12, 2)),
     "teacher_weight must have shape (V, H_T) = (13, 2), got (12, 2)"),
    (dict(teacher_logits=None, teacher_hidden="head",
          teacher_weight=torch.zeros(13, 2).index_fill_(0, torch.tensor([1]), math.nan)),
     "teacher_weight holds NaN; it must be finite"),
    (dict(teacher_logits=None, teacher_hidden="head", teacher_weight="head",
          teacher_bias=torch.zeros(12)),
     "teacher_bias must have shape (13,), got (12,)"),
    (dict(teacher_logits=None, teacher_hidden="head", teacher_weight="head",
          teacher_bias=torch.zeros(13).index_fill_(0, torch.tensor([3]), math.nan)),
     "teacher_bias holds NaN"),
    (dict(chunk_size=0), "chunk_size must be a positive int, got 0"),
    (dict(chunk_size=-3), "chunk_size must be a positive int, got -3"),
    (dict(chunk_size=True), "chunk_size must be a positive int, got True"),
    (dict(chunk_size=2.0), "chunk_size must be a positive int, got 2.0"),
    (dict(chunk_size="4"), "chunk_size must be a positive int, got '4'"),
    (dict(mask=torch.ones(9)), "mask must have the shape of student_hidden[:, 0] (10,), got (9,)"),
    (dict(mask=torch.ones(10, 1)),
     "mask must have the shape of student_hidden[:, 0] (10,), got (10, 1)"),
    (dict(mask=[1] * 10), "mask must be a torch.Tensor, got list"),
    (dict(mask=torch.full((10,), 0.5)), "mask values must be 0 or 1, found 0.5"),
    (dict(divergence="kl"),
     "divergence must be one of ('reverse_kl', 'forward_kl', 'jsd'), got 'kl'"),
    (dict(divergence="JSD"),
     "divergence must be one of ('reverse_kl', 'forward_kl', 'jsd'), got 'JSD'"),
    (dict(divergence="jsd", beta=1.5), "beta must be <= 1.0, got 1.5"),
    (dict(divergence="jsd", beta=-0.5), "beta must be >= 0.0, got -0.5"),
    (dict(beta=-0.5), "beta must be >= 0.0, got -0.5"),
    (dict(beta=math.nan), "beta must be a finite number, got nan"),
    (dict(beta=True), "beta must be a real number, got bool True"),
    (dict(normalize=1), "normalize must be a bool, got int 1"),
    (dict(divergence="jsd", normalize="yes"), "normalize must be a bool, got str 'yes'"),
]


@pytest.mark.parametrize("change,message", ARGUMENT_REFUSALS)
def test_every_argument_refusal_names_the_argument_what_it_got_and_what_it_must_be(change,
                                                                                   message):
    hidden, weight, bias, teacher = make_inputs()
    t_hidden, t_weight = _teacher_head()
    kwargs = dict(student_hidden=hidden, student_weight=weight, mask=torch.ones(10),
                  teacher_logits=teacher, student_bias=bias)
    kwargs.update(change)
    # "head": the well-formed teacher head of the same N and V
    kwargs.update({name: {"teacher_hidden": t_hidden, "teacher_weight": t_weight}[name]
                   for name, value in change.items() if isinstance(value, str) and value == "head"})
    with pytest.raises((ValueError, TypeError), match="^" + re.escape(message) + "$"):
        chunked_divergence(**kwargs)


def test_the_documented_defaults_are_the_ones_used():
    # divergence "reverse_kl", and for the JSD beta = 1/2 without normalisation: the dense
    # references with those arguments written out
    hidden, weight, bias, teacher = make_inputs()
    mask = torch.tensor(MASKS["partial"])
    logits = (hidden @ weight.T + bias)[None]
    got = chunked_divergence(hidden, weight, mask, teacher_logits=teacher, student_bias=bias)
    want = opd.full_vocab_reverse_kl(logits, teacher[None], mask[None])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for function in (lambda **kw: chunked_divergence(divergence="jsd", **kw),
                     chunked_generalized_jsd):
        got = function(student_hidden=hidden, student_weight=weight, mask=mask,
                       teacher_logits=teacher, student_bias=bias)
        want = opd.generalized_jsd(logits, teacher[None], mask[None], beta=0.5, normalize=False)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_default_chunk_is_256_rows():
    # a refusal names the rows of the chunk that holds the NaN: rows 256 to 299 of 300
    hidden = torch.zeros(300, 2, dtype=torch.float64)
    hidden[280, 1] = math.nan
    weight, teacher = torch.zeros(3, 2, dtype=torch.float64), torch.zeros(300, 3)
    message = "student_hidden (rows 256 to 299) holds NaN; it must be finite"
    for function in (chunked_divergence, chunked_reverse_kl, chunked_forward_kl,
                     chunked_generalized_jsd):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            function(hidden, weight, torch.ones(300), teacher_logits=teacher)
