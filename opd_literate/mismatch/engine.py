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
  tokens ranked above it carry less than $p$, $\sum_{u \succ v} \tilde\mu(u) < p$, so the most
  likely token always stays. vLLM masks where the ascending cumulative sum is at most $1 - p$:
  the same set in exact arithmetic, not in float32 (**Which nucleus**, below).

Min-$p$ and top-$k$ each keep a prefix of the ranking, so their order does not change $S$.

**Which nucleus.** The rule above is the exact one (``sampler="exact"``: float64, a mass above
within ``NUCLEUS_TOLERANCE`` of $p$ counted as reaching it, ties ranked by index). The frameworks
compute theirs in float32, each in its order, and ``sampler=`` computes each as it does, up to
the last bit of its softmax: the probabilities here are the float64 softmax of the float32
logits rounded once to float32, where a torch kernel's exp may round an ulp away, and a
boundary that holds exactly can go either way with it. On every distribution of four tokens in
hundredths at every top-$p$ in hundredths, transformers' installed ``TopPLogitsWarper`` and
``sampler="transformers"`` keep other sets on 71,424 of the 470,547 boundary rows (torch 2.13.0,
its AVX2 kernels) and on none off it (``tests/integration/test_engine_frameworks.py``).

* ``"vllm"``: vLLM's torch path, ``apply_top_k_top_p_pytorch`` (release 0.33.0 as its wheel
  ships it, ``vllm/v1/sample/ops/topk_topp_sampler.py`` lines 524-565; the same body at
  01fa3fe74b058bb604f236341ab2361c7cf3d25b). Temperature in float32, min-$p$, top-$k$ (ties
  stay); the logits sorted ascending, the float32 softmax of the survivors, its cumulative sum,
  masked where at most ``1 - p`` with ``p`` a float32 tensor, the last (largest) never. It is
  what ``apply_top_k_top_p`` (lines 501-521) runs where Triton is absent (a CPU build without
  Triton's CPU backend). On a CUDA GPU it runs the Triton kernel ``apply_top_k_top_p_triton``
  instead (``topk_topp_triton.py``, its top-$p$ at lines 611-878), a pivot search for the
  tokens whose float32 mass reaches $p$, not modelled here; with the raw log-probs FlashInfer
  samples instead (``VLLM_USE_FLASHINFER_SAMPLER``, on by default).
* ``"transformers"``: TRL's own generation (``use_vllm=False``) is ``model.generate``, whose
  warpers run temperature, top-$k$ (ties stay), ``TopPLogitsWarper`` (the same ascending rule
  with the cut ``float32(1 - p)``, ``1 - p`` taken in float64) and then min-$p$, after top-$p$
  unlike vLLM, on float32 scores (transformers 5.24.0, ``generation/logits_process.py`` lines
  556-568 and ``generation/utils.py`` lines 1618-1634; checked against the installed warpers).
* ``"sglang"``: SGLang's pytorch backend, ``top_k_top_p_min_p_sampling_from_probs_torch``
  (0.5.23, ``python/sglang/srt/layers/sampler.py`` lines 785-835), its default on a CPU and
  with deterministic inference. The float32 softmax sorted descending; top-$k$ by rank (exactly
  $k$, ties cut in the sort's order); top-$p$ on the mass of the full distribution, not
  renormalised after top-$k$, cut where the float32 mass above exceeds $p$ (at $p = 1$ too,
  once any cut runs); min-$p$. Where the platform has FlashInfer its default is FlashInfer's
  ``top_k_top_p_sampling_from_probs`` instead, not modelled here.

In exact arithmetic the first three keep the same set, and SGLang's keeps one token more where
the mass above a token equals $p$. In float32 such a boundary is decided by rounding, and a tie
across the cut by each sort: vLLM's and transformers' ascending sort cuts a tie's lower index
first, the exact rule and SGLang keep it (``torch.sort`` orders ties by index on a CPU for rows
of up to 16 entries; longer rows and CUDA promise no order, and ``sampler=`` uses the index
order for every length). :func:`nucleus_disagreement` counts where on every decimal
distribution of a few tokens, and :func:`boundary_toy` is a toy on which the four rules give
four engines.

**Which log-probs come back.** An engine can report $\log \mu(y_t)$ (the *processed*
log-probs: the distribution that sampled), $\log \mathrm{softmax}(z)_{y_t}$ (the *raw* ones:
the model before temperature and truncation) or $\log \mu_\tau(y_t)$ (the *tempered* ones: after
the temperature, before any cut, over the whole vocabulary). Only the first is the denominator
of an importance ratio: with the raw ones, $\rho_t = \pi(y_t) / \mathrm{softmax}(z)_{y_t}$
corrects a mismatch that is not the one that sampled, and with the tempered ones
$\rho_t = \pi_\tau(y_t) / \mu_\tau(y_t)$ leaves out the kept mass,
$\mu(y_t) = \mu_\tau(y_t) / \mu_\tau(S_t)$. vLLM reports raw or processed (``logprobs_mode``);
SGLang reports the tempered ones unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which gives
the raw ones (SGLang 0.5.23, ``python/sglang/srt/layers/sampler.py``, ``Sampler.forward``: the
logits divided in place by the temperature at line 275, their softmax, and the log-probs
``torch.log(probs)`` at line 315 of that full softmax, read before the cuts of
``_sample_from_probs``, which work on copies; the untempered ``log_softmax`` at lines 237 and
323). SGLang's opt-in ``return_sampling_mask`` adds each token's kept set and its processed
log-prob, the filtered weight over the kept mass (line 574). ``reported=`` of
:func:`engine_toy` is ``"processed"`` by default for every ``sampler``, the denominator of the
exact ratio; SGLang as it ships is ``reported="tempered"``. Which engine reports which by default
is in the mismatch chapter, with its sources.

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

**Correcting the ratio by the kept mass.** A trainer that knows each position's kept set $S_t$
can correct the reported log-probs by a kept mass (``kept_mass=`` of :func:`engine_toy`):

* ``"sampler"``: the reported distribution renormalised on $S_t$, its log-prob minus the log of
  its own mass on $S_t$. The tempered log-probs become the processed ones exactly,
  $\log \mu_\tau(y_t) - \log \mu_\tau(S_t) = \log \mu(y_t)$; the processed ones carry mass 1 on
  $S_t$ and stay; the raw ones become $\mathrm{softmax}(z)$ renormalised on $S_t$, the processed
  ones only at $\tau = 1$.
* ``"trainer"``: the log of the trainer's own kept mass $K_t = \pi_\tau(S_t)$ added (of
  $\pi_1$ for a trainer without the temperature): the processed log-probs put on the trainer's
  full vocabulary, $\log \mu(y_t) + \log K_t$, as TRL's pull request #7269 computes it from the
  trainer's logits and the kept token ids of vLLM's ``return_sampling_mask``. The ratio becomes
  $\pi_S(y_t) / \mu(y_t)$, 1 without the mismatch; the score stays the full vocabulary's. A
  trainer that replays the mask (``trainer_mask=True``) already has that ratio, and is refused
  this correction, which would count $K_t$ twice.

**What each ratio is unbiased for.** Write $W$ for the sequences the engine can write. For a
weight $w$, a baseline $\beta$ and the full-vocabulary score $s^\tau$,

$$
\mathbb{E}_\mu[w\,(R - \beta)\, s^\tau] = \sum_{y \in W} \mu(y)\, w(y)\, (R(y) - \beta)\,
s^\tau(y),
$$

and with $\beta = 0$:

* the exact ratio $w = \pi_\tau / \mu$ (processed, or tempered with ``kept_mass="sampler"``):
  $\sum_{y \in W} \pi_\tau R\, s^\tau = \nabla_\theta J^W_\tau$, the gradient of
  $J^W_\tau = \mathbb{E}_{\pi_\tau}[R\, \mathbb{1}_W]$, the objective with the reward of every
  sequence the engine cannot write set to 0, $W$ held fixed (``true_grad - truncated_grad``).
  It is $\nabla_\theta J_\tau$ exactly when $\sum_{y \notin W} \pi_\tau R\, s^\tau = 0$, which
  the support condition ($R(y) = 0$ on every $y \notin W$) ensures;
* $w = \pi_S / \mu$ (processed with ``kept_mass="trainer"``): the sum is
  $\nabla_\theta \mathbb{E}_{\pi_S}[R]$ plus $\mathbb{E}_{\pi_S}[R \sum_t \nabla_\theta
  \log \pi_\tau(S_t)]$, because $s^\tau = \nabla \log \pi_S + \sum_t \nabla \log \pi_\tau(S_t)$ on
  $W$; the row gradient of a kept mass is $\nabla \log \pi_\tau(S_t) = (\pi_{S,t} -
  \pi_{\tau,t}) / \tau$, not 0 where a token is cut. So it is unbiased for the truncated
  policy's gradient (``masked_grad``) only where that reward-weighted term vanishes, and for
  $\nabla_\theta J_\tau$ only where nothing is cut. Where the kept sets do not depend on the
  prefix (the toy of independent positions), $\pi_S = \pi_\tau / \pi_\tau(W)$ on $W$: the mean
  is the exact ratio's divided by $\pi_\tau(W)$, the same direction, longer; and with a
  baseline the extra term is $(\mathbb{E}_{\pi_S}[R] - \beta) \sum_t \nabla \log
  \pi_\tau(S_t)$, zero at $\beta = \mathbb{E}_{\pi_S}[R]$ only;
* the tempered ratio $w = \prod_t \pi_\tau(y_t) / \mu_\tau(y_t)$ (SGLang's log-probs, no
  correction): $\sum_{y \in W} \pi_\tau R\, s^\tau / \prod_t \mu_\tau(S_t)$, the previous form
  with the engine's kept masses in place of the trainer's, equal to it without the mismatch.

:func:`engine_toy` turns a toy of [opd_literate.mismatch.toy][] into the toy of such an engine,
with the same keys, so every estimator of [opd_literate.mismatch.estimators][] and
[opd_literate.mismatch.toy.estimator_moments][] computes its exact mean, bias and variance under
it. The toys themselves are unchanged: ``make_toy()`` still produces the seed's arrays, and
``engine_toy`` with its defaults returns them again.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .._numerics import check_choice, check_finite_number
from .toy import (  # noqa: F401 (the examples use make_toy)
    ar_toy_from_logits,
    check_toy,
    estimator_moments,
    log_softmax,
    make_toy,
    toy_from_logits,
)

__all__ = ["REPORTED", "KEPT_MASS", "SAMPLERS", "NUCLEUS_TOLERANCE", "BOUNDARY_PROBS",
           "processed_log_probs", "top_p_kept", "nucleus_disagreement", "boundary_toy",
           "engine_toy", "KEPT_MASS_CHOICES", "kept_mass_table"]

REPORTED = ("processed", "raw", "tempered")
"""The log-probs an engine can report for a sampled token: of the distribution that sampled it
(after temperature, min-p, top-k and top-p; vLLM's ``processed_logprobs``), of the model's raw
softmax (vLLM's default ``raw_logprobs``, SGLang with ``SGLANG_RETURN_ORIGINAL_LOGPROB``), or of
the softmax of the logits over the temperature, before any cut (SGLang's default)."""

KEPT_MASS = ("sampler", "trainer")
"""The kept-mass corrections of the reported log-probs (module docstring): the reported
distribution renormalised on the kept set, or the trainer's kept mass added (TRL's PR #7269)."""

SAMPLERS = ("exact", "vllm", "transformers", "sglang")
"""The samplers whose kept set :func:`processed_log_probs` computes (module docstring, **Which
nucleus**): the exact rule, and three frameworks' rules as each computes them in float32."""

NUCLEUS_TOLERANCE = 1e-12
r"""The exact rule's float64 margin: a mass ranked above a token within this of $p$ counts as
reaching $p$ (float64 computes that mass to about $10^{-15}$ from logits a few hundred apart), so
a boundary that holds in exact arithmetic is decided as in exact arithmetic."""

BOUNDARY_PROBS = ((0.5, 0.3, 0.15, 0.05), (0.4, 0.4, 0.1, 0.1), (0.12, 0.72, 0.12, 0.04))
"""The positions of :func:`boundary_toy`. At ``top_p=0.8`` the first two carry 0.8 in their top
two tokens, so each rule decides that boundary in its own arithmetic; the third has a tie across
the cut, between token 0 (the one the toys' reward counts) and token 2, which the rules break in
opposite directions."""

# vLLM 0.33.0, vllm/v1/sample/ops/topk_topp_sampler.py (the release wheel; the same body at
# 01fa3fe74b058bb604f236341ab2361c7cf3d25b): apply_top_k_top_p_pytorch, lines 545-562.
# transformers 5.24.0, generation/logits_process.py: TopPLogitsWarper.__call__, lines 556-568.
# SGLang 0.5.23, python/sglang/srt/layers/sampler.py: top_k_top_p_min_p_sampling_from_probs_torch,
# lines 821-835.
_FLOAT32 = np.float32
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SUM_TOLERANCE = 1e-6  # a float32 softmax sums to 1 within V half-ulps of each entry, ~6e-8
_MAX_ENUMERATED = 2_000_000  # distributions nucleus_disagreement enumerates at most


# vLLM's _SAMPLING_EPS (vllm/v1/sample/sampler.py at the commit above): a request whose
# temperature is below it is sampled greedily, its logits never divided by the temperature.
VLLM_GREEDY_BELOW = 1e-5


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


def _check_sampler(sampler, temperature=None):
    check_choice("sampler", sampler, SAMPLERS)
    if sampler == "vllm" and temperature is not None and temperature < VLLM_GREEDY_BELOW:
        # vLLM does not divide by such a temperature: it takes the argmax (and reports the
        # log-probs of the logits divided by 1), a sampler this model does not describe.
        raise ValueError(f"temperature={temperature!r} is below {VLLM_GREEDY_BELOW:g}, where "
                         "vLLM samples greedily (_SAMPLING_EPS, vllm/v1/sample/sampler.py); "
                         "for its greedy sampler give top_k=1 at temperature=1.0")
    return sampler


def _check_logits(logits, name="logits"):
    z = _real_array(name, logits)
    if z.ndim == 0 or z.shape[-1] == 0:
        raise ValueError(f"{name} must have shape (..., V) with V >= 1, got {z.shape}")
    return z


def _check_engine_toy(toy):
    """theta, b (float64, of the shape T and V give) and the finite number mismatch of a toy,
    with the sampler's logits theta + mismatch * b, refused where that sum overflows."""
    check_toy(toy, keys=("theta", "b", "mismatch", "T", "V"))
    autoregressive = "mask" in toy
    if autoregressive:
        check_toy(toy, keys=("eos",))
    theta = _real_array("toy['theta']", toy["theta"])
    T, V = toy["T"], toy["V"]
    expected, named = ((T, V + 1, V), "(T, V + 1, V)") if autoregressive else ((T, V), "(T, V)")
    if theta.shape != expected:
        raise ValueError(f"toy['theta'] must have shape {named} = {expected} (toy['T'] = {T!r}, "
                         f"toy['V'] = {V!r}), got {theta.shape}")
    b = _real_array("toy['b']", toy["b"])
    if b.shape != theta.shape:  # nothing is broadcast: b is one error per logit
        raise ValueError(f"toy['b'] must have the shape of toy['theta'] {theta.shape}, got "
                         f"{b.shape}")
    mismatch = check_finite_number("toy['mismatch']", toy["mismatch"])
    with np.errstate(over="ignore", invalid="ignore"):
        raw = theta + mismatch * b
    if not np.isfinite(raw).all():
        raise ValueError(f"the sampler's logits toy['theta'] + toy['mismatch'] * toy['b'] "
                         f"overflow float64 (mismatch {mismatch!r}, largest |b| "
                         f"{float(np.abs(b).max()):.3g}, largest |theta| "
                         f"{float(np.abs(theta).max()):.3g})")
    return theta, raw, autoregressive


def processed_log_probs(logits, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0,
                        sampler="exact"):
    r"""$\log \mu$: the log-probabilities of the distribution an engine samples from.

    Temperature, min-$p$, top-$k$ and top-$p$ decide the kept set $S$ by the rules of
    ``sampler`` (module docstring): ``"exact"`` in vLLM's order with the exact nucleus,
    ``"vllm"``, ``"transformers"`` or ``"sglang"`` as that framework computes them, in float32,
    in its order. Each row of the last axis is one position; $\mu$ is then the float64 softmax of
    ``logits / temperature`` over $S$, and a cut token gets $-\infty$ (probability 0).

    Parameters
    ----------
    logits : array_like
        Raw logits, any shape ``(..., V)`` with ``V >= 1``, finite (for a float32 sampler,
        within float32's range).
    temperature : float
        $\tau > 0$.
    top_k : int or None
        Keep the ``top_k`` largest logits of each row (and any tied with the smallest of them;
        ``"sglang"`` keeps exactly ``top_k``, ties cut in its sort's order);
        ``None`` or ``top_k >= V``: no cut.
    top_p : float
        In $(0, 1]$; 1 is no cut.
    min_p : float
        In $[0, 1]$; 0 is no cut.
    sampler : {"exact", "vllm", "transformers", "sglang"}
        Whose rules decide $S$.

    Returns
    -------
    numpy.ndarray
        Float64 of the shape of ``logits``; each row is a log-softmax over its kept tokens.

    Examples
    --------
    Probabilities 0.5, 0.3, 0.15, 0.05. With ``top_p=0.8`` the first two carry 0.8 before the
    third, so the exact rule cuts the third: above it lie 0.8, not less than 0.8. The kept pair
    is renormalised to 0.625 and 0.375:

    >>> logits = np.log([0.5, 0.3, 0.15, 0.05])
    >>> np.exp(processed_log_probs(logits, top_p=0.8)).round(12).tolist()
    [0.625, 0.375, 0.0, 0.0]
    >>> np.exp(processed_log_probs(logits, top_p=0.81)).round(6).tolist()  # 0.5 / 0.95, ...
    [0.526316, 0.315789, 0.157895, 0.0]

    vLLM keeps the third at 0.8: its float32 cumulative sum from below, 0.05 + 0.15, is
    ``float32(0.2)`` = 0.20000000298, above its cut ``1 - float32(0.8)`` = 0.19999998808
    (:func:`top_p_kept` shows each rule's arithmetic):

    >>> np.isfinite(processed_log_probs(logits, top_p=0.8, sampler="vllm")).tolist()
    [True, True, True, False]

    Temperature 0.5 squares the probabilities before renormalising; top-k = 1 keeps the largest:

    >>> tempered = processed_log_probs(np.log([0.5, 0.5 / 3, 1 / 3]), temperature=0.5)
    >>> np.exp(tempered).round(6).tolist()  # 9/14, 1/14, 4/14
    [0.642857, 0.071429, 0.285714]
    >>> np.exp(processed_log_probs(logits, top_k=1)).tolist()
    [1.0, 0.0, 0.0, 0.0]
    """
    z = _check_logits(logits)
    temperature = _check_temperature(temperature)
    keep, scaled = _kept(z, temperature, _check_top_k(top_k), _check_top_p(top_p),
                         _check_min_p(min_p), _check_sampler(sampler, temperature))
    if keep.all():
        return log_softmax(scaled)
    return log_softmax(np.where(keep, scaled, -np.inf))


def _scaled(z, temperature, name):
    """z / temperature, refused where it overflows float64 (inf - inf would be NaN)."""
    with np.errstate(over="ignore"):
        scaled = z / temperature
    if not np.isfinite(scaled).all():
        raise ValueError(f"{name} / temperature overflows float64 at temperature={temperature!r} "
                         f"(largest |{name}| {float(np.abs(z).max(initial=0.0)):.3g}); use a "
                         "larger temperature")
    return scaled


def _scaled_float32(z, temperature, name, sampler):
    """z / temperature as the frameworks hold it: z rounded to float32, divided in float32."""
    largest = float(np.abs(z).max(initial=0.0))  # 0 for a batch of no rows
    if largest > _FLOAT32_MAX:
        raise ValueError(f"{name} must be within float32's range for sampler={sampler!r} (its "
                         f"logits are float32), got |{name}| up to {largest:.3g}")
    tau = _FLOAT32(min(temperature, _FLOAT32_MAX))
    if temperature > _FLOAT32_MAX or not tau > 0:
        raise ValueError(f"temperature={temperature!r} is outside float32's positive range "
                         f"(sampler={sampler!r} divides in float32)")
    with np.errstate(over="ignore"):
        scaled = z.astype(_FLOAT32) / tau
    if not np.isfinite(scaled).all():
        raise ValueError(f"{name} / temperature overflows float32 at temperature={temperature!r} "
                         f"(largest |{name}| {largest:.3g}); use a larger temperature")
    return scaled


def _softmax_float32(scaled, keep):
    """The float32 probabilities of a framework: the softmax of its float32 logits over ``keep``,
    computed in float64 and rounded once (a torch kernel's exp rounds within an ulp or two)."""
    z = np.where(keep, scaled.astype(float), -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(_FLOAT32)


def _partial_sums_float32(ranked):
    """torch.cumsum of float32 on a CPU: each partial sum accumulated in float64 (torch's
    accumulate type on CPU) and stored in float32."""
    return np.cumsum(ranked, axis=-1, dtype=float).astype(_FLOAT32)


def _scatter(kept_ranked, order):
    kept = np.empty_like(kept_ranked)
    np.put_along_axis(kept, order, kept_ranked, axis=-1)
    return kept


def _mass_above(probs, order):
    """The exact rule's statistic: the mass ranked above each token, in the ranked order.

    ``probs`` ``(..., V)`` and ``order`` (the ranking, ``argsort`` of each row, most likely
    first) give ``above`` ``(..., V)``: ``above[..., r]`` is the sum of the probabilities ranked
    before rank ``r`` (0 for the first)."""
    ### BEGIN SOLUTION Task 1: the probabilities in ranked order, their running sum less each one
    ranked = np.take_along_axis(probs, order, axis=-1)
    return np.cumsum(ranked, axis=-1) - ranked
    ### END SOLUTION


def _cut_exact(above, top_p, axis=-1):
    """The exact nucleus in ranked order: True where the mass ranked above is less than
    ``top_p`` by more than ``NUCLEUS_TOLERANCE``, and at rank 0 along ``axis`` always."""
    ### BEGIN SOLUTION Task 1: above < top_p - NUCLEUS_TOLERANCE; rank 0 (along axis) stays: _set
    kept_ranked = above < top_p - NUCLEUS_TOLERANCE
    _set(kept_ranked, axis, 0)  # the first token always stays
    return kept_ranked
    ### END SOLUTION


def _set(array, axis, i):
    """array[..., i] = True, the index i along ``axis``."""
    where = [slice(None)] * array.ndim
    where[axis] = i
    array[tuple(where)] = True


def _top_p_exact(probs, top_p):
    """Keep v when the mass ranked above it is below top_p (by more than NUCLEUS_TOLERANCE)."""
    # Descending; a stable sort breaks ties by index (the lower index ranks first).
    order = np.argsort(-probs, axis=-1, kind="stable")
    return _scatter(_cut_exact(_mass_above(probs, order), top_p), order)


def _framework_sums(probs, order, sampler):
    """A framework's top-p statistic on its float32 ``probs`` in its sort ``order`` (ascending
    for vLLM and transformers, descending for SGLang): the float32 mass above each token
    (SGLang), or the float32 cumulative sum from below (vLLM, transformers)."""
    ranked = np.take_along_axis(probs, order, axis=-1)
    if sampler == "sglang":
        return _partial_sums_float32(ranked) - ranked  # probs_sum - probs_sort, in float32
    return _partial_sums_float32(ranked)


def _cut_framework(sums, top_p, sampler, axis=-1):
    """A framework's top-p cut in its ranked order (True: kept), from its float32 statistic
    ``sums`` (:func:`_framework_sums`): SGLang's mass above against ``float32(top_p)``; vLLM's
    and transformers' cumulative sum from below against their ``1 - p``, the last rank (the
    largest logit) kept along ``axis``."""
    ### BEGIN SOLUTION Task 2: cut sums > p (sglang) or sums <= 1 - p, each in its float32
    if sampler == "sglang":
        # probs_sort[(probs_sum - probs_sort) > top_ps] = 0, top_ps a float32 tensor
        return ~(sums > _FLOAT32(top_p))
    # top_p_mask = probs_sum <= 1 - p: vLLM's p is a float32 tensor (1 - p in float32),
    # transformers' a Python float (1 - p in float64, rounded to float32 by the comparison)
    cut = _FLOAT32(1.0) - _FLOAT32(top_p) if sampler == "vllm" else _FLOAT32(1.0 - top_p)
    kept_ranked = ~(sums <= cut)
    _set(kept_ranked, axis, -1)  # "at least one": the largest logit stays
    return kept_ranked
    ### END SOLUTION


def _top_p_float32(probs, order, top_p, sampler):
    """A framework's top-p on its float32 ``probs``, in its sort ``order``."""
    return _scatter(_cut_framework(_framework_sums(probs, order, sampler), top_p, sampler),
                    order)


def _min_p_float32(probs, min_p):
    """probs < min_p * max(probs) is cut, the product in float32 (all three frameworks)."""
    return probs >= probs.max(axis=-1, keepdims=True) * _FLOAT32(min_p)


def _kept(z, temperature, top_k, top_p, min_p, sampler, name="logits"):
    """The kept set S of each row (bool, the shape of z) and z / temperature in float64."""
    V = z.shape[-1]
    # Dividing by 1.0 is exact: with the defaults, the rows are the toys' log_softmax bit for bit.
    scaled = _scaled(z, temperature, name)
    keep = np.ones(z.shape, dtype=bool)
    if sampler == "exact":
        if top_k is not None and top_k < V:
            kth_largest = np.sort(scaled, axis=-1)[..., V - top_k, None]
            keep = scaled >= kth_largest  # ties with the k-th largest stay, as in vLLM
        if min_p > 0.0:
            # mu_tau(v) < min_p * max mu_tau, in log space: scaled_v - max < log(min_p)
            keep &= scaled - scaled.max(axis=-1, keepdims=True) >= np.log(min_p)
        if top_p < 1.0:
            keep &= _top_p_exact(np.exp(log_softmax(np.where(keep, scaled, -np.inf))), top_p)
        return keep, scaled
    s = _scaled_float32(z, temperature, name, sampler)
    if sampler == "sglang":
        # softmax, one descending sort of the probabilities, then top-k by rank (exactly k),
        # top-p on the full distribution's mass (not renormalised after top-k), min-p
        probs = _softmax_float32(s, keep)
        order = np.argsort(-probs, axis=-1, kind="stable")
        cut_by_rank = top_k is not None and top_k < V
        if cut_by_rank:
            keep &= _scatter(np.broadcast_to(np.arange(V) < top_k, z.shape).copy(), order)
        if top_p < 1.0 or cut_by_rank or min_p > 0.0:
            # once any cut runs, its top-p line runs too, at p = 1 as well: where the float32
            # partial sums pass 1, the tokens after are cut
            keep &= _top_p_float32(probs, order, top_p, sampler)
        if min_p > 0.0:
            keep &= _min_p_float32(probs, min_p)
        return keep, scaled
    if sampler == "vllm" and min_p > 0.0:  # vLLM: min-p before top-k and top-p
        keep &= _min_p_float32(_softmax_float32(s, keep), min_p)
    if top_k is not None and top_k < V:
        masked = np.where(keep, s, -np.inf)
        keep &= masked >= np.sort(masked, axis=-1)[..., V - top_k, None]
    if top_p < 1.0:
        # the logits sorted ascending (torch.sort; ties in index order on a CPU up to 16
        # entries), the softmax of the survivors, its cumulative sum from below
        order = np.argsort(np.where(keep, s, -np.inf), axis=-1, kind="stable")
        keep &= _top_p_float32(_softmax_float32(s, keep), order, top_p, sampler)
    if sampler == "transformers" and min_p > 0.0:  # transformers: min-p after top-p
        keep &= _min_p_float32(_softmax_float32(s, keep), min_p)
    return keep, scaled


def _real_array(name, values):
    """``values`` as a finite float64 array; bool, complex, strings, None and ragged lists are
    refused with the argument's name."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:  # a ragged list
        raise ValueError(f"{name} must be a rectangular array of real numbers ({error})") from None
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
    array = array.astype(float)
    if not np.isfinite(array).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        raise ValueError(f"{name} must be finite, got {float(array[bad])!r} at index "
                         f"{bad[0] if len(bad) == 1 else bad}")
    return array


def top_p_kept(probs, top_p, sampler="exact"):
    r"""The tokens top-$p$ keeps from a distribution, by the rule of ``sampler``.

    The rule reads ``probs`` as the distribution it cuts (for vLLM and transformers the
    survivors of the earlier cuts renormalised, for SGLang the full tempered softmax):

    * ``"exact"``: keep $v$ when the mass ranked above it is less than $p$ (within
      ``NUCLEUS_TOLERANCE``), ties ranked by index; the most likely token always stays.
    * ``"vllm"``: ``probs`` rounded to float32, sorted ascending (ties in index order), cut where
      the float32 cumulative sum is at most ``1 - float32(p)`` (computed in float32), never the
      last (vLLM's ``apply_top_k_top_p_pytorch``).
    * ``"transformers"``: the same with the cut ``float32(1 - p)``, ``1 - p`` in float64
      (``TopPLogitsWarper``).
    * ``"sglang"``: sorted descending (ties in index order), cut where the float32 mass above,
      ``cumsum - p_v``, exceeds ``float32(p)`` (``top_k_top_p_min_p_sampling_from_probs_torch``).

    In exact arithmetic the first three keep the same set, and SGLang's keeps one token more
    where the mass above a token equals $p$; in float32 every boundary is decided by rounding.

    Parameters
    ----------
    probs : array_like
        ``(..., V)``, ``V >= 1``, entries in $[0, 1]$, each row summing to 1 within 1e-6.
    top_p : float
        In $(0, 1]$; 1 keeps every token.
    sampler : {"exact", "vllm", "transformers", "sglang"}

    Returns
    -------
    numpy.ndarray
        Bool of the shape of ``probs``: True where the token is kept.

    Examples
    --------
    At $p = 0.8$ the two smallest of 0.5, 0.3, 0.15, 0.05 carry 0.2 exactly, and each rule
    decides the boundary in its own arithmetic. vLLM: ``float32(0.05) + float32(0.15)`` =
    0.2000000067 stored as ``float32(0.2)`` = 0.20000000298, above ``1 - float32(0.8)`` =
    0.19999998808, so 0.15 stays. transformers: the cut is ``float32(1 - 0.8)`` =
    ``float32(0.2)``, and 0.15 goes. SGLang: the mass above 0.15 is ``float32(0.95000001788)``
    (a tie, rounded to even: 0.95000004768) minus ``float32(0.15)`` = 0.80000004172, above
    ``float32(0.8)`` = 0.80000001192, and 0.15 goes:

    >>> probs = [0.5, 0.3, 0.15, 0.05]
    >>> [top_p_kept(probs, 0.8, sampler).sum().item() for sampler in SAMPLERS]
    [2, 3, 2, 2]

    Ties break in opposite directions: vLLM's ascending sort puts the lower index first and
    cuts it, the exact rule and SGLang rank it first and keep it:

    >>> top_p_kept([0.25] * 4, 0.5).tolist(), top_p_kept([0.25] * 4, 0.5, "vllm").tolist()
    ([True, True, False, False], [False, False, True, True])
    >>> top_p_kept([0.25] * 4, 0.5, "sglang").tolist()  # the mass above the third is 0.5
    [True, True, True, False]
    """
    p = _real_array("probs", probs)
    if p.ndim == 0 or p.shape[-1] == 0:
        raise ValueError(f"probs must have shape (..., V) with V >= 1, got {p.shape}")
    if (p < 0).any() or (p > 1).any():
        bad = float(p[(p < 0) | (p > 1)][0])
        raise ValueError(f"probs must lie in [0, 1], got {bad!r}")
    sums = p.sum(axis=-1)
    if (np.abs(sums - 1) > _SUM_TOLERANCE).any():
        bad = float(sums[np.abs(sums - 1) > _SUM_TOLERANCE][0])
        raise ValueError(f"each row of probs must sum to 1 (within {_SUM_TOLERANCE:g}), got a row "
                         f"summing to {bad!r}")
    top_p, sampler = _check_top_p(top_p), _check_sampler(sampler)
    if top_p == 1.0:
        return np.ones(p.shape, dtype=bool)
    if sampler == "exact":
        return _top_p_exact(p, top_p)
    p32 = p.astype(_FLOAT32)
    order = np.argsort(-p32 if sampler == "sglang" else p32, axis=-1, kind="stable")
    return _top_p_float32(p32, order, top_p, sampler)


def _compositions(V, resolution):
    """Every row of V positive integers summing to resolution, in lexicographic order."""
    # Stars and bars: the V - 1 cut points, increasing, in 1 .. resolution - 1.
    cuts = np.array(list(itertools.combinations(range(1, resolution), V - 1)),
                    dtype=np.int64).reshape(-1, V - 1)
    edges = np.concatenate([np.zeros((len(cuts), 1), np.int64), cuts,
                            np.full((len(cuts), 1), resolution, np.int64)], axis=1)
    return np.diff(edges, axis=1)


def nucleus_disagreement(sampler, V=4, resolution=100):
    r"""Where a sampler's top-$p$ keeps another set than the exact nucleus, on every decimal row.

    The rows are every distribution of ``V`` tokens whose probabilities are positive multiples
    of ``1 / resolution`` (``comb(resolution - 1, V - 1)`` of them, 156,849 for the defaults),
    each at every ``top_p = j / resolution``, ``j = 1 .. resolution - 1``. The sampler receives
    their logits $\log(k / \text{resolution})$ and cuts them as :func:`processed_log_probs` does
    (temperature 1, no other cut); the exact nucleus is computed on the integers: keep $v$ when
    the count ranked above it is less than $j$, ties ranked by index.

    Parameters
    ----------
    sampler : {"exact", "vllm", "transformers", "sglang"}
        ``"exact"`` measures the float64 implementation against the integers.
    V : int
        Tokens, 2 to 8.
    resolution : int
        From ``V`` to 1000, with at most two million distributions.

    Returns
    -------
    dict
        ``rows`` (distributions times top-p values); ``boundary``, the rows where the count
        above some token is exactly $j$ (the exact rule's boundary); ``differ``, the rows whose
        kept set is not the exact one, split into ``more`` (more tokens kept), ``fewer`` and
        ``swapped`` (as many, others: a tie broken the other way); ``differ_off_boundary``
        and ``resized_off_boundary`` (the differing rows off the boundary, and those of them
        with another number of tokens);
        ``fraction`` $=$ ``differ / rows``; ``max_mass_difference``, the largest
        $|\mu(S) - \mu(S_{\text{exact}})|$ of kept mass, and ``worst``, a row where it is
        reached (``probs``, ``top_p``, the two kept sets).

    Examples
    --------
    Three tokens in tenths: ``comb(9, 2)`` = 36 distributions at 9 top-p values. Each
    distribution sits on the exact rule's boundary at two of them, the mass of its top token and
    that of its top two (72 rows). vLLM never keeps fewer tokens than the exact rule, and keeps
    another number of them only on a boundary; off it, it differs only where a tie straddles
    the cut:

    >>> d = nucleus_disagreement("vllm", V=3, resolution=10)
    >>> d["rows"], d["boundary"], d["fewer"], d["resized_off_boundary"]
    (324, 72, 0, 0)
    >>> nucleus_disagreement("exact", V=3, resolution=10)["differ"]  # float64, as exact
    0
    """
    sampler = _check_sampler(sampler)
    for name, value, low, high in (("V", V, 2, 8), ("resolution", resolution, V, 1000)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        if not low <= value <= high:
            raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    V, resolution = int(V), int(resolution)
    count = math.comb(resolution - 1, V - 1)
    if count > _MAX_ENUMERATED:
        raise ValueError(f"V={V}, resolution={resolution} has {count:,} distributions, more than "
                         f"the {_MAX_ENUMERATED:,} nucleus_disagreement enumerates")
    counts = _compositions(V, resolution)
    logits = np.log(counts / resolution)
    # The exact nucleus on the integers, ranked as the exact rule ranks (ties by index).
    order_exact = np.argsort(-counts, axis=-1, kind="stable")
    ranked = np.take_along_axis(counts, order_exact, axis=-1)
    above_int = np.cumsum(ranked, axis=-1) - ranked
    # What the sampler sorts and sums, computed once for every top-p; the kept sets are read
    # back in the tokens' order through the inverse permutations.
    if sampler == "exact":
        probs = np.exp(log_softmax(logits))
        order = np.argsort(-probs, axis=-1, kind="stable")
        sums = _mass_above(probs, order)
    else:
        s = _scaled_float32(logits, 1.0, "logits", sampler)
        probs = _softmax_float32(s, np.ones(s.shape, dtype=bool))
        order = np.argsort(-probs if sampler == "sglang" else s, axis=-1, kind="stable")
        sums = _framework_sums(probs, order, sampler)
    # The loop works on (V, rows) arrays, the rank first: numpy reduces a short last axis
    # slowly. A kept set is compared as a bit mask of token indices.
    sums, above_int = sums.T.copy(), above_int.T.copy()
    bits, bits_exact = (1 << order).T.copy(), (1 << order_exact).T.copy()
    mass_ranked = np.take_along_axis(counts, order, axis=-1).T.copy()
    mass_exact_ranked = ranked.T.copy()
    stats = dict(rows=0, boundary=0, differ=0, more=0, fewer=0, swapped=0,
                 differ_off_boundary=0, resized_off_boundary=0)
    worst = (-1, None)
    for j in range(1, resolution):
        top_p = j / resolution
        kept = (_cut_exact(sums, top_p, axis=0) if sampler == "exact"
                else _cut_framework(sums, top_p, sampler, axis=0))
        exact = above_int < j
        n, n_exact = kept.sum(axis=0), exact.sum(axis=0)
        differ = (kept * bits).sum(axis=0) != (exact * bits_exact).sum(axis=0)
        off = ~(above_int == j).any(axis=0)
        mass = np.abs((kept * mass_ranked).sum(axis=0) - (exact * mass_exact_ranked).sum(axis=0))
        stats["rows"] += len(counts)
        stats["boundary"] += int((~off).sum())
        stats["differ"] += int(differ.sum())
        stats["more"] += int((n > n_exact).sum())
        stats["fewer"] += int((n < n_exact).sum())
        stats["swapped"] += int((differ & (n == n_exact)).sum())
        stats["differ_off_boundary"] += int((differ & off).sum())
        stats["resized_off_boundary"] += int((off & (n != n_exact)).sum())
        i = int(np.argmax(mass))
        if mass[i] > worst[0]:
            as_tokens = [_scatter(k[:, i][None], o[i][None])[0].tolist()
                         for k, o in ((kept, order), (exact, order_exact))]
            worst = (int(mass[i]), dict(probs=(counts[i] / resolution).tolist(), top_p=top_p,
                                        kept=as_tokens[0], exact=as_tokens[1]))
    return dict(stats, sampler=sampler, V=V, resolution=resolution,
                distributions=len(counts), fraction=stats["differ"] / stats["rows"],
                max_mass_difference=worst[0] / resolution, worst=worst[1])


def boundary_toy():
    r"""The toy of :func:`toy_from_logits` whose positions are the rows of ``BOUNDARY_PROBS``.

    Trainer and sampler are equal ($\epsilon = 0$): at ``top_p=0.8`` the only mismatch an
    estimator sees is the truncation, and the rules' kept sets are all that differs between
    their engines (:func:`engine_toy` with ``sampler=``).

    Examples
    --------
    >>> toy = boundary_toy()
    >>> toy["T"], toy["V"], len(toy["Y"]), float(np.abs(toy["b"]).max())
    (3, 4, 64, 0.0)
    >>> kept = {s: engine_toy(toy, top_p=0.8, sampler=s)["Y"] for s in SAMPLERS}
    >>> [sorted(set(kept[s][:, 2].tolist())) for s in SAMPLERS]  # the third position
    [[0, 1], [1, 2], [1, 2], [0, 1]]
    """
    logits = np.log(np.array(BOUNDARY_PROBS))
    return toy_from_logits(logits, logits)


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


def _log_kept(logits, kept):
    """log of the softmax(logits) mass on the kept tokens, one value a row of the last axis."""
    ### BEGIN SOLUTION Task 3: logsumexp over kept less logsumexp over all, each from its max
    # Each logsumexp from its own largest term, so neither sum underflows (the trainer's most
    # likely token may be one the engine cut).
    on_kept = np.where(kept, logits, -np.inf)
    top_kept = on_kept.max(axis=-1, keepdims=True)
    top = logits.max(axis=-1, keepdims=True)
    lse_kept = top_kept[..., 0] + np.log(np.exp(on_kept - top_kept).sum(axis=-1))
    return lse_kept - top[..., 0] - np.log(np.exp(logits - top).sum(axis=-1))
    ### END SOLUTION


def _per_token(table, target, real):
    """The (M, T) values of a per-row table (T,) or (T, V + 1) at each token's row, 0 on
    padding."""
    index = tuple(np.broadcast_to(i, target["Y"].shape) for i in _rows(target)[:-1])
    return np.where(real, table[index], 0.0)


def engine_toy(toy, temperature=1.0, top_k=None, top_p=1.0, reported="processed",
               trainer_temperature=True, trainer_mask=False, min_p=0.0, sampler="exact",
               kept_mass=None):
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
    temperature, top_k, top_p, min_p, sampler
        The engine's sampling parameters and whose rules cut, as in
        :func:`processed_log_probs`.
    reported : {"processed", "raw", "tempered"}
        The log-probs the engine returns, which the estimators read as ``logp_sampler``:
        $\log \mu(y_t)$, the raw $\log \mathrm{softmax}(z)_{y_t}$, or the tempered
        $\log \mu_\tau(y_t) = \log \mathrm{softmax}(z / \tau)_{y_t}$ before any cut
        (SGLang's default). The default is ``"processed"`` for every ``sampler``.
    trainer_temperature : bool
        Whether the trainer divides its logits by ``temperature``: ``logp_train`` and
        ``score`` are those of $\pi_\tau$ (True) or of $\pi_1$ (False).
    trainer_mask : bool
        Whether the trainer replays the engine's sampling mask: its softmax is renormalised
        over the kept tokens $S_t$ of each position (held fixed, not differentiated), as with
        vLLM's ``return_sampling_mask``. False: the full-vocabulary softmax, as TRL and verl
        compute it.
    kept_mass : {None, "sampler", "trainer"}
        The correction of the reported log-probs (module docstring): none; ``"sampler"``, the
        reported distribution renormalised on each position's kept set (the tempered log-probs
        become the processed ones); ``"trainer"``, the log of the trainer's kept mass
        $\pi_\tau(S_t)$ added (TRL's PR #7269; refused with ``trainer_mask=True``).

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
        $\pi_\tau$ renormalised on the kept tokens, the kept sets held fixed);
        ``log_kept_sampler`` and ``log_kept_trainer``, shape ``(M, T)``: each token's
        $\log \mu_\tau(S_t)$ and $\log \pi(S_t)$ (the trainer's softmax as it computes it),
        0 on padding; and ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``sampler``,
        ``reported``, ``trainer_temperature``, ``trainer_mask``, ``kept_mass``.

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
    its estimate misses the cut token's share of the gradient. The token ratios
    $\pi(y_t) / \mu(y_t)$, and the mean of the sequence-ratio estimate
    $\sum_y \mu(y)\, \rho(y)\, R(y)\, s_t(y)$ (the catalogue's ``seq_is``), from the arrays:

    >>> def token_ratios(e):
    ...     return np.exp(e["logp_train"] - e["logp_sampler"])
    >>> def seq_is_mean(e):
    ...     rho = token_ratios(e).prod(axis=1)
    ...     return np.einsum("m,m,m,mtv->tv", e["p_sampler"], rho, e["R"], e["score"])
    >>> logits = np.log([[0.5, 0.3, 0.2]])
    >>> engine = engine_toy(toy_from_logits(logits, logits), top_p=0.7)
    >>> engine["Y"].tolist(), engine["p_sampler"].round(12).tolist()
    ([[0], [1]], [0.625, 0.375])
    >>> token_ratios(engine).round(12).tolist()
    [[0.8], [0.8]]
    >>> mean = seq_is_mean(engine)
    >>> bool(np.allclose(mean, engine["true_grad"] - engine["truncated_grad"], atol=1e-15))
    True
    >>> round(engine["truncated_mass"], 12)
    0.2

    The same engine, its log-probs corrected by a kept mass. SGLang's tempered log-probs are
    of the full softmax: ratio 1, the kept mass hidden. Renormalised on the kept set
    (``kept_mass="sampler"``) they are the processed ones, ratio 0.8; the processed ones with
    the trainer's kept mass added (``kept_mass="trainer"``) give ratio 1 again:

    >>> same = toy_from_logits(logits, logits)
    >>> choices = (("tempered", None), ("tempered", "sampler"), ("processed", "trainer"))
    >>> [token_ratios(engine_toy(same, top_p=0.7, reported=r, kept_mass=k)).round(12).tolist()
    ...  for r, k in choices]
    [[[1.0], [1.0]], [[0.8], [0.8]], [[1.0], [1.0]]]

    The reward is 1 for token 0 alone, which the engine keeps: the support condition holds, and
    the exact ratio's mean is the true gradient. With the trainer's kept mass it is
    $1 / 0.8 = 1.25$ times the true gradient:

    >>> for k in (None, "trainer"):
    ...     e = engine_toy(same, top_p=0.7, kept_mass=k)
    ...     print(k, (seq_is_mean(e) / e["true_grad"]).round(12).tolist())
    None [[1.0, 1.0, 1.0]]
    trainer [[1.25, 1.25, 1.25]]
    """
    theta, raw, autoregressive = _check_engine_toy(toy)
    temperature = _check_temperature(temperature)
    top_k, top_p, min_p = _check_top_k(top_k), _check_top_p(top_p), _check_min_p(min_p)
    sampler = _check_sampler(sampler, temperature)
    check_choice("reported", reported, REPORTED)
    for name, flag in (("trainer_temperature", trainer_temperature),
                       ("trainer_mask", trainer_mask)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    check_choice("kept_mass", kept_mass, KEPT_MASS, allow_none=True)
    if kept_mass == "trainer" and trainer_mask:
        raise ValueError("kept_mass='trainer' with trainer_mask=True counts the trainer's kept "
                         "mass twice: the replayed mask already renormalises the trainer on "
                         "the kept set")
    scaled_theta = _scaled(theta, temperature, "theta")
    kept, scaled_raw = _kept(raw, temperature, top_k, top_p, min_p, sampler,
                             "theta + mismatch * b")
    log_processed = log_softmax(scaled_raw if kept.all() else np.where(kept, scaled_raw, -np.inf))

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
    # Each token's kept mass, log of sum over S_t of a softmax: of the engine's tempered logits
    # and of the trainer's logits as it computes them (divided by tau or not).
    trainer_logits = scaled_theta if trainer_temperature else theta
    log_kept_sampler = _per_token(_log_kept(scaled_raw, kept), target, real)
    log_kept_trainer = _per_token(_log_kept(trainer_logits, kept), target, real)
    if reported == "processed":
        reported_logp, log_kept_reported = logp_processed, 0.0  # its mass on S_t is 1
    elif reported == "raw":  # the toys' enumeration reads softmax(theta + mismatch * b)
        reported_logp = target["logp_sampler"]
        log_kept_reported = _per_token(_log_kept(raw, kept), target, real)
    else:  # tempered: softmax(z / tau) over the whole vocabulary, SGLang's default
        reported_logp = np.where(real, log_softmax(scaled_raw)[rows], 0.0)
        log_kept_reported = log_kept_sampler
    if kept_mass == "sampler":  # renormalised on S_t: log l(y_t) - log l(S_t)
        reported_logp = reported_logp - log_kept_reported
    elif kept_mass == "trainer":  # on the trainer's support: log mu(y_t) + log pi(S_t)
        reported_logp = reported_logp + log_kept_trainer
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
        log_kept_sampler=log_kept_sampler[writable],
        log_kept_trainer=log_kept_trainer[writable],
        theta=toy["theta"], b=toy["b"], mismatch=toy["mismatch"],
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler,
        reported=reported,
        trainer_temperature=bool(trainer_temperature), trainer_mask=bool(trainer_mask),
        kept_mass=kept_mass,
    )
    return engine


KEPT_MASS_CHOICES = (
    ("vLLM processed (TRL, verl)", dict(reported="processed")),
    ("+ the trainer's kept mass (TRL #7269)", dict(reported="processed", kept_mass="trainer")),
    ("the engine's mask replayed", dict(reported="processed", trainer_mask=True)),
    ("vLLM raw", dict(reported="raw")),
    ("+ renormalised on the kept set", dict(reported="raw", kept_mass="sampler")),
    ("SGLang (tempered)", dict(reported="tempered")),
    ("+ renormalised on the kept set", dict(reported="tempered", kept_mass="sampler")),
    ("+ the trainer's kept mass", dict(reported="tempered", kept_mass="trainer")),
)
"""The log-probs a trainer can get and the kept-mass corrections of them, as ``engine_toy``
options: the rows of ``kept_mass_table``."""


def kept_mass_table(toy, temperature=0.7, top_p=0.93, choices=KEPT_MASS_CHOICES, top_k=None,
                    min_p=0.0):
    r"""The sequence ratio (``seq_is``) with each reported log-prob and kept-mass correction:
    its exact relative bias against the three gradients it could be meant to estimate.

    For each ``(label, options)`` of ``choices``, ``engine_toy(toy, temperature=..., top_p=...,
    top_k=..., min_p=..., **options)`` and the mean of ``seq_is`` on it, against
    $\nabla J_\tau$ (``true_grad``), $\nabla J_\tau^W$, the objective with the reward of every
    sequence the engine cannot write set to 0 (``true_grad - truncated_grad``), and
    $\nabla \mathbb{E}_{\pi_S}[R]$, the gradient of the policy as the engine runs it
    (``masked_grad``): each the norm of the difference over the norm of the target. A target of
    norm 0 (cuts that leave no reward) is refused: its relative bias is undefined.

    Returns
    -------
    list of dict
        ``label``, ``options``, ``rel_bias_true``, ``rel_bias_writable``, ``rel_bias_masked``
        and ``var``, the total variance of one sample's estimate under the engine's $\mu$
        ([opd_literate.mismatch.toy.estimator_moments][]).

    Examples
    --------
    The processed log-probs give the exact ratio, unbiased for $\nabla J_\tau^W$; with the
    engine's mask replayed the trainer's policy is the engine's, unbiased for its gradient:

    >>> rows = kept_mass_table(make_toy(T=2, V=3))
    >>> round(rows[0]["rel_bias_writable"], 12), round(rows[2]["rel_bias_masked"], 12)
    (0.0, 0.0)
    """
    # imported here: the engine lab's folder holds this module without the estimators lab's
    from .estimators import seq_is

    rows = []
    for label, options in choices:
        engine = engine_toy(toy, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            **options)
        moments = estimator_moments(engine, seq_is(engine))
        mean = moments["mean"]
        targets = {"true": engine["true_grad"],
                   "writable": engine["true_grad"] - engine["truncated_grad"],
                   "masked": engine["masked_grad"]}
        norms = {name: np.linalg.norm(target) for name, target in targets.items()}
        for name, norm in norms.items():
            if not norm > 0:
                raise ValueError(f"the gradient {name!r} is 0 for {label!r} at these settings "
                                 "(the cuts leave no reward to estimate): its relative bias is "
                                 "undefined")
        rows.append(dict(label=label, options=dict(options), var=float(moments["var"]), **{
            f"rel_bias_{name}": float(np.linalg.norm(mean - target) / norms[name])
            for name, target in targets.items()}))
    return rows
