r"""The torch losses on an accelerator: values and gradients against float64, then memory and time.

    python benchmarks/device_check.py                      # on CUDA: the check, then the benchmark
    python benchmarks/device_check.py --tokens 8192        # a smaller benchmark
    python benchmarks/device_check.py --device cpu --quick # tiny sizes, seconds (the tests)

**(a) The check.** Every public torch function of the loss modules ``opd_literate.opd``,
``opd_literate.mismatch.correction``, ``opd_literate.large_vocab.chunked``,
``opd_literate.large_vocab.topk`` and ``opd_literate.teachers.teacher_targets`` (their
``__all__``; ``CASES`` below holds one case per function, several options of it at once)
runs on the device in float32, bfloat16 and float16. The inputs are
drawn in float64 on the CPU and rounded to the dtype; the reference is the same function on the CPU
in float64 *on the rounded inputs*, so what is measured is the computation's own rounding on the
device, not the rounding of the inputs. Compared: every output (tensors, and the floats of a metrics
dict; bool and integer outputs exactly), and for each differentiable output $y$ the gradient of
$\langle w, y \rangle$, with fixed random weights $w$, with respect to the floating inputs
that carry one (one output at a time, so that each gradient is rounded to the input's dtype
once). Every output and every gradient must lie on the device.

Tolerances (``TOLERANCES``): an output or a gradient passes when
$\max |y - y_{\mathrm{ref}}| \le \mathrm{rtol} \cdot \max |y_{\mathrm{ref}}| + \mathrm{atol}$
over its finite entries (the infinite and NaN entries must sit at the same places): normwise,
since the rounding error of a sum or a product is relative to the size of its terms, not to
each entry. The table shows the error divided by what is allowed, so a cell passes at most 1.
With $u$ the unit roundoff ($2^{-24}$ float32, $2^{-8}$ bfloat16, $2^{-11}$ float16):

* float32: values $3 \cdot 10^{-5}$ (about $500\,u$), gradients $2 \cdot 10^{-4}$ (about
  $3{,}400\,u$). A log-probability $\log p_v = z_v - \operatorname{logsumexp}(z)$ carries an
  absolute error of a few $u$ times $\max |z| + \log V$ (about 25 here: logits of standard
  deviation 2 over $V = 16{,}384$, some divided by a temperature of 0.7), and the losses are sums
  of such log-ratios $d_v$ weighted by probabilities. A value of order one keeps a relative error
  of some hundred $u$. A gradient entry $p_v (d_v - \mathrm{KL})$ is a difference of terms of
  the size of $d_v$ (up to about 20), so its relative error is larger by their ratio to it.
  Measured on the CPU at the default sizes: values up to $5.3 \cdot 10^{-6}$, gradients up to
  $5.2 \cdot 10^{-5}$ (``reverse_kl_per_position`` at temperature 0.7); the margins, 4 to 6,
  are for the device's other summation orders and kernels. Near $p = q$ a KL is a cancellation
  whose relative error grows like $1 / \mathrm{KL}$: the random inputs here have divergences of
  order one, and the table does not cover that regime.
* bfloat16 and float16: values as float32, since every function computes half-precision inputs
  in float32 (``compute_dtype``): from the same rounded inputs, the values carry float32 rounding
  only. Gradients $u$ + float32's $2 \cdot 10^{-4}$ ($4.1 \cdot 10^{-3}$ and
  $6.9 \cdot 10^{-4}$): autograd returns the gradient of a half-precision input in its dtype,
  and that rounding costs up to $u$ of each entry (measured: up to $0.96\,u$). float16 also
  underflows: below $2^{-14}$ it keeps multiples of $2^{-24}$, hence the absolute $2^{-25}$ (a
  token-mean gradient over a vocabulary, about $1 / (N V)$ an entry, reaches it; bfloat16 has
  float32's range).
* float64 ($10^{-10}$) only for ``topk.topk_bias_table``, which computes in float64 by design:
  the CPU and the device differ in summation order only.

Two cases measure against a floor of 1 on the scale (``Case.floor``): their outputs are
differences of terms of order one that can be much smaller than the terms, so no relative
accuracy is possible against the result itself. ``opd.expected_kl_estimator_gradient`` is
$c - p \sum_v c_v$ with $c_v \le 1$ (k1 as a loss is exactly 0); the gradient of
``opd.generalized_jsd_per_position`` at $\beta = 1/2$ is about 0.03 here, a difference of terms
$p_v \log(p_v / m_v)$ of order one.

On the CPU (``--device cpu``) the library calls run under a ``meta`` default device: a tensor
created without ``device=`` inside a library function becomes a meta tensor there, and shows as
a device error or a meta output, so the CPU run checks the placement too (a CPU-only machine
cannot otherwise tell a forgotten device from a right one).

**(b) The benchmark** (bfloat16, ``--tokens`` tokens, $V = 151{,}936$, $H = 1{,}024$ as in
``benchmarks/bench_large_vocab.py``): the full-vocabulary reverse KL, dense
(``opd.full_vocab_reverse_kl`` on the ``(N, V)`` logits, built with autograd for the student and
without for the teacher), chunked (``large_vocab.chunked_reverse_kl`` on the hidden states and
heads) and, where ``trl`` is installed, TRL's ``_chunked_divergence_loss`` with ``beta=1.0``, as
``bench_large_vocab.py`` runs them. Measured: the added peak memory
(``torch.cuda.max_memory_allocated`` during one forward plus backward pass, minus the memory
allocated before it: the inputs, heads and their preallocated gradients) and the time of the
forward plus backward pass (best of ``--repeats``, CUDA events). The variants share one
process: the allocator's peak is reset before each, and memory freed by one is not counted for
the next (a process's RSS does not shrink that way, hence ``bench_large_vocab.py``'s process per
variant). Targets, printed as pass or fail: chunked adds at most 1/10 of dense's memory, in at
most 1.2 times its time. They are judged on CUDA at full sizes only (not with ``--quick``, and
not on the CPU, where ``bench_large_vocab.py`` measures the resident memory instead); they do
not change the exit status. The chunked loss computes bfloat16 inputs in float32, its matrix
products included, where the dense one multiplies in bfloat16 and only then converts the
logits: on a GPU whose bfloat16 products are much faster, that costs it time.

Exit status: 0 when every check passes; 1 on a value or gradient mismatch or a device error
(an exception, or an output off the device, in the check or in the dense or chunked benchmark);
2 when the device is not available (``--device cuda`` without CUDA). A missed speed or memory
target is a ``FAIL`` row of the table, a measurement, not an error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

MODULES = {"opd": "opd", "correction": "mismatch.correction", "large_vocab": "large_vocab.chunked",
           "topk": "large_vocab.topk", "teachers": "teachers.teacher_targets"}
"""The loss modules of ``opd_literate`` whose public torch functions are checked: the short name
that labels a row, and the module's path below the package."""

CHECK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

TOLERANCES = {
    # dtype: (value rtol, gradient rtol, gradient atol); allowed: rtol * max |ref| + atol.
    # Derived in the module docstring; u = 2^-24 (float32), 2^-8 (bfloat16), 2^-11 (float16).
    torch.float64: (1e-10, 1e-10, 0.0),
    torch.float32: (3e-5, 2e-4, 0.0),
    torch.bfloat16: (3e-5, 2.0 ** -8 + 2e-4, 0.0),
    torch.float16: (3e-5, 2.0 ** -11 + 2e-4, 2.0 ** -25),  # 2^-25: float16's underflow
}

NOT_RUN = {
    # public functions of MODULES that take no tensor to place: why the check leaves them out
    "topk.zipf_pair": "draws the study's data on the CPU (CPU by design)",
    "topk.topk_bias_figure_data": "the study on zipf_pair's CPU data",
    "topk.format_topk_bias_table": "formats a table (no tensors)",
    "topk.plot_topk_bias": "draws a figure (no tensors)",
}

QUICK = {"B": 3, "T": 5, "V": 11, "H": 4, "k": 4, "chunk": 4}
FULL = {"B": 4, "T": 32, "V": 16_384, "H": 64, "k": 20, "chunk": 96}
# the benchmark: bench_large_vocab.py's V and H (a Qwen vocabulary) at 16,384 tokens; chunks of
# 1,024 rows (0.6 GiB of float32 logits each) keep the GPU's matrix products large
BENCH_FULL = {"tokens": 16_384, "vocab": 151_936, "hidden": 1024, "chunk": 1024}
BENCH_QUICK = {"tokens": 64, "vocab": 512, "hidden": 16, "chunk": 16}


# ---------------------------------------------------------------------------------------------
# The cases: valid arguments for every public torch function (as in the doctests and tests/)
# ---------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One public function, its inputs and the options it is called with.

    ``make(s, g)`` returns the inputs, a dict of float64 (or integer, bool) CPU tensors drawn
    from the generator ``g`` at the sizes ``s``; ``call(fn, x)`` calls ``fn`` on the placed
    inputs ``x`` and returns its outputs (any nesting of tuples, dicts and tensors); ``grad``
    names the floating inputs to differentiate with respect to.
    """

    name: str  # "module.function"
    make: Callable[[dict, torch.Generator], dict]
    call: Callable[[Callable, dict], Any]
    grad: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = CHECK_DTYPES
    floor: float = 0.0  # see the module docstring

    @property
    def function(self) -> Callable:
        module, name = self.name.split(".")
        return getattr(importlib.import_module(f"opd_literate.{MODULES[module]}"), name)


def _mask(s, g):
    """(B, T) bool: response lengths from 1 to T, the last response full."""
    lengths = torch.randint(1, s["T"] + 1, (s["B"],), generator=g)
    lengths[-1] = s["T"]
    return torch.arange(s["T"])[None, :] < lengths[:, None]


def _logits(s, g, *lead):
    return 2.0 * torch.randn(*lead, s["V"], generator=g, dtype=torch.float64)


def _logp(s, g):
    """(B, T) log-probabilities of sampled tokens, in [log 0.05, 0]."""
    return torch.log(0.05 + 0.95 * torch.rand(s["B"], s["T"], generator=g, dtype=torch.float64))


def _trainer_sampler(s, g):
    trainer = _logp(s, g)
    sampler = (trainer + 0.3 * torch.randn(trainer.shape, generator=g, dtype=torch.float64))
    return {"trainer_logp": trainer, "sampler_logp": sampler.clamp_max(0.0), "mask": _mask(s, g)}


def _with_advantages(s, g):
    return {**_trainer_sampler(s, g),
            "advantages": torch.randn(s["B"], generator=g, dtype=torch.float64)}


def _vocab_pair(s, g):
    return {"student_logits": _logits(s, g, s["B"], s["T"]),
            "teacher_logits": _logits(s, g, s["B"], s["T"]), "mask": _mask(s, g)}


def _token_pair(s, g):
    return {"student_logp": _logp(s, g), "teacher_logp": _logp(s, g), "mask": _mask(s, g)}


def _topk_inputs(s, g):
    teacher = F.log_softmax(_logits(s, g, s["B"], s["T"]), dim=-1)
    values, ids = teacher.topk(s["k"], dim=-1)
    return {"student_logits": _logits(s, g, s["B"], s["T"]), "teacher_topk_logp": values,
            "topk_ids": ids}


def _hidden_inputs(s, g):
    N, H, V = s["B"] * s["T"], s["H"], s["V"]

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    # logits W h of order 2, as _logits'
    return {"student_hidden": randn(N, H), "student_weight": randn(V, H, scale=2 / H ** 0.5),
            "student_bias": randn(V), "teacher_hidden": randn(N, H),
            "teacher_weight": randn(V, H, scale=2 / H ** 0.5), "teacher_bias": randn(V),
            "teacher_logits": _logits(s, g, N), "mask": _mask(s, g).reshape(N)}


def _chunked(divergence, **options):
    """A chunked loss with the teacher as logits and as hidden states, with and without bias.

    Every tensor is an input of the case (rounded once, as the reference sees it): nothing is
    computed in the input dtype here, where its rounding would count as the function's.
    """
    def call(fn, x):
        hw = (x["student_hidden"], x["student_weight"], x["mask"])
        return {
            "teacher_logits": fn(*hw, teacher_logits=x["teacher_logits"],
                                 chunk_size=x["chunk"], **options),
            "teacher_head": fn(*hw, student_bias=x["student_bias"],
                               teacher_hidden=x["teacher_hidden"],
                               teacher_weight=x["teacher_weight"], teacher_bias=x["teacher_bias"],
                               chunk_size=x["chunk"], **options),
        }
    return call


def _with_chunk(make):
    """The inputs of ``make`` and the chunk size (a plain int: inputs need not be tensors)."""
    def wrapped(s, g):
        return {**make(s, g), "chunk": s["chunk"]}
    return wrapped


_KL = ("student_logits", "teacher_logits", "mask")
_GRAD_HEAD = ("student_hidden", "student_weight", "student_bias")
_IS_LEVELS = ("token", "sequence", "geometric")
_REDUCTIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
               "seq-mean-token-sum-norm", "sum")


def _trainer(x):
    return x["trainer_logp"], x["sampler_logp"], x["mask"]


def _kept_mass_inputs(s, g):
    """(B, T, V) trainer logits, written tokens, kept sets holding them (about 60 % of the
    vocabulary), the reported log-probs and a kept log-mass between each and 0."""
    tokens = torch.randint(0, s["V"], (s["B"], s["T"]), generator=g)
    kept = torch.rand(s["B"], s["T"], s["V"], generator=g) < 0.6
    kept.scatter_(-1, tokens[..., None], True)
    logp = _logp(s, g)
    return {"trainer_logits": _logits(s, g, s["B"], s["T"]), "sampler_logp": logp,
            "tokens": tokens, "kept": kept, "mask": _mask(s, g),
            "sampler_log_kept": logp * torch.rand(logp.shape, generator=g, dtype=torch.float64)}


def _kept_mass_call(fn, x):
    """Every row of the chapter's kept-mass table, at two temperatures."""
    from opd_literate.mismatch.engine import KEPT_MASS_CHOICES

    out = {}
    for _, options in KEPT_MASS_CHOICES:
        needs = options.get("kept_mass") == "sampler" and options["reported"] != "processed"
        extra = {"sampler_log_kept": x["sampler_log_kept"]} if needs else {}
        for tau in (1.0, 0.7):
            out[str(options), tau] = fn(x["trainer_logits"], x["sampler_logp"], x["tokens"],
                                        x["kept"], x["mask"], temperature=tau, **options,
                                        **extra)
    return out


CASES = [
    # opd
    Case("opd.reverse_kl_rewards", _token_pair,
         lambda fn, x: fn(x["student_logp"], x["teacher_logp"], x["mask"]), ("student_logp",)),
    Case("opd.opd_pg_loss",
         lambda s, g: {**_token_pair(s, g), "rewards": torch.randn(s["B"], s["T"], generator=g,
                                                                   dtype=torch.float64)},
         lambda fn, x: fn(x["student_logp"], x["rewards"], x["mask"]), ("student_logp",)),
    *[Case(f"opd.{name}", _vocab_pair,
           lambda fn, x: {t: fn(*(x[k] for k in _KL), temperature=t) for t in (1.0, 0.7)},
           ("student_logits",))
      for name in ("full_vocab_reverse_kl", "forward_kl", "reverse_kl_per_position",
                   "forward_kl_per_position")],
    Case("opd.generalized_jsd", _vocab_pair,
         lambda fn, x: {(b, n): fn(*(x[k] for k in _KL), beta=b, normalize=n)
                        for b in (0.0, 0.3, 1.0) for n in (False, True)}, ("student_logits",)),
    Case("opd.generalized_jsd_per_position", _vocab_pair,
         lambda fn, x: {b: fn(x["student_logits"], x["teacher_logits"], beta=b, mask=x["mask"],
                              temperature=0.7)
                        for b in (0.0, 0.5, 1.0)}, ("student_logits",), floor=1.0),
    Case("opd.kl_estimator", _token_pair,
         lambda fn, x: {k: fn(x["student_logp"], x["teacher_logp"], k) for k in ("k1", "k2", "k3")},
         ("student_logp",)),
    Case("opd.expected_kl_estimator_gradient", _vocab_pair,
         lambda fn, x: {(k, m): fn(x["student_logits"], x["teacher_logits"], k, m)
                        for k in ("k1", "k2", "k3") for m in ("loss", "reward")}, floor=1.0),
    Case("opd.discounted_returns",
         lambda s, g: {"rewards": torch.randn(s["B"], s["T"], generator=g, dtype=torch.float64),
                       "mask": _mask(s, g)},
         lambda fn, x: {gamma: fn(x["rewards"], x["mask"], gamma) for gamma in (0.0, 0.9, 1.0)}),
    Case("opd.aggregate_loss",
         lambda s, g: {"per_token_loss": torch.randn(s["B"], s["T"], generator=g,
                                                     dtype=torch.float64), "mask": _mask(s, g)},
         lambda fn, x: {r: fn(x["per_token_loss"], x["mask"], r) for r in _REDUCTIONS},
         ("per_token_loss",)),
    Case("opd.sampled_token_opd_loss", _token_pair,
         lambda fn, x: {(gamma, r): fn(x["student_logp"], x["teacher_logp"], x["mask"], gamma, r)
                        for gamma in (0.0, 0.9) for r in ("token-mean", "seq-mean-token-sum")},
         ("student_logp",)),
    # correction
    Case("correction.log_ratios", _trainer_sampler,
         lambda fn, x: {lv: fn(*_trainer(x), lv) for lv in _IS_LEVELS}, ("trainer_logp",)),
    Case("correction.importance_weights", _trainer_sampler,
         lambda fn, x: {(lv, mode, norm): fn(*_trainer(x), lv, rollout_is_threshold=1.5,
                                             mode=mode,
                                             lower=None if mode == "truncate" else 0.5,
                                             rollout_is_batch_normalize=norm)
                        for lv in _IS_LEVELS for mode in ("truncate", "mask", "clamp")
                        for norm in (False, True)}),
    Case("correction.rejection_mask", _trainer_sampler,
         lambda fn, x: {(o, h): fn(*_trainer(x), o, h)
                        for o, h in (("token_k1", 1.5), ("seq_mean_k3", 0.02),
                                     ("seq_max_k2", 0.1), ("token_k2,seq_sum_k1", "0.1,0.5_2"))}),
    Case("correction.veto_mask", _trainer_sampler,
         lambda fn, x: {t: fn(*_trainer(x), veto_threshold=t) for t in (1e-4, 0.5)}),
    Case("correction.offpolicy_metrics", _trainer_sampler, lambda fn, x: fn(*_trainer(x))),
    Case("correction.rollout_correction", _trainer_sampler,
         lambda fn, x: fn(*_trainer(x), rollout_is="sequence", rollout_is_threshold=3.0,
                          rollout_rs="token_k1", rollout_rs_threshold=2.0, veto_threshold=0.1)),
    *[Case(f"correction.{name}", _with_advantages,
           lambda fn, x, clips=clips: {
               (r, str(c)): fn(x["trainer_logp"], x["sampler_logp"], x["advantages"], x["mask"],
                               reduction=r, **c)
               for r in ("token-mean", "seq-mean-token-mean") for c in clips},
           ("trainer_logp",))
      for name, clips in (("ppo_clip_loss", ({},)), ("cispo_loss", ({},)),
                          # GSPO's default band (3e-4, 4e-4) clips nearly every response of these
                          # inputs, which leaves no gradient to compare: a wide band as well
                          ("gspo_loss", ({}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3})),
                          # the default regions and tighter ones that remove and truncate more
                          ("dppo_tv_loss", ({}, {"clip_ratio": 0.05, "clip_ratio_c": 1.5})),
                          ("dppo_kl_loss", ({}, {"clip_ratio": 0.01, "clip_ratio_c": 1.5})),
                          ("dro_loss", ({"dro_beta": 0.1}, {"dro_beta": 2.0})))],
    Case("correction.trl_importance_weights", _trainer_sampler,
         lambda fn, x: {(mode, lo, hi): fn(*_trainer(x), mode,
                                           vllm_importance_sampling_clip_min=lo,
                                           vllm_importance_sampling_clip_max=hi)
                        for mode in ("token_truncate", "token_mask", "sequence_truncate",
                                     "sequence_mask")
                        for lo, hi in ((None, 3.0), (0.5, 1.5))}),
    Case("correction.off_policy_sequence_mask", _with_advantages,
         lambda fn, x: {t: fn(x["trainer_logp"], x["sampler_logp"], x["advantages"], x["mask"],
                              t) for t in (0.01, 0.1)}),
    # seq-mask-tis' default band (0.999, 1.002) masks nearly every response here: a wide one too
    Case("correction.seq_mask_tis_weights", _trainer_sampler,
         lambda fn, x: {b: fn(*_trainer(x), low=b[0], high=b[1])
                        for b in ((0.999, 1.002), (0.5, 2.0))}),
    Case("correction.kpop_mask", _trainer_sampler,
         lambda fn, x: {t: fn(*_trainer(x), t) for t in (0.01, 0.1)}),
    *[Case(f"correction.{name}", _with_advantages,
           lambda fn, x, options=options: {
               str(o): fn(x["trainer_logp"], x["sampler_logp"], x["advantages"], x["mask"], **o)
               for o in options},
           ("trainer_logp",))
      for name, options in (
          ("sapo_loss", ({}, {"tau_pos": 0.5, "reduction": "token-mean"})),
          ("geo_mean_loss", ({}, {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3})),
          ("luspo_loss", ({}, {"epsilon": 0.5, "epsilon_high": 1.0})),
          ("vespo_loss", ({}, {"reduction": "seq-mean-token-mean"})),
          # lb and ub that make tokens eligible on these inputs, and verl's (few or none)
          ("clip_cov_loss", ({}, {"clip_cov_ratio": 0.3, "clip_cov_lb": -1.0,
                                  "clip_cov_ub": 1.0})),
          ("kl_cov_loss", ({}, {"kl_cov_ratio": 0.3, "ppo_kl_coef": 1.0})))],
    # the policy losses as REINFORCE weights (detached: no gradient to compare)
    *[Case(f"correction.{name}", _with_advantages,
           lambda fn, x, options=options: {
               str(o): fn(x["trainer_logp"], x["sampler_logp"], x["advantages"], x["mask"], **o)
               for o in options})
      for name, options in (
          ("sapo_weights", ({}, {"tau_pos": 0.5})),
          ("gspo_weights", ({}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3})),
          ("clip_cov_weights", ({}, {"clip_cov_ratio": 0.3, "clip_cov_lb": -1.0,
                                     "clip_cov_ub": 1.0})))],
    Case("correction.reinforce_loss",
         lambda s, g: {**_with_advantages(s, g),
                       "weights": torch.rand(s["B"], s["T"], generator=g, dtype=torch.float64)},
         lambda fn, x: {"plain": fn(x["trainer_logp"], x["advantages"], x["mask"]),
                        "weighted": fn(x["trainer_logp"], x["advantages"], x["mask"],
                                       x["weights"], reduction="sum")},
         ("trainer_logp",)),
    Case("correction.kl_penalty", _trainer_sampler,
         lambda fn, x: {k: fn(*_trainer(x), k) for k in ("k1", "k2", "k3", "k1+", "k3+")},
         ("trainer_logp",)),
    Case("correction.kept_mass_log_ratio", _kept_mass_inputs, _kept_mass_call,
         ("trainer_logits",)),
    # group baselines under a rejection: (B, G) rewards, some answers rejected
    Case("correction.group_advantages",
         lambda s, g: {"rewards": torch.randn(s["B"], 4, generator=g, dtype=torch.float64),
                       "kept": torch.rand(s["B"], 4, generator=g) < 0.7},
         lambda fn, x: {b: fn(x["rewards"], x["kept"], b)
                        for b in ("grpo_all", "grpo_kept", "grpo_std_all", "grpo_std_kept",
                                  "rloo_all", "rloo_kept")}),
    # teachers
    Case("teachers.teacher_target_logprobs",
         lambda s, g: {"teacher_logp": torch.stack([_logp(s, g) for _ in range(3)]),
                       # exact in every dtype: the reference sees the rounded weights in float64
                       "weights": torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64),
                       "routes": torch.arange(s["B"]) % 3, "mask": _mask(s, g)},
         lambda fn, x: {kind: fn(x["teacher_logp"], x["mask"], kind,
                                 None if kind == "routed" else x["weights"],
                                 x["routes"] if kind == "routed" else None)
                        for kind in ("routed", "weighted_kl", "token_mixture",
                                     "sequence_mixture")}),
    # large_vocab
    Case("large_vocab.chunked_divergence", _with_chunk(_hidden_inputs),
         lambda fn, x: {(d, b, n): _chunked(d, beta=b, normalize=n)(fn, x)
                        for d, b, n in (("reverse_kl", 0.5, False), ("forward_kl", 0.5, False),
                                        ("jsd", 0.3, True))}, _GRAD_HEAD),
    Case("large_vocab.chunked_reverse_kl", _with_chunk(_hidden_inputs), _chunked("reverse_kl"),
         _GRAD_HEAD),
    Case("large_vocab.chunked_forward_kl", _with_chunk(_hidden_inputs), _chunked("forward_kl"),
         _GRAD_HEAD),
    Case("large_vocab.chunked_generalized_jsd", _with_chunk(_hidden_inputs),
         lambda fn, x: {b: _chunked("jsd", beta=b, normalize=True)(fn, x) for b in (0.2, 0.9)},
         _GRAD_HEAD),
    # topk
    Case("topk.topk_kl", _topk_inputs,
         lambda fn, x: {(a, d): fn(x["student_logits"], x["teacher_topk_logp"], x["topk_ids"],
                                   a, d)
                        for a in ("renormalize", "tail", "ignore")
                        for d in ("reverse", "forward")}, ("student_logits",)),
    Case("topk.topk_bias_table",
         lambda s, g: {"student_logits": _logits(s, g), "teacher_logits": _logits(s, g),
                       # not k = V: there the relative bias is 0 plus rounding noise
                       "ks": [1, s["k"]]},
         lambda fn, x: fn(x["ks"], x["student_logits"], x["teacher_logits"]),
         dtypes=(torch.float64,)),
]


def public_torch_functions() -> list[str]:
    """``"module.function"`` for every public function of ``MODULES`` (classes excluded)."""
    names = []
    for module in MODULES:
        mod = importlib.import_module(f"opd_literate.{MODULES[module]}")
        names += [f"{module}.{n}" for n in mod.__all__ if inspect.isfunction(getattr(mod, n))]
    return names


# ---------------------------------------------------------------------------------------------
# Running and comparing
# ---------------------------------------------------------------------------------------------
def _leaves(output, prefix=""):
    """Flatten nested tuples, lists, dicts (and NamedTuples) into ``[(path, leaf)]``."""
    if isinstance(output, dict):
        return [x for k, v in output.items() for x in _leaves(v, f"{prefix}[{k!r}]")]
    if isinstance(output, (tuple, list)):
        fields = getattr(output, "_fields", None) or range(len(output))
        return [x for k, v in zip(fields, output) for x in _leaves(v, f"{prefix}.{k}")]
    return [(prefix or "output", output)]


@dataclass
class Comparison:
    """The worst value and gradient errors divided by their tolerances, and what went wrong."""

    value: float = 0.0
    grad: float | None = None  # None: no gradient compared
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.value <= 1.0 and (self.grad is None or self.grad <= 1.0)


def _error(a, b, tolerance):
    """``max |a - b| / (rtol max(max |b|, floor) + atol)`` over the finite entries, for the
    ``tolerance = (rtol, atol, floor)``; or a message when ``a`` and the reference ``b`` differ
    in kind, shape or where they are not finite. Bool and integer values must be equal."""
    rtol, atol, floor = tolerance
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return f"got {type(a).__name__} {tuple(getattr(a, 'shape', ()))}, expected shape " \
                   f"{tuple(b.shape)}"
        a, b = a.detach().cpu(), b.detach().cpu()
        if not b.is_floating_point():
            return 0.0 if torch.equal(a.to(b.dtype), b) else \
                f"{int((a.to(b.dtype) != b).sum())} of {b.numel()} entries differ"
        a, b = a.double(), b.double()
    elif isinstance(b, float) and isinstance(a, (float, int)) and not isinstance(a, bool):
        a, b = torch.tensor(float(a), dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    else:
        return 0.0 if a == b else f"got {a!r}, expected {b!r}"
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)) or not torch.equal(a[~finite].nan_to_num(),
                                                                     b[~finite].nan_to_num()):
        return "its infinite or NaN entries differ from the reference's"
    if not finite.any():
        return 0.0
    allowed = rtol * max(b[finite].abs().max().item(), floor) + atol
    diff = (a[finite] - b[finite]).abs().max().item()
    return diff / allowed if allowed > 0 else (0.0 if diff == 0 else math.inf)


def compare(result, reference, dtype, floor=0.0) -> Comparison:
    """Compare ``(outputs, gradients)`` from the device with the float64 reference's.

    ``outputs`` is any nesting of tuples and dicts; ``gradients`` a dict of tensors (None for
    an input that got none), as ``evaluate`` returns them. Errors are divided by what
    ``TOLERANCES[dtype]`` allows; ``floor`` is the case's (see the module docstring).
    """
    (out, grads), (ref_out, ref_grads) = result, reference
    value_rtol, grad_rtol, grad_atol = TOLERANCES[dtype]
    comparison = Comparison(grad=0.0 if ref_grads else None)
    got, expected = _leaves(out), _leaves(ref_out)
    if [p for p, _ in got] != [p for p, _ in expected]:
        comparison.problems.append(f"outputs {[p for p, _ in got]} != {[p for p, _ in expected]}")
        return comparison
    if list(grads) != list(ref_grads):
        comparison.problems.append(f"gradients {list(grads)} != {list(ref_grads)}")
        return comparison
    pairs = [(path, a, b, (value_rtol, 0.0, floor)) for (path, a), (_, b) in zip(got, expected)]
    pairs += [(name, grads[name], b, (grad_rtol, grad_atol, floor))
              for name, b in ref_grads.items()]
    for path, a, b, tolerance in pairs:
        if b is None or a is None:
            if (a is None) != (b is None):
                comparison.problems.append(f"{path}: gradient {a!r} against {b!r}")
            continue
        error = _error(a, b, tolerance)
        if isinstance(error, str):
            comparison.problems.append(f"{path}: {error}")
        elif path in ref_grads:
            comparison.grad = max(comparison.grad, error)
        else:
            comparison.value = max(comparison.value, error)
    return comparison


def evaluate(case, inputs, device, dtype, meta_default=False):
    r"""Run ``case`` on ``inputs`` placed on ``device`` in ``dtype``: ``(outputs, gradients)``.

    ``gradients`` maps ``"d<output path>/d <input>"`` to the gradient of
    $\langle w, y \rangle$ for each differentiable floating output $y$ (its non-finite entries
    left out), with fixed random weights $w$, with respect to each input of ``case.grad``. One
    output at a time: autograd rounds each gradient to the input's dtype, and the sum over
    several outputs would add one rounding per output. With ``meta_default`` the calls run
    under a ``meta`` default device (see the module docstring).
    """
    placed = {}
    for name, x in inputs.items():
        if isinstance(x, torch.Tensor):
            x = x.to(device, dtype, copy=True) if x.is_floating_point() else x.to(device)
            if name in case.grad:
                x.requires_grad_(True)
        placed[name] = x
    context = torch.device("meta") if meta_default else contextlib.nullcontext()
    with context:
        output = case.call(case.function, placed)
    g = torch.Generator().manual_seed(1)  # the same weights for the device and the reference
    grads = {}
    for path, y in _leaves(output):
        if not (isinstance(y, torch.Tensor) and y.requires_grad and case.grad):
            continue
        w = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.device)
        y = y.double()
        objective = torch.where(torch.isfinite(y), y * w, 0.0).sum()
        with context:  # an autograd.Function's backward creates tensors too
            found = torch.autograd.grad(objective, [placed[n] for n in case.grad],
                                        retain_graph=True, allow_unused=True)
        grads.update({f"d{path}/d {n}": grad for n, grad in zip(case.grad, found)})
    return output, grads


def _off_device(result, device):
    """Paths of the output and gradient tensors that are not on ``device``."""
    out, grads = result
    leaves = _leaves(out) + list(grads.items())
    return [f"{path} on {y.device}" for path, y in leaves
            if isinstance(y, torch.Tensor) and y.device.type != device.type]


def _message(error):
    return traceback.format_exception_only(type(error), error)[-1].strip()


def check_case(case, sizes, device, dtype, meta_default=False) -> Comparison:
    """One cell of the table: ``case`` on ``device`` in ``dtype`` against float64 on the CPU."""
    inputs = case.make(sizes, torch.Generator().manual_seed(0))
    # the reference reads the inputs as the device sees them: rounded to dtype
    rounded = {n: x.to(dtype).double() if isinstance(x, torch.Tensor) and x.is_floating_point()
               else x for n, x in inputs.items()}
    try:
        reference = evaluate(case, rounded, torch.device("cpu"), torch.float64)
    except Exception as error:  # the case is wrong (or the function broke on the CPU too)
        return Comparison(problems=[f"the float64 CPU reference raised {_message(error)}"])
    try:
        result = evaluate(case, rounded, device, dtype, meta_default)
    except Exception as error:  # a device error: report it, go on with the other cells
        return Comparison(problems=[f"raised {_message(error)}"])
    off = _off_device(result, device)
    if off:
        return Comparison(problems=[f"off the device: {', '.join(off)}"])
    return compare(result, reference, dtype, case.floor)


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------
def _bench_variant(variant, device, tokens, vocab, hidden, chunk, repeats):
    """Added peak memory (MiB, CUDA only, else None) and best time (ms) of one variant."""
    from opd_literate.large_vocab.chunked import chunked_reverse_kl
    from opd_literate.opd import full_vocab_reverse_kl

    def loss_fn(h, W, th, tW, mask):
        if variant == "dense":
            logits = F.linear(h, W)  # (N, V), kept for the backward pass
            with torch.no_grad():
                teacher_logits = F.linear(th, tW)
            return full_vocab_reverse_kl(logits[None], teacher_logits[None], mask[None])
        if variant == "trl":
            from trl.trainer.distillation_trainer import _chunked_divergence_loss

            loss, _, _ = _chunked_divergence_loss(h[None], th[None], W, tW, mask[None], beta=1.0)
            return loss
        return chunked_reverse_kl(h, W, mask, teacher_hidden=th, teacher_weight=tW,
                                  chunk_size=chunk)

    def inputs(n):
        g = torch.Generator().manual_seed(0)

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=g).mul_(scale).to(device, torch.bfloat16)

        h = randn(n, hidden).requires_grad_(True)
        W = randn(vocab, hidden, scale=0.05).requires_grad_(True)
        th, tW = randn(n, hidden), randn(vocab, hidden, scale=0.05)
        h.grad, W.grad = torch.zeros_like(h), torch.zeros_like(W)
        return h, W, th, tW, torch.ones(n, device=device)

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    loss_fn(*inputs(2)).backward()  # warm-up: loads the kernels
    h, W, th, tW, mask = inputs(tokens)
    best, added, loss_value = math.inf, None, None
    for _ in range(repeats):
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            started = time.perf_counter()
        loss = loss_fn(h, W, th, tW, mask)
        loss.backward()
        if cuda:
            end.record()
            sync()
            milliseconds = start.elapsed_time(end)
            added = (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
        else:
            milliseconds = 1000 * (time.perf_counter() - started)
        best, loss_value = min(best, milliseconds), loss.item()
        del loss
    return {"added_mib": added, "ms": best, "loss": loss_value}


def benchmark(device, sizes, repeats, judge):
    """The benchmark part of the table, ``(rows, problems)``: each variant, then the two
    targets. A device error of the dense or the chunked loss is a problem (the exit status says
    so); dense running out of memory is a measurement, and TRL's failure is TRL's."""
    variants = ["dense", "chunked"]
    if importlib.util.find_spec("trl") is not None:
        variants.append("trl")
    results, rows, problems = {}, [], []
    for variant in variants:
        try:
            results[variant] = _bench_variant(variant, device, sizes["tokens"], sizes["vocab"],
                                              sizes["hidden"], sizes["chunk"], repeats)
        except torch.cuda.OutOfMemoryError:
            results[variant] = "out of memory"
        except Exception as error:  # a third party's failure is reported, not fatal
            results[variant] = f"error: {type(error).__name__}: {error}"[:60]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = results[variant]
        if isinstance(r, dict):
            memory = "-" if r["added_mib"] is None else f"{r['added_mib']:,.0f} MiB"
            rows.append((f"bench {variant}", "", f"{memory}, {r['ms']:,.1f} ms",
                         "", f"loss {r['loss']:.6f}"))
        else:
            rows.append((f"bench {variant}", "", r, "", ""))
            if variant == "chunked" or (variant == "dense" and r != "out of memory"):
                problems.append(f"bench {variant}: {r}")
    if "trl" not in variants:
        rows.append(("bench trl", "", "", "", "not run: trl not installed"))
    dense, chunked = results["dense"], results["chunked"]
    for target, key, limit in (("memory", "added_mib", 0.1), ("time", "ms", 1.2)):
        name = f"target chunked/dense {target} <= {limit:g}"
        if not isinstance(chunked, dict):
            rows.append((name, "", "", "", "fail (chunked did not run)"))
        elif dense == "out of memory":
            rows.append((name, "", "dense out of memory", "",
                         "pass" if target == "memory" else "n/a"))
        elif not isinstance(dense, dict) or dense[key] is None:
            rows.append((name, "", "-", "", "n/a (CUDA memory only)"))
        else:
            ratio = chunked[key] / dense[key]
            verdict = ("pass" if ratio <= limit else "FAIL") if judge else \
                "not judged (CUDA at full sizes only)"
            rows.append((name, "", f"{ratio:.3f}", "", verdict))
    return rows, problems


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}


def _cell(comparison):
    if comparison.problems:
        return "ERROR"
    grad = "-" if comparison.grad is None else f"{comparison.grad:.3f}"
    return f"{comparison.value:.3f} / {grad}" + ("" if comparison.ok else " !")


def run_checks(device, sizes, cases=None, meta_default=False):
    """The check part of the table: ``(rows, problems)``; ``problems`` empty when all pass.

    With the default ``cases`` (``CASES``), a public function with neither a case nor a
    ``NOT_RUN`` reason is a problem too.
    """
    full = cases is None
    cases = CASES if full else cases
    rows, problems = [], []
    for case in cases:
        cells, failed = [], False
        for dtype in CHECK_DTYPES:
            # a float64-only case (topk_bias_table) sits in the float32 column, marked
            run_dtype = dtype if dtype in case.dtypes else (
                torch.float64 if dtype == torch.float32 and torch.float64 in case.dtypes
                else None)
            if run_dtype is None:
                cells.append("")
                continue
            comparison = check_case(case, sizes, device, run_dtype, meta_default)
            cells.append(_cell(comparison) + (" (float64)" if run_dtype != dtype else ""))
            where = f"{case.name} {_DTYPE_NAMES[run_dtype]}"
            problems += [f"{where}: {p}" for p in comparison.problems]
            if not comparison.problems and not comparison.ok:
                problems.append(f"{where}: error / tolerance {comparison.value:.3g} (value), "
                                f"{comparison.grad:.3g} (gradient)")
            failed |= not comparison.ok
        rows.append((case.name, *cells, "FAIL" if failed else "pass"))
    covered = {case.name for case in cases}
    for name in public_torch_functions():
        if name in covered:
            continue
        if name in NOT_RUN:
            rows.append((name, "", "", "", f"not run: {NOT_RUN[name]}"))
        elif full:
            rows.append((name, "", "", "", "FAIL: no case in CASES"))
            problems.append(f"{name}: public, but neither in CASES nor in NOT_RUN")
    return rows, problems


def format_table(rows):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv=None, cases=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="a torch device (default: cuda)")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"benchmark tokens (default {BENCH_FULL['tokens']:,}; "
                             f"{BENCH_QUICK['tokens']} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (seconds; the targets are not judged)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help=f"the chunked loss's chunk_size in the benchmark (default "
                             f"{BENCH_FULL['chunk']}; {BENCH_QUICK['chunk']} with --quick)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs of each benchmark variant (default 3; 1 with --quick)")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        print(f"device_check: --device {args.device!r} is not a torch device ({error})",
              file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"device_check: --device {args.device} asked, but CUDA is not available "
              f"(torch {torch.__version__}); use --device cpu for the CPU run", file=sys.stderr)
        return 2
    # full float32 matrix products: TF32 would make them about 1e-3 accurate, which is not
    # what the float32 tolerance is about
    torch.set_float32_matmul_precision("highest")
    sizes = QUICK if args.quick else FULL
    bench = dict(BENCH_QUICK if args.quick else BENCH_FULL)
    if args.tokens is not None:
        bench["tokens"] = args.tokens
    if args.chunk_size is not None:
        bench["chunk"] = args.chunk_size
    repeats = args.repeats or (1 if args.quick else 3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        (platform.processor() or platform.machine())
    print(f"device_check: {device} ({name}), torch {torch.__version__}, sizes {sizes}; "
          f"reference float64 on the CPU from the same rounded inputs"
          + ("; library calls under a meta default device" if device.type == "cpu" else ""))
    print("cells: value / gradient error divided by the tolerance (pass: <= 1); tolerances "
          + ", ".join(f"{_DTYPE_NAMES[d]} {v:g} / {g:.2g}" + (f" + {a:.2g}" if a else "")
                      for d, (v, g, a) in TOLERANCES.items()))
    print(f"bench: bfloat16, {bench['tokens']:,} tokens, V = {bench['vocab']:,}, "
          f"H = {bench['hidden']:,}, chunk_size {bench['chunk']}, best of {repeats}; "
          f"memory: added peak torch.cuda.max_memory_allocated")
    rows, problems = run_checks(device, sizes, cases, meta_default=device.type == "cpu")
    bench_rows, bench_problems = benchmark(device, bench, repeats,
                                           judge=device.type == "cuda" and not args.quick)
    rows, problems = rows + bench_rows, problems + bench_problems
    header = ("row", *(_DTYPE_NAMES[d] for d in CHECK_DTYPES), "result")
    print(format_table([header, *rows]))
    for problem in problems:
        print(f"problem: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
