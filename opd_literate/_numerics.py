"""Argument checks shared by the modules of ``opd_literate``.

Every public function validates its inputs with these helpers so that a wrong shape, dtype or
value fails at the call with a message that names the argument, what it got and what was
expected, instead of being silently broadcast into a wrong answer many lines later.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the numpy-only modules import this file: torch is loaded only when used
    import torch

__all__ = [
    "check_float_tensor",
    "check_same_shape",
    "check_mask",
    "check_finite_number",
    "compute_dtype",
]


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
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and number < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and number > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    if positive and number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


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
