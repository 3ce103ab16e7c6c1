"""opd_literate.teachers.cross_tokenizer: the toy, the exact string-level KL and its gradient,
and the approximations' gradients, against enumeration, torch autograd and finite differences.

TRL's own loss is run on the same toys in tests/integration/test_trl_gold.py.
"""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opd_literate.teachers import cross_tokenizer as xt

KINDS = sorted(xt.KINDS)
METHODS = [("uld", {}), ("uld", {"merge": "bayesian"}), ("uld", {"extended": False}),
           ("hybrid", {}), ("hybrid", {"beta": 1.0}), ("hybrid", {"beta": 0.0}),
           ("hybrid", {"merge": "bayesian", "beta": 1.0}),
           ("hybrid", {"matched_weight": 0.3, "unmatched_weight": 2.0}),
           ("projection", {}), ("projection", {"reverse": False})]


# ---------------------------------------------------------------------------------------------
# The toy
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_every_model_is_a_distribution_over_strings(kind):
    toy = xt.make_cross_toy(kind)
    assert toy["p"].sum() == pytest.approx(1.0, abs=1e-12)
    assert toy["p_student"].sum() == pytest.approx(1.0, abs=1e-12)
    # The teacher's marginal from its tokenizations equals the sum over every sequence it can
    # write, and the two sum to 1 over all its strings.
    teacher = toy["teacher"]
    by_string = {}
    for n in range(teacher["T"] + 1):
        for ids in itertools.product(range(teacher["eos"]), repeat=n):
            x = "".join(teacher["vocab"][i] for i in ids)
            by_string[x] = by_string.get(x, 0.0) + np.exp(xt.sequence_logprob(teacher, ids))
    assert sum(by_string.values()) == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(toy["p_teacher"], [by_string[x] for x in toy["X"]], atol=1e-14)
    assert (toy["p_teacher_canonical"] <= toy["p_teacher"] + 1e-15).all()


def test_merges_put_mass_on_non_canonical_tokenizations():
    # teacher_merges: "ab" is written "ab" (canonical) or "a, b"; the canonical probability
    # misses the second, so it sums to less than 1 and its KL is larger.
    toy = xt.make_cross_toy("teacher_merges")
    i = toy["X"].index("ab")
    assert toy["p_teacher_canonical"][i] < toy["p_teacher"][i]
    assert xt.string_kl(toy, teacher="canonical") > xt.string_kl(toy)
    identical = xt.make_cross_toy("identical")
    np.testing.assert_array_equal(identical["p_teacher_canonical"], identical["p_teacher"])


def test_the_non_refining_pair_splits_aba_differently():
    s_vocab, t_vocab = xt.KINDS["non_refining"]
    s_ids, t_ids = xt.canonical_tokenize("aba", s_vocab), xt.canonical_tokenize("aba", t_vocab)
    assert [s_vocab[i] for i in s_ids] == ["ab", "a"]
    assert [t_vocab[i] for i in t_ids] == ["a", "ba"]
    groups = xt.align_groups(xt.token_offsets(s_ids, s_vocab), xt.token_offsets(t_ids, t_vocab))
    assert groups == ([[0, 1]], [[0, 1]])


# ---------------------------------------------------------------------------------------------
# The exact gradient
# ---------------------------------------------------------------------------------------------
def _torch_string_kl(theta_s, toy):
    """The string-level KL in torch float64, from the student's logits (autograd reference)."""
    student, eos = toy["student"], toy["student"]["eos"]
    log_pi = torch.log_softmax(theta_s, dim=-1)
    terms = []
    for ids in toy["sequences"]:
        rows = [0] + [1 + u for u in ids]
        tokens = list(ids) + [eos]
        steps = len(ids) if len(ids) == student["T"] else len(ids) + 1  # the forced end: 1
        terms.append(torch.exp(sum(log_pi[rows[k], tokens[k]] for k in range(steps))))
    p = torch.stack(terms)
    p_x = torch.zeros(len(toy["X"]), dtype=torch.float64).index_add(
        0, torch.as_tensor(toy["string_index"]), p)
    p_t = torch.as_tensor(toy["p_teacher"])
    return torch.sum(p_x * (torch.log(p_x) - torch.log(p_t)))


@pytest.mark.parametrize("kind", KINDS)
def test_the_exact_gradient_is_torch_autograd(kind):
    toy = xt.make_cross_toy(kind, T=3, seed=3)
    theta = torch.tensor(toy["student"]["theta"], requires_grad=True)
    kl = _torch_string_kl(theta, toy)
    kl.backward()
    assert kl.item() == pytest.approx(xt.string_kl(toy), abs=1e-12)
    np.testing.assert_allclose(xt.string_kl_grad(toy), theta.grad.numpy(), atol=1e-12)


def _rebuild(toy, theta):
    student = xt.model_from_logits(toy["student"]["vocab"], theta, toy["student"]["T"])
    return xt.cross_toy_from_models(student, toy["teacher"])


def _numeric_grad(f, theta, h=1e-6):
    grad = np.zeros_like(theta)
    for idx in np.ndindex(theta.shape):
        up, down = theta.copy(), theta.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (f(up) - f(down)) / (2 * h)
    return grad


def test_the_exact_gradient_is_the_finite_difference_of_the_kl():
    toy = xt.make_cross_toy("non_refining", T=2, seed=1)
    numeric = _numeric_grad(lambda th: xt.string_kl(_rebuild(toy, th)), toy["student"]["theta"])
    np.testing.assert_allclose(xt.string_kl_grad(toy), numeric, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# The approximations' gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method, options", METHODS)
def test_pathwise_and_total_gradients_are_finite_differences(kind, method, options):
    toy = xt.make_cross_toy(kind, T=2, seed=2)
    losses = xt._losses(toy, method, options)
    e = xt.expected_gradient(toy, losses)
    p_fixed = toy["p"].copy()

    def pathwise(theta):  # the samples' weights held fixed, as a trainer does
        return float(p_fixed @ xt._losses(_rebuild(toy, theta), method, options)["loss"])

    def expected(theta):
        other = _rebuild(toy, theta)
        return float(other["p"] @ xt._losses(other, method, options)["loss"])

    theta = toy["student"]["theta"]
    np.testing.assert_allclose(e["pathwise"], _numeric_grad(pathwise, theta), atol=1e-7)
    np.testing.assert_allclose(e["total"], _numeric_grad(expected, theta), atol=1e-7)


# ---------------------------------------------------------------------------------------------
# When each approximation is exact, and when not
# ---------------------------------------------------------------------------------------------
def test_projection_with_identical_tokenizers_is_the_string_kl_in_value_and_total_gradient():
    toy = xt.make_cross_toy("identical", T=3, seed=4)
    e = xt.expected_gradient(toy, xt.projection_losses(toy, eps=0.0))
    assert e["value"] == pytest.approx(xt.string_kl(toy), abs=1e-12)
    np.testing.assert_allclose(e["total"], xt.string_kl_grad(toy), atol=1e-12)
    # It is then the per-token full-vocabulary reverse KL, whose pathwise gradient misses the
    # later positions' KL: the score of each prefix times the KL still to come.
    token = xt.expected_gradient(toy, xt.token_kl_losses(toy))
    np.testing.assert_allclose(e["pathwise"], token["pathwise"], atol=1e-12)
    missing = xt.string_kl_grad(toy) - token["pathwise"]
    kl_to_come = np.zeros_like(missing)
    eos = toy["student"]["eos"]
    for m, ids in enumerate(toy["sequences"]):
        cond, t_cond = toy["cond"][m], toy["teacher_cond"][m]
        with np.errstate(divide="ignore", invalid="ignore"):
            kls = np.where(cond > 0, cond * (np.log(cond) - np.log(t_cond)), 0).sum(axis=1)
        rows = [0] + [1 + u for u in ids]
        tokens = list(ids) + [eos]
        for k in range(len(tokens)):
            score = np.eye(eos + 1)[tokens[k]] - cond[k]
            kl_to_come[rows[k]] += toy["p"][m] * score * kls[k + 1:].sum()
    np.testing.assert_allclose(missing, kl_to_come, atol=1e-12)
    assert np.linalg.norm(missing) > 0.1 * np.linalg.norm(xt.string_kl_grad(toy))


def test_nemo_epsilon_moves_the_identical_case_by_less_than_1e_8():
    toy = xt.make_cross_toy("identical", T=3, seed=4)
    with_eps = xt.expected_gradient(toy, xt.projection_losses(toy))
    assert with_eps["value"] == pytest.approx(xt.string_kl(toy), abs=1e-8)
    np.testing.assert_allclose(with_eps["total"], xt.string_kl_grad(toy), atol=1e-8)


@pytest.mark.parametrize("kind", ["teacher_merges", "student_merges", "non_refining"])
def test_projection_is_biased_once_the_tokenizers_differ(kind):
    r = xt.bias(xt.make_cross_toy(kind), "projection", eps=0.0)
    assert abs(r["value"] - r["exact_value"]) > 0.05
    assert r["total_rel_norm"] > 0.1


@pytest.mark.parametrize("merge", ["observed", "bayesian"])
def test_uld_is_blind_to_a_permuted_student(merge):
    # Identical tokenizers and caps; each row of the student's logits is the teacher's same
    # row with the tokens a and b swapped. Both read the same row at every position, so every
    # sorted vector agrees: ULD is 0 on every sequence, the KL is not.
    teacher = xt.make_model(("a", "b"), T=3, seed=7)
    theta = teacher["theta"][:, [1, 0, 2]]
    student = xt.model_from_logits(("a", "b"), theta, T=3)
    toy = xt.cross_toy_from_models(student, teacher)
    assert np.abs(xt.uld_losses(toy, merge=merge)["loss"]).max() == pytest.approx(0, abs=1e-15)
    assert xt.string_kl(toy) > 0.1


def test_gold_hybrid_with_one_vocabulary_is_a_length_normalised_token_kl_missing_a_position():
    # Identical vocabularies: every token matched, weight 1, beta = 1 is the reverse KL per
    # position, divided by the number of positions; "bayesian" reads pi_0 .. pi_{n-1} (not the
    # end's distribution), "observed" pi_1 .. pi_n (not the first token's).
    toy = xt.make_cross_toy("identical", T=3, seed=5)
    for merge, rows in (("bayesian", slice(0, -1)), ("observed", slice(1, None))):
        got = xt.uld_losses(toy, merge=merge, hybrid=True, beta=1.0)["loss"]
        for m, ids in enumerate(toy["sequences"]):
            if not ids:
                assert got[m] == 0.0
                continue
            s = np.maximum(toy["cond"][m][rows], 1e-8)
            t = np.maximum(toy["teacher_cond"][m][rows], 1e-8)
            assert got[m] == pytest.approx((s * np.log(s / t)).sum() / len(ids), abs=1e-12)


def test_bias_table_rows_and_the_exact_case():
    rows = xt.bias_table(T=2)
    assert len(rows) == len(xt.KINDS) * len(xt.TABLE_METHODS)
    exact = [r for r in rows if r["kind"] == "identical" and r["method"].startswith("projection")]
    assert exact[0]["total_rel_norm"] == pytest.approx(0, abs=1e-12)
    assert all(-1 - 1e-12 <= r["cosine"] <= 1 + 1e-12 for r in rows)


# ---------------------------------------------------------------------------------------------
# TRL's tensors, checked without TRL
# ---------------------------------------------------------------------------------------------
def test_trl_batch_layout():
    toy = xt.make_cross_toy("teacher_merges", T=2)
    batch = xt.trl_batch(toy)
    m = toy["strings"].index("ab")
    eos_t = toy["teacher"]["eos"]
    assert batch["teacher_input_ids"][m, :3].tolist() == [eos_t, 2, eos_t]  # "ab" one token
    assert batch["teacher_labels"][m, :3].tolist() == [-100, 2, eos_t]
    assert batch["teacher_byte_offsets"][m, 1:3].tolist() == [[0, 2], [2, 2]]
    np.testing.assert_allclose(np.exp(batch["student_logits"][m, :3]), toy["cond"][m])


def test_logit_grads_is_the_theta_gradient_per_row():
    toy = xt.make_cross_toy("student_merges", T=2, seed=1)
    losses = xt.uld_losses(toy)
    dz = xt.logit_grads(toy, losses) * len(toy["sequences"])
    e = xt.expected_gradient(toy, dict(loss=losses["loss"], grad=losses["grad"]))
    back = np.zeros_like(e["pathwise"])
    for m, ids in enumerate(toy["sequences"]):
        np.add.at(back, [0] + [1 + u for u in ids], toy["p"][m] * dz[m, :len(ids) + 1])
    np.testing.assert_allclose(back, e["pathwise"], atol=1e-14)


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------
_logits = st.lists(st.floats(-3, 3), min_size=16, max_size=16).map(np.array)


@pytest.mark.properties
@given(kind=st.sampled_from(KINDS), s=_logits, t=_logits, T=st.integers(1, 3))
def test_properties_on_random_logits(kind, s, t, T):
    s_vocab, t_vocab = xt.KINDS[kind]
    Ks, Kt = len(s_vocab) + 1, len(t_vocab) + 1
    student = xt.model_from_logits(s_vocab, s[:Ks * Ks].reshape(Ks, Ks), T)
    t_cap = 2 * T + 1  # above any canonical teacher tokenization of a student string
    teacher = xt.model_from_logits(t_vocab, t[:Kt * Kt].reshape(Kt, Kt), t_cap)
    toy = xt.cross_toy_from_models(student, teacher)
    assert toy["p"].sum() == pytest.approx(1.0, abs=1e-12)
    assert xt.string_kl(toy) >= -1e-12
    exact = xt.string_kl_grad(toy)
    np.testing.assert_allclose(exact.sum(axis=1), 0, atol=1e-12)  # a softmax row's invariance
    for method, options in METHODS:
        e = xt.expected_gradient(toy, xt._losses(toy, method, options))
        assert np.isfinite(e["value"]) and np.isfinite(e["total"]).all()
        np.testing.assert_allclose(e["pathwise"].sum(axis=1), 0, atol=1e-10)
    if kind == "identical":
        e = xt.expected_gradient(toy, xt.projection_losses(toy, eps=0.0))
        assert e["value"] == pytest.approx(xt.string_kl(toy), abs=1e-10)
        np.testing.assert_allclose(e["total"], exact, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
_TOY = xt.make_cross_toy("teacher_merges", T=2)

@pytest.mark.parametrize("call, error, match", [
    (lambda: xt.make_cross_toy("bpe"), ValueError, "kind must be one of"),
    (lambda: xt.canonical_tokenize("abc", ("a", "b")), ValueError, "text must be a string"),
    (lambda: xt.make_model(("a",), T=2), ValueError, "every character"),
    (lambda: xt.make_model(["a", "b"], T=2), TypeError, "tuple of token strings"),
    (lambda: xt.make_model(("a", "b", "a"), T=2), ValueError, "repeated token"),
    (lambda: xt.model_from_logits(("a", "b"), np.zeros((2, 3)), T=2), ValueError, r"\(3, 3\)"),
    (lambda: xt.model_from_logits(("a", "b"), np.full((3, 3), np.nan), T=2), ValueError,
     "finite"),
    (lambda: xt.make_model(("a", "b"), T=0), ValueError, "T must be an integer >= 1"),
    (lambda: xt.uld_losses(xt.make_cross_toy("identical", T=1), merge="max"), ValueError,
     "merge must be"),
    (lambda: xt.uld_losses(xt.make_cross_toy("identical", T=1), beta=1.5), ValueError,
     "beta must be <= 1"),
    (lambda: xt.uld_losses(xt.make_cross_toy("identical", T=1), matched_weight=0.5),
     ValueError, "both be None"),
    (lambda: xt.string_kl(xt.make_cross_toy("identical", T=1), teacher="full"), ValueError,
     "teacher must be"),
    (lambda: xt.bias(xt.make_cross_toy("identical", T=1), "kl"), ValueError, "method must be"),
    (lambda: xt.token_kl_losses(xt.make_cross_toy("teacher_merges", T=1)), ValueError,
     "identical tokenizers"),
    (lambda: xt.string_kl({"p": 1}), TypeError, "make_cross_toy"),
    # a negative id read numpy's last row (the <eos> column) and gave a log-prob
    (lambda: xt.sequence_logprob(_TOY["student"], (-1,)), ValueError,
     r"ids must hold text-token ids in 0 \.\. 1 \(the <eos> id 2 is implied\), got -1"),
    (lambda: xt.conditionals(_TOY["student"], (7,)), ValueError, "got 7 in"),
    (lambda: xt.conditionals(_TOY["student"], (True,)), TypeError, "integer token ids"),
    (lambda: xt.token_offsets((5,), ("a", "b")), ValueError, "got 5 in"),
    (lambda: xt.token_offsets("ab", ("a", "b")), TypeError, "sequence of token ids"),
    (lambda: xt.tokenizations("ab", ("a", "b"), max_tokens=-1), ValueError,
     "max_tokens must be None or an integer >= 0, got -1"),
    (lambda: xt.align_groups([(0, 1)], [(0, 2)]), ValueError, "cover one text, got ends 1 and 2"),
    (lambda: xt.align_groups([(0, 1), (2, 3)], [(0, 3)]), ValueError, "tile the text from 0"),
    (lambda: xt.align_groups([(0, 1.0)], [(0, 1)]), TypeError, "pair of integers"),
    (lambda: xt.make_model(("a", "b"), T=2, scale=-1.0), ValueError, "scale must be >= 0.0"),
    (lambda: xt.make_model(("a", "b"), T=2, seed=-1), ValueError, "seed must be an integer >= 0"),
    (lambda: xt.uld_losses(_TOY, extended="no"), TypeError, "extended must be True or False"),
    (lambda: xt.uld_losses(_TOY, hybrid="yes"), TypeError, "hybrid must be True or False"),
    (lambda: xt.string_prob(_TOY["student"], "ab", canonical="x"), TypeError,
     "canonical must be True or False"),
    # wrong-shape gradients broadcast into the sum, a short list was cut by zip
    (lambda: xt.expected_gradient(_TOY, dict(loss=np.zeros(len(_TOY["p"])),
                                             grad=[np.zeros((1, 1))] * len(_TOY["p"]))),
     ValueError, r"losses\['grad'\]\[0\] must have the shape of the sequence's conditionals"),
    (lambda: xt.expected_gradient(_TOY, dict(loss=np.full(len(_TOY["p"]), np.nan),
                                             grad=xt.uld_losses(_TOY)["grad"])),
     ValueError, r"losses\['loss'\] must be finite, got nan"),
    (lambda: xt.logit_grads(_TOY, {"grad": [np.zeros((1, 1))]}), TypeError,
     "must be a dict with 'loss' and 'grad'"),
    (lambda: xt.logit_grads(_TOY, dict(loss=np.zeros(len(_TOY["p"])), grad=[np.zeros((1, 1))])),
     ValueError, r"must be a list of \d+ gradients"),
])
def test_bad_input_is_refused_with_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_teacher_with_a_forced_end_is_refused_by_the_projection():
    student = xt.make_model(("a", "b"), T=2)
    toy = xt.cross_toy_from_models(student, xt.make_model(("a", "b"), T=2, seed=1))
    with pytest.raises(ValueError, match="forced end"):
        xt.projection_losses(toy)
    with pytest.raises(ValueError, match="teacher's cap"):
        xt.cross_toy_from_models(xt.make_model(("a", "b"), T=3), student)


# ---------------------------------------------------------------------------------------------
# The chapter's sentences (docs/teachers.md), read back against bias_table, the function its
# generated table is computed by (docs/hooks/generate.py, _cross_tokenizer)
# ---------------------------------------------------------------------------------------------
def test_the_chapters_sentences_on_the_cross_tokenizer_losses():
    import pathlib
    import re

    from tests.helpers.committed import assert_matches_committed

    page = " ".join((pathlib.Path(__file__).parents[2] / "docs" / "teachers.md").read_text()
                    .split())
    rows = {(r["kind"], r["method"].split(" ")[0] + (" bayesian" if "bayesian" in r["method"]
                                                     else "")): r for r in xt.bias_table()}
    n = r"([−-]?[0-9.]+)"
    found = re.search((r"its total gradient the exact one \(relative error N\), but its pathwise "
                       r"gradient, what a trainer gets, is off by N,").replace("N", n), page)
    assert found, "the sentence on the projection's exactness is not on the page"
    projection = rows["identical", "projection"]
    assert_matches_committed([projection["total_rel_norm"], projection["rel_norm"]],
                             [float(x) for x in found.groups()], rtol=0, atol=5e-4,
                             why="three decimals on the page")
    assert abs(projection["value"] - projection["exact_value"]) < 1e-12
    found = re.search((r"On `identical` its pathwise gradient has cosine N with the exact "
                       r"one\.").replace("N", n), page)
    assert found, "the sentence on ULD's cosine is not on the page"
    assert_matches_committed([rows["identical", "ULD"]["cosine"]],
                             [float(found.group(1).replace("−", "-"))], rtol=0, atol=5e-4,
                             why="three decimals on the page")
    found = re.search((r"a pathwise cosine of N on `teacher_merges` and N on `non_refining`, "
                       r"against ULD's N and N\.").replace("N", n), page)
    assert found, "the sentence on the projection across tokenizers is not on the page"
    computed = [rows["teacher_merges", "projection"]["cosine"],
                rows["non_refining", "projection"]["cosine"],
                rows["teacher_merges", "ULD"]["cosine"], rows["non_refining", "ULD"]["cosine"]]
    assert_matches_committed(computed, [float(x) for x in found.groups()], rtol=0, atol=5e-4,
                             why="three decimals on the page")
    # "comes nearest": the projection has the largest pathwise cosine on each differing pair
    for kind in ("teacher_merges", "student_merges", "non_refining"):
        best = max((r for (k, _), r in rows.items() if k == kind), key=lambda r: r["cosine"])
        assert best["method"].startswith("projection"), kind



def test_the_projections_forward_kl_is_not_exact_even_with_one_tokenizer():
    """The chapter: "NeMo-RL's default forward KL compares the chunks the other way and is not
    exact even there" (on `identical`, where the reverse KL is, to NeMo-RL's epsilon)."""
    import pathlib

    page = " ".join((pathlib.Path(__file__).parents[2] / "docs" / "teachers.md").read_text()
                    .split())
    assert "NeMo-RL's default forward KL compares the chunks the other way and is not exact " \
           "even there" in page
    toy = xt.make_cross_toy("identical", T=3, seed=0)
    assert xt.bias(toy, "projection", reverse=True, eps=0.0)["total_rel_norm"] < 1e-9
    # NeMo-RL's epsilon (eps = 0 is refused with the forward KL: a zero of the student's chunk)
    forward = xt.bias(toy, "projection", reverse=False)
    assert forward["total_rel_norm"] > 0.5 and forward["total_cosine"] < 0.9, forward
