r"""The inference engine's sampler: temperature, min-p, top-k, top-p, and the log-probs it reports.

An inference engine does not sample from the model's softmax. It divides the logits by a
temperature $\tau$, drops the tokens below a fraction of the most likely one's probability
(min-$p$), keeps the $k$ most likely tokens (top-$k$), then the smallest set of most likely
tokens whose probability reaches $p$ (top-$p$, nucleus), and samples from what is left,
renormalised. Call the raw sampler logits of a position $z$ (the toys' $\theta + \epsilon b$).
The distribution that writes the token is

$$
\mu(v) = \frac{\mu_\tau(v)\, \mathbb{1}[v \in S]}{\mu_\tau(S)}, \qquad
\mu_\tau = \mathrm{softmax}(z / \tau),
$$

with $S$ the tokens that survive every cut and $\mu_\tau(S)$ their *kept mass*. The rules are
vLLM's (``vllm/v1/sample/sampler.py`` and ``apply_top_k_top_p`` in
``vllm/v1/sample/ops/topk_topp_sampler.py``), in its order:

* temperature first;
* min-$p$ drops $v$ when $\mu_\tau(v) < p_{\min} \max_u \mu_\tau(u)$;
* top-$k$ keeps every token whose scaled logit is at least the $k$-th largest (ties stay);
* top-$p$ then works on the renormalised survivors $\tilde\mu$ and keeps $v$ exactly when the
  tokens ranked above it carry less than $p$, $\sum_{u \succ v} \tilde\mu(u) < p$ (vLLM masks
  where the ascending cumulative sum is at most $1 - p$: the same set), so the most likely token
  always stays.

Min-$p$ and top-$k$ each keep a prefix of the ranking, so their order does not change $S$.

**Which log-probs come back.** An engine can report $\log \mu(y_t)$ (the *processed*
log-probs: the distribution that sampled) or $\log \mathrm{softmax}(z)_{y_t}$ (the *raw* ones:
the model before temperature and truncation). Only the first is the denominator of an importance
ratio: with the raw ones, $\rho_t = \pi(y_t) / \mathrm{softmax}(z)_{y_t}$ corrects a mismatch
that is not the one that sampled. Which engine reports which by default is in the mismatch
chapter, with its sources.

**The objective.** With sampling temperature $\tau$, the policy being trained is the trainer's
softmax at the same temperature, $\pi_\tau = \mathrm{softmax}(\theta / \tau)$ (what verl and TRL
compute when they divide the trainer's logits by the temperature), and the target gradient is

$$
\nabla_\theta J_\tau = \sum_y \pi_\tau(y)\, R(y) \sum_t s^\tau_t(y), \qquad
s^\tau_t = \frac{e_{y_t} - \pi_{\tau, t}}{\tau}
$$

(the score of $\log \pi_\tau$: the chain rule through $\theta / \tau$ brings the $1/\tau$). A
trainer that forgets the temperature computes $\log \pi_1$ and its score $e_{y_t} - \pi_{1, t}$
instead: the gradient of another objective.

**What truncation does to every estimator.** A sequence with a token outside $S$ has
$\mu(y) = 0$: the engine never writes it, so no estimator ever sees it, whatever its weight
would be. Every estimator's mean is a sum over the support,
$\mathbb{E}_\mu[\hat g] = \sum_{y : \mu(y) > 0} \mu(y)\, \hat g(y)$. Even the sequence ratio
with the processed log-probs, unbiased without truncation, then has

$$
\mathbb{E}_\mu[\rho\, R\, s^\tau] = \sum_{y : \mu(y) > 0} \pi_\tau(y)\, R(y)\, s^\tau(y)
= \nabla_\theta J_\tau - \sum_{y : \mu(y) = 0} \pi_\tau(y)\, R(y)\, s^\tau(y):
$$

it misses exactly the part of the gradient carried by the sequences the engine cannot write
(the support condition of importance sampling, $\mu > 0$ wherever $\pi_\tau R s^\tau \neq 0$,
fails). Truncating or masking weights cannot restore it: they only reweight what was sampled.
Without the mismatch ($\epsilon = 0$) the processed per-token ratio is the kept mass of its
position, $\rho_t = \pi_\tau(y_t) / \mu(y_t) = \mu_\tau(S_t)$, the same for every token the
engine can write there: a trainer that scores over the full vocabulary sees a mismatch of
$\log \mu_\tau(S_t)$ per token where there is none.

**Replaying the mask.** If the engine returns each position's kept set $S_t$ and the trainer
renormalises its own softmax over it (``trainer_mask=True``), the trainer's policy becomes the
truncated policy $\pi_S(v) = \pi_\tau(v)\, \mathbb{1}[v \in S_t] / \pi_\tau(S_t)$. Holding the
sets fixed (they are not differentiated), the processed ratio $\pi_S / \mu$ is 1 without the
mismatch, and the sequence ratio is unbiased for $\nabla_\theta\, \mathbb{E}_{\pi_S}[R]$, the
gradient of the policy as the engine runs it (``masked_grad``): the objective has changed from
$J_\tau$ to the truncated one, and nothing is missing from its support.

:func:`engine_toy` turns a toy of [opd_literate.mismatch.toy][] into the toy of such an engine,
with the same keys, so every estimator of [opd_literate.mismatch.estimators][] and
[opd_literate.mismatch.toy.estimator_moments][] computes its exact mean, bias and variance under
it. The toys themselves are unchanged: ``make_toy()`` still produces the seed's arrays, and
``engine_toy`` with its defaults returns them again.
"""

from __future__ import annotations

import numpy as np

from .._numerics import check_finite_number
from .estimators import seq_is, token_ratios  # noqa: F401 (the examples use them)
from .toy import (  # noqa: F401 (the examples use make_toy)
    ar_toy_from_logits,
    check_toy,
    log_softmax,
    make_toy,
    toy_from_logits,
)

__all__ = ["REPORTED", "processed_log_probs", "engine_toy"]

REPORTED = ("processed", "raw")
"""The log-probs an engine can report for a sampled token: of the distribution that sampled it
(after temperature, min-p, top-k and top-p), or of the model's raw softmax."""


def _check_temperature(temperature):
    return check_finite_number("temperature", temperature, positive=True)


def _check_top_k(top_k):
    if top_k is None:
        return None
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be None (no cut) or >= 1, got {top_k}")
    return int(top_k)


def _check_top_p(top_p):
    return check_finite_number("top_p", top_p, high=1.0, positive=True)


def _check_min_p(min_p):
    return check_finite_number("min_p", min_p, low=0.0, high=1.0)


def processed_log_probs(logits, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0):
    r"""$\log \mu$: the log-probabilities of the distribution an engine samples from.

    Temperature, then min-$p$ and top-$k$, then top-$p$ on what they left, in vLLM's order and
    with its rules (module docstring); each row of the last axis is one position. A token cut by
    any rule gets $-\infty$ (probability 0).

    Parameters
    ----------
    logits : array_like
        Raw logits, any shape ``(..., V)`` with ``V >= 1``, finite.
    temperature : float
        $\tau > 0$.
    top_k : int or None
        Keep the ``top_k`` largest logits of each row (and any tied with the smallest of them);
        ``None`` or ``top_k >= V``: no cut.
    top_p : float
        In $(0, 1]$; 1 is no cut.
    min_p : float
        In $[0, 1]$; 0 is no cut.

    Returns
    -------
    numpy.ndarray
        Float64 of the shape of ``logits``; each row is a log-softmax over its kept tokens.

    Examples
    --------
    Probabilities 0.5, 0.3, 0.15, 0.05. With ``top_p=0.8`` the first two carry 0.8 before the
    third, so the third is cut: above it lie 0.8, not less than 0.8. The kept pair is
    renormalised to 0.625 and 0.375:

    >>> logits = np.log([0.5, 0.3, 0.15, 0.05])
    >>> np.exp(processed_log_probs(logits, top_p=0.8)).round(12).tolist()
    [0.625, 0.375, 0.0, 0.0]
    >>> np.exp(processed_log_probs(logits, top_p=0.81)).round(6).tolist()  # 0.5 / 0.95, ...
    [0.526316, 0.315789, 0.157895, 0.0]

    Temperature 0.5 squares the probabilities before renormalising; top-k = 1 keeps the largest:

    >>> tempered = processed_log_probs(np.log([0.5, 0.5 / 3, 1 / 3]), temperature=0.5)
    >>> np.exp(tempered).round(6).tolist()  # 9/14, 1/14, 4/14
    [0.642857, 0.071429, 0.285714]
    >>> np.exp(processed_log_probs(logits, top_k=1)).tolist()
    [1.0, 0.0, 0.0, 0.0]
    """
    z = np.asarray(logits)
    if z.dtype == bool or not (np.issubdtype(z.dtype, np.floating)
                               or np.issubdtype(z.dtype, np.integer)):
        raise TypeError(f"logits must hold real numbers, got dtype {z.dtype}")
    if z.ndim == 0 or z.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {z.shape}")
    z = z.astype(float)
    if not np.isfinite(z).all():
        raise ValueError(f"logits must be finite, got {float(z[~np.isfinite(z)][0])!r}")
    return _processed(z, _check_temperature(temperature), _check_top_k(top_k),
                      _check_top_p(top_p), _check_min_p(min_p))


def _scaled(z, temperature, name):
    """z / temperature, refused where it overflows float64 (inf - inf would be NaN)."""
    with np.errstate(over="ignore"):
        scaled = z / temperature
    if not np.isfinite(scaled).all():
        raise ValueError(f"{name} / temperature overflows float64 at temperature={temperature!r} "
                         f"(largest |{name}| {float(np.abs(z).max()):.3g}); use a larger "
                         "temperature")
    return scaled


def _processed(z, temperature, top_k, top_p, min_p=0.0, name="logits"):
    """processed_log_probs on checked inputs."""
    V = z.shape[-1]
    # Dividing by 1.0 is exact: with the defaults, the rows are the toys' log_softmax bit for bit.
    scaled = _scaled(z, temperature, name)
    keep = np.ones(z.shape, dtype=bool)
    if top_k is not None and top_k < V:
        kth_largest = np.sort(scaled, axis=-1)[..., V - top_k, None]
        keep = scaled >= kth_largest  # ties with the k-th largest stay, as in vLLM
    if min_p > 0.0:
        # mu_tau(v) < min_p * max mu_tau, in log space: scaled_v - max < log(min_p)
        keep &= scaled - scaled.max(axis=-1, keepdims=True) >= np.log(min_p)
    if top_p < 1.0:
        probs = np.exp(log_softmax(np.where(keep, scaled, -np.inf)))
        # Descending order; a stable sort breaks ties by index, a choice only at exact ties.
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, axis=-1)
        above = np.cumsum(ranked, axis=-1) - ranked  # the mass ranked above each token
        above[..., 0] = 0.0                          # exactly: the first token always stays
        kept_ranked = above < top_p
        kept = np.empty_like(kept_ranked)
        np.put_along_axis(kept, order, kept_ranked, axis=-1)
        keep &= kept
    if keep.all():
        return log_softmax(scaled)
    return log_softmax(np.where(keep, scaled, -np.inf))


def _rows(target):
    """The index of each token's row in a (T, V) or (T, V + 1, V) table of log-probs."""
    positions = np.arange(target["Y"].shape[1])[None, :]
    if "prev" in target:
        return positions, target["prev"], target["Y"]
    return positions, target["Y"]


def _trainer(log_pi, temperature, target, writable):
    r"""``logp_train``, ``p_train`` and ``score`` of a trainer whose per-row log-probs are
    ``log_pi`` of the logits divided by ``temperature``, on the sequences ``writable``.

    ``log_pi`` may be $-\infty$ on tokens the engine cannot write (a replayed mask): no
    written sequence reads them. The score of $\log \pi(y_t)$ is $(e_{y_t} - \pi_t) / \tau$.
    """
    rows = tuple(np.broadcast_to(index, target["Y"].shape)[writable] for index in _rows(target))
    Y = target["Y"][writable]
    real = target["mask"][writable] > 0 if "mask" in target else np.ones(Y.shape, dtype=bool)
    logp = np.where(real, log_pi[rows], 0.0)
    V = log_pi.shape[-1]
    # rows[:-1] picks the whole row of each token (its position, and its state for the AR toy)
    token_scores = np.where(real[..., None], np.eye(V)[Y] - np.exp(log_pi[rows[:-1]]), 0.0)
    if "prev" in target:  # each token's score lands in the row (t, prev_t) of the parameters
        M, T = Y.shape
        score = np.zeros((M, T, V + 1, V))
        score[np.arange(M)[:, None], np.arange(T)[None, :], rows[1]] = token_scores
    else:
        score = token_scores
    return dict(logp_train=logp, p_train=np.exp(logp.sum(axis=1)), score=score / temperature)


def engine_toy(toy, temperature=1.0, top_k=None, top_p=1.0, reported="processed",
               trainer_temperature=True, trainer_mask=False, min_p=0.0):
    r"""The toy of an inference engine that samples with temperature, top-$k$ and top-$p$.

    The sampler's raw logits are the toy's, $z = \theta + \epsilon b$; it samples from their
    processed distribution $\mu$ (:func:`processed_log_probs`). The target is
    $\nabla_\theta J_\tau$ for the trainer at the same temperature (module docstring).

    Parameters
    ----------
    toy : dict
        From [opd_literate.mismatch.toy.make_toy][], [opd_literate.mismatch.toy.toy_from_logits][],
        [opd_literate.mismatch.toy.make_ar_toy][] or
        [opd_literate.mismatch.toy.ar_toy_from_logits][] (it needs ``theta``, ``b`` and
        ``mismatch``).
    temperature, top_k, top_p, min_p
        The engine's sampling parameters, as in :func:`processed_log_probs`.
    reported : {"processed", "raw"}
        The log-probs the engine returns, which the estimators read as ``logp_sampler``:
        $\log \mu(y_t)$, or the raw $\log \mathrm{softmax}(z)_{y_t}$.
    trainer_temperature : bool
        Whether the trainer divides its logits by ``temperature``: ``logp_train`` and
        ``score`` are those of $\pi_\tau$ (True) or of $\pi_1$ (False).
    trainer_mask : bool
        Whether the trainer replays the engine's sampling mask: its softmax is renormalised
        over the kept tokens $S_t$ of each position (held fixed, not differentiated), as with
        vLLM's ``return_sampling_mask``. False: the full-vocabulary softmax, as TRL and verl
        compute it.

    Returns
    -------
    dict
        The keys of the toy, restricted to the sequences the engine can write
        ($\mu(y) > 0$), with ``p_sampler`` $= \mu(y)$ (it sums to 1), ``logp_sampler`` the
        reported log-probs, ``logp_train``, ``p_train`` and ``score`` the trainer's, and
        ``true_grad`` $= \nabla_\theta J_\tau$ summed over every sequence. Added:
        ``truncated_grad``, the part of ``true_grad`` carried by the sequences left out, and
        ``truncated_mass``, their probability under $\pi_\tau$; ``masked_grad``, the gradient
        of the truncated policy's objective $\nabla_\theta\, \mathbb{E}_{\pi_S}[R]$ ($\pi_S$:
        $\pi_\tau$ renormalised on the kept tokens, the kept sets held fixed); and
        ``temperature``, ``top_k``, ``top_p``, ``reported``, ``trainer_temperature``,
        ``trainer_mask``.

    Examples
    --------
    With the defaults the engine is the toy's sampler, and every array is the toy's:

    >>> toy = make_toy()
    >>> same = engine_toy(toy)
    >>> all(np.array_equal(same[key], toy[key]) for key in ("Y", "logp_sampler", "score",
    ...                                                     "true_grad", "p_sampler"))
    True

    One position of three tokens, trainer and sampler equal ($\epsilon = 0$): top-p = 0.7 cuts
    the token of probability 0.2. The sequence ratio of what is left is the kept mass 0.8, and
    its estimate misses the cut token's share of the gradient:

    >>> logits = np.log([[0.5, 0.3, 0.2]])
    >>> engine = engine_toy(toy_from_logits(logits, logits), top_p=0.7)
    >>> engine["Y"].tolist(), engine["p_sampler"].round(12).tolist()
    ([[0], [1]], [0.625, 0.375])
    >>> token_ratios(engine).round(12).tolist()
    [[0.8], [0.8]]
    >>> mean = np.einsum("m,mtv->tv", engine["p_sampler"], seq_is(engine))
    >>> bool(np.allclose(mean, engine["true_grad"] - engine["truncated_grad"], atol=1e-15))
    True
    >>> round(engine["truncated_mass"], 12)
    0.2
    """
    check_toy(toy, keys=("theta", "b", "mismatch", "T", "V"))
    temperature = _check_temperature(temperature)
    top_k, top_p, min_p = _check_top_k(top_k), _check_top_p(top_p), _check_min_p(min_p)
    if reported not in REPORTED:
        raise ValueError(f"reported must be one of {REPORTED}, got {reported!r}")
    for name, flag in (("trainer_temperature", trainer_temperature),
                       ("trainer_mask", trainer_mask)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    theta = np.asarray(toy["theta"], dtype=float)
    raw = theta + toy["mismatch"] * np.asarray(toy["b"], dtype=float)  # the sampler's logits
    autoregressive = "mask" in toy
    scaled_theta = _scaled(theta, temperature, "theta")
    log_processed = _processed(raw, temperature, top_k, top_p, min_p, "theta + mismatch * b")
    kept = np.isfinite(log_processed)

    # Enumerate under the target with the raw log-probs (all finite), then read mu per token:
    # the toys' own enumeration of softmax(theta / tau) against softmax(theta + mismatch * b).
    if autoregressive:
        target = ar_toy_from_logits(scaled_theta, raw, eos=toy["eos"] is not None)
    else:
        target = toy_from_logits(scaled_theta, raw)
    rows = _rows(target)
    real = target["mask"] > 0 if autoregressive else np.ones(target["Y"].shape, dtype=bool)
    with np.errstate(divide="ignore"):
        logp_processed = np.where(real, log_processed[rows], 0.0)  # -inf where a token is cut
    writable = np.isfinite(logp_processed).all(axis=1)

    # The target gradient uses the score of log pi_tau, (e - pi_tau) / tau, over every sequence:
    # the toy's sum over the scores e - pi_tau, divided by tau (exact at tau = 1).
    score_target = target["score"] / temperature
    true_grad = target["true_grad"] / temperature
    weighted = target["p_train"] * target["R"]
    truncated_grad = np.einsum("m,m...->...", weighted[~writable], score_target[~writable])
    # The truncated policy pi_S (pi_tau renormalised on the kept tokens, S held fixed) and the
    # gradient of its objective, a sum over the sequences the engine can write.
    log_masked = log_softmax(np.where(kept, scaled_theta, -np.inf))
    masked = _trainer(log_masked, temperature, target, writable)
    masked_grad = np.einsum("m,m,m...->...", masked["p_train"], target["R"][writable],
                            masked["score"])

    if trainer_mask:
        trainer_logits = scaled_theta if trainer_temperature else theta
        trainer = masked if trainer_temperature else _trainer(
            log_softmax(np.where(kept, trainer_logits, -np.inf)), 1.0, target, writable)
    elif trainer_temperature:
        trainer = dict(logp_train=target["logp_train"][writable],
                       p_train=target["p_train"][writable], score=score_target[writable])
    else:
        trainer = _trainer(log_softmax(theta), 1.0, target, writable)
    reported_logp = logp_processed if reported == "processed" else target["logp_sampler"]
    engine = {key: value[writable] if key in ("Y", "mask", "prev", "R") else value
              for key, value in target.items()}
    engine.update(
        trainer,
        logp_sampler=reported_logp[writable],
        p_sampler=np.exp(logp_processed[writable].sum(axis=1)),
        true_grad=true_grad,
        truncated_grad=truncated_grad,
        truncated_mass=float(target["p_train"][~writable].sum()),
        masked_grad=masked_grad,
        theta=toy["theta"], b=toy["b"], mismatch=toy["mismatch"],
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, reported=reported,
        trainer_temperature=bool(trainer_temperature), trainer_mask=bool(trainer_mask),
    )
    return engine
