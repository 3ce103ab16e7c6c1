r"""An enumerable toy "language model" whose sampler and trainer disagree.

In RL for language models the *inference engine* that writes the rollouts and the *trainer*
that computes the gradient run the same weights through different code: other kernels, a
lower-precision LM head, a quantized rollout model. So the sampler's distribution $\mu$ is not
exactly the trainer's $\pi_\theta$, and a policy gradient computed as if the data came from
$\pi_\theta$ is biased. This module builds a toy small enough that every expectation is an exact
sum, so the bias and variance of any gradient estimator can be computed exactly.

The toy:

* A response is a sequence $y = (y_1, \dots, y_T)$ of tokens from a vocabulary of $V$; there
  are $M = V^T$ of them ($4^6 = 4096$ by default) and we list them all.
* The **trainer** draws position $t$ independently: $\pi(y_t = v) = \mathrm{softmax}(\theta_t)_v$.
  (A real LM conditions on the prefix; independence keeps the toy enumerable.)
* The **sampler** sees the same logits with an error: $\mu(y_t = v) = \mathrm{softmax}(\theta_t +
  \epsilon\, b_t)_v$, with $b$ a fixed table drawn from a Student-t with 3 degrees of freedom
  (heavy tails: a few tokens are far off, as with real numerical mismatch) and $\epsilon$ the
  ``mismatch``. $\epsilon = 0$ means sampler equals trainer.
* The reward is $R(y) = 1$ if at least half of the tokens are token 0, else 0.

For a softmax, $\partial \log \pi(y_t) / \partial \theta_t = e_{y_t} - \pi_t$ (one-hot minus
probabilities), and the derivative with respect to every other row $\theta_s$ is 0. The
``(T, V)`` array whose row $t$ is $e_{y_t} - \pi_t$ is the **score** $s_t$ of token $t$. The
objective is $J(\theta) = \mathbb{E}_{y \sim \pi}[R(y)]$, with exact gradient (REINFORCE, summed
over all sequences)

$$
\nabla_\theta J = \sum_{y} \pi(y)\, R(y) \sum_t s_t(y).
$$

Memory: the score array dominates, $M \cdot T \cdot V$ float64 values; all arrays together take
$8 M (3T + 3 + TV)$ bytes ([opd_literate.mismatch.toy.toy_nbytes][]). Some sizes: $(T, V) = (6, 4)$:
1.4 MiB; $(8, 4)$: 29.5 MiB; $(6, 8)$: 138 MiB; $(10, 4)$: 584 MiB; $(8, 6)$: 961 MiB;
$(12, 4)$: 10.9 GiB. Each estimate array of ``estimators`` is as large as ``score`` again.
``make_toy`` refuses, before allocating anything, a toy whose arrays would exceed
``MAX_TOY_BYTES`` (2 GiB) and says how much it would take.

**What holds only because the positions are independent.** The estimators of
[opd_literate.mismatch.estimators][] are defined for any sequence model, and the unbiasedness of the
sequence ratio ($\mathbb{E}_\mu[\rho f] = \mathbb{E}_\pi[f]$) holds for any. Three results on
these pages use the independence of this toy and fail for an autoregressive model, where
$\pi_t$ and $\mu_t$ depend on the sampled prefix:

* the product formula $\mathbb{E}_\mu[\rho^2] = \prod_t (1 + \chi^2(\pi_t \,\|\, \mu_t))$
  for the second moment of the sequence ratio (with a prefix, the factors are conditional on
  it and their product is not the expectation of the product);
* the exactness of the token ratio for a per-token objective
  ([opd_literate.mismatch.opd_mismatch][]): $\mathbb{E}_\mu[\rho_t f(y_t)] = \mathbb{E}_\pi[f(y_t)]$
  needs the marginal of $y_t$ under $\mu$ to be $\mu_t$, whatever the earlier tokens;
* the score of a sequence as a sum of per-position rows, $\partial \log \pi(y) / \partial
  \theta_t = e_{y_t} - \pi_t$, on which ``true_grad`` and every estimate here are built.

The numbers (how large each bias is) are those of this toy, not of a language model.
[opd_literate.mismatch.toy.make_ar_toy][] builds the autoregressive counterpart: there the product
formula and the exactness of the token ratio fail (``tests/mismatch/test_ar_toy.py``), and the
score of token $t$ is a row of the parameters $\theta_{t, p}$ of the state $p$ it was written in.

The sampler's logits must stay finite with room to spare: ``make_toy`` accepts
$|\epsilon| \le$ ``MAX_MISMATCH`` $= 10^6$ (at $10^{308}$ the logits $\epsilon b$ overflow to
infinity and the probabilities become NaN). Long before that bound the importance ratios of
[opd_literate.mismatch.estimators][] overflow float64, which they report as a clear error: on the
default toy (``T = 6, V = 4, seed = 0``) the sequence ratios do from $\epsilon \approx 38.2$ on,
the per-token ratios from $\epsilon \approx 164.3$ on.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .._numerics import check_finite_number, check_positive_int

__all__ = [
    "MAX_TOY_BYTES",
    "MAX_MISMATCH",
    "TOY_KEYS",
    "log_softmax",
    "toy_nbytes",
    "make_toy",
    "toy_from_logits",
    "sample_from_sampler",
    "estimator_moments",
    "check_toy",
    "AR_TOY_KEYS",
    "ar_num_responses",
    "ar_toy_nbytes",
    "make_ar_toy",
    "ar_toy_from_logits",
    "response_mask",
]

MAX_TOY_BYTES = 2 * 1024**3
"""The largest toy (all its arrays together, in bytes) that ``make_toy`` builds."""

MAX_MISMATCH = 1e6
r"""The largest $|\epsilon|$ that ``make_toy`` accepts (see the module's last paragraph)."""

TOY_KEYS = ("Y", "logp_train", "logp_sampler", "p_train", "p_sampler", "R", "score",
            "true_grad", "theta", "b", "mismatch", "T", "V")
"""The keys of the dictionary returned by ``make_toy``."""


def log_softmax(z):
    r"""Numerically stable $\log \mathrm{softmax}$ over the last axis.

    $\log \mathrm{softmax}(z)_v = z_v - \log \sum_u e^{z_u}$, computed after subtracting
    $\max_u z_u$ so that no exponential overflows.

    Parameters
    ----------
    z : array_like
        Logits, any shape; the last axis is the vocabulary.

    Returns
    -------
    numpy.ndarray
        Same shape as ``z``.

    Examples
    --------
    >>> np.exp(log_softmax(np.array([0.0, np.log(3.0)]))).round(4).tolist()
    [0.25, 0.75]
    >>> log_softmax(np.array([1000.0, 0.0])).round(4).tolist()  # no overflow
    [0.0, -1000.0]
    """
    z = np.asarray(z, dtype=float)
    with np.errstate(over="ignore"):  # a gap above float max: -inf, the limit (probability 0)
        shifted = z - z.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def toy_nbytes(T, V):
    """Bytes that the arrays of ``make_toy(T, V)`` take, without building them.

    ``Y`` (int64) and the float64 arrays ``logp_train``, ``logp_sampler`` are ``(M, T)``;
    ``p_train``, ``p_sampler``, ``R`` are ``(M,)``; ``score`` is ``(M, T, V)``; ``M = V**T``.

    Examples
    --------
    >>> toy_nbytes(6, 4)  # 4096 * (3 * 6 + 3 + 6 * 4) * 8
    1474560
    """
    M = V**T
    return 8 * M * (3 * T + 3 + T * V)


def make_toy(T=6, V=4, mismatch=0.3, seed=0):
    r"""Enumerate everything about the toy.

    The random draws are, in this order, from ``numpy.random.default_rng(seed)``:
    ``theta ~ Normal(0, 0.7)`` of shape ``(T, V)``, then ``b ~ Student-t(3)`` of shape
    ``(T, V)``. The sequences are listed in ``itertools.product`` order (the last position
    varies fastest).

    Parameters
    ----------
    T : int
        Response length, >= 1.
    V : int
        Vocabulary size, >= 1.
    mismatch : float
        $\epsilon$, with $|\epsilon| \le$ ``MAX_MISMATCH``: the sampler's logits are
        $\theta + \epsilon b$.
    seed : int
        Seed of the random table.

    Returns
    -------
    dict
        ``Y`` (M, T) every sequence; ``logp_train`` (M, T) $\log \pi(y_t)$; ``logp_sampler``
        (M, T) $\log \mu(y_t)$; ``p_train`` (M,) $\pi(y)$; ``p_sampler`` (M,) $\mu(y)$; ``R``
        (M,) reward; ``score`` (M, T, V) $e_{y_t} - \pi_t$; ``true_grad`` (T, V)
        $\nabla_\theta J$; and ``theta``, ``b``, ``mismatch``, ``T``, ``V``.

    Raises
    ------
    ValueError
        For ``T < 1``, ``V < 1``, a ``mismatch`` that is not finite or above
        ``MAX_MISMATCH`` in absolute value, or a toy larger than ``MAX_TOY_BYTES``.

    Examples
    --------
    >>> toy = make_toy()
    >>> toy["Y"].shape, toy["score"].shape
    ((4096, 6), (4096, 6, 4))
    >>> round(float(toy["p_train"].sum()), 12), round(float(toy["p_sampler"].sum()), 12)
    (1.0, 1.0)

    A two-token toy can be checked by hand: $R = 1$ unless neither token is 0, so
    $J = 1 - (1 - \pi_1(0))(1 - \pi_2(0))$.

    >>> small = make_toy(T=2, V=3, mismatch=0.0)
    >>> pi0 = np.exp(small["logp_train"][0])  # sequence (0, 0): pi_1(0), pi_2(0)
    >>> J = float(small["p_train"] @ small["R"])
    >>> round(float(J - (1 - (1 - pi0[0]) * (1 - pi0[1]))), 12)
    0.0
    """
    T, V = check_positive_int("T", T), check_positive_int("V", V)
    mismatch = _check_mismatch(mismatch)
    _check_toy_size(T, V, "make_toy")

    rng = np.random.default_rng(seed)
    theta = rng.normal(0.0, 0.7, size=(T, V))  # trainer logits
    b = rng.standard_t(3, size=(T, V))         # the sampler's heavy-tailed logit error
    toy = _enumerate(log_softmax(theta), log_softmax(theta + mismatch * b))
    return dict(toy, theta=theta, b=b, mismatch=mismatch)


def toy_from_logits(train_logits, sampler_logits):
    r"""The toy of ``make_toy`` with the trainer's and the sampler's logits given by hand.

    Position $t$ of the trainer is $\mathrm{softmax}$ of row $t$ of ``train_logits``, of the
    sampler $\mathrm{softmax}$ of row $t$ of ``sampler_logits``; positions are independent and
    the reward is the same as in ``make_toy``. Small enough to check by hand: the estimators'
    examples use it.

    Parameters
    ----------
    train_logits, sampler_logits : array_like
        ``(T, V)`` finite logits (log-probabilities work: ``np.log([[0.5, 0.5]])``).

    Returns
    -------
    dict
        The keys of ``make_toy``, with ``theta = train_logits``, ``b = sampler_logits -
        train_logits`` and ``mismatch = 1.0``.

    Examples
    --------
    One position, two tokens; the trainer is uniform, the sampler prefers token 0. Token 0
    is the only sequence with reward 1:

    >>> toy = toy_from_logits(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]))
    >>> toy["Y"].tolist(), toy["R"].tolist(), toy["p_sampler"].round(12).tolist()
    ([[0], [1]], [1.0, 0.0], [0.8, 0.2])
    >>> toy["true_grad"].round(12).tolist()  # pi(0) * (e_0 - pi) = 0.5 * (0.5, -0.5)
    [[0.25, -0.25]]
    """
    train = _check_logits("train_logits", train_logits)
    sampler = _check_logits("sampler_logits", sampler_logits)
    if sampler.shape != train.shape:
        raise ValueError(f"sampler_logits must have the shape of train_logits {train.shape}, "
                         f"got {sampler.shape}")
    T, V = train.shape
    _check_toy_size(T, V, "toy_from_logits")
    toy = _enumerate(log_softmax(train), log_softmax(sampler))
    return dict(toy, theta=train, b=sampler - train, mismatch=1.0)


def _enumerate(log_pi, log_mu):
    """Every array of the toy from the per-position log-probabilities, each (T, V)."""
    T, V = log_pi.shape
    if not (np.isfinite(log_pi).all() and np.isfinite(log_mu).all()):
        raise ValueError("a token has probability 0 (log-probability -inf) under the trainer or "
                         "the sampler: its importance ratio is undefined; use smaller logits")
    Y = np.array(list(itertools.product(range(V), repeat=T)), dtype=np.int64)  # (M, T)
    positions = np.arange(T)
    logp_train = log_pi[positions, Y]    # (M, T): log pi(y_t)
    logp_sampler = log_mu[positions, Y]  # (M, T): log mu(y_t)
    # Positions are independent: log pi(y) = sum_t log pi(y_t).
    p_train = np.exp(logp_train.sum(axis=1))
    p_sampler = np.exp(logp_sampler.sum(axis=1))
    R = ((Y == 0).mean(axis=1) >= 0.5).astype(float)
    # score[m, t] = onehot(y_t) - pi_t = d log pi(y_t) / d theta[t]
    score = np.eye(V)[Y] - np.exp(log_pi)[None]  # (M, T, V)
    # grad J = sum_y pi(y) R(y) sum_t score_t(y); the sum over t lands each score on its row.
    true_grad = np.einsum("m,m,mtv->tv", p_train, R, score)
    return dict(Y=Y, logp_train=logp_train, logp_sampler=logp_sampler, p_train=p_train,
                p_sampler=p_sampler, R=R, score=score, true_grad=true_grad, T=T, V=V)


def _check_logits(name, logits):
    array = np.asarray(logits)
    if array.dtype == bool or not (np.issubdtype(array.dtype, np.floating)
                                   or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(f"{name} must have shape (T, V) with T, V >= 1, got {array.shape}")
    array = array.astype(float)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite, got {float(array[~np.isfinite(array)][0])!r}")
    return array


def _check_toy_size(T, V, caller):
    """Refuse, before allocating anything, a toy whose arrays would exceed MAX_TOY_BYTES."""
    # log2 of the size first: V**T itself is a huge integer for T = 10**6 (too long to print).
    if T * math.log2(V) > 60:
        digits = T * math.log10(V)
        raise ValueError(
            f"{caller}(T={T}, V={V}) would enumerate V**T ~ 10^{digits:.0f} sequences, far above "
            f"MAX_TOY_BYTES = {MAX_TOY_BYTES / 1024**3:.0f} GiB; choose a smaller T or V"
        )
    nbytes = toy_nbytes(T, V)
    if nbytes > MAX_TOY_BYTES:
        raise ValueError(
            f"{caller}(T={T}, V={V}) would enumerate V**T = {V**T:,} sequences and take "
            f"{nbytes / 1024**3:.1f} GiB, above MAX_TOY_BYTES = {MAX_TOY_BYTES / 1024**3:.0f} GiB; "
            "choose a smaller T or V"
        )


def _check_mismatch(mismatch):
    mismatch = check_finite_number("mismatch", mismatch)
    if abs(mismatch) > MAX_MISMATCH:
        raise ValueError(
            f"mismatch must be in [-{MAX_MISMATCH:g}, {MAX_MISMATCH:g}] (MAX_MISMATCH), got "
            f"{mismatch!r}: the sampler's logits theta + mismatch * b would be too large to "
            "compute its probabilities"
        )
    return mismatch


# What opd_mismatch.add_teacher adds to a toy.
_TEACHER_KEYS = frozenset({"phi", "logp_teacher", "kl", "kl_grad", "kl_grad_per_state"})


def check_toy(toy, keys=("Y", "logp_train", "logp_sampler", "p_sampler", "score", "R",
                         "true_grad")):
    """Raise a ``ValueError`` naming the missing keys unless ``toy`` looks like ``make_toy``'s."""
    if not isinstance(toy, dict):
        raise TypeError(f"toy must be the dict returned by make_toy, got {type(toy).__name__}")
    missing = [k for k in keys if k not in toy]
    if missing:
        # The teacher's keys come from opd_mismatch.add_teacher, a step after make_toy.
        how = ("add a teacher with opd_literate.mismatch.opd_mismatch.add_teacher(toy)"
               if set(missing) <= _TEACHER_KEYS else "build it with make_toy or make_ar_toy")
        raise ValueError(f"toy is missing the keys {missing}; {how}")


def sample_from_sampler(toy, n, rng):
    r"""Draw ``n`` sequences from the sampler $\mu$, as the inference engine would.

    Parameters
    ----------
    toy : dict
        From ``make_toy``.
    n : int
        Number of draws, >= 0.
    rng : numpy.random.Generator

    Returns
    -------
    numpy.ndarray
        ``(n,)`` indices into ``toy["Y"]``.

    Examples
    --------
    >>> toy = make_toy(T=2, V=2, mismatch=0.0)
    >>> idx = sample_from_sampler(toy, 100_000, np.random.default_rng(0))
    >>> bool(abs(np.mean(idx == 0) - toy["p_sampler"][0]) < 0.01)
    True
    """
    check_toy(toy, keys=("p_sampler",))
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    # Renormalize: the product of T per-token probabilities sums to 1 only up to rounding,
    # and Generator.choice rejects probabilities that do not sum to 1 within its tolerance.
    p = toy["p_sampler"] / toy["p_sampler"].sum()
    return rng.choice(len(p), size=n, p=p)


def estimator_moments(toy, per_seq_estimate):
    r"""Exact mean, bias and variance of a single-sample gradient estimator.

    If the sampler produces sequence $y_m$ (probability $\mu(y_m)$), the estimator returns
    ``per_seq_estimate[m]``, a ``(T, V)`` array $\hat g_m$. Then, exactly,

    $$
    \bar g = \sum_m \mu(y_m)\, \hat g_m, \qquad
    \text{bias} = \lVert \bar g - \nabla J \rVert, \qquad
    \text{var} = \sum_m \mu(y_m)\, \lVert \hat g_m - \bar g \rVert^2 ,
    $$

    (Frobenius norms; ``var`` is the total variance of one sample), and a batch average over
    $N$ independent samples has relative root-mean-square error

    $$
    \mathrm{RMSE}_{\mathrm{rel}}(N)
    = \sqrt{\text{bias}^2 + \text{var} / N} \,/\, \lVert \nabla J \rVert .
    $$

    **Parameters shared by the positions.** In the toys each position has its own parameters,
    so row $t$ of an estimate is token $t$'s part and the rows together are the gradient. In a
    language model every token's score is a gradient with respect to the same weights (tinylm's
    LM head, [opd_literate.experiment.quantized.answer_toy][]): such a toy sets
    ``toy["shared_parameters"] = True``, its ``true_grad`` has the shape of one row, and an
    estimate ``(M, T, ...)`` is summed over its positions first,
    $\hat g_m = \sum_t \hat g_{m,t}$. Nothing else changes.

    Parameters
    ----------
    toy : dict
        From ``make_toy`` (needs ``p_sampler``, ``true_grad``).
    per_seq_estimate : numpy.ndarray
        ``(M, T, V)`` (``(M, T) + true_grad.shape`` with shared parameters).

    Returns
    -------
    dict
        ``mean`` (T, V), ``bias``, ``var``, ``rel_bias`` (floats) and ``rel_rmse`` (a function
        of N).

    Examples
    --------
    Returning the true gradient whatever the sample is unbiased and has no variance:

    >>> toy = make_toy(T=3, V=2)
    >>> exact = np.broadcast_to(toy["true_grad"], toy["score"].shape)
    >>> m = estimator_moments(toy, exact)
    >>> round(m["bias"], 12), round(m["var"], 12), round(m["rel_rmse"](10), 12)
    (0.0, 0.0, 0.0)
    """
    check_toy(toy, keys=("p_sampler", "true_grad"))
    target = np.asarray(toy["true_grad"])
    estimate = np.asarray(per_seq_estimate)
    if toy["p_sampler"].ndim != 1 or toy["p_sampler"].shape[0] == 0:
        raise ValueError("toy['p_sampler'] must be a non-empty (M,) array of probabilities, got "
                         f"shape {toy['p_sampler'].shape}")
    if toy.get("shared_parameters", False):
        # every position's row is a gradient of the same parameters: g_m = sum_t g_{m,t}
        if estimate.ndim == target.ndim + 2 and estimate.shape[2:] == target.shape:
            estimate = estimate.sum(axis=1)
    expected_shape = (toy["p_sampler"].shape[0],) + target.shape
    if estimate.shape != expected_shape:
        raise ValueError(
            f"per_seq_estimate must have shape (M, T, V) = {expected_shape}, got {estimate.shape}"
        )
    largest = float(np.abs(estimate).max(initial=0.0))  # NaN or inf if any value is
    if not np.isfinite(largest):
        raise ValueError(f"per_seq_estimate holds {int((~np.isfinite(estimate)).sum())} "
                         "non-finite values; its moments would be NaN")
    mu = toy["p_sampler"]
    # Squares of values beyond 2**500 could overflow, below 2**-500 underflow: then work on
    # x / 2**k with 2**k <= the largest |value| (exact, a power of two), take the ratios there,
    # and scale back only the absolute moments (inf at worst, never inf - inf or 0 * inf = NaN).
    largest = max(largest, float(np.abs(target).max(initial=0.0)))
    if largest > 2.0**500 or 0 < largest < 2.0**-500:
        scale = np.ldexp(1.0, np.frexp(largest)[1] - 1)
        estimate, target = estimate / scale, target / scale
    else:
        scale = np.float64(1.0)
    # The parameters may have any shape: (T, V) here, (T, V + 1, V) for make_ar_toy.
    mean_scaled = np.einsum("m,m...->...", mu, estimate)
    # sum_m mu_m ||g_m - mean||^2, from the centred values: E||g||^2 - ||mean||^2 would lose
    # every digit to cancellation when the variance is small against the mean.
    centred = estimate - mean_scaled
    flat = centred.reshape(len(mu), -1)  # (M, number of parameters)
    var_scaled = float(np.einsum("m,mk,mk->", mu, flat, flat))
    bias_scaled = float(np.linalg.norm(mean_scaled - target))
    norm_scaled = float(np.linalg.norm(target))
    with np.errstate(over="ignore"):  # a huge estimate has an infinite variance: inf, not NaN
        mean = mean_scaled * scale
        var = float(var_scaled * scale * scale)
        bias = float(bias_scaled * scale)

    def relative(error_scaled):
        # A zero true gradient (T = V = 1, say) has no relative scale: 0 stays 0, else inf.
        if norm_scaled > 0:
            return error_scaled / norm_scaled
        return 0.0 if error_scaled == 0 else math.inf

    def rel_rmse(N):
        if not N >= 1:
            raise ValueError(f"N must be >= 1, got {N!r}")
        return relative(math.sqrt(bias_scaled**2 + var_scaled / N))

    return dict(mean=mean, bias=bias, var=var, rel_bias=relative(bias_scaled),
                rel_rmse=rel_rmse)


# ---------------------------------------------------------------------------------------------
# The autoregressive toy: the prefix matters, and responses can end early at <eos>
# ---------------------------------------------------------------------------------------------
AR_TOY_KEYS = ("Y", "mask", "prev", "logp_train", "logp_sampler", "p_train", "p_sampler", "R",
               "score", "true_grad", "theta", "b", "mismatch", "T", "V", "eos")
"""The keys of the dictionary returned by ``make_ar_toy``: those of ``make_toy`` (``TOY_KEYS``)
and ``mask``, ``prev``, ``eos``."""

START = 0
"""The row of ``theta[t]`` read at $t = 0$ (the start symbol); row $1 + u$ follows token $u$."""


def ar_num_responses(T, V, eos=True):
    r"""The number $M$ of responses that ``make_ar_toy(T, V, eos=eos)`` enumerates.

    Without ``<eos>`` every sequence of length $T$: $M = V^T$. With it, token $V - 1$ ends the
    response, so a response is $k$ ordinary tokens followed by ``<eos>`` ($0 \le k \le T - 2$),
    or $T - 1$ ordinary tokens followed by any token (``<eos>`` or not):

    $$
    M = \sum_{k=0}^{T-2} (V-1)^k + (V-1)^{T-1} V = \sum_{k=0}^{T} (V - 1)^k .
    $$

    Examples
    --------
    >>> ar_num_responses(2, 2), ar_num_responses(5, 3), ar_num_responses(5, 3, eos=False)
    (3, 63, 243)
    """
    T, V = check_positive_int("T", T), check_positive_int("V", V)
    if not eos:
        return V**T
    return sum((V - 1) ** k for k in range(T + 1))


def ar_toy_nbytes(T, V, eos=True):
    """Bytes that the arrays of ``make_ar_toy(T, V, eos=eos)`` take, without building them.

    ``Y``, ``prev`` (int64) and ``mask``, ``logp_train``, ``logp_sampler`` (float64) are
    ``(M, T)``; ``p_train``, ``p_sampler``, ``R`` are ``(M,)``; ``score`` is
    ``(M, T, V + 1, V)``, with ``M = ar_num_responses(T, V, eos)``.

    Examples
    --------
    >>> ar_toy_nbytes(5, 3)  # 63 * (5 * 5 + 3 + 5 * 4 * 3) * 8
    44352
    """
    M = ar_num_responses(T, V, eos)
    return 8 * M * (5 * T + 3 + T * (V + 1) * V)


def make_ar_toy(T=5, V=3, mismatch=0.3, seed=0, eos=True):
    r"""An enumerable autoregressive toy: each token depends on the one before it.

    The trainer writes token $t$ (counted from 0) with probability
    $\pi(y_t = v \mid y_{t-1}) = \mathrm{softmax}(\theta_{t, p})_v$, where the row
    $p = 1 + y_{t-1}$ is the previous token and $p = 0$ the start symbol at $t = 0$: the
    parameters ``theta`` have shape ``(T, V + 1, V)``. The sampler reads the same rows with a
    fixed error, $\mu(y_t = v \mid y_{t-1}) = \mathrm{softmax}(\theta_{t,p} + \epsilon\,
    b_{t,p})_v$, with $b$ from a Student-t with 3 degrees of freedom as in ``make_toy``.
    Because the row depends on the sampled prefix, $\pi_t$ and $\mu_t$ are conditional
    distributions: the three results that ``make_toy`` owes to independence (module
    docstring) fail here.

    **<eos>.** With ``eos=True`` the token $V - 1$ is ``<eos>``: it ends the response, which is
    then padded to length $T$. A response of $n$ tokens (``<eos>`` included, the last token
    counts even when it is not ``<eos>``) has ``mask`` 1 on its first $n$ positions and 0
    after. The padding holds the token ``V - 1`` in ``Y`` (a valid index, never read as a
    token), log-probability 0 in ``logp_train`` and ``logp_sampler`` (after ``<eos>`` the
    rest is certain under both models, so every importance ratio there is 1), row
    ``prev = V`` and a score of 0. So every array built from them ignores the padding: a
    sequence's log-probability is the sum of its row, and a weight times the score is 0 there.

    **The reward and the objective.** $R(y) = 1$ if at least half of the $n$ tokens of the
    response are token 0 (``<eos>`` counts as a token that is not 0), else 0; without
    ``<eos>`` it is ``make_toy``'s reward. $J(\theta) = \mathbb{E}_{y \sim \pi}[R(y)]$. The
    score of a sequence is the gradient of $\log \pi(y) = \sum_{t < n} \log
    \pi(y_t \mid y_{t-1})$: token $t$ contributes $e_{y_t} - \pi(\cdot \mid y_{t-1})$ to the
    row $(t, 1 + y_{t-1})$ of the parameters and nothing elsewhere, so ``score[m, t]`` is a
    ``(V + 1, V)`` array with one non-zero row, and

    $$
    \nabla_\theta J = \sum_y \pi(y)\, R(y) \sum_{t < n(y)} s_t(y)
    $$

    (``true_grad``, shape ``(T, V + 1, V)``; the rows no response visits, such as
    $\theta_{0, p}$ for $p \ge 1$, get 0). Every estimator of
    [opd_literate.mismatch.estimators][] and [opd_literate.mismatch.toy.estimator_moments][] accept
    this toy: an estimate is ``(M, T, V + 1, V)``, and the per-token weight of row $t$ multiplies
    the score of token $t$.

    The random draws are, in this order, from ``numpy.random.default_rng(seed)``:
    ``theta ~ Normal(0, 0.7)`` then ``b ~ Student-t(3)``, each of shape ``(T, V + 1, V)``. The
    responses are listed in lexicographic order of ``Y`` (padding included).

    Parameters
    ----------
    T : int
        Largest response length, >= 1.
    V : int
        Vocabulary size, >= 1 (>= 2 with ``eos``: ``<eos>`` and at least one other token).
    mismatch : float
        $\epsilon$, $|\epsilon| \le$ ``MAX_MISMATCH``.
    seed : int
        Seed of the random tables, >= 0.
    eos : bool
        Whether token ``V - 1`` is ``<eos>``. ``False``: every response has length $T$.

    Returns
    -------
    dict
        The keys of ``make_toy`` with ``score`` ``(M, T, V + 1, V)`` and ``true_grad``,
        ``theta``, ``b`` ``(T, V + 1, V)``; ``logp_train``, ``logp_sampler`` are the
        conditional log-probabilities $\log \pi(y_t \mid y_{t-1})$ (0 on padding); and
        ``mask`` (M, T) float 1/0, ``prev`` (M, T) the row read at each position, ``eos``
        (``V - 1`` or ``None``). ``M = ar_num_responses(T, V, eos)``.

    Raises
    ------
    ValueError, TypeError
        For a ``T``, ``V`` or ``seed`` that is not a positive (non-negative for ``seed``)
        integer, ``eos`` that is not a bool, ``V < 2`` with ``eos``, a ``mismatch`` that is
        not finite or above ``MAX_MISMATCH``, or a toy larger than ``MAX_TOY_BYTES``.

    Examples
    --------
    $T = 2$, $V = 2$: token 1 is ``<eos>``, so the responses are $(0, 0)$, $(0, \text{eos})$
    and $(\text{eos})$, padded with token 1:

    >>> toy = make_ar_toy(T=2, V=2)
    >>> toy["Y"].tolist(), toy["mask"].tolist(), toy["R"].tolist()
    ([[0, 0], [0, 1], [1, 1]], [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]], [1.0, 1.0, 0.0])
    >>> toy["score"].shape, round(float(toy["p_train"].sum()), 12)
    ((3, 2, 3, 2), 1.0)

    The rows read: the start symbol (row 0) at $t = 0$, then row $1 + y_0$; the padding's row
    is $V = 2$ with a score of 0:

    >>> toy["prev"].tolist(), float(np.abs(toy["score"][2, 1]).max())
    ([[0, 1], [0, 1], [0, 2]], 0.0)
    """
    T, V = check_positive_int("T", T), check_positive_int("V", V)
    mismatch = _check_mismatch(mismatch)
    eos = _check_eos(eos, V)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    _check_ar_size(T, V, eos, "make_ar_toy")
    rng = np.random.default_rng(seed)
    theta = rng.normal(0.0, 0.7, size=(T, V + 1, V))  # trainer logits, one row per previous token
    b = rng.standard_t(3, size=(T, V + 1, V))         # the sampler's logit error, same layout
    toy = _enumerate_ar(log_softmax(theta), log_softmax(theta + mismatch * b), eos)
    return dict(toy, theta=theta, b=b, mismatch=mismatch)


def ar_toy_from_logits(train_logits, sampler_logits, eos=True):
    r"""The toy of ``make_ar_toy`` with the trainer's and the sampler's logits given by hand.

    Parameters
    ----------
    train_logits, sampler_logits : array_like
        ``(T, V + 1, V)`` finite logits: row ``[t, 0]`` is read at $t = 0$, row
        ``[t, 1 + u]`` after token $u$ (rows never read may hold anything finite).
    eos : bool
        Whether token ``V - 1`` is ``<eos>``.

    Returns
    -------
    dict
        The keys of ``make_ar_toy``, with ``theta = train_logits``, ``b = sampler_logits -
        train_logits`` and ``mismatch = 1.0``.

    Examples
    --------
    $T = 2$, $V = 2$, token 1 is ``<eos>``. The trainer is uniform everywhere; the sampler
    writes token 0 first with probability 0.8, then uniformly. The responses $(0, 0)$,
    $(0, \text{eos})$, $(\text{eos})$ have $\pi = (0.25, 0.25, 0.5)$ and
    $\mu = (0.4, 0.4, 0.2)$; the reward is $(1, 1, 0)$, so $J = 0.5$:

    >>> half, skew = np.log([0.5, 0.5]), np.log([0.8, 0.2])
    >>> toy = ar_toy_from_logits([[half, half, half], [half, half, half]],
    ...                          [[skew, half, half], [half, half, half]])
    >>> toy["p_train"].round(12).tolist(), toy["p_sampler"].round(12).tolist()
    ([0.25, 0.25, 0.5], [0.4, 0.4, 0.2])

    Only the first token matters for the reward: $\nabla J$ is $0.5 \cdot (0.5, -0.5)$ in
    the start row of $t = 0$ (both responses with $R = 1$ begin with token 0, and
    $e_0 - \pi = (0.5, -0.5)$), and 0 in the row after token 0 (both continuations earn 1):

    >>> toy["true_grad"][0, 0].round(12).tolist(), toy["true_grad"][1, 1].round(12).tolist()
    ([0.25, -0.25], [0.0, 0.0])
    """
    train = _check_ar_logits("train_logits", train_logits)
    sampler = _check_ar_logits("sampler_logits", sampler_logits)
    if sampler.shape != train.shape:
        raise ValueError(f"sampler_logits must have the shape of train_logits {train.shape}, "
                         f"got {sampler.shape}")
    T, _, V = train.shape
    eos = _check_eos(eos, V)
    _check_ar_size(T, V, eos, "ar_toy_from_logits")
    toy = _enumerate_ar(log_softmax(train), log_softmax(sampler), eos)
    return dict(toy, theta=train, b=sampler - train, mismatch=1.0)


def response_mask(toy):
    """The ``(M, T)`` float mask of a toy: ``toy["mask"]``, or all ones for ``make_toy``'s.

    Examples
    --------
    >>> response_mask(make_toy(T=2, V=2)).tolist()
    [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    >>> response_mask(make_ar_toy(T=2, V=2)).sum(axis=1).tolist()  # the lengths
    [2.0, 2.0, 1.0]
    """
    check_toy(toy, keys=("logp_train",))
    if "mask" in toy:
        return np.asarray(toy["mask"], dtype=float)
    return np.ones(np.shape(toy["logp_train"]))


def _ar_responses(T, V, eos):
    """(Y, lengths): every response, padded with eos, in lexicographic order."""
    if eos is None:
        Y = np.array(list(itertools.product(range(V), repeat=T)), dtype=np.int64)
        return Y, np.full(len(Y), T, dtype=np.int64)
    blocks, lengths = [], []
    for n in range(1, T + 1):
        # n - 1 ordinary tokens, then <eos> (n < T) or any token (n = T)
        heads = list(itertools.product(range(V - 1), repeat=n - 1))
        heads = np.array(heads, dtype=np.int64).reshape(len(heads), n - 1)
        last = np.array([eos] if n < T else range(V), dtype=np.int64)
        block = np.full((len(heads) * len(last), T), eos, dtype=np.int64)
        block[:, : n - 1] = np.repeat(heads, len(last), axis=0)
        block[:, n - 1] = np.tile(last, len(heads))
        blocks.append(block)
        lengths.append(np.full(len(block), n, dtype=np.int64))
    Y, n = np.concatenate(blocks), np.concatenate(lengths)
    order = np.lexsort(Y.T[::-1])  # lexicographic: the first position is the primary key
    return Y[order], n[order]


def _enumerate_ar(log_pi, log_mu, eos):
    """Every array of the autoregressive toy from the (T, V + 1, V) conditional log-probs."""
    T, _, V = log_pi.shape
    if not (np.isfinite(log_pi).all() and np.isfinite(log_mu).all()):
        raise ValueError("a token has probability 0 (log-probability -inf) under the trainer or "
                         "the sampler: its importance ratio is undefined; use smaller logits")
    Y, n = _ar_responses(T, V, eos)  # (M, T), (M,)
    M = len(Y)
    real = np.arange(T)[None, :] < n[:, None]  # (M, T): the response's own tokens
    prev = np.empty_like(Y)
    prev[:, 0] = START
    prev[:, 1:] = 1 + Y[:, :-1]  # row 1 + u after token u (the padding's row is 1 + eos)
    positions = np.arange(T)[None, :]
    # log pi(y_t | y_{t-1}) on the response, 0 = log 1 on the padding
    logp_train = np.where(real, log_pi[positions, prev, Y], 0.0)
    logp_sampler = np.where(real, log_mu[positions, prev, Y], 0.0)
    # chain rule: log pi(y) = sum_t log pi(y_t | y_{t-1})
    p_train = np.exp(logp_train.sum(axis=1))
    p_sampler = np.exp(logp_sampler.sum(axis=1))
    # R = 1 when at least half of the n tokens are token 0 (integers: no rounding)
    zeros = ((Y == 0) & real).sum(axis=1)
    R = (2 * zeros >= n).astype(float)
    # score of token t: e_{y_t} - pi(. | y_{t-1}), placed in the parameter row (t, prev_t)
    rows = np.eye(V)[Y] - np.exp(log_pi)[positions, prev]  # (M, T, V)
    rows = np.where(real[:, :, None], rows, 0.0)
    score = np.zeros((M, T, V + 1, V))
    score[np.arange(M)[:, None], positions, prev] = rows  # (M, T, V + 1, V)
    true_grad = np.einsum("m,m,mtpv->tpv", p_train, R, score)
    return dict(Y=Y, mask=real.astype(float), prev=prev, logp_train=logp_train,
                logp_sampler=logp_sampler, p_train=p_train, p_sampler=p_sampler, R=R,
                score=score, true_grad=true_grad, T=T, V=V, eos=eos)


def _check_eos(eos, V):
    """eos=True -> the index V - 1, eos=False -> None."""
    if not isinstance(eos, (bool, np.bool_)):
        raise TypeError(f"eos must be True or False, got {eos!r}")
    if not eos:
        return None
    if V < 2:
        raise ValueError(f"with eos=True, V must be >= 2 (token V - 1 is <eos>, and at least one "
                         f"other token is needed), got V={V}")
    return V - 1


def _check_ar_logits(name, logits):
    array = np.asarray(logits)
    if array.dtype == bool or not (np.issubdtype(array.dtype, np.floating)
                                   or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
    if array.ndim != 3 or 0 in array.shape or array.shape[1] != array.shape[2] + 1:
        raise ValueError(f"{name} must have shape (T, V + 1, V) with T, V >= 1, got "
                         f"{array.shape}")
    array = array.astype(float)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite, got {float(array[~np.isfinite(array)][0])!r}")
    return array


def _check_ar_size(T, V, eos, caller):
    """Refuse, before allocating anything, an AR toy whose arrays would exceed MAX_TOY_BYTES."""
    # An upper bound on log2 M first: M itself is a huge integer for T = 10**6.
    if eos is None:
        log2_m = T * math.log2(V)
    else:
        # sum_{k <= T} (V - 1)^k < (V - 1)^(T + 1) for V > 2, and = T + 1 for V = 2
        log2_m = (T + 1) * math.log2(V - 1) if V > 2 else math.log2(T + 1)
    if log2_m + math.log2(8 * (5 * T + 3 + T * (V + 1) * V)) > 80:
        raise ValueError(
            f"{caller}(T={T}, V={V}, eos={eos is not None}) would enumerate about "
            f"10^{log2_m * math.log10(2):.0f} responses, far above MAX_TOY_BYTES = "
            f"{MAX_TOY_BYTES / 1024**3:.0f} GiB; choose a smaller T or V"
        )
    nbytes = ar_toy_nbytes(T, V, eos is not None)
    if nbytes > MAX_TOY_BYTES:
        raise ValueError(
            f"{caller}(T={T}, V={V}, eos={eos is not None}) would enumerate "
            f"{ar_num_responses(T, V, eos is not None):,} responses and take "
            f"{nbytes / 1024**3:.1f} GiB, above MAX_TOY_BYTES = "
            f"{MAX_TOY_BYTES / 1024**3:.0f} GiB; choose a smaller T or V"
        )
