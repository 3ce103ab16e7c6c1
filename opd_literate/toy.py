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
$8 M (3T + 3 + TV)$ bytes ([opd_literate.toy.toy_nbytes][]). Some sizes: $(T, V) = (6, 4)$:
1.4 MiB; $(8, 4)$: 29.5 MiB; $(6, 8)$: 138 MiB; $(10, 4)$: 584 MiB; $(8, 6)$: 961 MiB;
$(12, 4)$: 10.9 GiB. Each estimate array of ``estimators`` is as large as ``score`` again.
``make_toy`` refuses, before allocating anything, a toy whose arrays would exceed
``MAX_TOY_BYTES`` (2 GiB) and says how much it would take.

**What holds only because the positions are independent.** The estimators of
[opd_literate.estimators][] are defined for any sequence model, and the unbiasedness of the
sequence ratio ($\mathbb{E}_\mu[\rho f] = \mathbb{E}_\pi[f]$) holds for any. Three results on
these pages use the independence of this toy and fail for an autoregressive model, where
$\pi_t$ and $\mu_t$ depend on the sampled prefix:

* the product formula $\mathbb{E}_\mu[\rho^2] = \prod_t (1 + \chi^2(\pi_t \,\|\, \mu_t))$
  for the second moment of the sequence ratio (with a prefix, the factors are conditional on
  it and their product is not the expectation of the product);
* the exactness of the token ratio for a per-token objective
  ([opd_literate.opd_mismatch][]): $\mathbb{E}_\mu[\rho_t f(y_t)] = \mathbb{E}_\pi[f(y_t)]$
  needs the marginal of $y_t$ under $\mu$ to be $\mu_t$, whatever the earlier tokens;
* the score of a sequence as a sum of per-position rows, $\partial \log \pi(y) / \partial
  \theta_t = e_{y_t} - \pi_t$, on which ``true_grad`` and every estimate here are built.

The numbers (how large each bias is) are those of this toy, not of a language model.

The sampler's logits must stay finite with room to spare: ``make_toy`` accepts
$|\epsilon| \le$ ``MAX_MISMATCH`` $= 10^6$ (at $10^{308}$ the logits $\epsilon b$ overflow to
infinity and the probabilities become NaN). Long before that bound the importance ratios of
[opd_literate.estimators][] overflow float64, which they report as a clear error: on the
default table the sequence ratios do at $\epsilon = 50$, the per-token ratios at
$\epsilon = 1000$.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ._checks import check_finite_number

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
    T, V = _check_size("T", T), _check_size("V", V)
    mismatch = check_finite_number("mismatch", mismatch)
    if abs(mismatch) > MAX_MISMATCH:
        raise ValueError(
            f"mismatch must be in [-{MAX_MISMATCH:g}, {MAX_MISMATCH:g}] (MAX_MISMATCH), got "
            f"{mismatch!r}: the sampler's logits theta + mismatch * b would be too large to "
            "compute its probabilities"
        )
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


def _check_size(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_toy(toy, keys=("Y", "logp_train", "logp_sampler", "p_sampler", "score", "R",
                         "true_grad")):
    """Raise a ``ValueError`` naming the missing keys unless ``toy`` looks like ``make_toy``'s."""
    if not isinstance(toy, dict):
        raise TypeError(f"toy must be the dict returned by make_toy, got {type(toy).__name__}")
    missing = [k for k in keys if k not in toy]
    if missing:
        raise ValueError(f"toy is missing the keys {missing}; build it with make_toy")


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

    Parameters
    ----------
    toy : dict
        From ``make_toy`` (needs ``p_sampler``, ``true_grad``).
    per_seq_estimate : numpy.ndarray
        ``(M, T, V)``.

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
    mean_scaled = np.einsum("m,mtv->tv", mu, estimate)
    # sum_m mu_m ||g_m - mean||^2, from the centred values: E||g||^2 - ||mean||^2 would lose
    # every digit to cancellation when the variance is small against the mean.
    centred = estimate - mean_scaled
    var_scaled = float(np.einsum("m,mtv,mtv->", mu, centred, centred))
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
