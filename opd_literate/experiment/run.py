r"""The OPD experiment: on-policy distillation against off-policy distillation and RL.

``python -m opd_literate.experiment`` (or ``opd-experiment``) trains a strong teacher on two-digit
addition ([opd_literate.experiment.tinylm][]), or loads it from a cache keyed by its configuration,
makes ``seeds`` weak students (each from its own initial weights, briefly trained), and then trains
every student with every method at every learning rate of a common grid, with the same
optimizer, the same stream of prompts per seed and the same number of samples per step
(``batch_size``; RL answers the first ``batch_size / group`` prompts of each step, ``group``
times each). The students of one method (seeds times learning rates) train together as one
batched model ([opd_literate.experiment.tinylm.EnsembleLM][],
[opd_literate.experiment.run.BatchedAdam][]).

* ``opd_sampled``: sampled-token OPD. The student samples, the teacher scores the sampled
  tokens, and the loss is [opd_literate.opd.opd_pg_loss][] of
  [opd_literate.opd.reverse_kl_rewards][] (lab Tasks 1-2).
* ``opd_full_vocab``: full-vocabulary OPD, [opd_literate.opd.full_vocab_reverse_kl][] at the
  states the student visited (lab Task 3).
* ``sft``: off-policy distillation. The *teacher* samples answers to the same prompts and the
  student maximizes their likelihood (token-mean cross-entropy): trained on the teacher's
  states, not its own.
* ``rl``: REINFORCE with the 0/1 reward "the whole answer is right" and a group-mean baseline
  (``group`` samples per prompt), through the same [opd_literate.opd.opd_pg_loss][] with the
  advantage of each sequence on each of its tokens.

Every evaluation point records the student samples used so far and, per student, the greedy
accuracy on the validation and the test prompts (disjoint, both held out), the per-token
reverse KL to the teacher on the student's own samples, and its share of the seconds spent in
training steps so far (evaluations excluded). Each method is reported at the learning rate
that does best on the validation prompts; the headline is, per method, the mean over seeds
(with a 95% percentile-bootstrap interval) of the samples and seconds needed to first reach
90% of the teacher's accuracy on the test prompts, and of the final accuracy and reverse KL.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid

import filelock
import torch

from ..opd import full_vocab_reverse_kl, opd_pg_loss, reverse_kl_rewards
from . import tinylm as lm

__all__ = ["DEFAULTS", "QUICK", "LONG", "METHODS", "CACHE_MODES", "GRADIENT_KEYS", "prepare",
           "run_experiment", "available_cpus", "WorkerError", "train_teacher", "teacher_cache_path",
           "eval_steps", "BatchedAdam",
           "headline", "ratios", "bootstrap_interval", "format_headline", "gradient_agreement",
           "gradient_agreement_record", "write_plots", "main"]

METHODS = ("opd_sampled", "opd_full_vocab", "sft", "rl")

DEFAULTS = dict(
    seed=0, seeds=5, steps=1800, batch_size=64, group=4, lrs=[1e-3, 3e-3], warmup_steps=30,
    eval_every=25, eval_dense_until=300, eval_every_late=100, val_prompts=500, eval_prompts=500,
    held_out=2000, pretrain_lr=3e-3,
    teacher_hidden=256, teacher_layers=2, teacher_steps=400, teacher_batch=256,
    teacher_label_smoothing=0.1,
    student_hidden=128, student_layers=2, student_pretrain_steps=250, student_pretrain_batch=64,
    target_fraction=0.9,
)
"""The default experiment (about 115 s on 2 CPU cores, two worker processes, with the teacher
cached; the first run also trains the teacher).

Each method is trained for every seed at every learning rate in ``lrs`` (``seeds`` times
``len(lrs)`` students, trained together as one batched model) and reported at the learning
rate that does best on the validation prompts: a common grid, so that no method is compared
at a step size that suits only the others, and a choice made on prompts the results are not
reported on. The site's figures come from the committed results of this configuration.
"""
QUICK = dict(DEFAULTS, seeds=3, steps=200, lrs=[1e-3], eval_every=25, val_prompts=300,
             eval_prompts=300, teacher_steps=250)
"""``--quick``: the same pipeline, smaller, for the tests and smoke checks (about 11 s on
2 CPU cores with the teacher cached, 16 s the first time); full-vocabulary OPD reaches its
target on every seed."""


LONG = dict(DEFAULTS, digits=3, steps=1200, teacher_steps=1200, student_pretrain_steps=600)
"""``--long``: the second regime, longer answers. Three-digit operands (``"abc+def="``, answers
of up to 5 tokens), where a wrong early digit leaves the student further from anything the
teacher showed it; the teacher and the students are trained longer to reach comparable
starting points, and the budget is 1,200 steps of 64 samples."""


def _cache_dir():
    return pathlib.Path(os.environ.get("OPD_LITERATE_CACHE",
                                       pathlib.Path.home() / ".cache" / "opd_literate"))


def _split(config):
    """All operand pairs (10,000 with two digits), shuffled by the seed: (train pairs,
    held-out pairs)."""
    # CPU by design: the experiment runs on the CPU
    numbers = torch.arange(10 ** config.get("digits", 2))
    pairs = torch.cartesian_prod(numbers, numbers)
    # CPU by design: the experiment runs on the CPU
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(config["seed"]))
    held = config["held_out"]
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
    # "digits" only where set (LONG), so the two-digit configurations keep their cache files
    key = hashlib.sha256(json.dumps({k: config[k] for k in _TEACHER_KEYS if k in config},
                                    sort_keys=True).encode())
    return _cache_dir() / f"teacher-{key.hexdigest()[:16]}.pt"


def _state_digest(state):
    """SHA-256 of a state dict's names, shapes, dtypes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def _load_verified(path, model):
    """Load ``path`` into ``model``; return None, or why the file is unusable (one line)."""
    try:
        saved = torch.load(path, weights_only=True)
        if not isinstance(saved, dict) or set(saved) != {"state_dict", "sha256"}:
            return "not a teacher cache file of this version"
        if _state_digest(saved["state_dict"]) != saved["sha256"]:
            return "checksum mismatch"
        model.load_state_dict(saved["state_dict"])
    except Exception as error:  # a truncated or foreign file fails in many ways; all mean rebuild
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return None


def _replace_atomically(path, write):
    """Call ``write(tmp)`` for a new file ``tmp`` beside ``path``, then rename it over ``path``.

    The rename is atomic within a folder: a reader sees the old file or the new one, never
    half of one, and an interrupted write leaves no partial ``path``.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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

    def trained():
        torch.manual_seed(config["seed"])  # the initial weights
        teacher = lm.TinyLM(config["teacher_hidden"], config["teacher_layers"],
                            digits=config.get("digits", 2))
        _supervised(teacher, train_pairs, train_answers, config["teacher_steps"],
                    config["teacher_batch"], config["pretrain_lr"],
                    # CPU by design: the experiment runs on the CPU
                    torch.Generator().manual_seed(config["seed"] + 1),
                    config["teacher_label_smoothing"])
        return teacher.eval()

    if cache == "off":
        return trained(), False
    path = teacher_cache_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{path}.lock"):
        if cache == "read" and path.exists():
            cached = lm.TinyLM(config["teacher_hidden"], config["teacher_layers"],
                               digits=config.get("digits", 2))
            problem = _load_verified(path, cached)
            if problem is None:
                return cached.eval(), True
            print(f"opd-experiment: warning: teacher cache {path} is unusable ({problem}); "
                  "retraining the teacher and rewriting it", file=sys.stderr)
        teacher = trained()
        state = teacher.state_dict()
        _replace_atomically(path, lambda tmp: torch.save(
            {"state_dict": state, "sha256": _state_digest(state)}, tmp))
    return teacher, False


def _per_model(batched, loss_fn, *tensors):
    """``loss_fn`` of one model's ``(B, ...)`` tensors; for the ``(M, B, ...)`` tensors of an
    ensemble (``batched``), the sum over models of each model's own loss (its own token-mean
    normaliser), so that model ``m``'s gradient is that of its loss alone."""
    if not batched:
        return loss_fn(*tensors)
    return sum(loss_fn(*(t[m] for t in tensors)) for m in range(tensors[0].shape[0]))


def _step_loss(method, student, teacher, pairs, config, generator):
    """One update's loss and the number of samples it used (per model).

    ``pairs`` is ``(B, 2)`` for a [opd_literate.experiment.tinylm.TinyLM][], or ``(M, B, 2)`` for an
    [opd_literate.experiment.tinylm.EnsembleLM][] (one batch per model; the loss is then the sum of
    the models' losses).
    """
    B, batched = config["batch_size"], pairs.ndim == 3
    if method == "rl":
        # B samples: B / group prompts, group samples each, group-mean baseline.
        group = config["group"]
        firsts = pairs[..., : B // group, :].repeat_interleave(group, dim=-2)
        prompts = lm.make_prompts(firsts, student.digits)
        answers = lm.answer_tokens(firsts, student.digits)
        out = lm.rollout(student, prompts, generator)
        reward = (out.tokens == answers).all(dim=-1).float()  # (..., B)
        baseline = reward.unflatten(-1, (-1, group)).mean(-1).repeat_interleave(group, dim=-1)
        per_token_advantage = (reward - baseline)[..., None].expand_as(out.logp)
        return _per_model(batched, opd_pg_loss, out.logp, per_token_advantage, out.mask), B
    prompts = lm.make_prompts(pairs[..., :B, :], student.digits)
    if method == "sft":
        teacher_tokens, _ = lm.sample_tokens(teacher, prompts, generator)
        if not batched:
            return lm.supervised_loss(student, prompts, teacher_tokens), B
        log_probs = torch.log_softmax(student.logits(prompts, teacher_tokens), -1)
        nll = -log_probs.gather(-1, teacher_tokens[..., None])[..., 0]  # (M, B, T)
        mask = lm.answer_mask(teacher_tokens)
        # token-mean cross-entropy of each model, summed over models
        return ((nll * mask).sum((1, 2)) / mask.sum((1, 2))).sum(), B
    out = lm.rollout(student, prompts, generator)
    teacher_logp, teacher_logits = lm.score(teacher, prompts, out.tokens)
    if method == "opd_sampled":
        def loss(logp, t_logp, mask):
            return opd_pg_loss(logp, reverse_kl_rewards(logp, t_logp, mask), mask)
        return _per_model(batched, loss, out.logp, teacher_logp, out.mask), B
    if method == "opd_full_vocab":
        return _per_model(batched, full_vocab_reverse_kl, out.logits, teacher_logits, out.mask), B
    raise ValueError(f"unknown method {method!r}")


class BatchedAdam:
    r"""Adam over an ensemble's stacked weights, with one learning rate per model.

    The update of each element is torch's Adam (no weight decay, no amsgrad):

    $$
    m \leftarrow \beta_1 m + (1 - \beta_1) g,\quad
    v \leftarrow \beta_2 v + (1 - \beta_2) g^2,\quad
    \theta \leftarrow \theta - \frac{\eta_m s_k}{1 - \beta_1^k}\,
    \frac{m}{\sqrt{v / (1 - \beta_2^k)} + \epsilon},
    $$

    with $\eta_m$ the learning rate of model $m$ (the leading index of every weight) and
    $s_k$ the warm-up factor of step $k$. Adam is per element, so each model is updated as
    ``torch.optim.Adam`` would update it alone.
    """

    def __init__(self, params, lrs, betas=(0.9, 0.999), eps=1e-8):
        self.params = list(params)
        # (M,), on the weights' device: the step multiplies them
        self.lrs = torch.as_tensor(lrs, dtype=torch.float32, device=self.params[0].device)
        self.betas, self.eps, self.k = betas, eps, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, scale=1.0):
        self.k += 1
        beta1, beta2 = self.betas
        correction1, correction2 = 1 - beta1 ** self.k, 1 - beta2 ** self.k
        for p, m, v in zip(self.params, self.m, self.v):
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denominator = (v.sqrt() / correction2 ** 0.5).add_(self.eps)
            step_size = (self.lrs * scale / correction1).view(-1, *[1] * (p.ndim - 1))
            p.sub_(step_size * m / denominator)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _seed(config, seed_index, purpose):
    """The generator seed of one use (``purpose``) for seed ``seed_index`` of run ``config``."""
    return 1_000_003 * config["seed"] + 1009 * seed_index + purpose


def _pretrain_students(config, train_pairs, train_answers):
    """The ``seeds`` weak students, batched: each from its own initial weights and data."""
    S = config["seeds"]
    inits = []
    for s in range(S):
        torch.manual_seed(_seed(config, s, 2))
        inits.append(lm.TinyLM(config["student_hidden"], config["student_layers"],
                               digits=config.get("digits", 2)))
    students = lm.EnsembleLM.from_models(inits)
    optimizer = BatchedAdam(students.parameters(), [config["pretrain_lr"]] * S)
    # CPU by design: the experiment runs on the CPU
    generator = torch.Generator().manual_seed(_seed(config, 0, 3))
    for _ in range(config["student_pretrain_steps"]):
        # CPU by design: the experiment runs on the CPU
        idx = torch.randint(0, len(train_pairs), (S, config["student_pretrain_batch"]),
                            generator=generator)
        prompts = lm.make_prompts(train_pairs[idx], students.digits)
        targets = train_answers[idx]
        log_probs = torch.log_softmax(students.logits(prompts, targets), -1)
        nll = -log_probs.gather(-1, targets[..., None])[..., 0]  # (S, B, T)
        mask = lm.answer_mask(targets)
        loss = ((nll * mask).sum((1, 2)) / mask.sum((1, 2))).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in students.state_dict().items()}


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


def prepare(config, cache="read"):
    """Data split, teacher and the weak students' initial weights, as every method starts.

    The 2,000 held-out pairs are split in two disjoint sets: the first ``val_prompts`` are the
    validation prompts (used only to choose each method's learning rate), the next
    ``eval_prompts`` the test prompts (every reported number). ``cache``: how the teacher's
    cache file is used, one of [opd_literate.experiment.run.CACHE_MODES][].
    Returns ``(train_pairs, test_pairs, val_pairs, teacher, cached, student_state)``, the last
    the stacked weights of the ``seeds`` students (an
    [opd_literate.experiment.tinylm.EnsembleLM][]).
    """
    torch.manual_seed(config["seed"])
    train_pairs, held_out = _split(config)
    train_answers = lm.answer_tokens(train_pairs, config.get("digits", 2))
    val_pairs = held_out[: config["val_prompts"]]
    test_pairs = held_out[config["val_prompts"]: config["val_prompts"] + config["eval_prompts"]]
    teacher, cached = train_teacher(config, train_pairs, train_answers, cache)
    teacher.requires_grad_(False)
    student_state = _pretrain_students(config, train_pairs, train_answers)
    return train_pairs, test_pairs, val_pairs, teacher, cached, student_state


def available_cpus():
    """The CPUs this process may run on: its affinity mask where the platform has one, else
    every CPU. A container's CPU quota (cgroups) is not read: where it is below this count,
    pass ``--workers``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def run_experiment(config, methods=METHODS, progress=True, cache="read", on_method=None,
                   workers=1):
    """Run every method; return the ``results.json`` dictionary.

    Every training process runs on one CPU thread (restored after): the matrices are small, and
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
    train_pairs, test_pairs, val_pairs, teacher, cached, student_state = prepare(config, cache)
    teacher_accuracy = lm.greedy_accuracy(teacher, test_pairs)
    teacher_val_accuracy = lm.greedy_accuracy(teacher, val_pairs)

    bar = _progress(len(methods) * config["steps"], progress)
    val_target = config["target_fraction"] * teacher_val_accuracy
    results, search = {}, {}
    # "run": how this run was executed, not what it computed (the numbers do not depend on it)
    execution = {"workers": workers, "cpus": available_cpus(), "wall_seconds": None}
    summary = {"teacher_accuracy": teacher_accuracy,
               "teacher_val_accuracy": teacher_val_accuracy, "teacher_cached": cached,
               "config": config, "methods": results, "lr_search": search, "run": execution}

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

    data = (student_state, teacher, train_pairs, test_pairs, val_pairs, config)
    try:
        if workers == 1:
            for method in methods:
                finish(method, _train_one(method, *data, bar))
        else:
            with contextlib.closing(_train_in_workers(methods, data, workers, bar)) as trained:
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


class WorkerError(RuntimeError):
    """A worker process failed: its method raised (the message holds the worker's traceback),
    or the process died (killed, out of memory, or failed to start) before it answered."""


class _StepCounter:
    """The progress "bar" of worker ``slot``: adds its steps to its own slot of an array the
    parent sums. One writer a slot, so no lock: a worker killed mid-update (the out-of-memory
    killer does not wait) cannot leave a lock held for the parent to wait on for ever.

    It also checks, every step, that the parent is alive: a worker whose parent was killed
    (SIGKILL leaves it no time to stop its workers) exits instead of training on for nobody.
    """

    def __init__(self, steps, slot, parent_pid):
        self.steps, self.slot, self.parent_pid = steps, slot, parent_pid

    def update(self, n):
        if os.getppid() != self.parent_pid:
            os._exit(1)
        self.steps[self.slot] += n


def _worker_main(connection, steps, slot, parent_pid):
    """A worker process: receives the data (``torch.save`` bytes), then method names; sends
    back ``(method, "ok", runs)`` for each, until it receives ``None``. An error is sent back
    as ``(method, "error", traceback)``. A closed pipe means the parent is stopping: return."""
    torch.set_num_threads(1)
    try:
        data = torch.load(io.BytesIO(connection.recv_bytes()), weights_only=False)
    except (EOFError, OSError):
        return
    bar = _StepCounter(steps, slot, parent_pid)
    while True:
        try:
            method = connection.recv()
        except (EOFError, OSError):
            return
        if method is None:
            return
        try:
            runs = _train_one(method, *data, bar)
        except Exception:
            connection.send((method, "error", traceback.format_exc()))
            return
        connection.send((method, "ok", runs))


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while a worker is started: a child inherits the setting, so a worker
    ignores Ctrl-C from its first instruction and leaves it to the parent, which stops it.
    Held only for the ``start()`` call itself (the parent's Ctrl-C must not be lost)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set in the main thread
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler installed from C, which we cannot restore
            signal.signal(signal.SIGINT, previous)


def _train_in_workers(methods, data, workers, bar):
    """Yield ``(method, runs)`` as each method finishes, trained by ``workers`` processes.

    Each worker is a fresh interpreter (``spawn``: forking a process whose torch thread pools
    have run is unsafe) that receives its own copy of ``data`` through its pipe after it has
    started, and trains one method at a time, the next method waiting being sent to the first
    worker free. Nothing the parent does waits on a worker without also watching for its
    death: it waits on the workers' connections and process sentinels together, and a send to
    a dead worker fails at once; a worker that dies is a
    [opd_literate.experiment.run.WorkerError][]. However the generator ends (done, an error, Ctrl-C,
    closed early), its ``finally`` stops every worker that was started.
    """
    context = multiprocessing.get_context("spawn")
    steps = context.RawArray("q", workers)  # steps done, one slot a worker
    # The tensors travel as bytes: pickled directly, torch would hand them over as shared
    # memory through a helper thread, whose teardown on Ctrl-C prints tracebacks.
    buffer = io.BytesIO()
    torch.save(data, buffer)
    pool, waiting, busy, shown = [], list(methods), {}, 0  # busy: connection -> (process, method)
    completed = False
    try:
        for slot in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker_main, daemon=True,
                                      args=(theirs, steps, slot, os.getpid()))
            pool.append((process, ours))
            with _sigint_ignored():
                process.start()
            theirs.close()
        for slot, (process, connection) in enumerate(pool):
            try:
                connection.send_bytes(buffer.getvalue())
            except OSError:  # it died as it started
                raise WorkerError(_died(f"worker process {slot}", process)) from None
        for process, connection in pool[: len(waiting)]:
            _assign(busy, connection, process, waiting.pop(0))
        while busy:
            ready = multiprocessing.connection.wait(
                list(busy) + [process.sentinel for process, _ in busy.values()], timeout=0.2)
            for connection in [c for c in list(busy) if c in ready]:
                process, method = busy.pop(connection)
                try:
                    _, status, runs = connection.recv()
                except (EOFError, OSError):  # it died: the pipe is closed, or reset
                    raise WorkerError(_died(f"the worker process training {method}",
                                            process)) from None
                if status == "error":
                    raise WorkerError(f"training {method} failed in its worker process "
                                      f"(its traceback below)\n{runs}")
                if waiting:
                    _assign(busy, connection, process, waiting.pop(0))
                yield method, runs
            for connection, (process, method) in busy.items():
                if process.sentinel in ready and not connection.poll():
                    raise WorkerError(_died(f"the worker process training {method}", process))
            done = sum(steps)  # every pass, the last one after the last method too
            bar.update(done - shown)
            shown = done
        for _, connection in pool:
            with contextlib.suppress(OSError):  # one that died after its last method
                connection.send(None)  # done: the workers return
        completed = True
    finally:
        # Stopped early (an error, Ctrl-C): terminate first, so that no worker sees its pipe
        # close and prints about it; done: let them return.
        started = [process for process, _ in pool if process.pid is not None]
        for process in started:
            if not completed:
                process.terminate()
        for process in started:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        for _, connection in pool:
            connection.close()


def _assign(busy, connection, process, method):
    """Send ``method`` to an idle worker and mark it busy with it."""
    busy[connection] = (process, method)
    try:
        connection.send(method)
    except OSError:  # it died after its last result: its pipe is closed
        raise WorkerError(_died(f"the worker process training {method}", process)) from None


def _died(who, process):
    process.join(timeout=5)
    return (f"{who} died (exit code {process.exitcode}) before it answered (one that dies as "
            "it starts is often a script that runs the experiment with workers > 1 outside "
            "`if __name__ == \"__main__\":`; each worker imports the script again)")


def _train_one(method, student_state, teacher, train_pairs, test_pairs, val_pairs, config,
               bar):
    """Train every seed at every learning rate of one method, as one batched model.

    Model ``m = i * seeds + s`` is seed ``s`` at learning rate ``lrs[i]``. Returns
    ``{lr: record}``, each record holding the shared ``samples`` axis and, per seed, the
    ``accuracy``, ``reverse_kl`` (test prompts), ``val_accuracy`` and ``seconds`` curves.
    """
    S, lrs = config["seeds"], config["lrs"]
    M = S * len(lrs)
    teacher = lm.EnsembleLM.from_models([teacher]).requires_grad_(False)  # the fast forward
    students = lm.EnsembleLM(M, config["student_hidden"], config["student_layers"],
                             digits=config.get("digits", 2))
    students.load_state_dict({k: v.repeat(len(lrs), *[1] * (v.ndim - 1))
                              for k, v in student_state.items()})
    optimizer = BatchedAdam(students.parameters(),
                            [lr for lr in lrs for _ in range(S)])
    # Linear warm-up: Adam's first steps move every weight by about lr whatever the gradient's
    # size, which a noisy estimator (sampled-token OPD, RL) turns into a random jump.
    warmup = max(config["warmup_steps"], 1)
    # Seed s draws the same prompt stream at every learning rate and in every method.
    # CPU by design: the experiment runs on the CPU
    prompt_gen = torch.Generator().manual_seed(_seed(config, 0, 10))
    sample_gen = torch.Generator().manual_seed(_seed(config, 0, 11))  # CPU by design (above)
    samples, elapsed, evaluated_after = [0], 0.0, set(eval_steps(config))
    curves = {k: [[] for _ in range(M)] for k in ("accuracy", "val_accuracy", "reverse_kl",
                                                  "seconds")}

    def log():
        test, val, kl = _evaluate(students, teacher, test_pairs, val_pairs,
                                  _seed(config, 0, 12))
        for m in range(M):
            curves["accuracy"][m].append(float(test[m]))
            curves["val_accuracy"][m].append(float(val[m]))
            curves["reverse_kl"][m].append(float(kl[m]))
            # the batch's training time, shared by its M models
            curves["seconds"][m].append(round(elapsed / M, 5))

    log()
    for step in range(1, config["steps"] + 1):
        start = time.perf_counter()
        # CPU by design: the experiment runs on the CPU
        idx = torch.randint(0, len(train_pairs), (S, config["batch_size"]), generator=prompt_gen)
        pairs = train_pairs[idx].repeat(len(lrs), 1, 1)  # (M, B, 2)
        loss, used = _step_loss(method, students, teacher, pairs, config, sample_gen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step(min(1.0, step / warmup))
        elapsed += time.perf_counter() - start  # training time only, not evaluation
        bar.update(1)
        if step in evaluated_after:
            samples.append(step * used)
            log()
    return {lr: {"samples": list(samples),
                 **{k: v[i * S:(i + 1) * S] for k, v in curves.items()}}
            for i, lr in enumerate(lrs)}


def eval_steps(config):
    """The steps after which the students are evaluated (step 0, before any update, too):
    every ``eval_every`` steps up to ``eval_dense_until``, where the fast methods reach the
    target and the resolution matters, then every ``eval_every_late``, and the last step.

    Examples
    --------
    >>> eval_steps(dict(steps=10, eval_every=2, eval_dense_until=4, eval_every_late=5))
    [0, 2, 4, 5, 10]
    """
    return [k for k in range(config["steps"] + 1)
            if (k <= config["eval_dense_until"] and k % config["eval_every"] == 0)
            or k % config["eval_every_late"] == 0 or k == config["steps"]]


def _first_hit(samples, accuracy, target):
    """Samples at the first evaluation with accuracy >= target, or None."""
    index = _first_index(accuracy, target)
    return None if index is None else samples[index]


def _rank(search, config):
    """Sort key of a learning rate on the validation prompts: fewest seeds that never reach
    the target, then fewest mean samples to it (never counted as the budget), then the best
    mean final validation accuracy."""
    hits = search["val_samples_to_target"]
    budget = config["steps"] * config["batch_size"]
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
    train_pairs, _, _, teacher, _, student_state = prepare(config)
    student = lm.EnsembleLM(config["seeds"], config["student_hidden"],
                            config["student_layers"], digits=config.get("digits", 2))
    student.load_state_dict(student_state)
    student = student.member(0)
    # CPU by design: the experiment runs on the CPU
    generator = torch.Generator().manual_seed(config["seed"] + 20)

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

    expected = gradients(train_pairs[:reference])
    table = {method: {} for method in expected}
    offset = reference
    for B in batch_sizes:
        cosines = {method: [] for method in expected}
        for _ in range(repeats):
            grads = gradients(train_pairs[offset: offset + B])
            offset += B
            for method, g in grads.items():
                cosines[method].append(float(torch.nn.functional.cosine_similarity(
                    g, expected[method], dim=0)))
        for method, values in cosines.items():
            table[method][B] = sum(values) / len(values)
    return table


GRADIENT_KEYS = _TEACHER_KEYS[:-1] + ("seeds", "student_hidden", "student_layers",
                                 "student_pretrain_steps", "student_pretrain_batch")
"""The settings [opd_literate.experiment.run.gradient_agreement][] depends on: those of the teacher
and of
the weak students."""


def gradient_agreement_record(config, batch_sizes=(16, 64, 256), reference=4096, repeats=4):
    """``gradient_agreement.json``: the table of
    [opd_literate.experiment.run.gradient_agreement][] with the settings it was computed from
    (``config``, restricted to [opd_literate.experiment.run.GRADIENT_KEYS][]) and its sizes.

    Written by ``python -m opd_literate.experiment --gradient-agreement --out
    docs/data/experiment``; the docs build reads it rather than computing it (half a minute on 2
    cores).
    """
    table = gradient_agreement(config, batch_sizes, reference, repeats)
    return {"config": {k: config[k] for k in GRADIENT_KEYS},
            "batch_sizes": list(batch_sizes), "reference": reference, "repeats": repeats,
            "cosine": {method: {str(B): value for B, value in row.items()}
                       for method, row in table.items()}}


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total, enabled):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="training", unit="step", file=sys.stderr)


BOOTSTRAP = 10_000
"""Resamples of the percentile bootstrap over seeds."""


def bootstrap_interval(values, level=0.95, resamples=BOOTSTRAP, seed=0):
    r"""Percentile bootstrap interval of the mean of ``values`` (one per seed).

    Draws ``resamples`` samples of the seeds with replacement, computes the mean of each, and
    returns the $(1 - \text{level})/2$ and $(1 + \text{level})/2$ quantiles of those means.
    With few seeds the interval is narrow-biased (it cannot reach beyond the observed values).

    Examples
    --------
    >>> bootstrap_interval([2.0, 2.0, 2.0])
    (2.0, 2.0)
    >>> low, high = bootstrap_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    >>> 1.0 <= low < 3.0 < high <= 5.0
    True
    """
    import numpy as np

    means = _resampled_means(values, np.random.default_rng(seed), resamples)
    return _percentile_interval(means, level)


def _resampled_means(values, rng, resamples):
    """The means of ``resamples`` draws of the seeds' values, with replacement: (resamples,)."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    return x[rng.integers(0, len(x), (resamples, len(x)))].mean(axis=1)


def _percentile_interval(draws, level):
    import numpy as np

    alpha = (1 - level) / 2
    return float(np.quantile(draws, alpha)), float(np.quantile(draws, 1 - alpha))


def _ratio_interval(numerator, denominator, level=0.95, resamples=BOOTSTRAP, seed=0):
    """Percentile bootstrap of mean(numerator) / mean(denominator), seeds resampled
    independently for the two methods."""
    import numpy as np

    rng = np.random.default_rng(seed)
    # The numerator's draws first, then the denominator's, from one generator.
    numerator_means = _resampled_means(numerator, rng, resamples)
    return _percentile_interval(numerator_means / _resampled_means(denominator, rng, resamples),
                                level)


def headline(results):
    """Per method: samples and seconds to first reach ``target_fraction`` of the teacher (on
    the test prompts), final accuracy and reverse KL, each as a mean over seeds with its 95%
    percentile bootstrap interval.

    Returns ``{method: {"lr", "reached" (seeds that reach the target), "seeds", "samples",
    "seconds", "final_accuracy", "final_reverse_kl", "initial_accuracy",
    "initial_reverse_kl"}}``; each statistic is ``{"mean", "low", "high", "per_seed"}``.
    ``samples`` and ``seconds`` are None when some seed never reaches the target; their
    ``per_seed`` lists hold None for those seeds.
    """
    target = results["config"]["target_fraction"] * results["teacher_accuracy"]
    table = {}

    def stat(values):
        if any(v is None for v in values):
            return None
        low, high = bootstrap_interval(values)
        return dict(mean=sum(values) / len(values), low=low, high=high, per_seed=list(values))

    for method, record in results["methods"].items():
        hits = [_first_index(acc, target) for acc in record["accuracy"]]
        samples = [None if i is None else record["samples"][i] for i in hits]
        seconds = [None if i is None else record["seconds"][s][i] for s, i in enumerate(hits)]
        row = dict(lr=record.get("lr"), seeds=len(hits),
                   reached=sum(i is not None for i in hits))
        row["samples"], row["seconds"] = stat(samples), stat(seconds)
        row["samples_per_seed"] = samples
        for key, name, index in (("accuracy", "final_accuracy", -1),
                                 ("reverse_kl", "final_reverse_kl", -1),
                                 ("accuracy", "initial_accuracy", 0),
                                 ("reverse_kl", "initial_reverse_kl", 0)):
            row[name] = stat([curve[index] for curve in record[key]])
        table[method] = row
    return table


def _first_index(accuracy, target):
    """Index of the first evaluation with accuracy >= target, or None."""
    return next((i for i, a in enumerate(accuracy) if a >= target), None)


def ratios(results):
    """Samples to the target of RL and SFT over full-vocabulary OPD's: ``{name: dict}`` with
    ``mean`` (ratio of the means), ``low``, ``high`` (95% percentile bootstrap, seeds of the two
    methods resampled independently) and ``bound``: True when the other method misses the
    target on some seed, and the ratio is then a lower bound, the budget in place of each miss.
    """
    table = headline(results)
    out = {}
    base = table.get("opd_full_vocab")
    if base is None or base["samples"] is None or base["samples"]["mean"] == 0:
        return out  # no ratio to a method that never reaches the target, or starts there
    budget = results["config"]["steps"] * results["config"]["batch_size"]
    for other in ("rl", "sft", "opd_sampled"):
        if other not in table:
            continue
        per_seed = table[other]["samples_per_seed"]
        bound = any(v is None for v in per_seed)
        values = [budget if v is None else v for v in per_seed]
        mean = (sum(values) / len(values)) / base["samples"]["mean"]
        low, high = _ratio_interval(values, base["samples"]["per_seed"])
        out[other] = dict(mean=mean, low=low, high=high, bound=bound,
                          reached=table[other]["reached"], seeds=table[other]["seeds"])
    return out


def _interval_text(stat, fmt):
    return f"{fmt(stat['mean'])} [{fmt(stat['low'])}, {fmt(stat['high'])}]"


def format_headline(results):
    """The summary table as text (Markdown): means over seeds with 95% bootstrap intervals,
    and the ratios to full-vocabulary OPD."""
    table = headline(results)
    config = results["config"]
    target = config["target_fraction"]
    budget = config["steps"] * config["batch_size"]
    lines = [f"teacher accuracy {results['teacher_accuracy']:.3f} on the test prompts; target "
             f"{target:.0%} of it = {target * results['teacher_accuracy']:.3f}; "
             f"{config['seeds']} seeds per method, budget {budget:,} student samples; mean "
             "[95% percentile bootstrap interval over seeds]", "",
             "| method | lr (chosen on validation) | seeds at target | samples to target "
             "| seconds to target | final acc. | final reverse KL |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for method, row in table.items():
        if row["samples"] is None:
            samples = seconds = "never" if row["reached"] == 0 else "not every seed"
        else:
            samples = _interval_text(row["samples"], lambda x: f"{x:,.0f}")
            seconds = _interval_text(row["seconds"], lambda x: f"{x:.2f}")
        lines.append(f"| {method} | {row['lr']:g} | {row['reached']}/{row['seeds']} "
                     f"| {samples} | {seconds} "
                     f"| {_interval_text(row['final_accuracy'], lambda x: f'{x:.3f}')} "
                     f"| {_interval_text(row['final_reverse_kl'], lambda x: f'{x:.3f}')} |")
    found = ratios(results)
    if found:
        lines.append("")
    for other, r in found.items():
        text = f"{r['mean']:.1f}x [{r['low']:.1f}, {r['high']:.1f}]"
        if r["bound"]:
            text = (f"at least {text} ({r['seeds'] - r['reached']} of {r['seeds']} seeds "
                    "never reach the target; each counted at the budget)")
        lines.append(f"- samples to target, {other} / opd_full_vocab: {text}")
    return "\n".join(lines)


def _band(curves):
    """Mean and 95% percentile-bootstrap band over seeds at each evaluation point."""
    columns = list(zip(*curves))
    mean = [sum(c) / len(c) for c in columns]
    bands = [bootstrap_interval(c, resamples=2000) for c in columns]
    return mean, [b[0] for b in bands], [b[1] for b in bands]


def write_plots(results, out_dir, prefix=""):
    """``accuracy.png`` and ``reverse_kl.png`` against student samples: the mean over seeds
    of each method, with its 95% bootstrap band; the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    seeds = results["config"]["seeds"]
    target = results["config"]["target_fraction"] * results["teacher_accuracy"]
    for key, label, title in (
            ("accuracy", "greedy accuracy (test prompts)", "Greedy accuracy"),
            ("reverse_kl", "reverse KL per token, own samples", "Reverse KL to the teacher")):
        fig, ax = plt.subplots(figsize=(7.5, 4), dpi=110)
        for method, record in results["methods"].items():
            mean, low, high = _band(record[key])
            line, = ax.plot(record["samples"], mean, marker=".", label=method)
            ax.fill_between(record["samples"], low, high, color=line.get_color(), alpha=0.2)
        if key == "accuracy":
            ax.axhline(target, color="k", ls="--", lw=1,
                       label=f"target ({results['config']['target_fraction']:.0%} of teacher)")
        else:
            ax.set_yscale("log")
        ax.set_xlabel("student samples")
        ax.set_ylabel(label)
        ax.set_title(f"{title}: mean of {seeds} seeds, 95% bootstrap band")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = pathlib.Path(out_dir) / f"{prefix}{key}.png"
        fig.savefig(path, metadata={"Software": None})
        plt.close(fig)
        paths.append(path)
    return paths


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line, exit code 2: what a script calling us can parse.
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _methods(text):
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method {', '.join(unknown) or text!r}; choose from {', '.join(METHODS)}")
    repeated = sorted({m for m in names if names.count(m) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"method {', '.join(repeated)} given more than once "
                                         "(each method is run once)")
    return names


def build_parser():
    """The ``opd-experiment`` argument parser."""
    parser = _Parser(prog="opd-experiment", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the smaller QUICK configuration, for tests and smoke checks (about "
                             "11 s on 2 cores with the teacher cached)")
    parser.add_argument("--long", action="store_true",
                        help="the second regime, LONG: three-digit operands (longer answers)")
    parser.add_argument("--out", default="runs/latest",
                        help="output folder, created if missing (default %(default)s)")
    parser.add_argument("--methods", type=_methods, default=list(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}, each at most once")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"random seed (default {DEFAULTS['seed']})")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help=f"updates per method and learning rate (default {DEFAULTS['steps']}"
                             f", with --quick {QUICK['steps']})")
    parser.add_argument("--seeds", type=_positive_int, default=None,
                        help=f"seeds per method and learning rate (default {DEFAULTS['seeds']}, "
                             f"with --quick {QUICK['seeds']})")
    parser.add_argument("--gradient-agreement", action="store_true",
                        help="instead of training, write gradient_agreement.json (the table of "
                             "the OPD chapter, from the configuration's weak student) to --out")
    parser.add_argument("--no-cache", action="store_true",
                        help="retrain the teacher instead of loading it, and rewrite its cache "
                             "file (which also repairs a corrupt one)")
    parser.add_argument("--workers", type=_positive_int, default=None,
                        help="processes training the methods side by side, one thread each "
                             "(default: one per CPU, at most one per method; here "
                             f"{min(len(METHODS), available_cpus())}); the numbers do not "
                             "depend on it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _check_out(parser, text):
    """Create ``--out`` and write a test file into it, before any work: a bad folder fails in a
    second with one line, not after the training with a traceback."""
    out_dir = pathlib.Path(text)
    if out_dir.exists() and not out_dir.is_dir():
        parser.error(f"--out {text!r} exists and is not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {text!r} cannot be created: {error.strerror or error}")
    try:
        with tempfile.TemporaryFile(dir=out_dir) as probe:
            probe.write(b"write test")
    except OSError as error:
        parser.error(f"--out {text!r} is not writable: {error.strerror or error}")
    return out_dir


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it takes Ctrl-C's clean-up path."""


def main(argv=None):
    """The command line (see ``--help``).

    Bad arguments, an ``--out`` that cannot be created or written, or a method named twice
    exit with code 2 and one line on stderr, before any training. Ctrl-C exits with code 130,
    and SIGTERM with 143, after one line saying what was kept: the teacher cache, and the
    methods finished so far, saved in ``results.partial.json`` in ``--out`` after each method;
    either stops the worker processes first. A worker process that fails exits with code 1: a
    line saying which method and what was kept, then the worker's traceback, if it sent one.
    Signals can only be handled in the main thread: called from another thread, ``main``
    neither handles SIGTERM nor starts its workers with SIGINT ignored.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick and args.long:
        parser.error("--quick and --long are two configurations; choose one")
    out_dir = _check_out(parser, args.out)
    config = dict(QUICK if args.quick else LONG if args.long else DEFAULTS)
    if args.seed is not None:
        config["seed"] = args.seed
    if args.steps is not None:
        config["steps"] = args.steps
    if args.seeds is not None:
        config["seeds"] = args.seeds
    if args.gradient_agreement:
        path = out_dir / "gradient_agreement.json"
        record = gradient_agreement_record(config)
        _replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(record, indent=1)))
        print(f"wrote {path}")
        return 0
    cache = "refresh" if args.no_cache else "read"
    partial = out_dir / "results.partial.json"
    finished = []

    def save_partial(results):
        _replace_atomically(partial, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
        finished[:] = list(results["methods"])

    results_path = out_dir / "results.json"
    written = []

    def kept():
        teacher = teacher_cache_path(config)
        if written:
            methods = f"every method in {results_path} (the plots were not written)"
        elif finished:
            methods = f"finished methods {', '.join(finished)} in {partial}"
        else:
            methods = "no finished method"
        teacher_text = f"teacher cache {teacher}" if teacher.exists() else "no teacher cache"
        return f"kept: {teacher_text}; {methods}"

    def terminated(number, frame):
        raise _Terminated  # the same clean-up as Ctrl-C

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if on_main_thread else None
    try:
        workers = args.workers or min(len(args.methods), available_cpus())
        results = run_experiment(config, args.methods, progress=not args.no_progress,
                                 cache=cache, on_method=save_partial, workers=workers)
        _replace_atomically(results_path,
                            lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
        written.append(results_path)
        partial.unlink(missing_ok=True)  # superseded by results.json
        write_plots(results, out_dir)
    except KeyboardInterrupt as stop:
        number = signal.SIGTERM if isinstance(stop, _Terminated) else signal.SIGINT
        what = "terminated (SIGTERM)" if number == signal.SIGTERM else "interrupted"
        print(f"opd-experiment: {what}; {kept()}", file=sys.stderr)
        return 128 + number
    except WorkerError as error:
        # the worker's traceback is for a bug report; the first line says what happened
        print(f"opd-experiment: error: {str(error).splitlines()[0]}; {kept()}", file=sys.stderr)
        for line in str(error).splitlines()[1:]:
            print(f"  {line}", file=sys.stderr)
        return 1
    finally:
        if on_main_thread and previous is not None:  # None: set from C, cannot be restored
            signal.signal(signal.SIGTERM, previous)
    print(format_headline(results))
    print(f"\nwrote {results_path}, accuracy.png, reverse_kl.png")
    return 0

if __name__ == "__main__":
    sys.exit(main())
