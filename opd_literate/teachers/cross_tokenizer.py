r"""Distillation across tokenizers on an enumerable toy: the exact string-level objective, and
three approximations that frameworks ship, each with its exact bias (numpy only).

When the teacher's vocabulary is not the student's, the per-token losses of
[opd_literate.opd][] are undefined: position $t$ of the student and position $t$ of the teacher
do not predict the same piece of text. What is still defined is the distribution of each model
over **strings**, and with it the sequence-level reverse KL

$$
\mathrm{KL}(p_S \,\|\, p_T) = \sum_x p_S(x) \log \frac{p_S(x)}{p_T(x)} ,
$$

the objective that on-policy distillation approximates. This module builds a toy small enough
to sum it exactly, and measures against it what TRL 1.16.0's GOLD trainer (the ULD loss, its
byte-offset alignment and its hybrid "GOLD" variant) and NeMo-RL's projection loss compute.

**The toy.** Strings over the alphabet ``{a, b}``. A *tokenizer* is a tuple of token strings
(``("a", "b")``, the characters; ``("a", "b", "ab")``, a merge) and tokenizes a text by
greedy longest match from the left (``canonical_tokenize``). A *model* is autoregressive over
its own tokens plus an end token ``<eos>`` (id ``K``, after the ``K`` text tokens): the token
after the previous token $u$ has probability $\mathrm{softmax}(\theta_{1+u})$, the first token
$\mathrm{softmax}(\theta_0)$, so ``theta`` is ``(K + 1, K + 1)``; after ``T`` text tokens the end
is forced (probability 1, no parameter). Every sequence ends, so the sequences are finitely
many and their probabilities sum to 1.

**The probability of a string** is the sum over all its tokenizations,
$p(x) = \sum_{\tau \to x} p(\tau)$, because a model is free to write ``a, b`` where its
tokenizer would write ``ab``: this is what sampling from it produces, and the only definition
under which $\sum_x p(x) = 1$. The probability of the canonical tokenization alone,
$p^{c}(x) = p(\mathrm{canon}(x)) \le p(x)$, sums to less than 1 whenever the model puts mass on
non-canonical tokenizations (``teacher="canonical"`` uses it for the teacher; the frameworks
below read the teacher only along the canonical tokenization of the student's text).

**The exact gradient.** With $\sum_x p_S(x) = 1$ the derivative of the $+1$ of
$\nabla[p \log p]$ sums to zero, and $\nabla p_S(x) = \sum_{\tau \to x} p_S(\tau)\, s(\tau)$
with $s(\tau) = \sum_k (e_{\tau_k} - \pi_k)$ placed in the row of $\theta_S$ the token was
written from (the score of ``opd_literate.mismatch.toy``), so

$$
\nabla_{\theta_S} \mathrm{KL} = \sum_\tau p_S(\tau)\, s(\tau)\,
\log \frac{p_S(x(\tau))}{p_T(x(\tau))} .
$$

**The approximations** are losses $\ell(\tau; \theta_S)$ of one sampled student sequence,
differentiated through the student's logits with $\tau$ held fixed, as a trainer does. Their
expected gradient on-policy is the *pathwise* sum $\sum_\tau p_S(\tau) \nabla \ell(\tau)$;
the gradient of their expected value adds the score term
$\sum_\tau p_S(\tau)\, \ell(\tau)\, s(\tau)$ (``expected_gradient`` returns both). Each is
written as a function of the student's conditional distributions $\pi_k$ along $\tau$ with its
gradient $\partial \ell / \partial \pi_k$, then carried to the logits by the softmax Jacobian
$\partial \ell / \partial z_k = \pi_k \odot (g_k - \langle g_k, \pi_k \rangle)$.

* ``uld_losses``: TRL's ULD (``trl/experimental/gold/gold_trainer.py``, ``ULDLoss``): the
  student's own tokens and the teacher's canonical tokens of the same text are grouped where
  their byte offsets agree; a group of several tokens is merged into one unnormalised vector
  (``merge="observed"``, the default: the distribution read at the group's first position
  times the probabilities of the later tokens; ``"bayesian"``: the last position's
  distribution times the earlier tokens' probabilities); each vector is sorted in decreasing
  order, the shorter vocabulary padded with zeros, and the L1 distance summed over groups and
  divided by their number. With ``hybrid=True``, GOLD's hybrid: the entries whose token string
  is in both vocabularies are compared by TRL's generalized JSD, the others sorted.
* ``projection_losses``: NeMo-RL's P-KL (``nemo_rl/algorithms/loss/loss_functions.py``,
  ``_compute_p_kl``): the student's distribution is mapped onto the teacher's vocabulary by a
  matrix $W$ built from the teacher's tokenization of each student token, averaged over the
  positions of an aligned chunk and renormalised, and compared by a KL with the average of the
  teacher's log-probabilities over the chunk.

Which is exact when, and how far off each is on the stated toys, is in ``bias`` and
``bias_table``; TRL's own loss is run on ``trl_batch`` in ``tests/integration/test_trl_gold.py``.
Only numpy is imported. Temperatures are 1 throughout.
"""

from __future__ import annotations

import itertools

import numpy as np

from .._numerics import check_finite_number, check_real_array

__all__ = [
    "ALPHABET",
    "EOS",
    "KINDS",
    "canonical_tokenize",
    "tokenizations",
    "token_offsets",
    "make_model",
    "model_from_logits",
    "conditionals",
    "sequence_logprob",
    "string_prob",
    "make_cross_toy",
    "cross_toy_from_models",
    "string_kl",
    "string_kl_grad",
    "align_groups",
    "projection_matrix",
    "uld_losses",
    "projection_losses",
    "token_kl_losses",
    "expected_gradient",
    "bias",
    "bias_table",
    "retokenized_share",
    "retokenization_sweep",
    "trl_batch",
    "logit_grads",
]

ALPHABET = ("a", "b")
"""The characters of every string of the toy."""

EOS = "<eos>"
"""The end token's string: the same in every vocabulary (so GOLD's hybrid matches it)."""

KINDS = {
    "identical": (("a", "b"), ("a", "b")),
    "teacher_merges": (("a", "b"), ("a", "b", "ab")),
    "student_merges": (("a", "b", "ab"), ("a", "b")),
    "non_refining": (("a", "b", "ab"), ("a", "b", "ba")),
}
"""The (student, teacher) tokenizers of ``make_cross_toy``. ``teacher_merges``: every teacher
token is a merge of student tokens (the student's tokenization refines the teacher's);
``student_merges``: the reverse; ``non_refining``: neither refines the other (``aba`` is
``ab|a`` for the student and ``a|ba`` for the teacher)."""

_CLAMP = 1e-8  # TRL's clamp_min on merged scalar probabilities and on the JSD's log inputs
_NEMO_EPS = 1e-10  # NeMo-RL's eps in the chunk average, the renormalisation and the log


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------
def _check_vocab(vocab):
    if not isinstance(vocab, tuple) or not vocab:
        raise TypeError(f"vocab must be a non-empty tuple of token strings, got {vocab!r}")
    for token in vocab:
        if not isinstance(token, str) or not token or set(token) - set(ALPHABET):
            raise ValueError(f"vocab tokens must be non-empty strings over {ALPHABET}, got "
                             f"{token!r} in {vocab!r}")
    if len(set(vocab)) != len(vocab):
        raise ValueError(f"vocab has a repeated token: {vocab!r}")
    if not set(ALPHABET) <= set(vocab):
        raise ValueError(f"vocab must contain every character {ALPHABET} (so that every string "
                         f"has a tokenization), got {vocab!r}")
    return vocab


def _check_text(text):
    if not isinstance(text, str) or set(text) - set(ALPHABET):
        raise ValueError(f"text must be a string over {ALPHABET}, got {text!r}")
    return text


def _check_ids(ids, K, name="ids"):
    """``ids`` as a tuple of text-token ids in ``0 .. K - 1``: a negative id would read
    numpy's last row, an id of ``K`` or more another row's ``<eos>`` or none."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(ids).__name__} "
                        f"{ids!r}")
    ids = tuple(ids)
    for i in ids:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{name} must hold integer token ids, got {type(i).__name__} {i!r}")
        if not 0 <= i < K:
            raise ValueError(f"{name} must hold text-token ids in 0 .. {K - 1} (the <eos> id "
                             f"{K} is implied), got {int(i)} in {ids!r}")
    return tuple(int(i) for i in ids)


def _check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def canonical_tokenize(text, vocab):
    r"""The tokenizer's tokenization of ``text``: greedy longest match from the left.

    Parameters
    ----------
    text : str
        A string over ``ALPHABET`` (may be empty).
    vocab : tuple of str
        The tokens; must contain both characters.

    Returns
    -------
    tuple of int
        Token ids (indices into ``vocab``).

    Examples
    --------
    >>> canonical_tokenize("aab", ("a", "b", "ab")), canonical_tokenize("aba", ("a", "b", "ba"))
    ((0, 2), (0, 2))
    >>> canonical_tokenize("", ("a", "b"))
    ()
    """
    text, vocab = _check_text(text), _check_vocab(vocab)
    ids, i = [], 0
    while i < len(text):
        # the longest token that matches at i (a character always does)
        best = max((j for j, tok in enumerate(vocab) if text.startswith(tok, i)),
                   key=lambda j: len(vocab[j]))
        ids.append(best)
        i += len(vocab[best])
    return tuple(ids)


def tokenizations(text, vocab, max_tokens=None):
    r"""Every tokenization of ``text`` in ``vocab`` (at most ``max_tokens`` tokens).

    Examples
    --------
    ``aab`` with the merge ``ab``: ``a|a|b`` and ``a|ab``.

    >>> sorted(tokenizations("aab", ("a", "b", "ab")))
    [(0, 0, 1), (0, 2)]
    >>> tokenizations("aab", ("a", "b", "ab"), max_tokens=2)
    [(0, 2)]
    """
    text, vocab = _check_text(text), _check_vocab(vocab)
    if max_tokens is not None and (isinstance(max_tokens, (bool, np.bool_))
                                   or not isinstance(max_tokens, (int, np.integer))
                                   or max_tokens < 0):
        raise ValueError(f"max_tokens must be None or an integer >= 0, got {max_tokens!r}")
    found = []

    def extend(i, ids):
        if max_tokens is not None and len(ids) > max_tokens:
            return
        if i == len(text):
            found.append(tuple(ids))
            return
        for j, tok in enumerate(vocab):
            if text.startswith(tok, i):
                extend(i + len(tok), ids + [j])

    extend(0, [])
    return found


def token_offsets(ids, vocab):
    r"""The ``(start, end)`` character offsets of each token, as a fast tokenizer reports them
    (one byte per character here).

    Examples
    --------
    >>> token_offsets((0, 2), ("a", "b", "ab"))
    [(0, 1), (1, 3)]
    """
    vocab = _check_vocab(vocab)
    ids = _check_ids(ids, len(vocab))
    spans, start = [], 0
    for i in ids:
        spans.append((start, start + len(vocab[i])))
        start += len(vocab[i])
    return spans


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def _log_softmax(z):
    shifted = z - z.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def make_model(vocab, T, seed=0, scale=1.0):
    r"""A model over ``vocab`` with random logits ``theta ~ Normal(0, scale)``, ``(K+1, K+1)``.

    Row 0 is read for the first token, row ``1 + u`` after text token ``u``; column ``K`` is
    ``<eos>``. After ``T`` text tokens the end is forced.

    Examples
    --------
    >>> m = make_model(("a", "b"), T=2)
    >>> m["theta"].shape, m["eos"], m["T"]
    ((3, 3), 2, 2)
    """
    vocab = _check_vocab(vocab)
    scale = check_finite_number("scale", scale, low=0.0)
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    theta = np.random.default_rng(seed).normal(0.0, scale, size=(len(vocab) + 1,) * 2)
    return model_from_logits(vocab, theta, T)


def model_from_logits(vocab, theta, T):
    r"""A model over ``vocab`` with the logits ``theta`` given by hand (see ``make_model``).

    Examples
    --------
    >>> m = model_from_logits(("a", "b"), np.zeros((3, 3)), T=1)
    >>> conditionals(m, ()).round(6).tolist()
    [[0.333333, 0.333333, 0.333333]]
    """
    vocab = _check_vocab(vocab)
    K = len(vocab)
    theta = np.asarray(theta)
    if theta.dtype.kind not in "iuf":
        raise TypeError(f"theta must hold real numbers, got dtype {theta.dtype}")
    if theta.shape != (K + 1, K + 1):
        raise ValueError(f"theta must have shape (K + 1, K + 1) = {(K + 1, K + 1)} for the "
                         f"{K} tokens of {vocab!r}, got {theta.shape}")
    theta = theta.astype(float)
    if not np.isfinite(theta).all():
        raise ValueError("theta must be finite")
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise ValueError(f"T must be an integer >= 1, got {T!r}")
    return dict(vocab=vocab, theta=theta, T=int(T), eos=K)


def _rows(ids):
    """The row of theta read before each token of ``ids`` + <eos>: 0, then 1 + previous."""
    return np.array([0] + [1 + u for u in ids], dtype=np.int64)


def conditionals(model, ids):
    r"""The ``(n + 1, K + 1)`` distributions $\pi_k$ from which token $k$ of ``ids`` + ``<eos>``
    is drawn; row $n$ is the end's ($e_{\mathrm{eos}}$ when ``n == T``, the forced end).

    Examples
    --------
    >>> m = model_from_logits(("a", "b"), np.log([[0.5, 0.25, 0.25]] * 3), T=1)
    >>> conditionals(m, (0,)).round(4).tolist()  # after one token the end is forced
    [[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]]
    """
    ids = _check_ids(ids, model["eos"])
    if len(ids) > model["T"]:
        raise ValueError(f"ids has {len(ids)} tokens, more than the model's T = {model['T']}")
    probs = np.exp(_log_softmax(model["theta"][_rows(ids)]))  # (n + 1, K + 1)
    if len(ids) == model["T"]:
        probs[-1] = np.eye(model["eos"] + 1)[model["eos"]]  # the forced end
    return probs


def sequence_logprob(model, ids):
    r"""$\log p(\tau)$ of the text tokens ``ids`` followed by ``<eos>``.

    Examples
    --------
    >>> m = model_from_logits(("a", "b"), np.log([[0.5, 0.25, 0.25]] * 3), T=1)
    >>> round(float(np.exp(sequence_logprob(m, (0,)))), 12)  # 0.5 * 1 (forced end)
    0.5
    """
    probs = conditionals(model, ids)
    with np.errstate(divide="ignore"):
        return float(np.log(probs[np.arange(len(ids) + 1), list(ids) + [model["eos"]]]).sum())


def string_prob(model, text, canonical=False):
    r"""$p(x) = \sum_{\tau \to x} p(\tau)$, or $p(\mathrm{canon}(x))$ with ``canonical``.

    Examples
    --------
    Uniform model over ``a, b, ab, <eos>``: $p(ab) = p(a, b) + p(ab) = 1/4^3 + 1/4^2$.

    >>> m = model_from_logits(("a", "b", "ab"), np.zeros((4, 4)), T=3)
    >>> round(string_prob(m, "ab") * 64, 12), round(string_prob(m, "ab", canonical=True) * 64, 12)
    (5.0, 4.0)
    """
    if _check_flag("canonical", canonical):
        paths = [canonical_tokenize(text, model["vocab"])]
        if len(paths[0]) > model["T"]:
            return 0.0
    else:
        paths = tokenizations(text, model["vocab"], max_tokens=model["T"])
    return float(sum(np.exp(sequence_logprob(model, ids)) for ids in paths))


# ---------------------------------------------------------------------------------------------
# The toy
# ---------------------------------------------------------------------------------------------
def make_cross_toy(kind="teacher_merges", T=3, seed=0, scale=1.0):
    r"""The toy of one ``kind`` of ``KINDS``: a student with cap ``T`` and a teacher whose
    cap is one more than the longest canonical teacher tokenization of a student string (so
    the teacher's end is never forced where the frameworks read it). The student's logits are
    drawn with ``seed``, the teacher's with ``seed + 1``.

    Examples
    --------
    >>> toy = make_cross_toy("teacher_merges", T=2)
    >>> len(toy["sequences"]), toy["strings"][:4], round(float(toy["p"].sum()), 12)
    (7, ['', 'a', 'b', 'aa'], 1.0)
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    student_vocab, teacher_vocab = KINDS[kind]
    student = make_model(student_vocab, T, seed=seed, scale=scale)
    longest = max(len(canonical_tokenize(x, teacher_vocab))
                  for x in _student_strings(student_vocab, T))
    teacher = make_model(teacher_vocab, longest + 1, seed=seed + 1, scale=scale)
    return cross_toy_from_models(student, teacher)


def _student_sequences(K, T):
    return [ids for n in range(T + 1) for ids in itertools.product(range(K), repeat=n)]


def _student_strings(vocab, T):
    return {"".join(vocab[i] for i in ids) for ids in _student_sequences(len(vocab), T)}


def cross_toy_from_models(student, teacher):
    r"""Every student sequence with what the approximations read, and both models' string
    probabilities.

    Returns
    -------
    dict
        ``student``, ``teacher`` (the models); per student sequence (``M`` of them):
        ``sequences`` (text-token ids), ``p`` (M,) $p_S(\tau)$, ``cond`` the ``(n + 1, K_S + 1)``
        conditionals, ``score`` (M, K_S + 1, K_S + 1) $s(\tau)$, ``strings``,
        ``teacher_tokens`` (canonical ids of the string), ``teacher_cond`` the teacher's
        ``(m + 1, K_T + 1)`` conditionals along them, ``string_index``; per string of the
        student's support (``X``, sorted): ``p_student``, ``p_teacher`` (marginal) and
        ``p_teacher_canonical``.
    """
    for name, model in (("student", student), ("teacher", teacher)):
        if not isinstance(model, dict) or not {"vocab", "theta", "T", "eos"} <= set(model):
            raise TypeError(f"{name} must be a model from make_model or model_from_logits")
    Ks = student["eos"]
    sequences = _student_sequences(Ks, student["T"])
    cond = [conditionals(student, ids) for ids in sequences]
    p = np.array([np.exp(sequence_logprob(student, ids)) for ids in sequences])
    score = np.zeros((len(sequences), Ks + 1, Ks + 1))
    for m, (ids, probs) in enumerate(zip(sequences, cond)):
        # s(tau) = sum_k (e_{tau_k} - pi_k) in row prev_k; the forced end adds e_eos - e_eos = 0
        np.add.at(score[m], _rows(ids), np.eye(Ks + 1)[list(ids) + [Ks]] - probs)
    strings = ["".join(student["vocab"][i] for i in ids) for ids in sequences]
    X = sorted(set(strings), key=lambda x: (len(x), x))
    index = {x: i for i, x in enumerate(X)}
    string_index = np.array([index[x] for x in strings], dtype=np.int64)
    teacher_tokens = [canonical_tokenize(x, teacher["vocab"]) for x in strings]
    if max(len(t) for t in teacher_tokens) > teacher["T"]:
        raise ValueError(f"the teacher's cap T = {teacher['T']} is below the "
                         f"{max(len(t) for t in teacher_tokens)} tokens of its canonical "
                         "tokenization of a student string; raise it")
    teacher_cond = [conditionals(teacher, t) for t in teacher_tokens]
    p_student = np.bincount(string_index, weights=p, minlength=len(X))
    p_teacher = np.array([string_prob(teacher, x) for x in X])
    p_teacher_canonical = np.array([string_prob(teacher, x, canonical=True) for x in X])
    return dict(student=student, teacher=teacher, sequences=sequences, p=p, cond=cond,
                score=score, strings=strings, teacher_tokens=teacher_tokens,
                teacher_cond=teacher_cond, string_index=string_index, X=X,
                p_student=p_student, p_teacher=p_teacher,
                p_teacher_canonical=p_teacher_canonical)


def _check_toy(toy):
    keys = {"student", "teacher", "sequences", "p", "cond", "score", "teacher_cond"}
    if not isinstance(toy, dict) or not keys <= set(toy):
        raise TypeError("toy must be the dict of make_cross_toy or cross_toy_from_models")
    return toy


# ---------------------------------------------------------------------------------------------
# The exact objective
# ---------------------------------------------------------------------------------------------
def _teacher_string_probs(toy, teacher):
    if teacher not in ("marginal", "canonical"):
        raise ValueError(f"teacher must be 'marginal' or 'canonical', got {teacher!r}")
    return toy["p_teacher"] if teacher == "marginal" else toy["p_teacher_canonical"]


def string_kl(toy, teacher="marginal"):
    r"""$\mathrm{KL}(p_S \| p_T)$ over strings, exact (``teacher="canonical"``: $p_T^c$).

    Examples
    --------
    Identical tokenizers and identical logits: 0.

    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=2)
    >>> t = model_from_logits(("a", "b"), np.zeros((3, 3)), T=2)
    >>> round(string_kl(cross_toy_from_models(s, t)), 12)
    0.0
    """
    _check_toy(toy)
    ps, pt = toy["p_student"], _teacher_string_probs(toy, teacher)
    return float(np.sum(ps * (np.log(ps) - np.log(pt))))


def string_kl_grad(toy, teacher="marginal"):
    r"""$\nabla_{\theta_S} \mathrm{KL}(p_S \| p_T) = \sum_\tau p_S(\tau)\, s(\tau)
    \log(p_S(x) / p_T(x))$, ``(K_S + 1, K_S + 1)``, exact.

    Examples
    --------
    One token at most, uniform student: the strings ``""``, ``a``, ``b`` have $p_S = 1/3$
    each and $p_T = (1/4, 1/2, 1/4)$, so $\log(p_S/p_T) = (0.2877, -0.4055, 0.2877)$ and the
    first row is $\frac13 \sum_x (e_x - \pi) \log(p_S/p_T)(x)$: for ``a``,
    $\frac13 (\frac23 (-0.4055) - \frac13 \cdot 0.2877 \cdot 2) = -0.154$ (negative: raise
    the logit of ``a``). No other row is read.

    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=1)
    >>> t = model_from_logits(("a", "b"), np.log([[0.5, 0.25, 0.25]] * 3), T=1)
    >>> g = string_kl_grad(cross_toy_from_models(s, t))
    >>> (g[0].round(4).tolist(), float(np.abs(g[1:]).max()))
    ([-0.154, 0.077, 0.077], 0.0)
    """
    _check_toy(toy)
    pt = _teacher_string_probs(toy, teacher)
    log_ratio = np.log(toy["p_student"]) - np.log(pt)  # (X,)
    weights = toy["p"] * log_ratio[toy["string_index"]]
    return np.einsum("m,mrv->rv", weights, toy["score"])


# ---------------------------------------------------------------------------------------------
# Alignment
# ---------------------------------------------------------------------------------------------
def align_groups(s_offsets, t_offsets):
    r"""TRL's byte-offset alignment: groups of consecutive tokens that end where the other
    side's tokens end.

    Both lists are walked together; the side whose current token ends earlier advances; when
    both end at the same offset a group closes. Tokens left over on either side form a last
    group (``ULDLoss._align_by_byte_offsets``). Returns ``(student_groups, teacher_groups)``,
    lists of position lists.

    Examples
    --------
    ``ab|a`` against ``a|ba``: no shared boundary inside, one group of two tokens on each side.

    >>> align_groups([(0, 2), (2, 3)], [(0, 1), (1, 3)])
    ([[0, 1]], [[0, 1]])
    >>> align_groups([(0, 1), (1, 2), (2, 3)], [(0, 2), (2, 3)])
    ([[0, 1], [2]], [[0], [1]])
    """
    _check_spans("s_offsets", s_offsets)
    _check_spans("t_offsets", t_offsets)
    if s_offsets and t_offsets and s_offsets[-1][1] != t_offsets[-1][1]:
        raise ValueError(f"s_offsets and t_offsets must cover one text, got ends "
                         f"{s_offsets[-1][1]} and {t_offsets[-1][1]}")
    s_groups, t_groups = [], []
    s = t = s_start = t_start = 0
    while s < len(s_offsets) and t < len(t_offsets):
        s_end, t_end = s_offsets[s][1], t_offsets[t][1]
        if s_end == t_end:
            s, t = s + 1, t + 1
            s_groups.append(list(range(s_start, s)))
            t_groups.append(list(range(t_start, t)))
            s_start, t_start = s, t
        elif s_end < t_end:
            s += 1
        else:
            t += 1
    if s < len(s_offsets) or t < len(t_offsets):
        s_groups.append(list(range(s_start, len(s_offsets))))
        t_groups.append(list(range(t_start, len(t_offsets))))
    return s_groups, t_groups


def _check_spans(name, spans):
    """Token spans ``(start, end)`` that tile a text from 0, each non-empty."""
    for k, span in enumerate(spans):
        pair = isinstance(span, (tuple, list)) and len(span) == 2
        if not pair or [isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                        for x in span] != [True, True]:
            raise TypeError(f"{name}[{k}] must be a (start, end) pair of integers, got {span!r}")
    starts = [0] + [span[1] for span in spans[:-1]]  # each span starts where the last ended
    for k, (span, start) in enumerate(zip(spans, starts)):
        if span[0] != start or span[1] <= span[0]:
            raise ValueError(f"{name} must be non-empty spans that tile the text from 0, got "
                             f"{span!r} at {k} after the end {start}")


# ---------------------------------------------------------------------------------------------
# ULD and GOLD's hybrid, as TRL 1.16.0 computes them
# ---------------------------------------------------------------------------------------------
def _sorted_l1(a, b):
    """sum |sort(a) - sort(b)| over rows, zero-padded to a common width; and d/da."""
    width = max(a.shape[1], b.shape[1])
    order = np.argsort(-a, axis=1, kind="stable")
    a_sorted = np.zeros((len(a), width))
    a_sorted[:, :a.shape[1]] = np.take_along_axis(a, order, axis=1)
    b_sorted = np.zeros((len(b), width))
    b_sorted[:, :b.shape[1]] = -np.sort(-b, axis=1)
    sign = np.sign(a_sorted - b_sorted)[:, :a.shape[1]]  # torch's l1 gradient: sign(0) = 0
    grad = np.zeros_like(a)
    np.put_along_axis(grad, order, sign, axis=1)  # back from rank to token
    return float(np.abs(a_sorted - b_sorted).sum()), grad


def _jsd(s, t, beta):
    r"""TRL's generalized JSD on probabilities (``logits_are_probs=True``), summed; and d/ds."""
    s_c, t_c = np.maximum(s, _CLAMP), np.maximum(t, _CLAMP)  # clamp_min(1e-8) before the log
    live = s >= _CLAMP  # clamp_min passes no gradient below the bound
    if beta == 0:  # KL(t || s)
        value = t_c * (np.log(t_c) - np.log(s_c))
        grad = -t_c / s_c
    elif beta == 1:  # KL(s || t)
        value = s_c * (np.log(s_c) - np.log(t_c))
        grad = np.log(s_c) - np.log(t_c) + 1.0
    else:
        log_m = np.logaddexp(np.log(s_c) + np.log1p(-beta), np.log(t_c) + np.log(beta))
        value = beta * t_c * (np.log(t_c) - log_m) + (1 - beta) * s_c * (np.log(s_c) - log_m)
        # d/ds [beta t log(t/m) + (1-beta) s log(s/m)], m = (1-beta) s + beta t
        grad = (1 - beta) * (np.log(s_c) - log_m)
    return float(value.sum()), np.where(live, grad, 0.0)


def _matched_ids(student_vocab, teacher_vocab):
    """(student ids, teacher ids) of the token strings in both vocabularies, <eos> included,
    in the order of the teacher's ids (GOLD's vocabulary mapping)."""
    s_strings = list(student_vocab) + [EOS]
    t_strings = list(teacher_vocab) + [EOS]
    pairs = [(s_strings.index(tok), j) for j, tok in enumerate(t_strings) if tok in s_strings]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def _check_uld_options(merge, beta, matched_weight, unmatched_weight):
    if merge not in ("observed", "bayesian"):
        raise ValueError(f"merge must be 'observed' or 'bayesian', got {merge!r}")
    beta = check_finite_number("beta", beta, low=0.0, high=1.0)
    if (matched_weight is None) != (unmatched_weight is None):
        raise ValueError("matched_weight and unmatched_weight must both be None (adaptive) or "
                         f"both numbers, got {matched_weight!r} and {unmatched_weight!r}")
    if matched_weight is not None:
        matched_weight = check_finite_number("matched_weight", matched_weight, low=0.0)
        unmatched_weight = check_finite_number("unmatched_weight", unmatched_weight, low=0.0)
    return beta, matched_weight, unmatched_weight


def uld_losses(toy, merge="observed", extended=True, hybrid=False, beta=0.5,
               matched_weight=None, unmatched_weight=None):
    r"""TRL's ULD loss of every student sequence, and its gradient with respect to the
    student's conditionals.

    The arithmetic of ``ULDLoss._compute_distillation_loss`` (TRL 1.16.0, with its defaults
    ``uld_skip_student_eos = uld_skip_teacher_eos = True``, temperatures 1, no cross-entropy):

    * The answer is the completion without its end token (skip-EOS). With ``merge="observed"``
      the logits are sliced at the answer's positions, so row $k$ is $\pi_{k+1}$, the
      distribution of the token *after* token $k$ (the first token's distribution is never
      read, the end's is); ``"bayesian"`` slices one position earlier, row $k = \pi_k$.
    * ``extended=True`` groups the tokens with ``align_groups`` on their offsets (pairs with
      an empty side dropped) and merges a group $g$ into one vector: ``"observed"``,
      $P_{g_0} \prod_{j \in g_{1:}} \max(P_{j, \tau_j}, 10^{-8})$; ``"bayesian"``,
      $P_{g_{-1}} \prod_{j \in g_{:-1}} \max(P_{j, \tau_j}, 10^{-8})$. ``extended=False``
      keeps the first $\min(n, m)$ rows of each side, unmerged.
    * ULD: $\frac{1}{G} \sum_g \| \mathrm{sort}_\downarrow(A^S_g) - \mathrm{sort}_\downarrow(A^T_g)
      \|_1$, the shorter vocabulary padded with zeros.
    * ``hybrid=True`` (``uld_use_hybrid_loss``): the token strings in both vocabularies
      ($\mathcal{M}$, the end token among them) are compared entry by entry with TRL's
      generalized JSD at ``beta`` (``GOLDConfig.beta`` defaults to 0.5), summed and divided by
      $G$; the rest by the sorted L1 above (0 if either side has no unmatched token); weighted
      $|\mathcal{M}| / V_T$ and $1 - |\mathcal{M}| / V_T$ unless both weights are given.

    A sequence with an empty answer (the empty string) has loss 0 and no gradient.

    Returns
    -------
    dict
        ``loss`` (M,), and ``grad``: per sequence the ``(n + 1, K_S + 1)`` array
        $\partial \ell / \partial \pi_k$.

    Examples
    --------
    Identical tokenizers and models: every sorted vector equals the teacher's, loss 0.

    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=2)
    >>> out = uld_losses(cross_toy_from_models(s, s))
    >>> float(np.abs(out["loss"]).max())
    0.0

    One character, then the end; teacher ``(0.5, 0.25, 0.25)`` at every row, student uniform.
    ``"bayesian"`` compares the first-token distributions: $|1/3 - 1/2| + 2 |1/3 - 1/4| = 1/3$;
    ``"observed"`` compares the end's rows, forced on both sides: 0.

    >>> t = model_from_logits(("a", "b"), np.log([[0.5, 0.25, 0.25]] * 3), T=1)
    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=1)
    >>> toy = cross_toy_from_models(s, t)
    >>> toy["strings"], uld_losses(toy, merge="bayesian")["loss"].round(4).tolist()
    (['', 'a', 'b'], [0.0, 0.3333, 0.3333])
    >>> uld_losses(toy, merge="observed")["loss"].tolist()
    [0.0, 0.0, 0.0]
    """
    _check_toy(toy)
    beta, matched_weight, unmatched_weight = _check_uld_options(merge, beta, matched_weight,
                                                                unmatched_weight)
    extended, hybrid = _check_flag("extended", extended), _check_flag("hybrid", hybrid)
    student, teacher = toy["student"], toy["teacher"]
    s_match, t_match = _matched_ids(student["vocab"], teacher["vocab"])
    Vs, Vt = student["eos"] + 1, teacher["eos"] + 1
    s_unmatched = np.setdiff1d(np.arange(Vs), s_match)
    t_unmatched = np.setdiff1d(np.arange(Vt), t_match)
    if hybrid and matched_weight is None:
        matched_weight = len(t_match) / max(1, Vt)  # adaptive: the teacher vocabulary's overlap
        unmatched_weight = 1.0 - matched_weight
    shift = 1 if merge == "observed" else 0
    losses, grads = np.zeros(len(toy["sequences"])), []
    for m, (ids, t_ids) in enumerate(zip(toy["sequences"], toy["teacher_tokens"])):
        cond = toy["cond"][m]
        grad = np.zeros_like(cond)
        grads.append(grad)
        n, n_t = len(ids), len(t_ids)
        if n == 0 or n_t == 0:
            continue  # no answer token once the end is skipped
        Ps = cond[shift:shift + n]  # (n, Vs): row k predicts token k + shift
        Pt = toy["teacher_cond"][m][shift:shift + n_t]
        if extended:
            groups = [pair for pair in zip(*align_groups(token_offsets(ids, student["vocab"]),
                                                          token_offsets(t_ids, teacher["vocab"])))
                      if pair[0] and pair[1]]
            As, back = _merge(Ps, [g for g, _ in groups], ids, merge)
            At, _ = _merge(Pt, [g for _, g in groups], t_ids, merge)
        else:
            k = min(n, n_t)
            As, At, back = Ps[:k], Pt[:k], None
        G = len(As)
        if hybrid:
            jsd, d_jsd = _jsd(As[:, s_match], At[:, t_match], beta)
            value, dA = matched_weight * jsd / G, np.zeros_like(As)
            dA[:, s_match] = matched_weight * d_jsd / G
            if len(s_unmatched) and len(t_unmatched):
                l1, d_l1 = _sorted_l1(As[:, s_unmatched], At[:, t_unmatched])
                value += unmatched_weight * l1 / G
                dA[:, s_unmatched] = unmatched_weight * d_l1 / G
        else:
            l1, d_l1 = _sorted_l1(As, At)
            value, dA = l1 / G, d_l1 / G
        losses[m] = value
        dP = dA if back is None else back(dA)
        grad[shift:shift + len(dP)] += dP
    return dict(loss=losses, grad=grads)


def _merge(P, groups, ids, merge):
    """TRL's merged group vectors (G, V), and the map from d/d(merged) back to d/dP."""
    rows, parts = [], []
    for g in groups:
        if len(g) == 1:
            rows.append(P[g[0]])
            parts.append((g[0], [], 1.0))
            continue
        base, scalars = (g[0], g[1:]) if merge == "observed" else (g[-1], g[:-1])
        factors = [max(P[j, ids[j]], _CLAMP) for j in scalars]
        product = float(np.prod(factors))
        rows.append(P[base] * product)
        parts.append((base, [(j, f) for j, f in zip(scalars, factors)], product))

    def back(dA):
        dP = np.zeros_like(P)
        for d, (base, scalars, product) in zip(dA, parts):
            dP[base] += d * product
            inner = float(d @ P[base])  # d<merged> / d(product)
            for j, f in scalars:
                if P[j, ids[j]] >= _CLAMP:  # the clamp passes no gradient below the bound
                    dP[j, ids[j]] += inner * product / f
        return dP

    return np.array(rows), back


# ---------------------------------------------------------------------------------------------
# NeMo-RL's projection (P-KL)
# ---------------------------------------------------------------------------------------------
def projection_matrix(student_vocab, teacher_vocab):
    r"""NeMo-RL's student-to-teacher projection $W$, ``(K_S + 1, K_T + 1)``.

    Each student token's string is tokenized by the teacher; its $i$-th teacher token gets
    weight $\propto 0.9 \cdot 0.1^i$, normalised over the tokens and added to the row (the
    forward pass of ``tools/x_token/minimal_projection_via_multitoken.py``); the end maps to
    the end. A student token that is a teacher token maps to it with weight 1. The script's
    default ``--enable-reverse-pass`` (lines 395 to 406 and 691 to 706 at ``7ea279ab``) also
    adds each teacher token's student tokenization before normalising the rows; this matrix is
    the script's with that pass off, or with ``--enable-exact-match``
    (``tests/teachers/test_cross_tokenizer_nemo.py``), and differs from its default wherever a
    teacher token is no student token (``teacher_merges``, ``non_refining``).

    Examples
    --------
    >>> projection_matrix(("a", "b", "ab"), ("a", "b")).round(4).tolist()
    [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.9091, 0.0909, 0.0], [0.0, 0.0, 1.0]]
    """
    student_vocab, teacher_vocab = _check_vocab(student_vocab), _check_vocab(teacher_vocab)
    W = np.zeros((len(student_vocab) + 1, len(teacher_vocab) + 1))
    for s, token in enumerate(student_vocab):
        pieces = canonical_tokenize(token, teacher_vocab)
        weights = 0.9 * 0.1 ** np.arange(len(pieces))
        np.add.at(W[s], list(pieces), weights / weights.sum())
    W[-1, -1] = 1.0
    return W


def projection_losses(toy, reverse=True, include_eos=True, eps=_NEMO_EPS):
    r"""NeMo-RL's P-KL of every student sequence, and its gradient with respect to the
    student's conditionals.

    The arithmetic of ``CrossTokenizerDistillationLossFn._compute_p_kl`` at commit
    ``7ea279ab`` with temperature 1 and the full teacher vocabulary as its top-k: chunks are
    the aligned token groups (``align_groups``, TRL's byte-offset rule; NeMo-RL's own
    ``TokenAligner`` gives the same groups on every toy sequence at ``T = 3`` but one,
    ``non_refining``'s ``aabab``, which it aligns as one chunk; the end tokens form one more
    chunk with ``include_eos``), each read at the logits that predict its tokens (NeMo-RL's
    next-token shift of the chunk ids). For chunk $c$ with student positions $K_c$ and
    teacher positions $J_c$,

    $$
    u_c = \frac{\sum_{k \in K_c} \pi_k W}{|K_c| + \epsilon}, \quad
    q_c = \frac{u_c}{\sum_v u_{c,v} + \epsilon}, \quad
    \bar\ell_c = \frac{\sum_{j \in J_c} \log \rho_j}{|J_c| + \epsilon},
    $$

    and the chunk's loss is $\sum_v e^{\log(q_{c,v} + \epsilon)} (\log(q_{c,v} + \epsilon) -
    \bar\ell_{c,v})$ (``reverse=True``, NeMo-RL's ``reverse_kl``) or
    $\sum_v e^{\bar\ell_{c,v}} (\bar\ell_{c,v} - \log(q_{c,v} + \epsilon))$ (forward, NeMo-RL's
    default). The student's chunk is an average of probabilities, the teacher's an average of
    log-probabilities (not normalised). A sequence's loss is the sum over its chunks; NeMo-RL
    divides the batch's sum by its number of valid chunks, a positive constant in the limit of
    a large batch, which scales the expected gradient and leaves its direction alone.

    Returns
    -------
    dict
        ``loss`` (M,), ``grad`` (per sequence $\partial \ell / \partial \pi_k$), ``chunks`` (M,)
        the number of chunks.

    Raises
    ------
    ValueError
        If a teacher distribution read has a zero (the teacher's forced end): the average of
        its logs is $-\infty$ and NeMo-RL's $\epsilon$ makes the reverse KL infinite.

    Examples
    --------
    Identical tokenizers, ``eps=0``: $W = I$, every chunk one token, and the expected loss
    is the string-level KL (the sum of per-token KLs along the student's own prefixes).

    >>> s = make_model(("a", "b"), T=2, seed=0)
    >>> t = make_model(("a", "b"), T=3, seed=1)
    >>> toy = cross_toy_from_models(s, t)
    >>> out = projection_losses(toy, eps=0.0)
    >>> round(float(toy["p"] @ out["loss"] - string_kl(toy)), 12)
    0.0
    """
    _check_toy(toy)
    if not isinstance(reverse, bool) or not isinstance(include_eos, bool):
        raise TypeError(f"reverse and include_eos must be True or False, got {reverse!r} and "
                        f"{include_eos!r}")
    eps = check_finite_number("eps", eps, low=0.0)
    student, teacher = toy["student"], toy["teacher"]
    W = projection_matrix(student["vocab"], teacher["vocab"])
    losses, grads = np.zeros(len(toy["sequences"])), []
    n_chunks = np.zeros(len(toy["sequences"]), dtype=np.int64)
    for m, (ids, t_ids) in enumerate(zip(toy["sequences"], toy["teacher_tokens"])):
        cond, t_cond = toy["cond"][m], toy["teacher_cond"][m]
        if (t_cond <= 0).any():
            raise ValueError("a teacher distribution has a zero (the teacher's forced end): "
                             "the projection KL is infinite; give the teacher a larger T")
        groups = list(zip(*align_groups(token_offsets(ids, student["vocab"]),
                                        token_offsets(t_ids, teacher["vocab"]))))
        groups = [pair for pair in groups if pair[0] and pair[1]]  # NeMo-RL's valid chunks
        if include_eos:
            groups.append(([len(ids)], [len(t_ids)]))
        grad = np.zeros_like(cond)
        for ks, js in groups:
            u = (cond[ks] @ W).sum(axis=0) / (len(ks) + eps)  # average of probabilities
            total = u.sum() + eps
            q = u / total
            # With eps = 0 an entry q_v = 0 is 0 by structure here (a forced end, or a teacher
            # token no student token maps to): 0 log 0 = 0, and it gets no gradient.
            live = q + eps > 0
            log_q = np.log(np.where(live, q + eps, 1.0))
            log_t = np.log(t_cond[js]).sum(axis=0) / (len(js) + eps)  # average of logs
            if reverse:
                losses[m] += float(np.sum(np.where(live, (q + eps) * (log_q - log_t), 0.0)))
                dq = np.where(live, log_q - log_t + 1.0, 0.0)  # d/dq (q + eps)(log(q + eps) - l)
            else:
                if not live.all():
                    raise ValueError("eps = 0 with the forward KL: a zero of the student's "
                                     "projected chunk makes it infinite; use eps > 0")
                losses[m] += float(np.sum(np.exp(log_t) * (log_t - log_q)))
                dq = -np.exp(log_t) / (q + eps)
            du = dq / total - (dq @ u) / total**2  # through q = u / (sum u + eps)
            grad[ks] += (W @ du) / (len(ks) + eps)
        grads.append(grad)
        n_chunks[m] = len(groups)
    return dict(loss=losses, grad=grads, chunks=n_chunks)


def token_kl_losses(toy):
    r"""The per-token full-vocabulary reverse KL $\sum_k \mathrm{KL}(\pi_k \| \rho_k)$ along the
    student's sequence, for identical tokenizers only (the same-tokenizer reference: what
    [opd_literate.opd.full_vocab_reverse_kl][] sums).

    Examples
    --------
    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=1)
    >>> t = model_from_logits(("a", "b"), np.log([[0.5, 0.25, 0.25]] * 3), T=2)
    >>> toy = cross_toy_from_models(s, t)
    >>> round(float(token_kl_losses(toy)["loss"][0]), 4)  # (log(2/3) + 2 log(4/3)) / 3
    0.0566
    """
    _check_toy(toy)
    if toy["student"]["vocab"] != toy["teacher"]["vocab"]:
        raise ValueError("token_kl_losses needs identical tokenizers, got "
                         f"{toy['student']['vocab']!r} and {toy['teacher']['vocab']!r}")
    losses, grads = np.zeros(len(toy["sequences"])), []
    for m, (cond, t_cond) in enumerate(zip(toy["cond"], toy["teacher_cond"])):
        with np.errstate(divide="ignore", invalid="ignore"):
            log_ratio = np.where(cond > 0, np.log(cond) - np.log(t_cond), 0.0)
        losses[m] = float(np.sum(np.where(cond > 0, cond * log_ratio, 0.0)))
        grads.append(log_ratio + 1.0)
    return dict(loss=losses, grad=grads)


# ---------------------------------------------------------------------------------------------
# Expected gradients and the bias
# ---------------------------------------------------------------------------------------------
def _theta_grad(toy, m, grad):
    """d loss / d theta_S of sequence m from d loss / d pi_k: the softmax Jacobian, per row."""
    cond = toy["cond"][m]
    out = np.zeros_like(toy["score"][m])
    # dl/dz_k = pi_k * (g_k - <g_k, pi_k>); a forced end (pi = e_eos) gives 0
    dz = cond * (grad - (grad * cond).sum(axis=1, keepdims=True))
    np.add.at(out, _rows(toy["sequences"][m]), dz)
    return out


def _check_losses(toy, losses):
    """``(loss (M,), [grad (n_m + 1, K + 1)])`` of a per-sequence loss on ``toy``: one finite
    loss and one finite gradient of the shape of ``toy["cond"][m]`` for every sequence."""
    if not isinstance(losses, dict) or not {"loss", "grad"} <= set(losses):
        raise TypeError("losses must be a dict with 'loss' and 'grad', as uld_losses, "
                        "projection_losses and token_kl_losses return")
    M = len(toy["sequences"])
    loss = check_real_array("losses['loss']", losses["loss"], 1)
    if loss.shape != (M,):
        raise ValueError(f"losses['loss'] must have shape ({M},), one per sequence, got "
                         f"{loss.shape}")
    grads = losses["grad"]
    if isinstance(grads, np.ndarray) or not hasattr(grads, "__len__") or len(grads) != M:
        raise ValueError(f"losses['grad'] must be a list of {M} gradients, one per sequence")
    checked = []
    for m, (g, cond) in enumerate(zip(grads, toy["cond"])):
        g = check_real_array(f"losses['grad'][{m}]", g, 2)
        if g.shape != cond.shape:
            raise ValueError(f"losses['grad'][{m}] must have the shape of the sequence's "
                             f"conditionals, {cond.shape}, got {g.shape}")
        checked.append(g)
    return loss, checked


def expected_gradient(toy, losses):
    r"""On-policy expectations of a per-sequence loss: its value $\sum_\tau p_S(\tau)
    \ell(\tau)$, its pathwise gradient $\sum_\tau p_S(\tau) \nabla \ell(\tau)$ (what a trainer
    backpropagates) and the gradient of its expected value (pathwise plus
    $\sum_\tau p_S(\tau)\, \ell(\tau)\, s(\tau)$).

    Examples
    --------
    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=1)
    >>> t = model_from_logits(("a", "b"), np.log([[0.5, 0.25, 0.25]] * 3), T=2)
    >>> toy = cross_toy_from_models(s, t)
    >>> e = expected_gradient(toy, projection_losses(toy, eps=0.0))
    >>> bool(np.allclose(e["total"], string_kl_grad(toy), atol=1e-12))
    True
    """
    _check_toy(toy)
    loss, grads = _check_losses(toy, losses)
    pathwise = sum(p * _theta_grad(toy, m, g) for m, (p, g) in enumerate(zip(toy["p"], grads)))
    total = pathwise + np.einsum("m,m,mrv->rv", toy["p"], loss, toy["score"])
    return dict(value=float(toy["p"] @ loss), pathwise=pathwise, total=total)


_METHODS = ("uld", "hybrid", "projection", "token_kl")


def _losses(toy, method, options):
    if method == "uld":
        return uld_losses(toy, **options)
    if method == "hybrid":
        return uld_losses(toy, hybrid=True, **options)
    if method == "projection":
        return projection_losses(toy, **options)
    if method == "token_kl":
        return token_kl_losses(toy, **options)
    raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def _compare(g, exact):
    norm = float(np.linalg.norm(exact))
    return (float(np.linalg.norm(g - exact)) / norm,
            float(np.sum(g * exact)) / (float(np.linalg.norm(g)) * norm))


def bias(toy, method, teacher="marginal", **options):
    r"""A method's expected value and gradients against the exact string-level KL.

    Parameters
    ----------
    toy : dict
        From ``make_cross_toy`` or ``cross_toy_from_models``.
    method : {"uld", "hybrid", "projection", "token_kl"}
        ``uld_losses``, ``uld_losses(hybrid=True)``, ``projection_losses``,
        ``token_kl_losses``; ``options`` go to it.
    teacher : {"marginal", "canonical"}
        The teacher's string probability in the exact objective.

    Returns
    -------
    dict
        ``value``, ``exact_value``; ``rel_norm`` $\|g - g^*\| / \|g^*\|$ and ``cosine`` of the
        pathwise gradient $g$ against the exact $g^*$; ``total_rel_norm``, ``total_cosine``
        for the gradient of the expected value.

    Examples
    --------
    >>> r = bias(make_cross_toy("identical"), "projection", eps=0.0)
    >>> round(r["value"] - r["exact_value"], 12), round(r["total_rel_norm"], 12)
    (0.0, 0.0)
    """
    losses = _losses(toy, method, options)
    e = expected_gradient(toy, losses)
    exact = string_kl_grad(toy, teacher)
    rel, cos = _compare(e["pathwise"], exact)
    total_rel, total_cos = _compare(e["total"], exact)
    return dict(value=e["value"], exact_value=string_kl(toy, teacher), rel_norm=rel,
                cosine=cos, total_rel_norm=total_rel, total_cosine=total_cos)


TABLE_METHODS = (
    ("ULD (TRL's ULD options)", "uld", {}),
    ("ULD, bayesian merge", "uld", {"merge": "bayesian"}),
    ("GOLD hybrid, beta = 1", "hybrid", {"beta": 1.0}),
    ("GOLD hybrid, bayesian, beta = 1", "hybrid", {"merge": "bayesian", "beta": 1.0}),
    ("projection (NeMo-RL P-KL, reverse)", "projection", {}),
)
"""The rows of ``bias_table``: a label, the method and its options."""


def bias_table(kinds=tuple(KINDS), T=3, seed=0):
    r"""The exact bias of every method of ``TABLE_METHODS`` on ``make_cross_toy(kind, T,
    seed)``: a list of dicts with ``kind``, ``method`` (the label) and ``bias``'s keys.

    Examples
    --------
    >>> rows = bias_table(kinds=("identical",), T=2)
    >>> [round(r["total_rel_norm"], 12) for r in rows if r["method"].startswith("projection")]
    [0.0]
    """
    rows = []
    for kind in kinds:
        toy = make_cross_toy(kind, T=T, seed=seed)
        for label, method, options in TABLE_METHODS:
            if method == "projection" and kind == "identical":
                options = dict(options, eps=0.0)  # the exact case, without NeMo-RL's epsilon
            rows.append(dict(kind=kind, method=label, **bias(toy, method, **options)))
    return rows


def retokenized_share(toy):
    r"""How different the two tokenizations are: the probability, under the student, that the
    teacher's canonical tokenization of the response splits its string elsewhere than the
    student's own tokens,

    $$
    \sum_\tau p_S(\tau)\, \mathbb{1}\big[t(x(\tau)) \ne \tau\big],
    $$

    the two compared as sequences of token strings. 0 where both tokenizers write every string
    alike (``identical``).

    Examples
    --------
    A uniform student over ``a``, ``b`` and the end, at most two tokens: ``ab`` has
    $p_S = 1/3 \cdot 1/3$, and it is the one string the merging teacher writes as one token.

    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=2)
    >>> t = model_from_logits(("a", "b", "ab"), np.zeros((4, 4)), T=3)
    >>> round(retokenized_share(cross_toy_from_models(s, t)), 6)
    0.111111
    >>> retokenized_share(make_cross_toy("identical"))
    0.0
    """
    _check_toy(toy)
    student, teacher = toy["student"]["vocab"], toy["teacher"]["vocab"]
    differs = np.array([tuple(student[i] for i in ids) != tuple(teacher[j] for j in tokens)
                        for ids, tokens in zip(toy["sequences"], toy["teacher_tokens"])])
    return float(toy["p"][differs].sum())


def retokenization_sweep(kind, seeds, T=3, scale=1.5):
    r"""The bias of every method of ``TABLE_METHODS`` against how different the tokenizations
    are, over random draws: for each seed of ``seeds``, ``make_cross_toy(kind, T, seed, scale)``
    and a dict with ``seed``, ``share`` (``retokenized_share``) and ``bias``, ``{label: bias(toy,
    method, **options)}``.

    The draws' logits set how often the student writes the strings the two tokenizers split
    differently, so ``share`` spreads over the seeds (with ``scale=1.5``, from 0.001 to 0.62 on
    ``teacher_merges`` over seeds 0 to 39).

    Examples
    --------
    >>> rows = retokenization_sweep("identical", [0, 1], T=2)
    >>> [r["share"] for r in rows]
    [0.0, 0.0]
    >>> [round(r["bias"]["projection (NeMo-RL P-KL, reverse)"]["total_rel_norm"], 6) < 1e-6
    ...  for r in rows]  # exact up to NeMo-RL's epsilon of 1e-10
    [True, True]
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    seeds = list(seeds)
    if not seeds or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0
                        for x in seeds):
        raise ValueError(f"seeds must be non-negative integers, at least one, got {seeds!r}")
    rows = []
    for seed in seeds:
        toy = make_cross_toy(kind, T=T, seed=int(seed), scale=scale)
        rows.append(dict(seed=int(seed), share=retokenized_share(toy),
                         bias={label: bias(toy, method, **options)
                               for label, method, options in TABLE_METHODS}))
    return rows


# ---------------------------------------------------------------------------------------------
# TRL's tensors
# ---------------------------------------------------------------------------------------------
def trl_batch(toy):
    r"""The toy's sequences as the batch TRL's ``ULDLoss`` reads (numpy arrays; one row per
    student sequence, in the toy's order).

    Each side is ``[<eos>] + tokens + [<eos>]``: the end token doubles as the one-token prompt
    (label ``-100``), the completion and its end are labelled, rows are right-padded (label
    ``-100``, id ``<eos>``, logits 0, offsets ``(0, 0)``). ``logits[i]`` predicts token
    ``i + 1`` (the causal-LM convention): the log of the model's conditional (``-inf`` where
    the student's end is forced), and 0 after the last token. Offsets are completion-relative
    character offsets, ``(len, len)`` for the end, as ``build_teacher_inputs_from_texts``
    writes them.

    Returns
    -------
    dict
        ``student_logits`` (M, L_S, V_S), ``teacher_logits`` (M, L_T, V_T), ``student_labels``,
        ``teacher_labels``, ``student_input_ids``, ``teacher_input_ids`` (int64),
        ``student_byte_offsets``, ``teacher_byte_offsets`` (M, L, 2) int64.

    Examples
    --------
    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=1)
    >>> batch = trl_batch(cross_toy_from_models(s, s))
    >>> batch["student_input_ids"].tolist(), batch["student_labels"].tolist()
    ([[2, 2, 2], [2, 0, 2], [2, 1, 2]], [[-100, 2, -100], [-100, 0, 2], [-100, 1, 2]])
    """
    _check_toy(toy)
    out = {}
    for side, tokens, conds in (("student", toy["sequences"], toy["cond"]),
                                ("teacher", toy["teacher_tokens"], toy["teacher_cond"])):
        model = toy[side]
        eos = model["eos"]
        L = max(len(t) for t in tokens) + 2
        M = len(tokens)
        logits = np.zeros((M, L, eos + 1))
        ids = np.full((M, L), eos, dtype=np.int64)
        labels = np.full((M, L), -100, dtype=np.int64)
        offsets = np.zeros((M, L, 2), dtype=np.int64)
        for m, (t, cond) in enumerate(zip(tokens, conds)):
            n = len(t)
            with np.errstate(divide="ignore"):
                logits[m, :n + 1] = np.log(cond)  # position i predicts token i + 1
            ids[m, 1:n + 1] = t
            labels[m, 1:n + 2] = list(t) + [eos]
            spans = token_offsets(t, model["vocab"])
            end = spans[-1][1] if spans else 0
            offsets[m, 1:n + 2] = spans + [(end, end)]
        out.update({f"{side}_logits": logits, f"{side}_input_ids": ids,
                    f"{side}_labels": labels, f"{side}_byte_offsets": offsets})
    return out


def logit_grads(toy, losses):
    r"""The gradient of TRL's batch loss (the mean of the per-sequence losses) with respect to
    ``trl_batch(toy)["student_logits"]``, from a loss's $\partial \ell / \partial \pi_k$.

    Examples
    --------
    >>> s = model_from_logits(("a", "b"), np.zeros((3, 3)), T=1)
    >>> toy = cross_toy_from_models(s, s)
    >>> logit_grads(toy, uld_losses(toy)).shape
    (3, 3, 3)
    """
    _check_toy(toy)
    _, grads = _check_losses(toy, losses)
    M = len(toy["sequences"])
    L = max(len(t) for t in toy["sequences"]) + 2
    out = np.zeros((M, L, toy["student"]["eos"] + 1))
    for m, (cond, g) in enumerate(zip(toy["cond"], grads)):
        # d mean / d z_k = pi_k * (g_k - <g_k, pi_k>) / M
        out[m, :len(cond)] = cond * (g - (g * cond).sum(axis=1, keepdims=True)) / M
    return out
