r"""The OPD experiment: on-policy distillation against off-policy distillation and RL.

``python -m opd_literate.experiment`` (or ``opd-experiment``) trains a strong teacher on two-digit
addition ([opd_literate.experiment.tinylm][]), or loads it from a cache keyed by its configuration,
makes ``seeds`` weak students (each from its own initial weights, briefly trained), and then trains
every student with every method at every learning rate of a common grid, with the same
optimizer, the same stream of prompts per seed and the same number of samples per step
(``batch_size``; RL answers the first ``batch_size / group`` prompts of each step, ``group``
times each). The students of one method (seeds times learning rates) train together as one
batched model ([opd_literate.experiment.tinylm.EnsembleLM][],
[opd_literate.experiment.ensemble.BatchedAdam][]).

The four methods (``METHODS``) and their losses are in [opd_literate.experiment.train][], the
configurations in [opd_literate.experiment.config][], the statistics in
[opd_literate.experiment.stats][], the figures in [opd_literate.experiment.plots][] and the
command line in [opd_literate.experiment.cli][]. This module is the study itself: what every
method starts from ([opd_literate.experiment.run.prepare][]), the run of every method
([opd_literate.experiment.run.run_experiment][]) and the OPD chapter's gradient agreement.

Every evaluation point records the student samples used so far and, per student, the greedy
accuracy on the validation and the test prompts (disjoint, both held out), the per-token
reverse KL to the teacher on the student's own samples, and its share of the seconds spent in
training steps so far (evaluations excluded). Each method is reported at the learning rate
that does best on the validation prompts; the headline is, per method, the mean over seeds
(with a 95% percentile-bootstrap interval) of the samples and seconds needed to first reach
90% of the teacher's accuracy on the test prompts, and of the final accuracy and reverse KL.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..opd import full_vocab_reverse_kl, opd_pg_loss, reverse_kl_rewards
from . import _cache
from . import tinylm as lm
from ._workers import WorkerError, available_cpus, progress_bar, train_in_workers
from .config import METHODS
from .ensemble import BatchedAdam, summed_cross_entropy
from .stats import first_index
from .train import Prepared, train_method

__all__ = ["CACHE_MODES", "GRADIENT_KEYS", "WorkerError", "train_teacher",
           "teacher_cache_path", "prepare", "run_experiment", "gradient_agreement",
           "gradient_agreement_record"]


def _split(config):
    """All operand pairs (10,000 with two digits), shuffled by the seed: (train pairs,
    held-out pairs)."""
    # CPU by design: the experiment runs on the CPU
    numbers = torch.arange(10 ** config.digits)
    pairs = torch.cartesian_prod(numbers, numbers)
    # CPU by design: the experiment runs on the CPU
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(config.seed))
    held = config.held_out
    return pairs[order[held:]], pairs[order[:held]]


def _supervised(model, pairs, answers, steps, batch, lr, generator, label_smoothing=0.0):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        # CPU by design: the experiment runs on the CPU
        idx = torch.randint(0, len(pairs), (batch,), generator=generator)
        loss = lm.supervised_loss(model, lm.make_prompts(pairs[idx], model.digits), answers[idx],
                                  label_smoothing)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


CACHE_MODES = ("read", "refresh", "off")
"""How [opd_literate.experiment.run.train_teacher][] uses its cache file.

``read`` loads a valid cached teacher, and trains and caches it when the file is missing or
fails verification; ``refresh`` (the CLI's ``--no-cache``) always trains and rewrites the
file, so it also repairs a corrupt one; ``off`` neither reads nor writes it.
"""

_TEACHER_KEYS = ("seed", "held_out", "teacher_hidden", "teacher_layers", "teacher_steps",
                 "teacher_batch", "pretrain_lr", "teacher_label_smoothing", "digits")


def teacher_cache_path(config):
    """The cache file of the teacher of ``config``: keyed by the settings that shape it."""
    # as results.json records them: "digits" only where not 2 (LONG), so that the two-digit
    # configurations keep their cache files
    record = config.as_dict()
    key = _cache.cache_key({k: record[k] for k in _TEACHER_KEYS if k in record})
    return _cache.cache_dir() / f"teacher-{key}.pt"


def train_teacher(config, train_pairs, train_answers, cache="read"):
    """The teacher: a wide TinyLM trained by supervised learning; cached by configuration.

    Returns ``(teacher, loaded_from_cache)``. ``cache`` is one of
    [opd_literate.experiment.run.CACHE_MODES][]. The cache file (see
    [opd_literate.experiment.run.teacher_cache_path][]) holds the weights and their SHA-256; a file
    that does not load or does not match its checksum is reported in one line on stderr and rebuilt.
    A file lock beside it makes concurrent runs safe: the first trains and writes, the others
    wait and then load its file.
    """
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")

    def empty():
        return lm.TinyLM(config.teacher_hidden, config.teacher_layers, digits=config.digits)

    def trained():
        torch.manual_seed(config.seed)  # the initial weights
        teacher = empty()
        _supervised(teacher, train_pairs, train_answers, config.teacher_steps,
                    config.teacher_batch, config.pretrain_lr,
                    # CPU by design: the experiment runs on the CPU
                    torch.Generator().manual_seed(config.seed + 1),
                    config.teacher_label_smoothing)
        return teacher.eval()

    return _cache.load_or_train(teacher_cache_path(config), cache, empty, trained)


def _pretrain_students(config, train_pairs, train_answers):
    """The ``seeds`` weak students, batched: each from its own initial weights and data."""
    S = config.seeds
    inits = []
    for s in range(S):
        torch.manual_seed(config.stream_seed(s, 2))
        inits.append(lm.TinyLM(config.student_hidden, config.student_layers,
                               digits=config.digits))
    students = lm.EnsembleLM.from_models(inits)
    optimizer = BatchedAdam(students.parameters(), [config.pretrain_lr] * S)
    # CPU by design: the experiment runs on the CPU
    generator = torch.Generator().manual_seed(config.stream_seed(0, 3))
    for _ in range(config.student_pretrain_steps):
        # CPU by design: the experiment runs on the CPU
        idx = torch.randint(0, len(train_pairs), (S, config.student_pretrain_batch),
                            generator=generator)
        prompts = lm.make_prompts(train_pairs[idx], students.digits)
        loss = summed_cross_entropy(students, prompts, train_answers[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in students.state_dict().items()}


def prepare(config, cache="read"):
    """Data split, teacher and the weak students' initial weights, as every method starts.

    The 2,000 held-out pairs are split in two disjoint sets: the first ``val_prompts`` are the
    validation prompts (used only to choose each method's learning rate), the next
    ``eval_prompts`` the test prompts (every reported number). ``config`` is an
    [opd_literate.experiment.config.ExperimentConfig][]; ``cache``: how the teacher's cache file
    is used, one of [opd_literate.experiment.run.CACHE_MODES][]. Returns a
    [opd_literate.experiment.train.Prepared][].
    """
    torch.manual_seed(config.seed)
    train_pairs, held_out = _split(config)
    train_answers = lm.answer_tokens(train_pairs, config.digits)
    val_pairs = held_out[: config.val_prompts]
    test_pairs = held_out[config.val_prompts: config.val_prompts + config.eval_prompts]
    teacher, cached = train_teacher(config, train_pairs, train_answers, cache)
    teacher.requires_grad_(False)
    student_state = _pretrain_students(config, train_pairs, train_answers)
    return Prepared(config=config, train_pairs=train_pairs, val_pairs=val_pairs,
                    test_pairs=test_pairs, teacher=teacher, teacher_cached=cached,
                    student_state=student_state)


def run_experiment(config, methods=METHODS, progress=True, cache="read", on_method=None,
                   workers=1):
    """Run every method; return the ``results.json`` dictionary.

    ``config`` is an [opd_literate.experiment.config.ExperimentConfig][]. Every training
    process runs on one CPU thread (restored after): the matrices are small, and
    a second thread costs more in synchronisation than it gains, several times more on a busy
    machine. ``workers`` processes train the methods side by side instead (the CLI's
    ``--workers``, by default one per CPU, at most one per method): the methods are
    independent, so a second core is used without any synchronisation. The teacher and the
    students' initial weights are prepared once, in this process, and sent to the workers;
    each method's random streams depend on the configuration only, so the numbers are the same
    for every ``workers`` (the ``seconds`` curves, measured times, are not).

    ``cache`` is one of [opd_literate.experiment.run.CACHE_MODES][]. ``on_method``, if given, is
    called after each method with the results so far (the same dictionary, holding the methods
    finished): the CLI saves them, so that an interrupted run keeps its finished methods.
    """
    methods = list(methods)
    unknown = [m for m in methods if m not in METHODS]
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if unknown or repeated or not methods:
        raise ValueError(f"methods must be distinct names from {', '.join(METHODS)}; got "
                         f"{methods!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_methods(config, methods, progress, cache, on_method,
                            min(workers, len(methods)))
    finally:
        torch.set_num_threads(threads)


def _run_methods(config, methods, progress, cache, on_method, workers):
    started = time.perf_counter()
    prepared = prepare(config, cache)
    teacher_accuracy = lm.greedy_accuracy(prepared.teacher, prepared.test_pairs)
    teacher_val_accuracy = lm.greedy_accuracy(prepared.teacher, prepared.val_pairs)

    bar = progress_bar(len(methods) * config.steps, progress)
    val_target = config.target_fraction * teacher_val_accuracy
    results, search = {}, {}
    # "run": how this run was executed, not what it computed (the numbers do not depend on it)
    execution = {"workers": workers, "cpus": available_cpus(), "wall_seconds": None}
    summary = {"teacher_accuracy": teacher_accuracy,
               "teacher_val_accuracy": teacher_val_accuracy,
               "teacher_cached": prepared.teacher_cached, "config": config.as_dict(),
               "methods": results, "lr_search": search, "run": execution}

    def finish(method, runs):
        search[method] = {str(lr): dict(
            val_samples_to_target=[_first_hit(run["samples"], acc, val_target)
                                   for acc in run["val_accuracy"]],
            val_final_accuracy=[acc[-1] for acc in run["val_accuracy"]])
            for lr, run in runs.items()}
        best = min(runs, key=lambda lr: _rank(search[method][str(lr)], config))
        record = runs[best]
        del record["val_accuracy"]
        results[method] = dict(record, lr=best)
        if on_method is not None:
            on_method(summary)

    try:
        if workers == 1:
            for method in methods:
                finish(method, train_method(method, prepared, bar))
        else:
            with contextlib.closing(train_in_workers(methods, prepared, workers, bar)) as trained:
                for method, runs in trained:
                    finish(method, runs)
    finally:
        bar.close()
    for table in (results, search):  # the requested order, whichever method finished first
        ordered = {method: table[method] for method in methods}
        table.clear()
        table.update(ordered)  # in place: summary (and on_method's callers) hold these dicts
    # from the start of prepare() (the teacher's training too, when it was not cached)
    execution["wall_seconds"] = round(time.perf_counter() - started, 1)
    return summary


def _first_hit(samples, accuracy, target):
    """Samples at the first evaluation with accuracy >= target, or None."""
    index = first_index(accuracy, target)
    return None if index is None else samples[index]


def _rank(search, config):
    """Sort key of a learning rate on the validation prompts: fewest seeds that never reach
    the target, then fewest mean samples to it (never counted as the budget), then the best
    mean final validation accuracy."""
    hits = search["val_samples_to_target"]
    budget = config.steps * config.batch_size
    misses = sum(h is None for h in hits)
    mean_hit = sum(budget if h is None else h for h in hits) / len(hits)
    return (misses, mean_hit, -sum(search["val_final_accuracy"]) / len(hits))


def gradient_agreement(config, batch_sizes=(16, 64, 256), reference=4096, repeats=4):
    r"""How well one batch's OPD gradient points along the expected gradient.

    For the first weak student of ``config`` (seed index 0, before any OPD update), the
    expected gradient of each OPD loss is estimated from ``reference`` fresh rollouts; each
    batch of ``B`` rollouts then gives a gradient, and its cosine with the reference measures
    how much of it is signal rather than sampling noise (1 would mean none; the reference is
    itself an estimate from finitely many rollouts).
    Returns ``{method: {B: mean cosine over repeats}}`` for ``opd_sampled`` and
    ``opd_full_vocab``. Both reference gradients are computed at the same rollouts.
    """
    prepared = prepare(config)
    teacher = prepared.teacher
    student = lm.EnsembleLM(config.seeds, config.student_hidden, config.student_layers,
                            digits=config.digits)
    student.load_state_dict(prepared.student_state)
    student = student.member(0)
    # CPU by design: the experiment runs on the CPU
    generator = torch.Generator().manual_seed(config.seed + 20)

    def gradients(pairs):
        prompts = lm.make_prompts(pairs, student.digits)
        out = lm.rollout(student, prompts, generator)
        teacher_logp, teacher_logits = lm.score(teacher, prompts, out.tokens)
        losses = {
            "opd_sampled": opd_pg_loss(
                out.logp, reverse_kl_rewards(out.logp, teacher_logp, out.mask), out.mask),
            "opd_full_vocab": full_vocab_reverse_kl(out.logits, teacher_logits, out.mask),
        }
        grads = {}
        for method, loss in losses.items():
            student.zero_grad()
            loss.backward(retain_graph=True)
            grads[method] = torch.cat([p.grad.flatten() for p in student.parameters()])
        return grads

    expected = gradients(prepared.train_pairs[:reference])
    table = {method: {} for method in expected}
    offset = reference
    for B in batch_sizes:
        cosines = {method: [] for method in expected}
        for _ in range(repeats):
            grads = gradients(prepared.train_pairs[offset: offset + B])
            offset += B
            for method, g in grads.items():
                cosines[method].append(float(torch.nn.functional.cosine_similarity(
                    g, expected[method], dim=0)))
        for method, values in cosines.items():
            table[method][B] = sum(values) / len(values)
    return table


GRADIENT_KEYS = ("seed", "held_out", "teacher_hidden", "teacher_layers", "teacher_steps",
                 "teacher_batch", "pretrain_lr", "teacher_label_smoothing", "seeds",
                 "student_hidden", "student_layers", "student_pretrain_steps",
                 "student_pretrain_batch")
"""The fields of [opd_literate.experiment.config.ExperimentConfig][] that
[opd_literate.experiment.run.gradient_agreement][] depends on: those of the teacher and of the
weak students, in the order ``gradient_agreement.json`` records them."""


def gradient_agreement_record(config, batch_sizes=(16, 64, 256), reference=4096, repeats=4):
    """``gradient_agreement.json``: the table of
    [opd_literate.experiment.run.gradient_agreement][] with the settings it was computed from
    (``config``, restricted to [opd_literate.experiment.run.GRADIENT_KEYS][]) and its sizes.

    Written by ``python -m opd_literate.experiment --gradient-agreement --out
    docs/data/experiment``; the docs build reads it rather than computing it (half a minute on 2
    cores).
    """
    table = gradient_agreement(config, batch_sizes, reference, repeats)
    return {"config": {k: getattr(config, k) for k in GRADIENT_KEYS},
            "batch_sizes": list(batch_sizes), "reference": reference, "repeats": repeats,
            "cosine": {method: {str(B): value for B, value in row.items()}
                       for method, row in table.items()}}
