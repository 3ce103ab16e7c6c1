r"""Training one method: its loss, one update, and the loop that evaluates as it goes.

Read top to bottom: what the loop starts from ([opd_literate.experiment.train.Prepared][], made
by [opd_literate.experiment.run.prepare][]), the loss of each method, one update of every
student, the evaluation, and the loop ([opd_literate.experiment.train.train_method][]).

* ``opd_sampled``: the student samples, the teacher scores the sampled tokens, and the loss is
  [opd_literate.opd.opd_pg_loss][] of [opd_literate.opd.reverse_kl_rewards][] (lab Tasks 1-2).
* ``opd_full_vocab``: [opd_literate.opd.full_vocab_reverse_kl][] at the states the student
  visited (lab Task 3).
* ``sft``: the *teacher* samples answers to the same prompts and the student maximizes their
  likelihood (token-mean cross-entropy): trained on the teacher's states, not its own.
* ``rl``: REINFORCE with the 0/1 reward "the whole answer is right" and a group-mean baseline
  (``group`` samples per prompt), through the same [opd_literate.opd.opd_pg_loss][] with the
  advantage of each sequence on each of its tokens.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..opd import full_vocab_reverse_kl, opd_pg_loss, reverse_kl_rewards
from . import tinylm as lm
from .config import ExperimentConfig, eval_steps
from .ensemble import BatchedAdam, sum_of_model_losses, summed_cross_entropy

__all__ = ["Prepared", "train_method"]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What every method starts from: the data, the teacher and the weak students' weights."""

    config: ExperimentConfig
    """The run's configuration."""
    train_pairs: torch.Tensor
    """``(N, 2)`` operand pairs to train on."""
    val_pairs: torch.Tensor
    """``(val_prompts, 2)`` held-out pairs that choose the learning rate."""
    test_pairs: torch.Tensor
    """``(eval_prompts, 2)`` held-out pairs of every reported number."""
    teacher: lm.TinyLM
    """The trained teacher, frozen."""
    teacher_cached: bool
    """Whether the teacher was loaded from its cache file."""
    student_state: dict
    """The stacked weights of the ``seeds`` weak students (an
    [opd_literate.experiment.tinylm.EnsembleLM][] state dict)."""


def _method_loss(method, student, teacher, pairs, config, generator):
    """One update's loss and the number of samples it used (per model).

    ``pairs`` is ``(B, 2)`` for a [opd_literate.experiment.tinylm.TinyLM][], or ``(M, B, 2)`` for an
    [opd_literate.experiment.tinylm.EnsembleLM][] (one batch per model; the loss is then the sum of
    the models' losses).
    """
    B, batched = config.batch_size, pairs.ndim == 3
    if method == "rl":
        # B samples: B / group prompts, group samples each, group-mean baseline.
        group = config.group
        firsts = pairs[..., : B // group, :].repeat_interleave(group, dim=-2)
        prompts = lm.make_prompts(firsts, student.digits)
        answers = lm.answer_tokens(firsts, student.digits)
        out = lm.rollout(student, prompts, generator)
        reward = (out.tokens == answers).all(dim=-1).float()  # (..., B)
        baseline = reward.unflatten(-1, (-1, group)).mean(-1).repeat_interleave(group, dim=-1)
        per_token_advantage = (reward - baseline)[..., None].expand_as(out.logp)
        return sum_of_model_losses(batched, opd_pg_loss, out.logp, per_token_advantage,
                                   out.mask), B
    prompts = lm.make_prompts(pairs[..., :B, :], student.digits)
    if method == "sft":
        teacher_tokens, _ = lm.sample_tokens(teacher, prompts, generator)
        if not batched:
            return lm.supervised_loss(student, prompts, teacher_tokens), B
        return summed_cross_entropy(student, prompts, teacher_tokens), B
    out = lm.rollout(student, prompts, generator)
    teacher_logp, teacher_logits = lm.score(teacher, prompts, out.tokens)
    if method == "opd_sampled":
        def loss(logp, t_logp, mask):
            return opd_pg_loss(logp, reverse_kl_rewards(logp, t_logp, mask), mask)
        return sum_of_model_losses(batched, loss, out.logp, teacher_logp, out.mask), B
    if method == "opd_full_vocab":
        return sum_of_model_losses(batched, full_vocab_reverse_kl, out.logits, teacher_logits,
                                   out.mask), B
    raise ValueError(f"unknown method {method!r}")


def _update(method, students, teacher, optimizer, pairs, config, generator, warmup_factor):
    """One update of every student; returns the samples it used per student."""
    loss, used = _method_loss(method, students, teacher, pairs, config, generator)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step(warmup_factor)
    return used


@torch.no_grad()
def _evaluate(students, teacher, test_pairs, val_pairs, seed):
    """Per model ``(M,)``: greedy accuracy on the test and validation prompts, and the
    per-token reverse KL to the teacher on one own sample per test prompt."""
    M = students.models
    accuracy = {}
    for name, pairs in (("test", test_pairs), ("val", val_pairs)):
        prompts = lm.make_prompts(pairs, students.digits).expand(M, -1, -1)
        tokens, _ = lm.sample_tokens(students, prompts, greedy=True)
        answers = lm.answer_tokens(pairs, students.digits)
        accuracy[name] = (tokens == answers).all(-1).float().mean(-1)
    prompts = lm.make_prompts(test_pairs, students.digits).expand(M, -1, -1)
    # CPU by design: the experiment runs on the CPU
    out = lm.rollout(students, prompts, torch.Generator().manual_seed(seed))
    _, teacher_logits = lm.score(teacher, prompts, out.tokens)
    kl = torch.stack([full_vocab_reverse_kl(out.logits[m], teacher_logits[m], out.mask[m])
                      for m in range(M)])
    return accuracy["test"], accuracy["val"], kl


def train_method(method, prepared, bar):
    """Train every seed at every learning rate of one method, as one batched model.

    Model ``m = i * seeds + s`` is seed ``s`` at learning rate ``lrs[i]``. ``bar`` receives
    ``update(1)`` after each step. Returns ``{lr: record}``, each record holding the shared
    ``samples`` axis and, per seed, the ``accuracy``, ``reverse_kl`` (test prompts),
    ``val_accuracy`` and ``seconds`` curves.
    """
    config, train_pairs = prepared.config, prepared.train_pairs
    S, lrs = config.seeds, config.lrs
    M = S * len(lrs)
    # the fast forward
    teacher = lm.EnsembleLM.from_models([prepared.teacher]).requires_grad_(False)
    students = lm.EnsembleLM(M, config.student_hidden, config.student_layers,
                             digits=config.digits)
    students.load_state_dict({k: v.repeat(len(lrs), *[1] * (v.ndim - 1))
                              for k, v in prepared.student_state.items()})
    optimizer = BatchedAdam(students.parameters(), [lr for lr in lrs for _ in range(S)])
    # Linear warm-up: Adam's first steps move every weight by about lr whatever the gradient's
    # size, which a noisy estimator (sampled-token OPD, RL) turns into a random jump.
    warmup = max(config.warmup_steps, 1)
    # Seed s draws the same prompt stream at every learning rate and in every method.
    # CPU by design: the experiment runs on the CPU
    prompt_gen = torch.Generator().manual_seed(config.stream_seed(0, 10))
    sample_gen = torch.Generator().manual_seed(config.stream_seed(0, 11))  # CPU by design (above)
    samples, elapsed, evaluated_after = [0], 0.0, set(eval_steps(config))
    curves = {k: [[] for _ in range(M)] for k in ("accuracy", "val_accuracy", "reverse_kl",
                                                  "seconds")}

    def log():
        test, val, kl = _evaluate(students, teacher, prepared.test_pairs, prepared.val_pairs,
                                  config.stream_seed(0, 12))
        for m in range(M):
            curves["accuracy"][m].append(float(test[m]))
            curves["val_accuracy"][m].append(float(val[m]))
            curves["reverse_kl"][m].append(float(kl[m]))
            # the batch's training time, shared by its M models
            curves["seconds"][m].append(round(elapsed / M, 5))

    log()
    for step in range(1, config.steps + 1):
        start = time.perf_counter()
        # CPU by design: the experiment runs on the CPU
        idx = torch.randint(0, len(train_pairs), (S, config.batch_size), generator=prompt_gen)
        pairs = train_pairs[idx].repeat(len(lrs), 1, 1)  # (M, B, 2)
        used = _update(method, students, teacher, optimizer, pairs, config, sample_gen,
                       min(1.0, step / warmup))
        elapsed += time.perf_counter() - start  # training time only, not evaluation
        bar.update(1)
        if step in evaluated_after:
            samples.append(step * used)
            log()
    return {lr: {"samples": list(samples),
                 **{k: v[i * S:(i + 1) * S] for k, v in curves.items()}}
            for i, lr in enumerate(lrs)}
