r"""The one home of what two chapters share: argument checks, constants and small numerics.

**Argument checks.** Every public function validates its inputs with these helpers so that a
wrong shape, dtype or value fails at the call with a message that names the argument, what it
got and what was expected, instead of being silently broadcast into a wrong answer many lines
later. A public function checks once and then calls private implementations that trust their
inputs (as equinox's and numpy's internals do): a public function calling another public one
would check the same mask again.

**Numerics** that work on checked inputs: selection by a mask, the masked mean, the response
lengths, the reductions of a per-token loss, the cancellation-free KL to a mixture (torch), and
the exponential of a log-ratio that refuses to overflow (numpy).

**Constants** read by several modules, defined here once: ``REDUCTIONS``, ``VERL_VERSION``,
``VERL_COMMIT`` and ``BINARY_KL_EPS``.
The modules that document them re-export them under the same name.

The numpy-only modules import this file, so it imports no third-party package at import time:
the torch helpers import torch inside the function, ``exp_ratio`` takes numpy from its argument
(``x.__array_namespace__()`` is the ``numpy`` module for a numpy array), and ``check_real_array``
imports numpy when it is called (a list has no array namespace).
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the numpy-only modules import this file: torch is loaded only when used
    import torch

__all__ = [
    "REDUCTIONS",
    "VERL_VERSION",
    "VERL_COMMIT",
    "MAX_LOG_RATIO",
    "BINARY_KL_EPS",
    "check_float_tensor",
    "check_same_shape",
    "check_mask",
    "check_finite_number",
    "check_band",
    "check_reduction",
    "check_real_array",
    "check_reported_mass",
    "check_sequence",
    "compute_dtype",
    "select",
    "masked_mean",
    "lengths",
    "aggregate",
    "kl_to_mixture",
    "exp_ratio",
]

REDUCTIONS = (
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum",
    "token-sum", "token-sum-norm",
)
"""The loss reductions of [opd_literate.opd.aggregate_loss][]: verl's five ``loss_agg_mode``
names (``"token-sum"`` since commit 4730d46), ``"sum"`` (the same as ``"token-sum"``), and
``"token-sum-norm"``, the meaning verl gave ``"seq-mean-token-sum-norm"`` until commit b8d91ef
(not a verl name)."""

VERL_VERSION = "0.9.1"
"""The verl release every "verl" statement of the package is checked against: the ``verl``
extra's pin, whose functions ``tests/integration/test_verl.py`` calls."""

VERL_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"
"""The newest verl-project/verl commit read from source (2026-08-22), for the history of a
statement ("since commit ..."). The 0.9.1 release was tagged after it (PR #7947); its
installed ``rollout_corr_helper.py`` equals this commit's byte for byte, its ``core_algos.py``
differs from it only in GSPO's reduction (``docs/provenance.md``)."""

MAX_LOG_RATIO = math.log(sys.float_info.max)
"""709.78: ``exp`` of a larger log-ratio is ``inf`` in float64, and ``inf * 0`` is NaN."""

BINARY_KL_EPS = 1e-8
r"""The $10^{-8}$ that verl's DPPO-Binary-KL (``compute_policy_loss_dppo_kl``) adds to $1 - q$ and
$1 - p$ inside its logarithm, $(1 - q) \log \frac{1 - q + 10^{-8}}{1 - p + 10^{-8}}$: finite at
$p = 1$. The numpy estimator and the torch loss of DPPO-KL both use it, so that their trust
regions are verl's."""


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def check_float_tensor(name: str, x, ndim: int | None) -> None:
    """Raise unless ``x`` is a floating ``torch.Tensor`` with ``ndim`` dimensions (None: any)."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)} ({x.ndim} dimensions)"
        )


def check_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Raise unless two tensors have exactly the same shape (no broadcasting)."""
    if a.shape != b.shape:
        raise ValueError(
            f"{name_b} must have the same shape as {name_a} {tuple(a.shape)}, "
            f"got {tuple(b.shape)}"
        )


def check_mask(mask, like_name: str, like_shape: tuple[int, ...]) -> torch.Tensor:
    """Validate a 0/1 mask of shape ``like_shape`` and return it as a bool tensor.

    A bool, integer or floating mask is accepted; every value must be exactly 0 or 1.
    """
    import torch

    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(like_shape):
        raise ValueError(
            f"mask must have the shape of {like_name} {tuple(like_shape)}, got {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"mask must be bool, integer or floating, got {mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        value = mask[bad].flatten()[0].item()
        raise ValueError(f"mask values must be 0 or 1, found {value!r}")
    return mask != 0


def check_positive_int(name: str, value) -> int:
    """Return ``value`` as an int, or raise unless it is an integer >= 1 (a bool is refused)."""
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_finite_number(name: str, value, low: float | None = None, high: float | None = None,
                        allow_inf: bool = False, positive: bool = False) -> float:
    """Return ``value`` as a float, or raise if it is not a real number in ``[low, high]``.

    NaN is always refused; infinities unless ``allow_inf``; 0 and below if ``positive``.
    A bool (Python, numpy or torch) and a string are refused with a ``TypeError`` although
    ``float`` accepts them: ``beta=True`` or ``gamma="0.5"`` is a mistake, not a number.
    """
    dtype = getattr(value, "dtype", None)
    is_bool = isinstance(value, bool) or (
        dtype is not None and (getattr(dtype, "kind", None) == "b" or str(dtype) == "torch.bool")
    )
    if is_bool or isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    except OverflowError:  # an int beyond float's range, such as 10**400
        raise ValueError(f"{name} must be a finite number, got an int of "
                         f"{len(str(abs(value)))} digits") from None
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and number < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and number > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    if positive and number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def check_band(low, high, low_name: str = "low", high_name: str = "high", *,
               cap: bool = False) -> tuple[float, float]:
    r"""Return the band $[l, h]$ of a ratio as two floats, or raise naming the bad bound.

    Two rules, each the one its callers have always had:

    * ``cap=False`` (the numpy estimators' ``low`` and ``high``): ``low`` is checked first and
      must be $\ge 0$ (ratios are), ``inf`` allowed; ``high`` is any real number or ``inf``.
    * ``cap=True`` (correction's ``rollout_is_threshold`` and its ``lower``): the cap ``high``
      is checked first and must be $> 0$, ``inf`` meaning no cap; ``low`` must be a finite
      number $\ge 0$.

    Either way ``low > high`` is a ``ValueError`` that gives both values.

    Examples
    --------
    >>> check_band(0.5, 2)
    (0.5, 2.0)
    >>> check_band(0, math.inf, "lower", "rollout_is_threshold", cap=True)
    (0.0, inf)
    >>> check_band(3.0, 2.0)
    Traceback (most recent call last):
    ...
    ValueError: low must be <= high, got low=3.0 > high=2.0
    """
    if cap:
        high = check_finite_number(high_name, high, positive=True, allow_inf=True)
        low = check_finite_number(low_name, low, low=0.0)
    else:
        low = check_finite_number(low_name, low, low=0.0, allow_inf=True)  # ratios are >= 0
        high = check_finite_number(high_name, high, allow_inf=True)
    if low > high:
        raise ValueError(f"{low_name} must be <= {high_name}, got {low_name}={low!r} > "
                         f"{high_name}={high!r}")
    return low, high


def check_choice(name: str, value, choices: tuple[str, ...], *, allow_none: bool = False):
    """Return ``value`` if it is one of the strings ``choices`` (or None, if ``allow_none``).

    Anything but a string is a ``TypeError`` naming its type, so that ``True`` or ``1`` is not
    reported as a string that is merely unknown; an unknown string is a ``ValueError``.
    """
    if allow_none and value is None:
        return None
    expected = f"None or one of {choices}" if allow_none else f"one of {choices}"
    if not isinstance(value, str):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def check_reduction(reduction) -> None:
    """Raise unless ``reduction`` is one of ``REDUCTIONS``."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype to compute in: float32 for half-precision inputs, else the promoted dtype.

    bf16 has 8 bits of mantissa; a KL summed over a vocabulary in bf16 can come out negative.
    """
    import torch

    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype



# ---------------------------------------------------------------------------------------------
# Numerics on checked inputs: nothing below validates its arguments
# ---------------------------------------------------------------------------------------------
def select(mask: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """``values`` where the bool ``mask`` is True, exactly 0 elsewhere (None: ``values``).

    A ``torch.where`` on both branches, never ``values * mask``: a masked-out ``-inf`` or NaN
    times 0 is NaN, in the value and in the gradient.
    """
    import torch

    if mask is None:
        return values
    return torch.where(mask, values, torch.zeros_like(values))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values over mask) / max(number of masked-in entries, 1); masked-out entries ignored.

    ``values`` in a compute dtype (float32 or float64, as ``compute_dtype`` gives): the count
    is converted to that dtype, which in bfloat16 would round 257 to 256.

    Examples
    --------
    >>> import torch
    >>> masked_mean(torch.tensor([1.0, 3.0, math.nan]), torch.tensor([True, True, False])).item()
    2.0
    """
    return select(mask, values).sum() / mask.sum().clamp_min(1).to(values.dtype)


def lengths(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tokens per response of a (B, T) bool mask, (B,), at least 1 (an empty mean is 0, not 0/0),
    in ``dtype``, a compute dtype (float32 or float64: a half type would round the counts)."""
    return mask.sum(dim=1).clamp_min(1).to(dtype)


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, reduction: str) -> torch.Tensor:
    """The reductions of [opd_literate.opd.aggregate_loss][] (see there for the formulas), on a
    checked (B, T) loss in its compute dtype and a bool mask."""
    if reduction == "token-mean":
        return masked_mean(per_token_loss, mask)
    masked = select(mask, per_token_loss)
    if reduction in ("sum", "token-sum"):
        return masked.sum()
    if reduction == "token-sum-norm":
        # verl's seq-mean-token-sum-norm before b8d91ef: the sum over the padded length T
        return masked.sum() / max(masked.shape[1], 1)
    per_sequence = masked.sum(dim=1)  # (B,)
    if reduction == "seq-mean-token-mean":
        per_sequence = per_sequence / lengths(mask, masked.dtype)
    loss = per_sequence.sum() / max(per_sequence.shape[0], 1)
    if reduction == "seq-mean-token-sum-norm":
        # the sequence mean over the padded length T (verl's default loss_scale_factor)
        loss = loss / max(masked.shape[1], 1)
    return loss


def kl_to_mixture(log_a: torch.Tensor, log_m: torch.Tensor) -> torch.Tensor:
    r"""$\mathrm{KL}(a \,\|\, m)$ over the last axis, in a form with no cancellation.

    With $u_v = \log m_v - \log a_v$ and $\varphi(u) = e^u - 1 - u \ge 0$, and because
    $\sum_v m_v = \sum_v a_v = 1$,

    $$
    \mathrm{KL}(a \,\|\, m) = \sum_{v:\, a_v > 0} a_v\, \varphi(u_v) + \sum_{v:\, a_v = 0} m_v .
    $$

    Every term is $\ge 0$. The plain $\sum_v a_v(\log a_v - \log m_v)$ sums terms of size
    $|u_v|$ that cancel to $O(u^2)$, which a division by a small $\beta$ then magnifies; here
    the first-order terms are gone before rounding. For $u \le 1$, $a\varphi(u)$ is computed as
    $a\,(\mathrm{expm1}(u) - u)$; for $u > 1$ (where $e^u$ could overflow) as $m - a(1 + u)$.
    Requires $m_v > 0$ wherever $a_v > 0$ (true for a mixture with a positive weight on $a$).
    Used by the dense JSD of [opd_literate.opd.generalized_jsd_per_position][] and the chunked
    one of [opd_literate.large_vocab.chunked.chunked_divergence][].
    """
    import torch

    support = log_a > -math.inf
    u = torch.where(support, log_m - torch.where(support, log_a, torch.zeros_like(log_a)),
                    torch.zeros_like(log_a))
    small = support & (u <= 1.0)
    large = support & (u > 1.0)
    a = torch.where(support, log_a, torch.zeros_like(log_a)).exp()
    u_small = torch.where(small, u, torch.zeros_like(u))
    u_large = torch.where(large, u, torch.ones_like(u))
    m = torch.where(support | (log_m > -math.inf), log_m, torch.zeros_like(log_m)).exp()
    terms = torch.where(small, a * (torch.expm1(u_small) - u_small), a.new_zeros(()))
    terms = torch.where(large, m - a * (1.0 + u_large), terms)
    # off a's support the term is m_v itself (0 where m_v = 0 too: a padded entry)
    off_support = ~support & (log_m > -math.inf)
    terms = torch.where(off_support, m, terms)
    return terms.sum(dim=-1).clamp_min(0.0)


def exp_ratio(log_ratio, level: str, toy: dict):
    """``exp(log_ratio)`` for a numpy array of log importance ratios, or a ``ValueError`` where
    a ratio would overflow float64 (``level`` and ``toy["mismatch"]`` name it in the message).

    Examples
    --------
    >>> import numpy as np
    >>> exp_ratio(np.log([0.5, 2.0]), "per-token", {}).tolist()
    [0.5, 2.0]
    >>> exp_ratio(np.array([800.0]), "sequence", {"mismatch": 3.0})
    Traceback (most recent call last):
    ...
    ValueError: the sequence importance ratios overflow float64 (log ratio up to 800 > 709.8) ...
    """
    np = log_ratio.__array_namespace__()  # numpy, not imported here (see the module docstring)
    largest = float(np.max(log_ratio)) if np.size(log_ratio) else 0.0
    if largest > MAX_LOG_RATIO:
        raise ValueError(
            f"the {level} importance ratios overflow float64 (log ratio up to {largest:.0f} > "
            f"{MAX_LOG_RATIO:.1f}) at mismatch={toy.get('mismatch')!r}: the sampler gives "
            "some sequences a probability that underflows; use a smaller mismatch"
        )
    return np.exp(log_ratio)


# ---------------------------------------------------------------------------------------------
# Argument checks of real numbers in lists and arrays (numpy, imported when called)
# ---------------------------------------------------------------------------------------------
def check_real_array(name: str, values, ndim: int | None = 1, *, min_size: int = 0,
                     finite: bool = True):
    """``values`` as a float64 numpy array, or a ``TypeError`` / ``ValueError`` naming ``name``.

    A list, tuple, numpy array or torch tensor of real numbers: ``bool``, complex, strings and
    ``None`` are refused (a ``TypeError``: ``[True, False]`` is a mistake, not a list of
    numbers); so is a ragged list. A ``ValueError`` unless it has ``ndim`` dimensions (None:
    any), at least ``min_size`` entries and (``finite``) no NaN or inf; the message gives the
    shape or the first bad entry. numpy is imported here, when called, not at the top (see the
    module docstring): a list has no array namespace to take it from.

    Examples
    --------
    >>> check_real_array("values", [1, 2.5]).tolist()
    [1.0, 2.5]
    >>> check_real_array("values", [1.0, float("nan")])
    Traceback (most recent call last):
    ...
    ValueError: values must be finite, got nan at index 1
    """
    import numpy as np

    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor, bf16 included
        if values.is_complex() or str(values.dtype) == "torch.bool":
            raise TypeError(f"{name} must hold real numbers, got a tensor of {values.dtype}")
        values = values.detach().cpu().double().numpy()
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:  # a ragged list, or entries numpy cannot read
        raise ValueError(f"{name} must be a rectangular array of real numbers ({error})") from None
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {array.dtype} (a bool, a "
                        "complex number, a string or None?)")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension{'s' if ndim != 1 else ''}, got "
                         f"shape {array.shape}")
    if array.size < min_size:
        raise ValueError(f"{name} must have at least {min_size} entries, got {array.size}")
    array = array.astype(np.float64)
    if finite and not np.isfinite(array).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        where = bad[0] if len(bad) == 1 else bad
        raise ValueError(f"{name} must be finite, got {float(array[bad])!r} at index {where}")
    return array


def check_reported_mass(teacher_topk_logp, dtype, every_token):
    r"""Raise unless the reported probabilities $q_v$, $v \in S$, sum to at most 1 at every
    position, and to 1 where ``every_token`` (k = V: the teacher's tail is taken as 0).

    To $\sqrt{\varepsilon_r} + 4 k \varepsilon$, with $\varepsilon_r$ the report's epsilon
    (float32's at least: a float64 report may hold float32 log-probabilities) and
    $\varepsilon$ the compute dtype's: a log-probability is rounded to about $\varepsilon_r$
    times the size of the logits it came from, so $\sqrt{\varepsilon_r}$ ($3.5 \cdot 10^{-4}$
    for float32) accepts log-probabilities computed as $z - \log \sum e^z$ in float32 from
    logits $z$ of 1,000 (tested), and still refuses a mass of 1.3 or 0."""
    import torch

    k = teacher_topk_logp.shape[-1]
    report = max(torch.finfo(teacher_topk_logp.dtype).eps, torch.finfo(torch.float32).eps)
    tolerance = math.sqrt(report) + 4 * k * torch.finfo(dtype).eps
    mass = torch.logsumexp(teacher_topk_logp.detach().to(dtype), dim=-1).exp()  # 0 for all -inf
    bad = mass > 1.0 + tolerance
    if every_token:
        bad = bad | (mass < 1.0 - tolerance)
    if bool(bad.any()):
        index = tuple(bad.nonzero()[0].tolist())
        expected = "1 (k = V: every token is reported)" if every_token else "at most 1"
        raise ValueError(f"teacher_topk_logp must be log-probabilities of one distribution: the "
                         f"reported probabilities sum to {mass[index].item():.6g} at position "
                         f"{index}, where they must sum to {expected}")


def check_sequence(name, values):
    """``values`` as a non-empty list, or a named error: a string, bytes or a non-iterable is no
    sequence of settings (``ks``, ``kinds``, ``coefs``), and an empty one has nothing to run."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence, got {type(values).__name__} {values!r}")
    values = list(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    return values
