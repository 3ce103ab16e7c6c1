r"""Training under the mismatch: RL and sampled-token OPD with a quantized sampler.

[opd_literate.experiment.quantized][] computes, exactly, what every correction does to *one*
gradient step of tinylm's weak students when their answers come from a low-precision copy of
the weights. This module trains them so. At every step the sampler is rebuilt from the
trainer's current weights (a weight sync every step, as a synchronous RL loop does), writes the
batch's answers and reports its log-probability of each token it wrote; the trainer, the same
weights in float32, scores those tokens with gradient, and the loss is REINFORCE with the
correction's weights over the tokens it keeps.

**The samplers** are those of [opd_literate.experiment.quantized.SAMPLERS][], applied to every
model of an [opd_literate.experiment.tinylm.EnsembleLM][] by
[opd_literate.experiment.quantized.ensemble_sampler][] (``fp32``: the trainer's own
weights, sampled position by position; its log-probabilities differ from the trainer's
teacher-forced ones by float32 rounding only, the on-policy reference).

**The loss of one model**, with $w_t$ and the kept tokens $K$ from
[opd_literate.mismatch.correction.rollout_correction][] at one of verl's presets
(``PRESETS``), or from one of ``PEER_CORRECTIONS`` (``correction_weights``), and $A_t$ the
advantage of token $t$,

$$
L = -\frac{1}{|K|} \sum_{(b, t) \in K} \mathrm{sg}(w_{b,t})\, A_{b,t}\,
\log \pi_\theta(y_{b,t} \mid s_{b,t}),
$$

[opd_literate.mismatch.correction.reinforce_loss][] with ``reduction="token-mean"``
(0 when every token is rejected). The advantage is, for ``rl``, the 0/1 reward of the whole
answer less the mean of its group (``group`` answers a prompt), as in
[opd_literate.experiment.train][]; for ``opd_sampled``, the reward
$r_t = \log \pi_T(y_t \mid s_t) - \log \pi_\theta(y_t \mid s_t)$ of
[opd_literate.opd.reverse_kl_rewards][] with the **trainer's** log-probabilities, or, in the
condition named ``sampler reward``, with the sampler's (a frequent bug). Without a correction
($w = 1$, $K$ the mask) the loss is the experiment's own ``rl`` and ``opd_sampled`` loss
(``tests/experiment/test_mismatch_training.py`` checks both). One update a batch: at the step's
weights verl's decoupled PPO loss has the ratio $\pi_\theta / \pi_{\text{old}} = 1$, its clip is
inactive, and its gradient is this one.

**Common random numbers.** Every condition and every seed draws its tokens by inverting the
sampler's CDF at the same uniform numbers (one per prompt, position and seed), from the same
prompts: two conditions whose samplers agree write the same answers, so a difference between
them is the sampler's or the correction's, not the draw's.

**What is recorded**, at every evaluation: the greedy accuracy on the test prompts of the
trainer's weights and of the sampler (the model an engine would serve), the reverse KL to the
teacher on the trainer's own samples, and, averaged over the training steps since the last
evaluation, the exact per-token $\mathrm{KL}(\mu \,\|\, \pi)$ at the states the sampler wrote
(from the full distributions, in float64) and the fraction of the answers' tokens whose weight in
the loss is not 0 (``kept_fraction``: a rejection, or IcePop's band, sets it to 0).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._numerics import (
    check_finite_number,
    check_float_tensor,
    check_same_shape,
    compute_dtype,
)
from ..mismatch.correction import (
    PRESETS,
    clip_cov_weights,
    gspo_weights,
    kpop_mask,
    reinforce_loss,
    rollout_correction,
    sapo_weights,
    trl_importance_weights,
)
from ..opd import full_vocab_reverse_kl, reverse_kl_rewards
from . import tinylm as lm
from .config import DEFAULT, QUICK, ExperimentConfig
from .ensemble import BatchedAdam
from .quantized import SAMPLERS, ensemble_sampler

__all__ = ["STUDY_METHODS", "CORRECTIONS", "PEER_CORRECTIONS", "STRONGEST_CORRECTIONS",
           "Condition", "MismatchTrainingConfig", "MISMATCH_DEFAULT", "MISMATCH_QUICK",
           "MISMATCH_STRONGEST", "conditions",
           "engine_sample", "correction_weights", "corrected_loss", "train_under_mismatch",
           "run_mismatch_training", "mismatch_summary", "format_summary"]

STUDY_METHODS = ("rl", "opd_sampled")
"""The two methods trained under the mismatch: the experiment's RL and sampled-token OPD."""

PEER_CORRECTIONS = ("trl_sequence_mask", "trl_sequence_truncate", "kpop")
r"""The corrections of other frameworks trained, at their defaults: TRL's
``vllm_importance_sampling_mode`` ``"sequence_mask"`` (its default) and ``"sequence_truncate"``
([opd_literate.mismatch.correction.trl_importance_weights][], $C_{\max} = 3$), and KPop's
rejection ([opd_literate.mismatch.correction.kpop_mask][], threshold 0.1) with weight 1 on the
tokens it keeps, as verl's rejection presets weight theirs. That is KPop's mask alone:
prime-rl's loss, and the catalogue's ``kpop``, also weight each kept token by $\rho_t$. On the
exact tinylm study the first two are the catalogue's least biased sequence weights after
``seq_is`` (``trl_sequence_truncate``) and TRL's default."""

CORRECTIONS = ("decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop",
               "decoupled_seq_is_rs", "decoupled_geo_rs", *PEER_CORRECTIONS)
"""The corrections trained: verl's presets by name
([opd_literate.mismatch.correction.PRESETS][], at verl's default thresholds), token TIS, sequence
TIS, token masking (IcePop), sequence TIS with sequence masking, geometric rejection; then
``PEER_CORRECTIONS``."""


STRONGEST_CORRECTIONS = ("kpop_is", "gspo", "clip_cov", "sapo")
r"""The corrections of the second study (``MISMATCH_STRONGEST``). ``gspo``, ``clip_cov`` and
``sapo`` are verl's policy losses of those names with the sampler as their anchor (bypass mode),
at verl's defaults but GSPO's band (the paper's $3 \cdot 10^{-4}$ and $4 \cdot 10^{-4}$, to
which verl's ``clip_ratio_low`` and ``clip_ratio_high`` must be set), as REINFORCE weights
([opd_literate.mismatch.correction.gspo_weights][], ``clip_cov_weights``, ``sapo_weights``:
REINFORCE with them has the loss's gradient). On the exact tinylm study at ``int4`` with 64
answers (baseline 0) they come first among the catalogue's estimators that ``CORRECTIONS``
does not train, with ``ppo_clip_bypass``, which ties ``clip_cov`` there to the last digit.
``kpop_is`` is KPop as prime-rl weights it: its mask
([opd_literate.mismatch.correction.kpop_mask][]) with the raw ratio $\rho_t$ on the tokens it
keeps, the catalogue's ``kpop``."""

_LOSS_WEIGHTS = {"gspo": gspo_weights, "clip_cov": clip_cov_weights, "sapo": sapo_weights}


def _check_correction(correction):
    """``"none"``, a preset of weights and rejection (not a bypass loss, not ``disabled``,
    which is ``"none"``), or one of ``PEER_CORRECTIONS`` and ``STRONGEST_CORRECTIONS``."""
    if correction == "none" or correction in PEER_CORRECTIONS + STRONGEST_CORRECTIONS:
        return
    if (not isinstance(correction, str) or correction not in PRESETS
            or "bypass_mode" in PRESETS[correction] or correction == "disabled"):
        raise ValueError(f"correction must be 'none', a decoupled preset of PRESETS (weights "
                         f"and rejection, no bypass loss) or one of "
                         f"{', '.join(PEER_CORRECTIONS + STRONGEST_CORRECTIONS)}, got "
                         f"{correction!r}")


def correction_weights(trainer_logp, sampler_logp, mask, correction, advantages=None):
    r"""The ``(weights, keep)`` of ``correction`` on ``(B, T)`` log-probabilities.

    A verl preset: [opd_literate.mismatch.correction.rollout_correction][] at its arguments
    (``"none"``: weight 1, every token kept). TRL's two sequence modes: its weights, every
    token of the mask kept (TRL multiplies the per-token loss by them and normalises by the
    completion mask, so a masked response still counts in the token mean). KPop: weight 1 on the
    tokens it keeps, which alone enter the token mean (a rejection, as verl's); ``kpop_is``:
    the ratio $\rho_t$ on them. ``gspo``, ``clip_cov`` and ``sapo``: the weights of the policy
    loss's gradient, every token of the mask kept (a clipped token has weight 0 and stays in the
    token mean, as in the loss); they read ``advantages`` ``(B, T)``, which the others ignore.

    Examples
    --------
    >>> trainer = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.9]]))
    >>> sampler = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]]))
    >>> mask = torch.ones(2, 2)
    >>> w, keep = correction_weights(trainer, sampler, mask, "trl_sequence_mask")
    >>> w.tolist(), keep.tolist()  # ratios 2 and 9: the second response is above 3
    ([[2.0, 2.0], [0.0, 0.0]], [[True, True], [True, True]])
    >>> w, keep = correction_weights(trainer, sampler, mask, "kpop")
    >>> w.tolist(), keep.tolist()  # 0.9 against 0.1 fails KPop's binary KLs; 0.5 vs 0.25 too
    ([[1.0, 1.0], [1.0, 1.0]], [[True, False], [False, True]])
    """
    _check_correction(correction)
    if correction in ("trl_sequence_mask", "trl_sequence_truncate"):
        weights, _ = trl_importance_weights(trainer_logp, sampler_logp, mask,
                                            correction.removeprefix("trl_"))
        return weights, mask.bool()
    if correction in _LOSS_WEIGHTS:
        if advantages is None:
            raise ValueError(f"correction {correction!r} needs the advantages: its weights "
                             "depend on their sign")
        return _LOSS_WEIGHTS[correction](trainer_logp, sampler_logp, advantages, mask), mask.bool()
    if correction in ("kpop", "kpop_is"):
        keep, _ = kpop_mask(trainer_logp, sampler_logp, mask)
        if correction == "kpop_is":
            # the raw ratio, uncapped (prime-rl's loss -keep A rho): verl's token IS at an
            # infinite threshold
            weights, _, _ = rollout_correction(trainer_logp, sampler_logp, mask,
                                               rollout_is="token",
                                               rollout_is_threshold=math.inf)
            return weights, keep
        # the weights in the compute dtype, as the other corrections' (float32 for half inputs)
        dtype = compute_dtype(trainer_logp, sampler_logp)
        return torch.ones_like(trainer_logp, dtype=dtype), keep
    options = {} if correction == "none" else PRESETS[correction]
    weights, keep, _ = rollout_correction(trainer_logp, sampler_logp, mask, **options)
    return weights, keep


@dataclasses.dataclass(frozen=True)
class Condition:
    """One way of training: a sampler, a correction, and which log-probs the OPD reward uses."""

    sampler: str
    """A key of [opd_literate.experiment.quantized.SAMPLERS][]."""
    correction: str = "none"
    """``"none"``, a key of ``PRESETS`` (its ``rollout_correction`` arguments) or of
    ``PEER_CORRECTIONS``."""
    reward_logp: str = "trainer"
    """``opd_sampled`` only: the reward's student log-probs, ``"trainer"`` or ``"sampler"``."""

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be a key of SAMPLERS ({', '.join(SAMPLERS)}), got "
                             f"{self.sampler!r}")
        _check_correction(self.correction)
        if self.reward_logp not in ("trainer", "sampler"):
            raise ValueError(f"reward_logp must be 'trainer' or 'sampler', got "
                             f"{self.reward_logp!r}")

    @property
    def name(self):
        """``"int4 decoupled_token_is"``, ``"int4 none, sampler reward"``."""
        text = f"{self.sampler} {self.correction}"
        return text + (", sampler reward" if self.reward_logp == "sampler" else "")


@dataclasses.dataclass(frozen=True)
class MismatchTrainingConfig:
    """The study: what every method starts from, the conditions, and the common budget."""

    experiment: ExperimentConfig = DEFAULT
    """The data, the teacher, the weak students (``seeds`` of them), ``batch_size``, ``group``."""
    levels: tuple = ("fp32", "bf16", "int8", "int4")
    """The samplers trained without a correction: the ladder of mismatch."""
    correction_level: str = "int4"
    """The sampler every correction of ``corrections`` is trained with."""
    corrections: tuple = CORRECTIONS
    """The corrections, by preset name."""
    steps: int = 600
    """Updates per condition (the same for every condition and method)."""
    lr: float = 1e-3
    """Adam's learning rate, every condition (the experiment's best for both methods)."""
    eval_every: int = 50
    """Steps between evaluations."""

    def __post_init__(self):
        if not isinstance(self.experiment, ExperimentConfig):
            raise TypeError(f"experiment must be an ExperimentConfig, got "
                            f"{type(self.experiment).__name__}")
        for level in (*self.levels, self.correction_level):
            if level not in SAMPLERS:
                raise ValueError(f"levels and correction_level must be keys of SAMPLERS "
                                 f"({', '.join(SAMPLERS)}), got {level!r}")
        if len(set(self.levels)) != len(self.levels) or not self.levels:
            raise ValueError(f"levels must be distinct and not empty, got {self.levels!r}")
        if self.levels[0] != "fp32" or self.correction_level not in self.levels:
            raise ValueError(f"levels must start with 'fp32' (the on-policy reference every "
                             f"difference is taken to) and hold correction_level "
                             f"({self.correction_level!r}), got {self.levels!r}")
        for name in self.corrections:
            if name == "none":
                raise ValueError("corrections must be presets or peer corrections; 'none' is "
                                 "trained at each level")
            _check_correction(name)
        if len(set(self.corrections)) != len(self.corrections):
            raise ValueError(f"corrections must be distinct, got {self.corrections!r}")
        for name in ("steps", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.lr, float) and 0 < self.lr < float("inf")):
            raise ValueError(f"lr must be a positive finite float, got {self.lr!r}")
        if self.experiment.batch_size % self.experiment.group:
            raise ValueError(f"the experiment's batch_size ({self.experiment.batch_size}) must "
                             f"be a multiple of its group ({self.experiment.group})")

    def as_dict(self):
        """The configuration as the results record it (``experiment`` as its own record)."""
        record = dataclasses.asdict(self)
        record["experiment"] = self.experiment.as_dict()
        for key in ("levels", "corrections"):
            record[key] = list(record[key])
        return record


MISMATCH_DEFAULT = MismatchTrainingConfig()
"""The committed study: 5 seeds, 600 steps of 64 answers, both methods."""

MISMATCH_QUICK = MismatchTrainingConfig(experiment=QUICK, steps=60, eval_every=30)
"""``--quick``: the experiment's quick students (3 seeds), 60 steps."""

MISMATCH_STRONGEST = MismatchTrainingConfig(
    levels=("fp32", "int4"),
    corrections=("decoupled_seq_is", "kpop", *STRONGEST_CORRECTIONS))
"""``--strongest``: ``STRONGEST_CORRECTIONS`` beside the uncorrected runs, sequence TIS (the
first study's best correction for RL) and KPop's mask with weight 1, at the first study's
settings, so that each new correction is paired seed by seed with those."""


def conditions(config, method):
    """The conditions of ``method``: each level without a correction, then each correction at
    ``correction_level``, then (``opd_sampled``) the sampler's log-probs in the reward."""
    if not isinstance(config, MismatchTrainingConfig):
        raise TypeError(f"config must be a MismatchTrainingConfig, got {type(config).__name__}")
    if method not in STUDY_METHODS:
        raise ValueError(f"method must be one of {', '.join(STUDY_METHODS)}, got {method!r}")
    out = [Condition(level) for level in config.levels]
    out += [Condition(config.correction_level, c) for c in config.corrections]
    if method == "opd_sampled":
        out.append(Condition(config.correction_level, "none", "sampler"))
    return out


@torch.no_grad()
def engine_sample(sampler, prompts, uniforms):
    r"""Answers written by ``sampler`` at given uniform numbers, with its log-probabilities.

    At each position the token is the inverse of the sampler's CDF at the uniform $u$:
    the smallest $v$ with $u \sum_{v'} \mu_{v'} < \sum_{v' \le v} \mu_{v'}$ (the probabilities
    of the softmax in float32, summed in float64), so a token of probability 0 is never written.

    Parameters
    ----------
    sampler : opd_literate.experiment.tinylm.EnsembleLM
        The engine (any dtype).
    prompts : torch.Tensor
        ``(M, B, L)`` long.
    uniforms : torch.Tensor
        ``(M, B, T)`` in $[0, 1)$, ``T`` the sampler's ``max_answer``.

    Returns
    -------
    tuple
        ``tokens`` ``(M, B, T)`` (``<pad>`` after ``<eos>``), ``mask``, ``sampler_logp``
        ``(M, B, T)`` float32 (0 on the padding) and ``sampler_logits`` ``(M, B, T, V)`` as the
        sampler computed them.

    Examples
    --------
    >>> _ = torch.manual_seed(0)
    >>> model = lm.EnsembleLM(1, 8, 1)
    >>> prompts = lm.make_prompts(torch.tensor([[[1, 2], [3, 4]]]))
    >>> tokens, mask, logp, logits = engine_sample(model, prompts, torch.full((1, 2, 4), 0.5))
    >>> tokens.shape, bool((logp <= 0).all()), logits.shape
    (torch.Size([1, 2, 4]), True, torch.Size([1, 2, 4, 14]))
    """
    if not isinstance(prompts, torch.Tensor) or prompts.dtype != torch.long or prompts.ndim != 3:
        raise TypeError(f"prompts must be an (M, B, L) long tensor, got "
                        f"{getattr(prompts, 'dtype', type(prompts).__name__)} of shape "
                        f"{tuple(getattr(prompts, 'shape', ()))}")
    if not (callable(sampler) and hasattr(sampler, "max_answer")
            and hasattr(sampler, "context_at")):
        raise TypeError(f"sampler must be an EnsembleLM (or a model with max_answer and "
                        f"context_at), got {type(sampler).__name__}")
    # an EnsembleLM reads token v of slot j as row j * V + v: an id outside [0, V) would read
    # another slot's row without a word
    outside = (prompts < 0) | (prompts >= lm.V)
    if bool(outside.any()):
        raise ValueError(f"prompts must hold token ids in [0, {lm.V}), got "
                         f"{int(prompts[outside][0])}")
    models = getattr(sampler, "models", prompts.shape[0])
    if prompts.shape[0] != models:
        raise ValueError(f"prompts must have one batch per model of the sampler ({models}), got "
                         f"shape {tuple(prompts.shape)}")
    if not isinstance(uniforms, torch.Tensor) or not uniforms.is_floating_point():
        raise TypeError(f"uniforms must be a floating tensor, got "
                        f"{getattr(uniforms, 'dtype', type(uniforms).__name__)}")
    if uniforms.device != prompts.device:
        raise ValueError(f"uniforms must be on the prompts' device ({prompts.device}), got "
                         f"{uniforms.device}")
    lead = prompts.shape[:-1]
    T = sampler.max_answer
    if uniforms.shape != (*lead, T):
        raise ValueError(f"uniforms must have shape {(*lead, T)}, got {tuple(uniforms.shape)}")
    if not bool(((uniforms >= 0) & (uniforms < 1)).all()):
        raise ValueError("uniforms must lie in [0, 1) (a 1 is past every token of the CDF)")
    tokens = torch.full((*lead, T), lm.PAD, dtype=torch.long, device=prompts.device)
    all_logits = []
    for t in range(T):
        context = sampler.context_at(prompts, tokens, t)
        position = torch.full(lead, t, dtype=torch.long, device=prompts.device)
        logits = sampler(context, position)  # (M, B, V) in the sampler's dtype
        if not bool(torch.isfinite(logits).all()):
            raise ValueError(f"the sampler's logits at answer position {t} are not all finite "
                             "(a NaN or inf weight?): it has no distribution to sample from")
        all_logits.append(logits)
        cdf = torch.softmax(logits.float(), -1).double().cumsum(-1)
        # the smallest v with cdf[v] > u * total: a token of probability 0 adds nothing to the
        # CDF, so it is never the first to pass (even at u = 0)
        passed = cdf <= uniforms[..., t, None].double() * cdf[..., -1:]
        tokens[..., t] = passed.sum(-1)
    logits = torch.stack(all_logits, dim=-2)
    mask = lm.answer_mask(tokens)
    tokens = torch.where(mask.bool(), tokens, torch.full_like(tokens, lm.PAD))
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
    logp = torch.where(mask.bool(), logp, torch.zeros_like(logp))
    return tokens, mask, logp, logits


def corrected_loss(trainer_logp, sampler_logp, advantages, mask, correction):
    r"""The sum over models of each model's corrected REINFORCE loss, and its kept tokens.

    ``trainer_logp``, ``sampler_logp``, ``advantages`` and ``mask`` are ``(M, B, T)``: model
    ``m``'s loss is [opd_literate.mismatch.correction.reinforce_loss][] of its ``(B, T)`` slice
    with the weights and ``keep`` of ``correction_weights``, ``reduction="token-mean"``.
    Computed in one call: each model's weights divided by its kept tokens
    (at least 1), then ``reduction="sum"``, which is the same sum.

    Returns
    -------
    tuple
        The loss (a scalar with gradient) and ``used`` ``(M, B, T)`` bool: the tokens whose
        weight in the loss is not 0 (kept, and not masked by IcePop's band).
    """
    check_float_tensor("trainer_logp", trainer_logp, 3)
    for name, tensor in (("sampler_logp", sampler_logp), ("advantages", advantages),
                         ("mask", mask)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        check_same_shape("trainer_logp", trainer_logp, name, tensor)
    M, B, T = trainer_logp.shape
    flat = {"trainer": trainer_logp.reshape(M * B, T), "sampler": sampler_logp.reshape(M * B, T),
            "mask": mask.reshape(M * B, T)}
    # "none" is the preset "disabled": weight 1, every token kept (and the inputs checked)
    weights, keep = _weights_per_model(flat, advantages.reshape(M * B, T), correction, M)
    keep = keep.reshape(M, B, T)
    kept = keep.sum((1, 2)).clamp_min(1).to(weights.dtype)  # (M,)
    scaled = weights.reshape(M, B, T) * keep / kept[:, None, None]
    loss = reinforce_loss(flat["trainer"], advantages.reshape(M * B, T), keep.reshape(M * B, T),
                          scaled.reshape(M * B, T), reduction="sum")
    return loss, keep & (weights.reshape(M, B, T) != 0)


def _weights_per_model(flat, advantages, correction, M):
    """``correction_weights`` of each model's ``(B, T)`` rows: Clip-Cov's covariance and
    eligible share are statistics of one model's batch, so the policy losses' weights are
    taken model by model; the other weights are per response, and taken at once."""
    trainer = flat["trainer"].detach()
    if correction not in _LOSS_WEIGHTS:
        return correction_weights(trainer, flat["sampler"], flat["mask"], correction)
    parts = [correction_weights(t, s, k, correction, a) for t, s, k, a in zip(
        trainer.chunk(M), flat["sampler"].chunk(M), flat["mask"].chunk(M), advantages.chunk(M))]
    return torch.cat([w for w, _ in parts]), torch.cat([k for _, k in parts])


def _advantages(method, sampler_reward, tokens, answers, trainer_logp, sampler_logp,
                teacher_logp, mask, group):
    """(M, B, T) advantages: RL's group-baselined 0/1 reward, or the OPD reward per token."""
    if method == "rl":
        reward = (tokens == answers).all(dim=-1).float()  # (M, B)
        baseline = reward.unflatten(-1, (-1, group)).mean(-1).repeat_interleave(group, dim=-1)
        return (reward - baseline)[..., None].expand_as(trainer_logp)
    # the reward's student log-probs: the sampler's for the models of the "sampler reward" bug
    student = torch.where(sampler_reward[:, None, None], sampler_logp, trainer_logp.detach())
    return torch.stack([reverse_kl_rewards(student[m], teacher_logp[m], mask[m])
                        for m in range(len(student))])


def _kl_per_model(sampler_logits, trainer_logits, mask):
    """(M,): the mean over the mask of the exact KL(mu_s || pi_s), in float64."""
    log_mu = torch.log_softmax(sampler_logits.double(), -1)
    log_pi = torch.log_softmax(trainer_logits.detach().double(), -1)
    kl = (log_mu.exp() * (log_mu - log_pi)).sum(-1)  # (M, B, T)
    kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl.sum((1, 2)) / mask.sum((1, 2)).double().clamp_min(1)


@torch.no_grad()
def _teacher_logp(teacher, prompts, tokens):
    """The teacher's log-prob of every token, scored once per distinct (prompt, answer): the
    conditions share prompts and uniforms, so most of their answers are the same."""
    rows = torch.cat([prompts, tokens], dim=-1).reshape(-1, prompts.shape[-1] + tokens.shape[-1])
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    L = prompts.shape[-1]
    logp, _ = lm.score(teacher, unique[:, :L], unique[:, L:])
    return logp[inverse].reshape(tokens.shape)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What a worker process needs: the prepared experiment and the study's configuration."""

    prepared: object
    config: MismatchTrainingConfig


def _samplers(trainer, groups):
    """One engine per sampler level, over the models of that level: ``[(index, engine)]``."""
    engines = []
    state = trainer.state_dict()
    for sampler, index in groups.items():
        subset = lm.EnsembleLM(len(index), trainer.weights[0].shape[2], len(trainer.weights) - 1,
                               trainer.embed, trainer.digits)
        subset.load_state_dict({k: v.detach()[index] for k, v in state.items()})
        engines.append((index, subset if sampler == "fp32" else ensemble_sampler(subset, sampler)))
    return engines


def _sample_all(engines, prompts, uniforms, M, T):
    device = prompts.device
    tokens = torch.empty((*prompts.shape[:-1], T), dtype=torch.long, device=device)
    # float32: the engine's log-probs and the softmax of its logits, whatever its dtype
    mask = torch.empty(tokens.shape, dtype=torch.float32, device=device)
    logp = torch.empty(tokens.shape, dtype=torch.float32, device=device)
    logits = torch.empty((*tokens.shape, lm.V), dtype=torch.float32, device=device)
    for index, engine in engines:
        t, k, p, z = engine_sample(engine, prompts[index], uniforms[index])
        tokens[index], mask[index], logp[index], logits[index] = t, k, p, z.float()
    return tokens, mask, logp, logits


def _models_by(conds, seeds, field):
    """``{value: model indices}`` of the conditions grouped by one of their fields (model
    ``c * seeds + s`` is seed ``s`` of condition ``c``), in the order the values first appear."""
    index = {}
    for c, condition in enumerate(conds):
        index.setdefault(getattr(condition, field), []).extend(range(c * seeds, (c + 1) * seeds))
    # CPU by design: the experiment runs on the CPU (these index the models)
    return {value: torch.tensor(models) for value, models in index.items()}


def train_under_mismatch(method, run, bar=None):
    """Train every condition of ``method`` for every seed, as one batched model.

    Model ``m = c * seeds + s`` is seed ``s`` under condition ``c`` of
    [opd_literate.experiment.mismatch_training.conditions][]. Every condition starts from the
    same weak students, sees the same prompts and draws at the same uniforms. Returns
    ``{"samples": [...], condition name: {curve: [per seed]}}`` with the curves ``accuracy``,
    ``sampler_accuracy``, ``reverse_kl`` (at each evaluation), ``mismatch_kl`` and
    ``kept_fraction`` (the mean over the steps up to each evaluation, None at step 0).
    """
    if method not in STUDY_METHODS:
        raise ValueError(f"method must be one of {', '.join(STUDY_METHODS)}, got {method!r}")
    if not isinstance(run, _Run):
        raise TypeError(f"run must be a _Run(prepared, config) of this module, got "
                        f"{type(run).__name__}")
    if not isinstance(run.config, MismatchTrainingConfig):
        raise TypeError(f"run.config must be a MismatchTrainingConfig, got "
                        f"{type(run.config).__name__}")
    if bar is not None and not callable(getattr(bar, "update", None)):
        raise TypeError(f"bar must be None or have an update(n) method, got {type(bar).__name__}")
    prepared, config = run.prepared, run.config
    ex = config.experiment
    S, B = ex.seeds, ex.batch_size
    conds = conditions(config, method)
    C = len(conds)
    M = C * S
    teacher = lm.EnsembleLM.from_models([prepared.teacher]).requires_grad_(False)
    trainer = lm.EnsembleLM(M, ex.student_hidden, ex.student_layers, digits=ex.digits)
    trainer.load_state_dict({k: v.repeat(C, *[1] * (v.ndim - 1))
                             for k, v in prepared.student_state.items()})
    optimizer = BatchedAdam(trainer.parameters(), [config.lr] * M)
    warmup = max(ex.warmup_steps, 1)
    groups = _models_by(conds, S, "sampler")
    by_correction = _models_by(conds, S, "correction")
    # CPU by design: the experiment runs on the CPU
    sampler_reward = torch.tensor([cond.reward_logp == "sampler" for cond in conds
                                   for _ in range(S)])
    # CPU by design: the experiment runs on the CPU
    prompt_gen = torch.Generator().manual_seed(ex.stream_seed(0, 30))
    uniform_gen = torch.Generator().manual_seed(ex.stream_seed(0, 31))  # CPU by design (above)
    eval_gen_seed = ex.stream_seed(0, 32)
    T = trainer.max_answer
    test_prompts = lm.make_prompts(prepared.test_pairs, ex.digits).expand(M, -1, -1)
    test_answers = lm.answer_tokens(prepared.test_pairs, ex.digits)
    names = [cond.name for cond in conds]
    curves = {n: {k: [[] for _ in range(S)] for k in ("accuracy", "sampler_accuracy",
                                                      "reverse_kl", "mismatch_kl",
                                                      "kept_fraction")} for n in names}
    samples = [0]
    # CPU by design: the experiment runs on the CPU
    since = {"kl": torch.zeros(M, dtype=torch.float64), "kept": torch.zeros(M, dtype=torch.float64),
             "steps": 0}

    def log():
        engines = _samplers(trainer, groups)
        with torch.no_grad():
            greedy, _ = lm.sample_tokens(trainer, test_prompts, greedy=True)
            accuracy = (greedy == test_answers).all(-1).float().mean(-1)
            sampler_accuracy = torch.empty(M)  # CPU by design: the experiment runs on the CPU
            for index, engine in engines:
                tokens, _ = lm.sample_tokens(engine, test_prompts[index], greedy=True)
                sampler_accuracy[index] = (tokens == test_answers).all(-1).float().mean(-1)
            # CPU by design: the experiment runs on the CPU
            out = lm.rollout(trainer, test_prompts, torch.Generator().manual_seed(eval_gen_seed))
            _, teacher_logits = lm.score(teacher, test_prompts, out.tokens)
            reverse_kl = [float(full_vocab_reverse_kl(out.logits[m], teacher_logits[m],
                                                      out.mask[m])) for m in range(M)]
        steps = since["steps"]
        for c, name in enumerate(names):
            for s in range(S):
                m = c * S + s
                record = curves[name]
                record["accuracy"][s].append(float(accuracy[m]))
                record["sampler_accuracy"][s].append(float(sampler_accuracy[m]))
                record["reverse_kl"][s].append(reverse_kl[m])
                record["mismatch_kl"][s].append(float(since["kl"][m] / steps) if steps else None)
                record["kept_fraction"][s].append(float(since["kept"][m] / steps)
                                                  if steps else None)
        since["kl"].zero_()
        since["kept"].zero_()
        since["steps"] = 0

    log()
    for step in range(1, config.steps + 1):
        # CPU by design: the experiment runs on the CPU
        idx = torch.randint(0, len(prepared.train_pairs), (S, B), generator=prompt_gen)
        pairs = prepared.train_pairs[idx]
        if method == "rl":  # B / group prompts, group answers each
            pairs = pairs[:, : B // ex.group].repeat_interleave(ex.group, dim=1)
        pairs = pairs.repeat(C, 1, 1)  # (M, B, 2): every condition, the same prompts
        prompts = lm.make_prompts(pairs, ex.digits)
        # CPU by design: the experiment runs on the CPU
        uniforms = torch.rand((S, B, T), generator=uniform_gen).repeat(C, 1, 1)  # CPU by design
        engines = _samplers(trainer, groups)
        tokens, mask, sampler_logp, sampler_logits = _sample_all(engines, prompts, uniforms, M, T)
        trainer_logits = trainer.logits(prompts, tokens)
        trainer_logp = lm.token_logp(trainer_logits, tokens)
        teacher_logp = None
        if method == "opd_sampled":
            teacher_logp = _teacher_logp(teacher, prompts, tokens)
        advantages = _advantages(method, sampler_reward, tokens, lm.answer_tokens(pairs, ex.digits),
                                 trainer_logp, sampler_logp, teacher_logp, mask, ex.group)
        loss = 0.0
        used = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
        for correction, index in by_correction.items():
            part, used[index] = corrected_loss(trainer_logp[index], sampler_logp[index],
                                               advantages[index], mask[index], correction)
            loss = loss + part
        optimizer.zero_grad()
        loss.backward()
        optimizer.step(min(1.0, step / warmup))
        since["kl"] += _kl_per_model(sampler_logits, trainer_logits, mask)
        since["kept"] += (used.sum((1, 2)) / mask.sum((1, 2))).double()
        since["steps"] += 1
        if bar is not None:
            bar.update(1)
        if step % config.eval_every == 0 or step == config.steps:
            samples.append(step * B)
            log()
    return {"samples": samples, "conditions": names, **curves}


def run_mismatch_training(config=MISMATCH_DEFAULT, progress=True, workers=1, cache="read"):
    """The study: both methods under every condition; the ``results.json`` dictionary.

    The teacher, the data and the weak students are those of
    [opd_literate.experiment.run.prepare][] for ``config.experiment`` (``cache``: how the teacher's
    cache file is used). Every training process runs on one CPU thread; ``workers`` processes
    train the two methods side by side (the numbers do not depend on it). Returns ``config``,
    the teacher's test accuracy, ``methods`` ``{method: the curves of}``
    [opd_literate.experiment.mismatch_training.train_under_mismatch][] and ``run`` (how it was
    executed: workers, CPUs, wall seconds).
    """
    import contextlib
    import time

    from ._workers import available_cpus, progress_bar, train_in_workers
    from .run import prepare

    if not isinstance(config, MismatchTrainingConfig):
        raise TypeError(f"config must be a MismatchTrainingConfig, got {type(config).__name__}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {type(progress).__name__}")
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prepared = prepare(config.experiment, cache)
        teacher_accuracy = lm.greedy_accuracy(prepared.teacher, prepared.test_pairs)
        run = _Run(prepared, config)
        workers = min(workers, len(STUDY_METHODS))
        bar = progress_bar(len(STUDY_METHODS) * config.steps, progress)
        methods = {}
        try:
            if workers == 1:
                for method in STUDY_METHODS:
                    methods[method] = train_under_mismatch(method, run, bar)
            else:
                with contextlib.closing(train_in_workers(STUDY_METHODS, run, workers, bar,
                                                         train=train_under_mismatch)) as trained:
                    for method, runs in trained:
                        methods[method] = runs
        finally:
            bar.close()
    finally:
        torch.set_num_threads(threads)
    return {"config": config.as_dict(), "teacher_accuracy": teacher_accuracy,
            "methods": {method: methods[method] for method in STUDY_METHODS},
            "run": {"workers": workers, "cpus": available_cpus(),
                    "wall_seconds": round(time.perf_counter() - started, 1)}}


# ---------------------------------------------------------------------------------------------
# The statistics: pure functions of the results dictionary (the docs build uses them)
# ---------------------------------------------------------------------------------------------
def _stat(values):
    from .stats import bootstrap_interval

    low, high = bootstrap_interval(values)
    return dict(mean=sum(values) / len(values), low=low, high=high, per_seed=list(values))


_CURVES = {"accuracy": (0.0, 1.0), "sampler_accuracy": (0.0, 1.0),
           "reverse_kl": (-math.inf, math.inf), "mismatch_kl": (0.0, math.inf),
           "kept_fraction": (0.0, 1.0)}
"""The curves of a condition and the range of their values (the KLs: any finite number for the
teacher's, >= 0 for the exact one)."""


def _numbers(label, values, length, low=-math.inf, high=math.inf, start=0):
    """``values`` as a list of ``length`` entries, finite real numbers in [low, high] from index
    ``start`` on, or a named error (plain Python: this module loads no numpy)."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{label} must be a list of numbers, got {type(values).__name__}")
    if len(values) != length:
        raise ValueError(f"{label} must have {length} entries (one per evaluation), got "
                         f"{len(values)}")
    for i, v in enumerate(values[start:], start):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{label} must hold real numbers (None at step 0 only), got {v!r} at "
                            f"index {i}")
        if not math.isfinite(v) or not low <= v <= high:
            raise ValueError(f"{label} must hold finite numbers in [{low}, {high}], got {v!r} at "
                             f"index {i}")
    return list(values)


def _check_record(results):
    """Raise unless ``results`` is a record mismatch_summary can read (see there)."""
    if not isinstance(results, dict) or "methods" not in results or "config" not in results:
        raise ValueError("results must be a record of run_mismatch_training (with 'config' and "
                         "'methods')")
    if not isinstance(results["config"], dict) or not isinstance(results["methods"], dict):
        raise TypeError("results['config'] and results['methods'] must be dicts")
    level = results["config"].get("correction_level")
    if level not in SAMPLERS:
        raise ValueError(f"results['config']['correction_level'] must be a key of SAMPLERS, "
                         f"got {level!r}")
    for method, runs in results["methods"].items():
        where = f"methods[{method!r}]"
        if not isinstance(runs, dict) or "samples" not in runs or "conditions" not in runs:
            raise ValueError(f"{where} must have 'samples' and 'conditions'")
        samples = runs["samples"]
        if not isinstance(samples, (list, tuple)) or len(samples) < 2:
            raise ValueError(f"{where}['samples'] must list step 0 and one evaluation at least, "
                             f"got {samples!r}")
        samples = _numbers(f"{where}['samples']", samples, len(samples), low=0.0)
        if any(b <= a for a, b in zip(samples[:-1], samples[1:])):
            raise ValueError(f"{where}['samples'] must increase (an evaluation covers at least "
                             f"one step), got {samples!r}")
        names = runs["conditions"]
        if not isinstance(names, (list, tuple)) or f"{level} none" not in names:
            raise ValueError(f"{where}['conditions'] must be a list of condition names with "
                             f"{level + ' none'!r} (the uncorrected run) among them, got "
                             f"{names!r}")
        missing = [n for n in names if n not in runs]
        if missing:
            raise ValueError(f"{where} has no curves for the conditions {missing!r}")
        seeds = None
        for name in names:
            for key, (low, high) in _CURVES.items():
                label = f"{where}[{name!r}][{key!r}]"
                curves = runs[name].get(key) if isinstance(runs[name], dict) else None
                if not isinstance(curves, (list, tuple)) or not curves:
                    raise ValueError(f"{label} must be a list of curves, one a seed, got "
                                     f"{curves!r}")
                seeds = len(curves) if seeds is None else seeds
                if len(curves) != seeds:
                    raise ValueError(f"{label} must have one curve per seed ({seeds}, as every "
                                     f"condition: the seeds are paired), got {len(curves)}")
                # the averages over steps have no value at step 0 (None): from evaluation 1
                start = int(key in ("mismatch_kl", "kept_fraction"))
                for s, curve in enumerate(curves):
                    _numbers(f"{label}[{s}]", curve, len(samples), low, high, start)


def mismatch_summary(results):
    r"""Per method, per condition: each statistic as its mean over seeds with the 95%
    percentile-bootstrap interval of [opd_literate.experiment.stats.bootstrap_interval][].

    ``final_accuracy`` and ``final_sampler_accuracy`` (greedy, test prompts, last evaluation),
    ``final_reverse_kl``, ``difference`` (the final accuracy less that of the first condition,
    ``fp32`` without correction, seed by seed: the seeds are paired, the same students, prompts
    and uniforms), ``against_uncorrected`` and ``sampler_against_uncorrected`` (the final
    accuracy of the trainer's weights, and of the sampler's model, less that of the uncorrected
    run at ``correction_level``, seed by seed), ``mismatch_kl`` and ``kept_fraction`` (each
    seed's mean over the training steps: each evaluation's value is the mean over the steps
    since the last one, weighted here by their number).

    Returns ``{method: [row per condition]}``, each row ``{"name", statistic: {"mean", "low",
    "high", "per_seed"}}``.

    ``results`` is checked first: ``config['correction_level']`` a key of ``SAMPLERS``; per
    method, ``samples`` increasing (two entries at least: step 0 and one evaluation), every
    name of ``conditions`` a key, ``"<correction_level> none"`` among them; and every curve
    one finite number per seed (the same seeds everywhere) and evaluation (``mismatch_kl``,
    ``>= 0``, and ``kept_fraction`` from the first evaluation after step 0), the accuracies and
    ``kept_fraction`` in [0, 1]. Anything else is a ``ValueError`` or ``TypeError`` naming the
    entry: the seeds are paired by position, so a missing seed would drop its partner silently.
    """
    _check_record(results)
    table = {}
    uncorrected_name = f"{results['config']['correction_level']} none"
    for method, runs in results["methods"].items():
        reference = runs[runs["conditions"][0]]["accuracy"]
        uncorrected = runs[uncorrected_name]
        # the training steps each evaluation averages over (samples / batch, differenced)
        steps = [b - a for a, b in zip(runs["samples"][:-1], runs["samples"][1:])]
        rows = []
        for name in runs["conditions"]:
            curves = runs[name]

            def over_training(key, curves=curves, steps=steps):
                return [sum(n * v for n, v in zip(steps, seed[1:])) / sum(steps)
                        for seed in curves[key]]

            def against(key, curves=curves, uncorrected=uncorrected):
                return _stat([a[-1] - r[-1] for a, r in zip(curves[key], uncorrected[key])])

            rows.append(dict(
                name=name,
                final_accuracy=_stat([a[-1] for a in curves["accuracy"]]),
                final_sampler_accuracy=_stat([a[-1] for a in curves["sampler_accuracy"]]),
                final_reverse_kl=_stat([a[-1] for a in curves["reverse_kl"]]),
                difference=_stat([a[-1] - r[-1] for a, r in zip(curves["accuracy"], reference)]),
                against_uncorrected=against("accuracy"),
                sampler_against_uncorrected=against("sampler_accuracy"),
                mismatch_kl=_stat(over_training("mismatch_kl")),
                kept_fraction=_stat(over_training("kept_fraction"))))
        table[method] = rows
    return table


def format_summary(results):
    """The summary as text: a table per method (``results`` checked as by
    [opd_literate.experiment.mismatch_training.mismatch_summary][], and ``teacher_accuracy``
    a number in [0, 1])."""
    check_finite_number("teacher_accuracy", results.get("teacher_accuracy")
                        if isinstance(results, dict) else None, low=0.0, high=1.0)
    lines = [f"teacher accuracy {results['teacher_accuracy']:.3f}"]
    for method, rows in mismatch_summary(results).items():
        lines += ["", f"{method}: final greedy accuracy (trainer, sampler), its difference to "
                  "fp32, per-token KL(sampler || trainer), kept tokens; mean [95% interval]",
                  f"{'condition':34s} {'trainer':>20s} {'sampler':>20s} {'vs fp32':>22s} "
                  f"{'KL':>9s} {'kept':>6s}"]
        for row in rows:
            def cell(stat, digits=3):
                return f"{stat['mean']:.{digits}f} [{stat['low']:.{digits}f}, " \
                       f"{stat['high']:.{digits}f}]"
            lines.append(f"{row['name']:34s} {cell(row['final_accuracy']):>20s} "
                         f"{cell(row['final_sampler_accuracy']):>20s} "
                         f"{cell(row['difference']):>22s} {row['mismatch_kl']['mean']:9.2e} "
                         f"{row['kept_fraction']['mean']:6.3f}")
    return "\n".join(lines)
