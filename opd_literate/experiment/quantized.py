r"""The mismatch on a trained model: tinylm's students run as an inference engine would.

The mismatch chapter measures every rollout correction on toys whose sampler error is a random
table $b$. Here the sampler is real: the experiment's trained student, run the way an inference
engine runs a model, and the trainer is the same weights in float64. Because tinylm's answers
are enumerable ([opd_literate.experiment.exact][]: 2,380 prefixes a prompt), everything is exact.

**The samplers** (``SAMPLERS``). The trainer $\pi$ is the student in float64. The sampler $\mu$
is one of

* ``fp32``: the same weights, forward pass in float32 (another kernel's rounding, the floor);
* ``bf16``, ``fp16``: weights and every activation rounded to bfloat16 or float16, the LM
  head's logits rounded to that type (then the softmax in float64: an engine's sampler
  computes it in float32 from the rounded logits). The exact studies compute this engine with
  [opd_literate.experiment.quantized.rounded_half_forward][]: each operation's output rounded
  to the half type from its float64 value (through float32, as a kernel accumulating in
  float32 rounds it), so its numbers depend on the weights, not on the CPU's half-precision
  kernels. [opd_literate.experiment.quantized.ensemble_sampler][], the sampler of the training
  study, runs torch's own ``bfloat16`` and ``float16`` kernels, which round differently on
  different CPUs;
* ``int8``, ``int4``: **weight-only, symmetric, per output channel, round to nearest**
  ([opd_literate.experiment.quantized.quantize_per_channel][]) for the weight of every
  ``nn.Linear`` (the LM head included); embeddings and biases stay as they are, and the
  forward pass runs in float32 on the dequantized weights, as a weight-only kernel computes
  (the integers are multiplied by their scale before the product).

**The mismatch it creates** ([opd_literate.experiment.quantized.token_mismatch][]): at every
state $s$ the sampler reaches, the per-token $\mathrm{KL}(\mu_s \,\|\, \pi_s)$ and the
distribution of the log-ratio $\log \rho = \log \pi(v \mid s) - \log \mu(v \mid s)$ of the
token $v$ it writes, each state weighted by the **sampler's** probability of reaching it (the
sampler writes the answers). The toys' $b$ is measured by the same function.

**Every estimator, exactly** ([opd_literate.experiment.quantized.answer_toy][]). The complete
answers of a set of prompts (a state followed by ``<eos>``, or by any token at the last
position: 30,941 a prompt) with their trainer and sampler log-probabilities, the 0/1 reward and
a score, form a dictionary with the keys of the toys, so that the numpy catalogue
([opd_literate.mismatch.estimators.comparison_table][],
[opd_literate.mismatch.opd_mismatch.opd_estimate][]) computes every estimator's exact mean, bias
and variance under the sampler with the same definitions. The prompts are drawn uniformly, one
answer a prompt, as the experiment's batch is: the dictionary's distribution is the mixture
$\frac1B \sum_x \mu(y \mid x)$.

**The score, on a stated subset of the parameters.** The score of token $t$ is the gradient of
$\log \pi(y_t \mid s_t)$ with respect to the LM head (the last ``nn.Linear``, logits
$z = W h + c$), which is, in closed form,

$$
\frac{\partial \log \pi(y_t \mid s_t)}{\partial c} = e_{y_t} - \pi(\cdot \mid s_t), \qquad
\frac{\partial \log \pi(y_t \mid s_t)}{\partial W} = \bigl(e_{y_t} - \pi(\cdot \mid s_t)\bigr)
\, h(s_t)^\top .
$$

``features="bias"`` keeps the bias $c$ ($V = 14$ parameters: the gradient in logit space, what
the studies use, because the full head's score, 1,806 numbers a token, would take 900 MB a
prompt); ``features="head"`` the whole head $[W, c]$ (for small models and tests).
``tests/experiment/test_quantized.py`` checks both against torch autograd.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from .._numerics import check_finite_number, check_real_array, compute_dtype
from .exact import answer_states, reach_log_probs, state_contexts, state_logits
from .tinylm import EOS, PAD, EnsembleLM, V, answer_tokens, make_prompts

__all__ = ["SAMPLERS", "QUANTILES", "quantize_per_channel", "sampler_copy", "ensemble_sampler",
           "rounded_half_forward", "engine_logits",
           "token_mismatch", "answer_toy", "sampler_states", "tinylm_answer_toy",
           "full_parameter_bias",
           "toy_token_mismatch", "matched_toy_mismatch", "average_ranks", "rank_correlation",
           "mismatch_study", "mismatch_study_record"]

SAMPLERS = {
    "fp32": "forward pass in float32",
    "bf16": "weights, activations and logits in bfloat16",
    "fp16": "weights, activations and logits in float16",
    "int8": "int8 weights (symmetric, per output channel, round to nearest), float32 compute",
    "int4": "int4 weights (symmetric, per output channel, round to nearest), float32 compute",
}
"""The samplers of this module, each against the float64 trainer."""

QUANTILES = (0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999)
"""The quantiles of the log-ratio that [opd_literate.experiment.quantized.token_mismatch][]
reports."""

_BITS = {"int8": 8, "int4": 4}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_model(name, model):
    """A TinyLM (an ``nn.Module`` with ``mlp``, ``digits`` and ``max_answer``), not an
    ensemble."""
    if (not isinstance(model, nn.Module) or not hasattr(model, "mlp")
            or not hasattr(model, "digits") or hasattr(model, "models")):
        raise TypeError(f"{name} must be a TinyLM, got {type(model).__name__}")


def _check_pairs(pairs, digits):
    """``(B, 2)`` long operands with at most ``digits`` digits, B >= 1 (make_prompts writes a
    negative or a longer number as other digits without a word)."""
    if not isinstance(pairs, torch.Tensor) or pairs.dtype != torch.long:
        raise TypeError(f"pairs must be a (B, 2) long tensor, got "
                        f"{getattr(pairs, 'dtype', type(pairs).__name__)}")
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.shape[0] == 0:
        raise ValueError(f"pairs must have shape (B, 2) with B >= 1, got {tuple(pairs.shape)}")
    bad = (pairs < 0) | (pairs >= 10 ** digits)
    if bool(bad.any()):
        raise ValueError(f"pairs must be operands in [0, {10 ** digits}) for {digits}-digit "
                         f"prompts, got {int(pairs[bad][0])}")


def _check_log_probs(name, x, shape=None):
    """``x`` as a float64 ``(N, V)`` array of finite log-probabilities (each row's exp sums to
    1 within 1e-6), or a named error."""
    x = check_real_array(name, x, 2, finite=False)
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite: a token of probability 0 has no log-ratio, got "
                         f"{float(x[~np.isfinite(x)][0])!r}")
    total = np.exp(x).sum(axis=1)
    if x.size and np.abs(total - 1).max() > 1e-6:
        row = int(np.abs(total - 1).argmax())
        raise ValueError(f"{name} must hold log-probabilities: exp of row {row} sums to "
                         f"{float(total[row])!r}, not 1")
    return x


def quantize_per_channel(weight, bits):
    r"""Symmetric per-output-channel round-to-nearest quantization, returned dequantized.

    For the weight $W$ of an ``nn.Linear`` (``(out, in)``: row $o$ is output channel $o$), with
    $q_{\max} = 2^{\text{bits} - 1} - 1$ (127 for int8, 7 for int4; the code $-2^{\text{bits}-1}$
    is not used, so the grid is symmetric),

    $$
    s_o = \frac{\max_i |W_{oi}|}{q_{\max}}, \qquad
    q_{oi} = \mathrm{round}\bigl(W_{oi} / s_o\bigr) \in [-q_{\max}, q_{\max}], \qquad
    \hat W_{oi} = s_o\, q_{oi},
    $$

    with ``torch.round`` (half to even). A row of zeros stays zeros; an empty weight (a layer
    with no inputs or no outputs, ``nn.Linear(0, 3)``) is returned empty.

    **The error.** In exact arithmetic $|W_{oi} - \hat W_{oi}| \le s_o / 2$. The function
    computes in float64 for a float64 weight and in float32 for a float32, bfloat16 or float16
    one (a half-precision weight is widened exactly); with $u$ the unit roundoff of that type
    ($2^{-53}$, $2^{-24}$), each of its three roundings ($s_o$, $W_{oi} / s_o$, $s_o q_{oi}$)
    is off by at most $u$ relative in the normal range, and then

    $$
    |W_{oi} - \hat W_{oi}| \le \frac{s_o}{2} + 3u \max_i |W_{oi}|
    $$

    (the division adds $u |W_{oi}|$, the scale's rounding $u s_o / 2$ to the half step, the
    product $u\, q_{\max} s_o (1 + u)$: at most $(2.5 + u)\, u \max_i |W_{oi}|$ together, as
    $s_o \le \max_i |W_{oi}| = q_{\max} s_o$) for every channel whose $s_o$ is 0 or at least
    the smallest normal number of that type (``torch.finfo(dtype).tiny``); below it the
    roundings underflow, and a scale that underflows to 0 returns its channel as zeros. At the
    top of the range $s_o q_{oi}$ is clamped to the largest finite number, never rounded to
    ``inf``.

    **Half-precision weights** come back in float32: $s_o q_{oi}$, a code of up to 7 bits times
    a scale of 24, does not fit the half type, and rounding it there would move it by up to half
    an ulp more, at most $2^{-8} |\hat W_{oi}|$ in bfloat16 and $2^{-11} |\hat W_{oi}|$ in
    float16 (a normal number): at the largest entry of an int8 channel in bfloat16,
    $2^{-8} \cdot 127\, s_o \approx 0.5\, s_o$ more, an error of up to about $s_o$, twice the
    bound above.

    Parameters
    ----------
    weight : torch.Tensor
        ``(out, in)`` floating, finite.
    bits : int
        2 to 8.

    Returns
    -------
    torch.Tensor
        $\hat W$, a new tensor of the shape and device of ``weight``, in its dtype (float32 for
        a bfloat16 or float16 weight).

    Examples
    --------
    One channel with largest entry 1.4 at 4 bits: the step is $1.4 / 7 = 0.2$, so 0.5 is
    2.5 steps and rounds (half to even) to 2 steps, 0.4:

    >>> w = torch.tensor([[1.4, 0.5, -0.31], [0.0, 0.0, 0.0]], dtype=torch.float64)
    >>> [round(x, 6) for x in quantize_per_channel(w, 4)[0].tolist()]
    [1.4, 0.4, -0.4]
    >>> quantize_per_channel(w, 4)[1].tolist()
    [0.0, 0.0, 0.0]
    >>> quantize_per_channel(torch.empty(3, 0), 8).shape  # nn.Linear(0, 3)'s weight
    torch.Size([3, 0])
    >>> quantize_per_channel(w.bfloat16(), 4).dtype
    torch.float32
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D floating tensor (out, in), got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)} of shape "
                        f"{tuple(getattr(weight, 'shape', ()))}")
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)) \
            or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 2 to 8, got {bits!r}")
    bits = int(bits)
    if not torch.isfinite(weight).all():
        raise ValueError("weight must be finite: a NaN or inf has no quantization scale")
    # float32 for a half-precision weight (widened exactly); float32 and float64 as they are
    w = weight.to(compute_dtype(weight))
    if w.numel() == 0:  # no channel, or channels without entries: nothing to round
        return w.clone()
    q_max = 2 ** (bits - 1) - 1
    # s_o = max_i |W_oi| / q_max, one scale per output channel (row): (out, 1)
    scale = w.abs().amax(dim=1, keepdim=True) / q_max
    # a row of zeros has scale 0: divide by 1 instead (its codes are 0 either way)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # q = round(W / s), clamped to the symmetric grid [-q_max, q_max]
    codes = torch.clamp(torch.round(w / safe), -q_max, q_max)
    # W_hat = s q: the dequantized weight the kernel multiplies by; s q_max can round past the
    # largest finite number when max |W_o| is near it: clamped there (a no-op below it)
    largest = torch.finfo(w.dtype).max
    return torch.clamp(codes * scale, -largest, largest)


def sampler_copy(model, sampler):
    r"""A copy of a [opd_literate.experiment.tinylm.TinyLM][] run as the sampler ``sampler``.

    ``"float64"`` is the trainer; the others are the keys of ``SAMPLERS``. The model itself is
    not changed.

    Examples
    --------
    >>> from opd_literate.experiment.tinylm import TinyLM
    >>> _ = torch.manual_seed(0)
    >>> model = TinyLM(hidden=8, layers=1)
    >>> int4 = sampler_copy(model, "int4")
    >>> head = int4.mlp[-1].weight
    >>> int(torch.unique(head[0] / (head[0].abs().max() / 7)).round().numel()) <= 15
    True
    >>> sampler_copy(model, "bf16").mlp[-1].weight.dtype
    torch.bfloat16
    """
    if sampler != "float64" and sampler not in SAMPLERS:
        raise ValueError(f"sampler must be 'float64' or one of {sorted(SAMPLERS)}, got "
                         f"{sampler!r}")
    _check_model("model", model)
    engine = copy.deepcopy(model).eval()
    if sampler == "float64":
        return engine.double()
    if sampler in _DTYPES:
        return engine.to(_DTYPES[sampler])
    engine = engine.float()
    with torch.no_grad():
        for layer in engine.modules():
            if isinstance(layer, nn.Linear):
                layer.weight.copy_(quantize_per_channel(layer.weight, _BITS[sampler]))
    return engine


@torch.no_grad()
def ensemble_sampler(ensemble, sampler):
    r"""A copy of an [opd_literate.experiment.tinylm.EnsembleLM][] run as ``sampler``: each
    model exactly as [opd_literate.experiment.quantized.sampler_copy][] runs it alone.

    An ensemble stores linear layer $\ell$ of model $m$ as ``weights[l][m]``, ``(in, out)``, the
    transpose of ``nn.Linear``'s ``(out, in)``: an output channel is a column, so the int8 and
    int4 scales are maxima over ``in``. Embeddings and biases are kept.

    Examples
    --------
    >>> from opd_literate.experiment.tinylm import EnsembleLM
    >>> _ = torch.manual_seed(0)
    >>> ensemble = EnsembleLM(2, 8, 1)
    >>> for p in ensemble.parameters():
    ...     _ = torch.nn.init.normal_(p)
    >>> int4 = ensemble_sampler(ensemble, "int4")
    >>> column = int4.weights[1][1][:, 0]
    >>> len(torch.unique((column / (column.abs().max() / 7)).round())) <= 15
    True
    >>> ensemble_sampler(ensemble, "bf16").weights[0].dtype
    torch.bfloat16
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {sorted(SAMPLERS)}, got {sampler!r}")
    if not isinstance(ensemble, EnsembleLM):
        raise TypeError(f"ensemble must be an EnsembleLM, got {type(ensemble).__name__}")
    copy = EnsembleLM(ensemble.models, ensemble.weights[0].shape[2], len(ensemble.weights) - 1,
                      ensemble.embed, ensemble.digits).to(ensemble.weights[0].device)
    copy.load_state_dict(ensemble.state_dict())
    copy.requires_grad_(False)
    if sampler in _DTYPES:
        return copy.to(_DTYPES[sampler])
    copy = copy.float()  # weight-only quantization computes in float32, as sampler_copy
    for weight in copy.weights:
        M, n_in, n_out = weight.shape
        # (M, in, out) -> one row per (model, output channel), as quantize_per_channel takes them
        rows = weight.transpose(1, 2).reshape(M * n_out, n_in)
        weight.copy_(quantize_per_channel(rows, _BITS[sampler]).reshape(M, n_out, n_in)
                     .transpose(1, 2))
    return copy


def _round_half(x, dtype):
    """``x`` (float64) rounded to float32, then to ``dtype``, returned exactly in float64."""
    return x.to(torch.float32).to(dtype).to(torch.float64)


@torch.no_grad()
def rounded_half_forward(engine, context, position):
    r"""The logits of a ``bf16`` or ``fp16`` copy of a TinyLM as a kernel that accumulates in
    float32 computes them, with arithmetic that does not depend on the CPU.

    ``engine`` is [opd_literate.experiment.quantized.sampler_copy][] at ``"bf16"`` or
    ``"fp16"``: its weights are the half-precision roundings of the model's. Every operation's
    output is rounded to the half type, as an engine stores its activations:

    $$
    h_{\ell+1} = \mathrm{r}\Bigl(\mathrm{GELU}\bigl(\mathrm{r}(h_\ell W_\ell + b_\ell)\bigr)
    \Bigr), \qquad z = \mathrm{r}(h_L W_L + b_L), \qquad
    \mathrm{r}(x) = \mathrm{half}\bigl(\mathrm{float32}(x)\bigr),
    $$

    each rounding to nearest, ties to even. The products and sums, the bias and the GELU
    ($x\,\Phi(x)$, with float64's $\mathrm{erf}$, good to an ulp or two of float64) are
    computed in float64: a product of two half-precision numbers is exact there, and the sum of
    a layer's $k$ of them is off by at most about $k \cdot 1.1 \times 10^{-16}$ times the sum of
    their magnitudes, whatever the order of the sum ($2 \times 10^{-14}$ for the students' 160
    inputs). So $\mathrm{float32}(x)$ is the float32 rounding of the exact value (what a
    float32 accumulator holds at best) unless the exact value lies within that distance of a
    halfway point between two float32 numbers. The logits therefore depend on the weights only, not
    on the CPU's half-precision kernels, which differ by instruction set: on an AMD EPYC with
    AVX2, torch's own ``float16`` and ``bfloat16`` matrix products and GELUs give other bits
    with its AVX2 kernels than with its baseline ones (``ATEN_CPU_CAPABILITY=default``), and
    each differs from this rounding in some outputs.

    Parameters
    ----------
    engine : opd_literate.experiment.tinylm.TinyLM
        A ``bfloat16`` or ``float16`` TinyLM (not an ensemble).
    context, position : torch.Tensor
        ``(..., 9)`` and ``(...)`` long, as ``engine(context, position)`` takes them.

    Returns
    -------
    torch.Tensor
        ``(..., V)`` float64, every entry a number of the half type.

    Examples
    --------
    >>> from opd_literate.experiment.tinylm import TinyLM, make_prompts
    >>> _ = torch.manual_seed(0)
    >>> engine = sampler_copy(TinyLM(hidden=8, layers=1), "fp16")
    >>> context = torch.cat([make_prompts(torch.tensor([[1, 2]])), torch.full((1, 3), PAD)], -1)
    >>> z = rounded_half_forward(engine, context, torch.zeros(1, dtype=torch.long))
    >>> z.dtype, bool((z.half().double() == z).all())
    (torch.float64, True)
    """
    dtype = None  # not a TinyLM, or one without layers: refused below
    if isinstance(engine, nn.Module) and isinstance(getattr(engine, "mlp", None), nn.Sequential) \
            and len(engine.mlp) and isinstance(engine.mlp[-1], nn.Linear):
        dtype = engine.mlp[-1].weight.dtype
    if dtype not in (torch.bfloat16, torch.float16) or hasattr(engine, "models"):
        raise TypeError(f"engine must be a bfloat16 or float16 TinyLM (sampler_copy), got a "
                        f"{type(engine).__name__} in {dtype}")
    slots = 2 * engine.digits + 2 + engine.max_answer - 1  # the prompt, then the answer so far
    for name, x in (("context", context), ("position", position)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.long:
            raise TypeError(f"{name} must be a long tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
    if context.ndim < 1 or context.shape[-1] != slots:
        raise ValueError(f"context must have shape (..., {slots}), got {tuple(context.shape)}")
    if position.shape != context.shape[:-1]:
        raise ValueError(f"position must have shape {tuple(context.shape[:-1])} (context's "
                         f"without its last axis), got {tuple(position.shape)}")
    # indexing would wrap a negative id round, and read another row without a word
    for name, x, high in (("context", context, V), ("position", position, engine.max_answer)):
        bad = (x < 0) | (x >= high)
        if bool(bad.any()):
            raise ValueError(f"{name} must hold ids in [0, {high}), got {int(x[bad][0])}")
    wide = torch.float64
    slots = engine.token_embedding.weight.to(wide)[context].flatten(-2)
    h = torch.cat([slots, engine.position_embedding.weight.to(wide)[position]], dim=-1)
    for layer in engine.mlp:
        if isinstance(layer, nn.Linear):
            h = _round_half(h @ layer.weight.to(wide).T + layer.bias.to(wide), dtype)
        elif isinstance(layer, nn.GELU) and layer.approximate == "none":
            h = _round_half(torch.nn.functional.gelu(h), dtype)
        else:
            raise TypeError(f"rounded_half_forward knows nn.Linear and nn.GELU, got {layer!r}")
    return h


@torch.no_grad()
def engine_logits(model, sampler, prompts, states):
    r"""The logits ``(N, V)`` at every state, computed by ``sampler``, returned in float64.

    ``bf16`` and ``fp16``: [opd_literate.experiment.quantized.rounded_half_forward][] (every
    operation rounded to the half type, the arithmetic independent of the CPU's kernels), its
    logits numbers of the half type. The others: the forward pass of
    [opd_literate.experiment.quantized.sampler_copy][] in float32, widened exactly to float64.
    """
    engine = sampler_copy(model, sampler)
    if sampler in ("bf16", "fp16"):
        return rounded_half_forward(engine, state_contexts(engine, prompts, states),
                                    states["position"])
    return state_logits(engine, prompts, states).double()


def _weighted_quantiles(values, weights, qs):
    """The smallest value whose cumulative weight reaches q, for each q (weights sum to 1)."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    cumulative /= cumulative[-1]
    index = np.minimum(np.searchsorted(cumulative, qs, side="left"), len(values) - 1)
    return values[order][index]


def token_mismatch(log_pi, log_mu, visits):
    r"""The per-token mismatch between a sampler and a trainer, exactly, on given states.

    For states $s$ (rows) with expected visits $n_s$ under the sampler (a probability of
    reaching $s$, or 1 for a position of the independent toy),

    $$
    \begin{aligned}
    \overline{\mathrm{KL}} &= \frac{\sum_s n_s\, \mathrm{KL}(\mu_s \,\|\, \pi_s)}{\sum_s n_s},
    \\
    \log \rho(s, v) &= \log \pi(v \mid s) - \log \mu(v \mid s)
    \ \text{ with weight } \ \frac{n_s\, \mu(v \mid s)}{\sum_s n_s},
    \end{aligned}
    $$

    the mean KL of a sampled token and the distribution of the log-ratio of the token the
    sampler writes.

    Parameters
    ----------
    log_pi, log_mu : numpy.ndarray
        ``(N, V)`` log-probabilities of the trainer and the sampler, finite, ``N, V >= 1``,
        each row's exponentials summing to 1 within $10^{-6}$.
    visits : numpy.ndarray
        ``(N,)`` non-negative, not all 0.

    Returns
    -------
    dict
        ``kl`` (the mean per-token KL), ``mean_abs_log_ratio``, ``quantiles`` (of $\log\rho$
        at ``QUANTILES``), ``abs_quantiles`` (of $|\log\rho|$ at 0.5, 0.99, 0.999),
        ``max_abs_log_ratio`` (over every token of every state, whatever its weight) and
        ``kurtosis`` of $\log \rho$ (3 for a normal distribution: above it, a heavy tail).

    Examples
    --------
    One state, two tokens: $\mu = (0.8, 0.2)$, $\pi = (0.5, 0.5)$; the log-ratios are
    $\log 0.625$ (weight 0.8) and $\log 2.5$ (weight 0.2):

    >>> out = token_mismatch(np.log([[0.5, 0.5]]), np.log([[0.8, 0.2]]), np.ones(1))
    >>> round(out["kl"], 6), round(float(0.8 * np.log(1.6) + 0.2 * np.log(0.4)), 6)
    (0.192745, 0.192745)
    >>> round(out["quantiles"]["0.5"], 6), round(out["max_abs_log_ratio"], 6)
    (-0.470004, 0.916291)
    """
    log_pi = check_real_array("log_pi", log_pi, 2, finite=False)
    log_mu = check_real_array("log_mu", log_mu, 2, finite=False)
    if log_pi.shape != log_mu.shape or log_pi.shape[0] == 0 or log_pi.shape[1] == 0:
        raise ValueError(f"log_pi and log_mu must be (N, V) of one shape with N, V >= 1, got "
                         f"shape {log_pi.shape} and {log_mu.shape}")
    log_pi, log_mu = _check_log_probs("log_pi", log_pi), _check_log_probs("log_mu", log_mu)
    visits = check_real_array("visits", visits, None, finite=False)
    if visits.shape != log_pi.shape[:1]:
        raise ValueError(f"visits must have shape ({log_pi.shape[0]},), got {visits.shape}")
    if not np.isfinite(visits).all() or (visits < 0).any() or visits.sum() <= 0:
        raise ValueError("visits must be finite, non-negative and not all 0")
    mu = np.exp(log_mu)
    log_rho = log_pi - log_mu  # (N, V): log pi(v|s) - log mu(v|s)
    share = visits / visits.sum()  # (N,): the share of the sampled tokens written at s
    # KL(mu_s || pi_s) = sum_v mu(v|s) (log mu - log pi), then the visit-weighted mean
    kl = float(share @ (mu * -log_rho).sum(axis=1))
    weights = (share[:, None] * mu).ravel()  # the probability of the atom (s, v)
    values = log_rho.ravel()
    mean = weights @ values / weights.sum()
    variance = weights @ (values - mean) ** 2 / weights.sum()
    fourth = weights @ (values - mean) ** 4 / weights.sum()
    quantiles = _weighted_quantiles(values, weights, np.array(QUANTILES))
    abs_q = _weighted_quantiles(np.abs(values), weights, np.array([0.5, 0.99, 0.999]))
    return dict(
        kl=max(kl, 0.0),  # >= 0 exactly; a rounding of -1e-20 is 0
        mean_abs_log_ratio=float(weights @ np.abs(values) / weights.sum()),
        quantiles={str(q): float(v) for q, v in zip(QUANTILES, quantiles)},
        abs_quantiles={str(q): float(v) for q, v in zip((0.5, 0.99, 0.999), abs_q)},
        max_abs_log_ratio=float(np.abs(values).max()),
        kurtosis=float(fourth / variance**2) if variance > 0 else 0.0,
    )


def _level_ancestors(states, T):
    """(N, T): the ancestor of each state at each position k <= its own (itself at its own),
    -1 after."""
    position, parent = states["position"], states["parent"]
    ancestors = np.full((len(position), T), -1, dtype=np.int64)
    for t in range(T):  # the states are in order of position: every parent is done first
        rows = np.nonzero(position == t)[0]
        if t > 0:
            ancestors[rows] = ancestors[parent[rows]]
        ancestors[rows, t] = rows
    return ancestors


def answer_toy(states, log_pi, log_mu, reward, *, eos, pad, features=None, log_teacher=None):
    r"""Every complete answer of an enumerated model, as a toy of the mismatch chapter.

    A complete answer is a state $s$ at position $t$ followed by a token $v$ that ends it:
    ``eos``, or any token at the last position $T - 1$. Its tokens are $y = (s, v)$, padded
    with ``pad``; token $k$ was written at the ancestor state $s_k$ of $s$. With prompts drawn
    uniformly (``states["prompt"]`` numbers them), the dictionary's probabilities are those of
    one (prompt, answer) pair: $\pi(x, y) = \frac1B \prod_k \pi(y_k \mid s_k)$, the same for
    $\mu$, so the importance ratios are those of the answer.

    Parameters
    ----------
    states : dict
        From [opd_literate.experiment.exact.answer_states][] (tensors or arrays).
    log_pi, log_mu : numpy.ndarray
        ``(N, V)`` the trainer's and the sampler's log-probabilities at every state, finite,
        each row's exponentials summing to 1 within $10^{-6}$ (``log_teacher`` too).
    reward : callable
        ``reward(Y, mask, prompt) -> (M,)``: the reward of each answer, from its tokens
        ``(M, T)`` (padded), its ``(M, T)`` mask and its prompt index ``(M,)``.
    eos, pad : int
        The token that ends an answer; the token written into ``Y`` after it (ids in
        ``[0, V)``).
    features : numpy.ndarray, optional
        ``(N, F)``: the score of token $k$ is $(e_{y_k} - \pi(\cdot \mid s_k)) \otimes
        \phi(s_k)$, an ``(V, F)`` array: the gradient of $\log \pi(y_k \mid s_k)$ with respect
        to a layer $z = W \phi + c$ whose output is the logits. Default: ones, ``F = 1`` (the
        bias $c$ of that layer).
    log_teacher : numpy.ndarray, optional
        ``(N, V)``: adds ``logp_teacher`` and, as
        [opd_literate.mismatch.opd_mismatch.add_teacher][] defines them for the autoregressive
        toy, ``kl``, ``kl_grad`` and ``kl_grad_per_state``.

    Returns
    -------
    dict
        ``Y``, ``mask``, ``logp_train``, ``logp_sampler`` ``(M, T)`` (0 on the padding),
        ``p_train``, ``p_sampler``, ``R``, ``prompt`` ``(M,)``, ``score`` ``(M, T, V, F)``,
        ``true_grad`` ``(V, F)`` $= \sum_{x, y} \pi(x, y) R \sum_k s_k$, ``state`` ``(M, T)``
        (the state of each token, -1 on the padding), ``T``, ``V``, ``eos``.

    Examples
    --------
    Two tokens, token 1 ends the answer, at most 2 positions; the trainer is uniform, the
    sampler writes token 0 with probability 0.8 at the root. The answers are $(0, 0)$,
    $(0, \text{eos})$ and $(\text{eos})$:

    >>> import torch
    >>> states = answer_states(torch.zeros((1, 1), dtype=torch.long), 2, vocab=2, eos=1)
    >>> half, skew = np.log([0.5, 0.5]), np.log([0.8, 0.2])
    >>> toy = answer_toy(states, np.stack([half, half]), np.stack([skew, half]),
    ...                  lambda Y, mask, prompt: (Y[:, 0] == 0).astype(float), eos=1, pad=1)
    >>> sorted(map(tuple, toy["Y"].tolist()))
    [(0, 0), (0, 1), (1, 1)]
    >>> sorted(toy["p_sampler"].round(12).tolist()), sorted(toy["p_train"].tolist())
    ([0.2, 0.4, 0.4], [0.25, 0.25, 0.5])
    """
    needed = ("prompt", "position", "prefix", "parent")
    if not isinstance(states, dict) or any(k not in states for k in needed):
        raise ValueError(f"states must be the dict of answer_states (keys {', '.join(needed)}), "
                         f"got {sorted(states) if isinstance(states, dict) else type(states)}")
    if not callable(reward):
        raise TypeError(f"reward must be callable (Y, mask, prompt) -> (M,), got "
                        f"{type(reward).__name__}")
    states = {k: np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v)
              for k, v in states.items()}
    N, T = states["prefix"].shape
    log_pi = check_real_array("log_pi", log_pi, None, finite=False)
    log_mu = check_real_array("log_mu", log_mu, None, finite=False)
    if log_pi.shape != log_mu.shape or log_pi.ndim != 2 or log_pi.shape[0] != N:
        raise ValueError(f"log_pi and log_mu must be (N, V) with N = {N} states, got "
                         f"{log_pi.shape} and {log_mu.shape}")
    V = log_pi.shape[1]
    if not (np.isfinite(log_pi).all() and np.isfinite(log_mu).all()):
        raise ValueError("log_pi and log_mu must be finite: a token of probability 0 has no "
                         "importance ratio")
    log_pi, log_mu = _check_log_probs("log_pi", log_pi), _check_log_probs("log_mu", log_mu)
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (eos, pad)):
        raise TypeError(f"eos and pad must be integer token ids, got {eos!r}, {pad!r}")
    if not (0 <= eos < V and 0 <= pad < V):
        raise ValueError(f"eos and pad must be token ids in [0, {V}), got {eos!r}, {pad!r}")
    features = (np.ones((N, 1)) if features is None
                else check_real_array("features", features, None, finite=False))
    if features.ndim != 2 or features.shape[0] != N or not np.isfinite(features).all():
        raise ValueError(f"features must be a finite (N, F) array with N = {N}, got "
                         f"{features.shape}")
    position = states["position"]
    # the answers: each state before the last position ends with eos; a state at the last
    # position with any token
    early = np.nonzero(position < T - 1)[0]
    last = np.nonzero(position == T - 1)[0]
    end_state = np.concatenate([early, np.repeat(last, V)])  # (M,)
    end_token = np.concatenate([np.full(len(early), eos), np.tile(np.arange(V), len(last))])
    n = position[end_state] + 1  # (M,) the answer's tokens, the last one included
    real = np.arange(T)[None, :] < n[:, None]  # (M, T)
    state = np.where(real, _level_ancestors(states, T)[end_state], -1)  # s_k, (M, T)
    # y_k: the prefix of the end state, then the ending token at k = t, then padding
    Y = np.where(real, states["prefix"][end_state], pad)
    Y[np.arange(len(end_state)), n - 1] = end_token
    rows = np.where(real, state, 0)  # a valid row to read on the padding (masked below)
    # log pi(y_k | s_k) on the answer, log 1 = 0 on the padding
    logp_train = np.where(real, log_pi[rows, Y], 0.0)
    logp_sampler = np.where(real, log_mu[rows, Y], 0.0)
    prompt = states["prompt"][end_state]
    B = int(states["prompt"].max()) + 1
    # pi(x, y) = (1 / B) prod_k pi(y_k | s_k): uniform prompts, then the chain rule
    p_train = np.exp(logp_train.sum(axis=1)) / B
    p_sampler = np.exp(logp_sampler.sum(axis=1)) / B
    mask = real.astype(float)
    R = np.asarray(reward(Y, mask, prompt), dtype=float)
    if R.shape != (len(Y),) or not np.isfinite(R).all():
        raise ValueError(f"reward must return {len(Y)} finite values, got shape {R.shape}")
    # s_k = (e_{y_k} - pi(.|s_k)) outer phi(s_k): (M, T, V) times (M, T, F) -> (M, T, V, F)
    residual = np.where(real[:, :, None], np.eye(V)[Y] - np.exp(log_pi)[rows], 0.0)
    score = residual[:, :, :, None] * features[rows][:, :, None, :]
    # grad J = sum_{x, y} pi(x, y) R(y) sum_k s_k
    true_grad = np.einsum("m,m,mtvf->vf", p_train, R, score)
    toy = dict(Y=Y, mask=mask, logp_train=logp_train, logp_sampler=logp_sampler,
               p_train=p_train, p_sampler=p_sampler, R=R, prompt=prompt, score=score,
               true_grad=true_grad, state=state, T=T, V=V, eos=eos, shared_parameters=True)
    if log_teacher is not None:
        log_teacher = check_real_array("log_teacher", log_teacher, None, finite=False)
        if log_teacher.shape != log_pi.shape or not np.isfinite(log_teacher).all():
            raise ValueError(f"log_teacher must be finite with shape {log_pi.shape}, got shape "
                             f"{log_teacher.shape}")
        log_teacher = _check_log_probs("log_teacher", log_teacher)
        logp_teacher = np.where(real, log_teacher[rows, Y], 0.0)
        d = logp_train - logp_teacher  # (M, T): log pi - log pi_T, 0 on the padding
        # the sequence reverse KL E_pi[sum_k d_k], its gradient E_pi[sum_k d_k sum_k s_k] and
        # the per-state gradient E_pi[sum_k d_k s_k] that discount-0 sampled-token OPD estimates
        toy.update(logp_teacher=logp_teacher, kl=float(p_train @ d.sum(axis=1)),
                   kl_grad=np.einsum("m,m,mtvf->vf", p_train, d.sum(axis=1), score),
                   kl_grad_per_state=np.einsum("m,mt,mtvf->vf", p_train, d, score))
    return toy


def sampler_states(model, pairs, sampler):
    r"""Every state of the answers to ``pairs``, with the trainer's and the sampler's
    log-probabilities there and the sampler's expected visits.

    Returns
    -------
    dict
        ``states`` (from [opd_literate.experiment.exact.answer_states][]), ``prompts``,
        ``log_pi`` and ``log_mu`` ``(N, V)`` float64 tensors (the trainer is ``model`` in
        float64), ``visits`` ``(N,)`` the sampler's probability of reaching each state divided
        by the number of prompts (one answer a prompt, prompts drawn uniformly).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {sorted(SAMPLERS)}, got {sampler!r}")
    _check_model("model", model)
    _check_pairs(pairs, model.digits)
    prompts = make_prompts(pairs, model.digits)
    states = answer_states(prompts, model.max_answer)
    log_pi = torch.log_softmax(state_logits(sampler_copy(model, "float64"), prompts, states), -1)
    log_mu = torch.log_softmax(engine_logits(model, sampler, prompts, states), -1)
    visits = reach_log_probs(log_mu, states).exp() / len(pairs)
    return dict(states=states, prompts=prompts, log_pi=log_pi, log_mu=log_mu, visits=visits)


def tinylm_answer_toy(model, pairs, sampler, *, teacher=None, features="bias"):
    r"""[opd_literate.experiment.quantized.answer_toy][] for tinylm: the trainer is ``model``
    in float64, the sampler ``model`` run as ``sampler``, the reward 1 for the exact answer
    (every token up to and including ``<eos>``, as
    [opd_literate.experiment.tinylm.greedy_accuracy][] counts it).

    Parameters
    ----------
    model : opd_literate.experiment.tinylm.TinyLM
    pairs : torch.Tensor
        ``(B, 2)`` operands.
    sampler : str
        A key of ``SAMPLERS``.
    teacher : opd_literate.experiment.tinylm.TinyLM, optional
        Adds the OPD keys (its log-probabilities in float64).
    features : {"bias", "head"}
        The parameters of the score: the LM head's bias, or its weight and bias.

    Returns
    -------
    dict
        The toy, with ``log_pi``, ``log_mu`` ``(N, V)`` and ``visits`` ``(N,)`` of
        [opd_literate.experiment.quantized.sampler_states][] as numpy arrays.
    """
    if features not in ("bias", "head"):
        raise ValueError(f"features must be 'bias' or 'head', got {features!r}")
    if teacher is not None:
        _check_model("teacher", teacher)
        _check_model("model", model)
        if teacher.digits != model.digits:
            raise ValueError(f"teacher must answer the model's {model.digits}-digit prompts, got "
                             f"a {teacher.digits}-digit teacher")
    exact = sampler_states(model, pairs, sampler)
    states, prompts = exact["states"], exact["prompts"]
    phi = None
    if features == "head":
        trainer = sampler_copy(model, "float64")
        captured = {}
        # h(s): the input of the LM head at every state, then 1 for its bias
        hook = trainer.mlp[-1].register_forward_hook(
            lambda module, inputs, output: captured.update(h=inputs[0]))
        state_logits(trainer, prompts, states)
        hook.remove()
        h = captured["h"]
        phi = torch.cat([h, torch.ones_like(h[:, :1])], dim=1).cpu().numpy()
    log_teacher = None
    if teacher is not None:
        log_teacher = torch.log_softmax(
            state_logits(sampler_copy(teacher, "float64"), prompts, states), -1).cpu().numpy()
    targets = answer_tokens(pairs, model.digits).cpu().numpy()  # (B, T): the correct answers

    def exact_answer(Y, mask, prompt):
        return (Y == targets[prompt]).all(axis=1).astype(float)

    log_pi, log_mu = exact["log_pi"].cpu().numpy(), exact["log_mu"].cpu().numpy()
    toy = answer_toy(states, log_pi, log_mu, exact_answer, eos=EOS, pad=PAD, features=phi,
                     log_teacher=log_teacher)
    return dict(toy, log_pi=log_pi, log_mu=log_mu, visits=exact["visits"].cpu().numpy())


def full_parameter_bias(model, pairs, toy, names=None, parameter_names=None):
    r"""Every estimator's exact relative bias over **all** the trainer's parameters.

    The answer toy's score covers the LM head (``features``); the mean of an estimator over
    every parameter $\theta$ of the model is still one backward pass. With $w_{m,t}$ the
    estimator's weights ([opd_literate.mismatch.estimators.estimator_weights][]) and answer $m$
    written at states $s_{m,t}$,

    $$
    \begin{aligned}
    \bar g &= \sum_m \mu_m \sum_t w_{m,t} R_m \nabla_\theta \log \pi(y_{m,t} \mid s_{m,t})
    \\
    &= \nabla_\theta \sum_{s, v} C_{s,v} \log \pi(v \mid s), \\
    C_{s,v} &= \sum_{(m, t):\ s_{m,t} = s,\ y_{m,t} = v} \mu_m w_{m,t} R_m ,
    \end{aligned}
    $$

    with $C$ held constant, and $\nabla J$ the same with $\pi_m R_m$ in place of
    $\mu_m w_{m,t} R_m$. ``tests/experiment/test_quantized.py`` checks $\nabla J$ against
    autograd of $J(\theta) = \sum_m \pi_m R_m$ itself, and the LM head's bias part against
    the toy's own moments.

    Parameters
    ----------
    model : opd_literate.experiment.tinylm.TinyLM
        The trainer (run in float64).
    pairs : torch.Tensor
        The ``(B, 2)`` operands ``toy`` was built from.
    toy : dict
        From [opd_literate.experiment.quantized.tinylm_answer_toy][] for ``model`` and ``pairs``.
    names : list of str, optional
        Estimators of [opd_literate.mismatch.estimators.REGISTRY][]; all by default.
    parameter_names : list of str, optional
        The parameters to measure, by their names in ``model.named_parameters()``; all by
        default (``["mlp.4.bias"]``, the LM head's bias of a two-layer student, gives the answer
        toy's own ``features="bias"`` moments).

    Returns
    -------
    dict
        ``parameters`` (how many numbers), ``true_grad_norm`` and ``rel_bias`` ``{name: float}``:
        $\lVert \bar g - \nabla J \rVert / \lVert \nabla J \rVert$ over every parameter.
    """
    from ..mismatch.estimators import REGISTRY, estimator_weights

    _check_model("model", model)
    _check_pairs(pairs, model.digits)
    keys = ("log_pi", "mask", "state", "Y", "R", "p_train", "p_sampler")
    if not isinstance(toy, dict) or any(k not in toy for k in keys):
        raise ValueError(f"toy must be a tinylm_answer_toy dict (keys {', '.join(keys)}), got "
                         f"{sorted(toy) if isinstance(toy, dict) else type(toy).__name__}")
    unknown = [n for n in (names or ()) if n not in REGISTRY]
    if names is not None and (unknown or isinstance(names, str) or not list(names)):
        raise ValueError(f"names must be a non-empty list of estimators of REGISTRY, got "
                         f"{names!r}")
    trainer = sampler_copy(model, "float64")
    prompts = make_prompts(pairs, model.digits)
    states = answer_states(prompts, model.max_answer)
    if len(states["prompt"]) != len(toy["log_pi"]):
        raise ValueError(f"toy has {len(toy['log_pi'])} states, pairs give "
                         f"{len(states['prompt'])}: build the toy from the same pairs")
    log_pi = torch.log_softmax(trainer(state_contexts(trainer, prompts, states),
                                       states["position"]), -1)  # (N, V), with gradient
    named = dict(trainer.named_parameters())
    chosen = list(named) if parameter_names is None else list(parameter_names)
    unknown = [n for n in chosen if n not in named]
    if unknown or not chosen:
        raise ValueError(f"parameter_names must name parameters of the model ({', '.join(named)}),"
                         f" got {parameter_names!r}")
    params = [named[n] for n in chosen]
    real = np.asarray(toy["mask"]) > 0
    N, V = log_pi.shape
    # the (state, token) of every real position of every answer, as one flat index
    cell = (np.where(real, toy["state"], 0) * V + toy["Y"])[real]

    def gradient(coefficients):
        C = np.bincount(cell, weights=np.broadcast_to(coefficients, real.shape)[real],
                        minlength=N * V).reshape(N, V)
        surrogate = (torch.as_tensor(C, dtype=log_pi.dtype, device=log_pi.device)
                     * log_pi).sum()
        grads = torch.autograd.grad(surrogate, params, retain_graph=True)
        return torch.cat([g.flatten() for g in grads]).cpu().numpy()

    R = np.asarray(toy["R"])
    true = gradient((toy["p_train"] * R)[:, None])
    norm = float(np.linalg.norm(true))
    rel_bias = {}
    for name in (list(REGISTRY) if names is None else names):
        weights = estimator_weights(toy, name)
        mean = gradient(toy["p_sampler"][:, None] * weights * R[:, None])
        rel_bias[name] = float(np.linalg.norm(mean - true)) / norm
    return dict(parameters=int(true.size), true_grad_norm=norm, rel_bias=rel_bias)


def toy_token_mismatch(toy):
    r"""[opd_literate.experiment.quantized.token_mismatch][] of a toy of the mismatch chapter.

    [opd_literate.mismatch.toy.make_toy][]: its $T$ positions, each visited once. The
    autoregressive toy ([opd_literate.mismatch.toy.make_ar_toy][]): its rows $(t, p)$, each
    visited with the sampler's probability $\sum_y \mu(y)\, [p_t(y) = p]$ over the responses
    that reach position $t$.

    Examples
    --------
    >>> from opd_literate.mismatch.toy import make_toy
    >>> round(toy_token_mismatch(make_toy(mismatch=0.0))["kl"], 12)
    0.0
    """
    from ..mismatch.toy import log_softmax

    if not isinstance(toy, dict) or any(k not in toy for k in ("theta", "b", "mismatch")):
        raise ValueError("toy must be a toy of the mismatch chapter (a dict with theta, b and "
                         f"mismatch), got {type(toy).__name__}")
    theta = check_real_array("toy['theta']", toy["theta"], None)
    b = check_real_array("toy['b']", toy["b"], None)
    eps = check_finite_number("toy['mismatch']", toy["mismatch"])
    if theta.ndim not in (2, 3) or b.shape != theta.shape:
        raise ValueError(f"toy['theta'] must be (T, V) or (T, P, V) with toy['b'] of its shape, "
                         f"got {theta.shape} and {b.shape}")
    log_pi, log_mu = log_softmax(theta), log_softmax(theta + eps * b)
    if theta.ndim == 2:
        return token_mismatch(log_pi, log_mu, np.ones(theta.shape[0]))
    T, P, V = theta.shape
    visits = np.zeros((T, P))
    mask = np.asarray(toy["mask"]) > 0
    rows_t = np.broadcast_to(np.arange(T), mask.shape)
    weights = np.broadcast_to(toy["p_sampler"][:, None], mask.shape)
    np.add.at(visits, (rows_t[mask], np.asarray(toy["prev"])[mask]), weights[mask])
    return token_mismatch(log_pi.reshape(T * P, V), log_mu.reshape(T * P, V), visits.ravel())


def matched_toy_mismatch(target_kl, kl_of, low=1e-6, high=10.0, iterations=80):
    r"""The toy mismatch $\epsilon$ whose mean per-token KL is ``target_kl``, by bisection.

    ``kl_of(eps)`` is the toy's mean per-token KL at $\epsilon$, increasing on
    $[\text{low}, \text{high}]$ (it grows like $\epsilon^2$ near 0). Bisection on $\log\epsilon$.

    Examples
    --------
    >>> round(matched_toy_mismatch(0.04, lambda eps: eps ** 2), 9)
    0.2
    """
    target_kl = check_finite_number("target_kl", target_kl, positive=True)
    low = check_finite_number("low", low, positive=True)
    high = check_finite_number("high", high, positive=True)
    if not low < high:
        raise ValueError(f"low must be < high, got low={low!r} >= high={high!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive integer, got {iterations!r}")
    if not callable(kl_of):
        raise TypeError(f"kl_of must be callable eps -> KL, got {type(kl_of).__name__}")
    ends = {name: check_finite_number(f"kl_of({name})", kl_of(x))
            for name, x in (("low", low), ("high", high))}
    lo, hi = np.log(low), np.log(high)
    if not ends["low"] <= target_kl <= ends["high"]:
        raise ValueError(f"target_kl = {target_kl!r} is outside the KLs at low = {low!r} and "
                         f"high = {high!r}")
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if kl_of(float(np.exp(mid))) < target_kl:
            lo = mid
        else:
            hi = mid
    return float(np.exp(0.5 * (lo + hi)))


def average_ranks(values):
    """Ranks from 1 (the smallest), values equal to 10 significant digits sharing their mean rank.

    ``values``: a 1-D list or array of finite real numbers (empty: no ranks); NaN, inf, a bool
    or a string is refused with a ``ValueError`` or ``TypeError`` naming ``values``.

    Examples
    --------
    >>> average_ranks([0.3, 0.1, 0.3]).tolist()
    [2.5, 1.0, 2.5]
    """
    return _average_ranks(check_real_array("values", values, 1))


def _average_ranks(values):
    """average_ranks of a checked float64 array."""
    keys = np.array([float(f"{v:.10g}") for v in values])
    order = np.argsort(keys, kind="stable")
    ranks = np.empty(len(keys))
    i = 0
    while i < len(keys):
        j = i
        while j + 1 < len(keys) and keys[order[j + 1]] == keys[order[i]]:
            j += 1
        ranks[order[i: j + 1]] = 0.5 * (i + j) + 1
        i = j + 1
    return ranks


def rank_correlation(a, b):
    r"""Spearman's rank correlation of two lists (ties share their mean rank).

    The Pearson correlation of the ranks of
    [opd_literate.experiment.quantized.average_ranks][]. ``a`` and ``b`` are 1-D, of one length
    $n \ge 2$, finite and real; the correlation is undefined (0 / 0) where either is constant
    (to 10 significant digits), which is a ``ValueError`` too, as are the others.

    Examples
    --------
    >>> rank_correlation([0.1, 0.2, 0.3], [1.0, 5.0, 9.0]), rank_correlation([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    >>> rank_correlation([1, 2], [1, 2, 3])
    Traceback (most recent call last):
    ...
    ValueError: a and b must have one length, got 2 and 3
    """
    a = check_real_array("a", a, 1, min_size=2)
    b = check_real_array("b", b, 1)
    if len(a) != len(b):
        raise ValueError(f"a and b must have one length, got {len(a)} and {len(b)}")
    ra, rb = _average_ranks(a), _average_ranks(b)
    for name, ranks, values in (("a", ra, a), ("b", rb, b)):
        if (ranks == ranks[0]).all():
            raise ValueError(f"{name} is constant (every value {float(values[0])!r} to 10 "
                             "significant digits): its rank correlation is undefined")
    ra, rb = ra - ra.mean(), rb - rb.mean()
    # ranks are multiples of 1/2 and their mean of 1/2: every product and sum here is exact
    return float(ra @ rb) / float(np.sqrt((ra @ ra) * (rb @ rb)))


def _check_prompts(prompts, available):
    """``prompts``: an integer in [1, available] (the test prompts)."""
    if isinstance(prompts, bool) or not isinstance(prompts, int) or not 1 <= prompts <= available:
        raise ValueError(f"prompts must be an integer in [1, {available}] (the test prompts), "
                         f"got {prompts!r}")


_ROW_KEYS = ("name", "rel_bias", "rel_rmse", "token_frac", "seq_frac")


def mismatch_study(prepared, prompts=20, samplers=tuple(SAMPLERS), seeds=None):
    r"""The mismatch each sampler creates on the weak students, and every estimator on tinylm.

    For the first ``prompts`` test prompts of ``prepared``
    ([opd_literate.experiment.run.prepare][]): the per-token mismatch of every sampler on every
    weak student (``seeds``: all by default), and, on the first student, every estimator of
    [opd_literate.mismatch.estimators.REGISTRY][] and the sampled-token OPD recipes against the
    teacher, exactly, beside the independent and the autoregressive toy at the matched mismatch
    (the $\epsilon$ whose mean per-token KL is the student's). Each tinylm row also holds
    ``rel_bias_all``, the relative bias over every parameter of the student
    ([opd_literate.experiment.quantized.full_parameter_bias][]).

    Returns
    -------
    dict
        JSON-ready: ``mismatch`` ``{sampler: [per student]}``, ``toy_b`` (the toys at
        $\epsilon = 0.3$), ``estimators`` and ``opd`` ``{sampler: ...}``.
    """
    from ..mismatch.estimators import comparison_table
    from ..mismatch.opd_mismatch import OPD_RECIPES, PREFIX_RECIPES, add_teacher, opd_estimate
    from ..mismatch.toy import estimator_moments, make_ar_toy, make_toy
    from .tinylm import EnsembleLM

    for name in ("config", "test_pairs", "teacher", "student_state"):
        if not hasattr(prepared, name):
            raise TypeError(f"prepared must be the Prepared of run.prepare (with .{name}), got "
                            f"{type(prepared).__name__}")
    config = prepared.config
    _check_prompts(prompts, len(prepared.test_pairs))
    # a string is one name, not a sequence of them: refused, not split into letters
    given = samplers
    samplers = () if isinstance(given, str) else tuple(given)
    if not samplers or len(set(samplers)) < len(samplers) or not set(samplers) <= set(SAMPLERS):
        raise ValueError(f"samplers must be a sequence of distinct keys of SAMPLERS "
                         f"({', '.join(SAMPLERS)}), at least one, got {given!r}")
    given = seeds
    seeds = [] if isinstance(given, str) else list(range(config.seeds) if given is None
                                                   else given)
    if not seeds or len(set(seeds)) < len(seeds) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < config.seeds
            for s in seeds):
        raise ValueError(f"seeds must be distinct students in [0, {config.seeds}), at least one, "
                         f"got {given!r}")
    pairs = prepared.test_pairs[:prompts]
    students = EnsembleLM(config.seeds, config.student_hidden, config.student_layers,
                          digits=config.digits)
    students.load_state_dict(prepared.student_state)
    members = [students.member(s) for s in seeds]
    N = config.batch_size
    record = {"prompts": prompts, "batch_size": N, "seeds": list(seeds),
              "samplers": {k: SAMPLERS[k] for k in samplers}, "mismatch": {}, "estimators": {},
              "opd": {}}
    record["toy_b"] = {"toy": toy_token_mismatch(make_toy(mismatch=0.3)),
                       "ar_toy": toy_token_mismatch(make_ar_toy(mismatch=0.3))}
    for sampler in samplers:
        stats = []
        for member in members:
            exact = sampler_states(member, pairs, sampler)
            stats.append(token_mismatch(exact["log_pi"].numpy(), exact["log_mu"].numpy(),
                                        exact["visits"].numpy()))
        record["mismatch"][sampler] = stats
        toy = tinylm_answer_toy(members[0], pairs, sampler, teacher=prepared.teacher)
        kl = stats[0]["kl"]
        rows = {"tinylm": [{k: r[k] for k in _ROW_KEYS} for r in comparison_table(toy, N=N)]}
        # the bias over every parameter of the student, beside the LM head's bias above
        every = full_parameter_bias(members[0], pairs, toy)
        for row in rows["tinylm"]:
            row["rel_bias_all"] = every["rel_bias"][row["name"]]
        rows["parameters"] = every["parameters"]
        rows["J"] = float(toy["p_train"] @ toy["R"])
        for kind, make in (("toy", make_toy), ("ar_toy", make_ar_toy)):
            def kl_of(e, make=make):
                return toy_token_mismatch(make(mismatch=e))["kl"]

            eps = matched_toy_mismatch(kl, kl_of, low=1e-9)
            rows[f"{kind}_eps"] = eps
            rows[kind] = [{k: r[k] for k in _ROW_KEYS}
                          for r in comparison_table(make(mismatch=eps), N=N)]
            for key in ("rel_bias", "rel_rmse"):
                rows[f"{kind}_spearman_{key}"] = rank_correlation(
                    [r[key] for r in rows["tinylm"]], [r[key] for r in rows[kind]])
        record["estimators"][sampler] = rows
        opd_rows = []
        target = dict(toy, true_grad=toy["kl_grad_per_state"])
        ar = add_teacher(make_ar_toy(mismatch=rows["ar_toy_eps"]))
        ar_target = dict(ar, true_grad=ar["kl_grad_per_state"])
        for logp, weight in (*OPD_RECIPES, *PREFIX_RECIPES):
            moments = estimator_moments(target, opd_estimate(toy, logp, weight))
            ar_moments = estimator_moments(ar_target, opd_estimate(ar, logp, weight))
            opd_rows.append(dict(logp=logp, weight=weight, rel_bias=moments["rel_bias"],
                                 rel_rmse=moments["rel_rmse"](N),
                                 ar_toy_rel_bias=ar_moments["rel_bias"],
                                 ar_toy_rel_rmse=ar_moments["rel_rmse"](N)))
        record["opd"][sampler] = opd_rows
        del toy, target
    return record


def mismatch_study_record(config, prompts=20, cache="read"):
    """``tinylm_mismatch.json``: [opd_literate.experiment.quantized.mismatch_study][] with the
    settings it came from.

    Written by ``python -m opd_literate.experiment --tinylm-mismatch --out docs/data/experiment``
    (282 s on a 2-core AMD EPYC with AVX2, the teacher cached); the docs build reads it.
    """
    from .config import ExperimentConfig
    from .exact import CLAMP_STUDY_KEYS
    from .run import prepare

    if not isinstance(config, ExperimentConfig):
        raise TypeError(f"config must be an ExperimentConfig, got {type(config).__name__}")
    _check_prompts(prompts, config.eval_prompts)  # before the teacher is trained or read
    record = mismatch_study(prepare(config, cache), prompts)
    return {"config": {k: getattr(config, k) for k in CLAMP_STUDY_KEYS}, **record}
