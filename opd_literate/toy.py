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
  (A real LM conditions on the prefix; independence keeps the toy enumerable, and none of the
  estimators studied here relies on it.)
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
"""

from __future__ import annotations

import itertools
import math

import numpy as np

__all__ = [
    "MAX_TOY_BYTES",
    "TOY_KEYS",
    "log_softmax",
    "toy_nbytes",
    "make_toy",
    "sample_from_sampler",
    "estimator_moments",
    "check_toy",
]

MAX_TOY_BYTES = 2 * 1024**3
"""The largest toy (all its arrays together, in bytes) that ``make_toy`` builds."""

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
        $\epsilon$, finite: the sampler's logits are $\theta + \epsilon b$.
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
        For ``T < 1``, ``V < 1``, a non-finite ``mismatch``, or a toy larger than
        ``MAX_TOY_BYTES``.

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
    mismatch = float(mismatch)
    if not math.isfinite(mismatch):
        raise ValueError(f"mismatch must be a finite number, got {mismatch!r}")
    nbytes = toy_nbytes(T, V)
    if nbytes > MAX_TOY_BYTES:
        raise ValueError(
            f"make_toy(T={T}, V={V}) would enumerate V**T = {V**T:,} sequences and take "
            f"{nbytes / 1024**3:.1f} GiB, above MAX_TOY_BYTES = {MAX_TOY_BYTES / 1024**3:.0f} GiB; "
            "choose a smaller T or V"
        )

    rng = np.random.default_rng(seed)
    theta = rng.normal(0.0, 0.7, size=(T, V))   # trainer logits
    b = rng.standard_t(3, size=(T, V))          # the sampler's heavy-tailed logit error
    log_pi = log_softmax(theta)                 # (T, V)
    log_mu = log_softmax(theta + mismatch * b)  # (T, V)

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
                p_sampler=p_sampler, R=R, score=score, true_grad=true_grad,
                theta=theta, b=b, mismatch=mismatch, T=T, V=V)


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
    mu = toy["p_sampler"]
    mean = np.einsum("m,mtv->tv", mu, estimate)
    bias = float(np.linalg.norm(mean - target))
    # sum_m mu_m ||g_m - mean||^2, from the centred values: E||g||^2 - ||mean||^2 would lose
    # every digit to cancellation when the variance is small against the mean.
    centred = estimate - mean
    var = float(np.einsum("m,mtv,mtv->", mu, centred, centred))
    norm = float(np.linalg.norm(target))

    def relative(error):
        # A zero true gradient (T = V = 1, say) has no relative scale: 0 stays 0, else inf.
        if norm > 0:
            return error / norm
        return 0.0 if error == 0 else math.inf

    def rel_rmse(N):
        if not N >= 1:
            raise ValueError(f"N must be >= 1, got {N!r}")
        return relative(float(np.sqrt(bias**2 + var / N)))

    return dict(mean=mean, bias=bias, var=var, rel_bias=relative(bias), rel_rmse=rel_rmse)
