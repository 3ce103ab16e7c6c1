r"""Every answer of tinylm, enumerated: exact expectations over a model's own answers.

tinylm answers a prompt with at most ``max_answer`` tokens (4 for two-digit operands) from a
vocabulary of $V = 14$, the last of them ``<eos>`` unless the answer fills every position. A
model's answer distribution is therefore a finite tree: the **states** (prefixes) at answer
position $t$ are the $(V - 1)^t$ sequences of $t$ tokens none of which is ``<eos>`` (after
``<eos>`` nothing more is written), $1 + 13 + 169 + 2197 = 2380$ states per prompt in all. The
probability that a model $\pi$ reaches the state $y_{<t}$ is the product of its conditional
probabilities along the way,

$$
P_\pi(y_{<t}) = \prod_{s < t} \pi(y_s \mid x, y_{<s}),
$$

and for each $t$ these probabilities sum to the probability that the answer is still going at
position $t$. Any expectation over the model's own answers of a per-position quantity $f$
(what a sampled rollout estimates) is then an exact sum over the states,
$\mathbb{E}_\pi\bigl[\sum_t f(x, y_{<t})\bigr] = \sum_{t, y_{<t}} P_\pi(y_{<t})\, f(x, y_{<t})$.

:func:`answer_states` lists the states of some prompts (independent of any model), and
:func:`reach_log_probs` their log-probabilities under a model. Every function checks its
arguments: prompts a ``(B, L)`` long tensor, states the dict of :func:`answer_states` (its keys,
dtypes and lengths, and prompt indices that exist), logits floating (an integer tensor is a
``TypeError``, not torch's ``NotImplementedError`` from inside the softmax), of the states'
length, with no NaN or $+\infty$ (a ``-inf`` logit is a token of probability 0, a row of them
is refused); half precision is computed in float32.
"""

from __future__ import annotations

import math

import torch

from .._numerics import check_float_tensor, compute_dtype
from .tinylm import EOS, PAD, V

__all__ = ["STATE_KEYS", "answer_states", "state_contexts", "state_logits", "reach_log_probs",
           "clamp_study_on_tinylm", "CLAMP_STUDY_KEYS", "clamp_study_record"]


STATE_KEYS = ("prompt", "position", "prefix", "parent", "token")
"""The keys of :func:`answer_states`' dict."""


def _check_prompts(prompts):
    if not isinstance(prompts, torch.Tensor) or prompts.dtype != torch.long or prompts.ndim != 2:
        raise TypeError(f"prompts must be a (B, L) long tensor, got "
                        f"{getattr(prompts, 'dtype', type(prompts).__name__)} of shape "
                        f"{tuple(getattr(prompts, 'shape', ()))}")


def _check_states(states, prompts=None):
    """Raise unless ``states`` looks like :func:`answer_states`' dict (of ``prompts``)."""
    if not isinstance(states, dict):
        raise TypeError(f"states must be the dict of answer_states, got {type(states).__name__}")
    missing = [key for key in STATE_KEYS if key not in states]
    if missing:
        raise ValueError(f"states is missing the keys {missing}; build it with answer_states")
    for key in STATE_KEYS:
        value = states[key]
        if not isinstance(value, torch.Tensor) or value.dtype != torch.long:
            raise TypeError(f"states[{key!r}] must be a long tensor, got "
                            f"{getattr(value, 'dtype', type(value).__name__)}")
    if states["prompt"].ndim != 1 or states["prompt"].shape[0] < 1:
        raise ValueError(f"states['prompt'] must have shape (N,) with N >= 1 states, got "
                         f"{tuple(states['prompt'].shape)}")
    N = states["prompt"].shape[0]
    for key in STATE_KEYS[1:]:
        ndim, want = (2, f"({N}, T)") if key == "prefix" else (1, f"({N},)")
        if states[key].ndim != ndim or states[key].shape[0] != N:
            raise ValueError(f"states[{key!r}] must have shape {want} like states['prompt'], "
                             f"got {tuple(states[key].shape)}")
    if bool((states["position"] < 0).any()) or bool(
            (states["position"] >= states["prefix"].shape[-1]).any()):
        raise ValueError(f"states['position'] must lie in [0, {states['prefix'].shape[-1]})")
    if bool((states["parent"] >= torch.arange(N, device=states["parent"].device)).any()) or bool(
            (states["parent"] < -1).any()):
        raise ValueError("states['parent'] must index an earlier state (or be -1 at the root)")
    if bool(((states["parent"] == -1) != (states["position"] == 0)).any()):
        raise ValueError("states['parent'] must be -1 exactly at the states of position 0")
    child = states["parent"] >= 0
    parents = states["parent"][child]
    if bool((states["position"][parents] != states["position"][child] - 1).any()) or bool(
            (states["prompt"][parents] != states["prompt"][child]).any()):
        raise ValueError("states['parent'] must be a state of the same prompt one position "
                         "earlier")
    if prompts is not None and bool(((states["prompt"] < 0)
                                     | (states["prompt"] >= prompts.shape[0])).any()):
        raise ValueError(f"states['prompt'] must index the {prompts.shape[0]} prompts")
    return N


def answer_states(prompts, max_answer=4, vocab=V, eos=EOS):
    r"""Every state of the answers to ``prompts``, level by level.

    Parameters
    ----------
    prompts : torch.Tensor
        ``(B, L)`` long, from [opd_literate.experiment.tinylm.make_prompts][].
    max_answer : int
        The answer positions (a model's ``max_answer``).
    vocab, eos : int
        The vocabulary size and the token that ends an answer: tinylm's $V = 14$ and
        ``<eos>`` by default (another enumerable model, such as the autoregressive toy of
        [opd_literate.mismatch.toy.make_ar_toy][], has its own). A state's children are the
        ``vocab - 1`` tokens other than ``eos``.

    Returns
    -------
    dict
        ``prompt`` ``(N,)`` the index of each state's prompt; ``position`` ``(N,)`` its answer
        position $t$; ``prefix`` ``(N, max_answer)`` the $t$ tokens written, then ``<pad>``;
        ``parent`` ``(N,)`` the index of the state one token earlier (-1 at $t = 0$) and
        ``token`` ``(N,)`` the token that led from it (``<pad>`` at $t = 0$). States are in
        order of position, so every parent comes before its children.

    Examples
    --------
    >>> from opd_literate.experiment.tinylm import make_prompts
    >>> states = answer_states(make_prompts(torch.tensor([[1, 2], [3, 4]])))
    >>> len(states["prompt"]), int((states["position"] == 3).sum())  # 2 * 2380, 2 * 13**3
    (4760, 4394)
    """
    _check_prompts(prompts)
    if isinstance(max_answer, bool) or not isinstance(max_answer, int) or max_answer < 1:
        raise ValueError(f"max_answer must be an integer >= 1, got {max_answer!r}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise ValueError(f"vocab must be an integer >= 2, got {vocab!r}")
    if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab:
        raise ValueError(f"eos must be a token id in [0, {vocab}), got {eos!r}")
    device = prompts.device
    B = prompts.shape[0]
    continuing = torch.tensor([v for v in range(vocab) if v != eos], device=device)  # 13 for tinylm
    prompt = torch.arange(B, device=device)
    prefix = torch.full((B, max_answer), PAD, dtype=torch.long, device=device)
    parent = torch.full((B,), -1, dtype=torch.long, device=device)
    token = torch.full((B,), PAD, dtype=torch.long, device=device)
    levels = [dict(prompt=prompt, prefix=prefix, parent=parent, token=token)]
    offset = 0
    for t in range(1, max_answer):
        previous = levels[-1]
        n = len(previous["prompt"])
        # each state of level t - 1 has one child per token that is not <eos>
        child_prefix = previous["prefix"].repeat_interleave(len(continuing), dim=0)
        child_token = continuing.repeat(n)
        child_prefix[:, t - 1] = child_token
        levels.append(dict(
            prompt=previous["prompt"].repeat_interleave(len(continuing)),
            prefix=child_prefix,
            parent=offset + torch.arange(n, device=device).repeat_interleave(len(continuing)),
            token=child_token,
        ))
        offset += n
    out = {key: torch.cat([level[key] for level in levels]) for key in levels[0]}
    out["position"] = torch.cat([torch.full((len(level["prompt"]),), t, dtype=torch.long,
                                            device=device) for t, level in enumerate(levels)])
    return out


def state_contexts(model, prompts, states):
    """The context window ``(N, L + T - 1)`` of every state, as ``model.context_at`` writes it:
    with ``states["position"]``, the input of ``model(contexts, positions)``."""
    _check_prompts(prompts)
    _check_states(states, prompts)
    contexts = torch.empty((len(states["prompt"]), prompts.shape[1] + states["prefix"].shape[1]
                            - 1), dtype=torch.long, device=prompts.device)
    for t in range(states["prefix"].shape[1]):
        rows = states["position"] == t
        contexts[rows] = model.context_at(prompts[states["prompt"][rows]],
                                          states["prefix"][rows], t)
    return contexts


@torch.no_grad()
def state_logits(model, prompts, states):
    """The model's logits ``(N, V)`` at every state (``(M, N, V)`` for an ensemble of ``M``)."""
    contexts = state_contexts(model, prompts, states)
    models = getattr(model, "models", None)
    if models is None:
        return model(contexts, states["position"])
    return model(contexts.expand(models, *contexts.shape),
                 states["position"].expand(models, -1))


def reach_log_probs(logits, states):
    r"""$\log P_\pi$ of every state, from the model's logits at every state.

    Parameters
    ----------
    logits : torch.Tensor
        ``(..., N, V)`` from :func:`state_logits`.
    states : dict
        From :func:`answer_states`.

    Returns
    -------
    torch.Tensor
        ``(..., N)``: 0 at $t = 0$, then the parent's value plus the log-probability of the
        token that leads to the state.

    Examples
    --------
    At each position the states' probabilities sum to the probability that the answer has not
    ended: 1 at $t = 0$, then 1 minus the mass of ``<eos>`` so far.

    >>> from opd_literate.experiment.tinylm import TinyLM, make_prompts
    >>> _ = torch.manual_seed(0)
    >>> model, prompts = TinyLM(), make_prompts(torch.tensor([[1, 2]]))
    >>> states = answer_states(prompts)
    >>> logits = state_logits(model, prompts, states)
    >>> reach = reach_log_probs(logits, states).exp()
    >>> log_p = torch.log_softmax(logits, -1)
    >>> ended_at_1 = float(log_p[0, EOS].exp())  # the root's <eos>
    >>> round(float(reach[states["position"] == 1].sum()), 6) == round(1 - ended_at_1, 6)
    True
    """
    N = _check_states(states)
    check_float_tensor("logits", logits, None)
    if logits.ndim < 2 or logits.shape[-2] != N or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., N, V) with N = {N} states and V >= 1, "
                         f"got {tuple(logits.shape)}")
    if bool(logits.isnan().any()) or bool((logits == math.inf).any()):
        raise ValueError("logits must be finite or -inf (no NaN, no +inf)")
    if bool((logits == -math.inf).all(-1).any()):
        raise ValueError("logits must not be -inf at every token of a state (its softmax is NaN)")
    if bool((states["token"][states["position"] > 0] >= logits.shape[-1]).any()) or bool(
            (states["token"][states["position"] > 0] < 0).any()):
        raise ValueError(f"states['token'] must be token ids in [0, V) = [0, {logits.shape[-1]})")
    log_p = torch.log_softmax(logits.to(compute_dtype(logits)), -1)
    reach = torch.zeros(logits.shape[:-1], dtype=log_p.dtype, device=logits.device)
    for t in range(1, int(states["position"].max()) + 1):
        rows = torch.nonzero(states["position"] == t).squeeze(-1)
        parents = states["parent"][rows]
        step = log_p[..., parents, :].gather(
            -1, states["token"][rows].expand(*log_p.shape[:-2], -1)[..., None])[..., 0]
        reach[..., rows] = reach[..., parents] + step
    return reach


def _check_ks(ks, vocab=V):
    if isinstance(ks, (str, bytes)) or not hasattr(ks, "__iter__"):
        raise TypeError(f"ks must be a sequence of report sizes, got {type(ks).__name__} {ks!r}")
    ks = list(ks)
    if not ks:
        raise ValueError("ks must not be empty")
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
            raise ValueError(f"every k must be an integer in [1, V] = [1, {vocab}], got {k!r}")
    return ks


def _tinylm_states(prepared, prompts):
    """The teacher's and the weak students' logits at every state of the first ``prompts`` test
    prompts, and each student's probability of reaching each state (float64)."""
    from .tinylm import EnsembleLM, make_prompts

    for name in ("config", "test_pairs", "teacher", "student_state"):
        if not hasattr(prepared, name):
            raise TypeError(f"prepared must be the Prepared of run.prepare (with .{name}), got "
                            f"{type(prepared).__name__}")
    available = len(prepared.test_pairs)
    if isinstance(prompts, bool) or not isinstance(prompts, int) or not 1 <= prompts <= available:
        raise ValueError(f"prompts must be an integer in [1, {available}] (the test prompts), "
                         f"got {prompts!r}")
    config = prepared.config
    prompt_ids = make_prompts(prepared.test_pairs[:prompts], config.digits)
    states = answer_states(prompt_ids, prepared.teacher.max_answer)
    teacher = state_logits(prepared.teacher, prompt_ids, states).double()
    students = EnsembleLM(config.seeds, config.student_hidden, config.student_layers,
                          digits=config.digits)
    students.load_state_dict(prepared.student_state)
    student_logits = state_logits(students, prompt_ids, states).double()  # (seeds, N, V)
    return teacher, student_logits, reach_log_probs(student_logits, states).exp()


def _studies(teacher, student_logits, reach, ks, settings):
    from ..large_vocab.clamps import weighted_clamp_study

    return [[{"seed": seed, **row}
             for seed in range(student_logits.shape[0])
             for row in weighted_clamp_study(student_logits[seed], teacher, reach[seed], ks,
                                             **clamps)]
            for clamps in settings]


def clamp_study_on_tinylm(prepared, prompts=200, ks=(1, 2, 4, 8), *, log_prob_min_clamp=None,
                          loss_max_clamp=None):
    r"""verl's clamped top-$k$ forward KL, on the experiment's teacher against its students.

    For the first ``prompts`` test prompts, every state of every weak student's own answers
    (the states on-policy distillation samples), weighted by the student's probability of
    reaching it: [opd_literate.large_vocab.clamps.weighted_clamp_study][] with the teacher's
    top-$k$ report at each state. Exact: no answer is sampled.

    Parameters
    ----------
    prepared : opd_literate.experiment.train.Prepared
        From [opd_literate.experiment.run.prepare][]: the teacher and the students' initial
        weights.
    prompts : int
        How many test prompts, at most ``len(prepared.test_pairs)``.
    ks : sequence of int
        Report sizes, at most $V = 14$ (the top-32 of the config verl's trainer composes, and
        the dataclass's top-128, would report the whole vocabulary).
    log_prob_min_clamp, loss_max_clamp : float or None
        verl's clamps; by default none, as in the config verl's trainer composes
        (``clamps.VERL_LOG_PROB_MIN_CLAMP``, ``clamps.VERL_LOSS_MAX_CLAMP``).

    Returns
    -------
    list of dict
        One row per (student seed, k): ``seed`` and the keys of ``weighted_clamp_study``.
    """
    ks = _check_ks(ks)
    states = _tinylm_states(prepared, prompts)
    return _studies(*states, ks, [dict(log_prob_min_clamp=log_prob_min_clamp,
                                       loss_max_clamp=loss_max_clamp)])[0]


CLAMP_STUDY_KEYS = ("seed", "held_out", "val_prompts", "teacher_hidden", "teacher_layers",
                    "teacher_steps", "teacher_batch", "pretrain_lr", "teacher_label_smoothing",
                    "seeds", "student_hidden", "student_layers", "student_pretrain_steps",
                    "student_pretrain_batch", "digits")
"""The settings of an experiment configuration that shape the teacher, the weak students and
the test prompts of :func:`clamp_study_on_tinylm`."""


def clamp_study_record(config, prompts=200, ks=(1, 2, 4, 8), cache="read"):
    r"""``clamp_study.json``: :func:`clamp_study_on_tinylm` with the settings it came from.

    ``rows`` are computed with the clamps of the config verl's trainer composes (none but the
    $\max(\cdot, 0)$: ``clamps``), ``dataclass_rows`` with the ``DistillationLossConfig``
    dataclass's clamps switched on (``dataclass_clamps``: $c = -10$, $M = 10$), on the same
    states. Written by ``python -m opd_literate.experiment --clamp-study --out
    docs/data/experiment`` (about two minutes on 2 cores: the students' pretraining, the teacher
    from its cache, then the exact sums); the docs build reads it.
    """
    from ..large_vocab import clamps as verl_clamps
    from .run import prepare

    ks = _check_ks(ks)
    stock = {"log_prob_min_clamp": verl_clamps.VERL_LOG_PROB_MIN_CLAMP,
             "loss_max_clamp": verl_clamps.VERL_LOSS_MAX_CLAMP}
    dataclass = {"log_prob_min_clamp": verl_clamps.DATACLASS_LOG_PROB_MIN_CLAMP,
                 "loss_max_clamp": verl_clamps.DATACLASS_LOSS_MAX_CLAMP}
    rows, dataclass_rows = _studies(*_tinylm_states(prepare(config, cache), prompts), ks,
                                    [stock, dataclass])
    return {"config": {k: getattr(config, k) for k in CLAMP_STUDY_KEYS}, "prompts": prompts,
            "ks": list(ks), "clamps": stock, "rows": rows, "dataclass_clamps": dataclass,
            "dataclass_rows": dataclass_rows}
