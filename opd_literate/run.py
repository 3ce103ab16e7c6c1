r"""The OPD experiment: on-policy distillation against off-policy distillation and RL.

``python -m opd_literate.run`` (or ``opd-experiment``) trains a strong teacher on two-digit
addition ([opd_literate.tinylm][]), or loads it from a cache keyed by its configuration, makes
a weak student (narrower, briefly trained), and then trains one copy of the student per
method and learning rate, with the same optimizer, the same learning-rate grid, the same
stream of prompts and the same number of samples per step (``batch_size``; RL answers the
first ``batch_size / group`` prompts of each step, ``group`` times each):

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

Every evaluation point records the student samples used so far, the greedy accuracy on
held-out prompts, the per-token reverse KL to the teacher on the student's own samples, and
the seconds spent in training steps so far (evaluations excluded). The headline is, per
method, the samples and seconds needed to first reach 90% of the teacher's accuracy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import time
import uuid

import filelock
import torch

from . import tinylm as lm
from .opd import full_vocab_reverse_kl, opd_pg_loss, reverse_kl_rewards

__all__ = ["DEFAULTS", "QUICK", "METHODS", "CACHE_MODES", "prepare", "run_experiment",
           "train_teacher", "teacher_cache_path", "headline", "format_headline",
           "gradient_agreement", "write_plots", "main"]

METHODS = ("opd_sampled", "opd_full_vocab", "sft", "rl")

DEFAULTS = dict(
    seed=0, steps=600, batch_size=64, group=4, lrs=[3e-4, 1e-3, 3e-3], warmup_steps=30,
    eval_every=30, eval_prompts=1000, held_out=2000, pretrain_lr=3e-3,
    teacher_hidden=256, teacher_layers=2, teacher_steps=400, teacher_batch=256,
    teacher_label_smoothing=0.1,
    student_hidden=128, student_layers=2, student_pretrain_steps=200, student_pretrain_batch=64,
    target_fraction=0.9,
)
"""The default experiment (about 70 s on 2 CPU cores with the teacher cached, about 150 s the
first time, which trains it).

Each method is trained once per learning rate in ``lrs`` and reported at its best one: a common
grid, so that no method is compared at a step size that suits only the others. The site's
figures come from the committed results of this configuration.
"""
QUICK = dict(DEFAULTS, steps=80, batch_size=256, lrs=[3e-3], eval_every=20, eval_prompts=500,
             teacher_steps=250)
"""``--quick``: the same pipeline, smaller, for the tests and smoke checks (about 12 s on
2 CPU cores with the teacher cached)."""


def _cache_dir():
    return pathlib.Path(os.environ.get("OPD_LITERATE_CACHE",
                                       pathlib.Path.home() / ".cache" / "opd_literate"))


def _split(config):
    """All 10,000 operand pairs, shuffled by the seed: (train pairs, held-out pairs)."""
    pairs = torch.cartesian_prod(torch.arange(100), torch.arange(100))
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(config["seed"]))
    held = config["held_out"]
    return pairs[order[held:]], pairs[order[:held]]


def _supervised(model, pairs, answers, steps, batch, lr, generator, label_smoothing=0.0):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(pairs), (batch,), generator=generator)
        loss = lm.supervised_loss(model, lm.make_prompts(pairs[idx]), answers[idx],
                                  label_smoothing)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


CACHE_MODES = ("read", "refresh", "off")
"""How [opd_literate.run.train_teacher][] uses its cache file.

``read`` loads a valid cached teacher, and trains and caches it when the file is missing or
fails verification; ``refresh`` (the CLI's ``--no-cache``) always trains and rewrites the
file, so it also repairs a corrupt one; ``off`` neither reads nor writes it.
"""

_TEACHER_KEYS = ("seed", "held_out", "teacher_hidden", "teacher_layers", "teacher_steps",
                 "teacher_batch", "pretrain_lr", "teacher_label_smoothing")


def teacher_cache_path(config):
    """The cache file of the teacher of ``config``: keyed by the settings that shape it."""
    key = hashlib.sha256(json.dumps({k: config[k] for k in _TEACHER_KEYS},
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
    [opd_literate.run.CACHE_MODES][]. The cache file (see
    [opd_literate.run.teacher_cache_path][]) holds the weights and their SHA-256; a file that
    does not load or does not match its checksum is reported in one line on stderr and rebuilt.
    A file lock beside it makes concurrent runs safe: the first trains and writes, the others
    wait and then load its file.
    """
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")

    def trained():
        torch.manual_seed(config["seed"])  # the initial weights
        teacher = lm.TinyLM(config["teacher_hidden"], config["teacher_layers"])
        _supervised(teacher, train_pairs, train_answers, config["teacher_steps"],
                    config["teacher_batch"], config["pretrain_lr"],
                    torch.Generator().manual_seed(config["seed"] + 1),
                    config["teacher_label_smoothing"])
        return teacher.eval()

    if cache == "off":
        return trained(), False
    path = teacher_cache_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{path}.lock"):
        if cache == "read" and path.exists():
            cached = lm.TinyLM(config["teacher_hidden"], config["teacher_layers"])
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


def _step_loss(method, student, teacher, pairs, config, generator):
    """One update's loss and the number of samples it used."""
    B = config["batch_size"]
    if method == "rl":
        # B samples: B / group prompts, group samples each, group-mean baseline.
        group = config["group"]
        prompts = lm.make_prompts(pairs[: B // group].repeat_interleave(group, dim=0))
        answers = lm.answer_tokens(pairs[: B // group]).repeat_interleave(group, dim=0)
        out = lm.rollout(student, prompts, generator)
        reward = (out.tokens == answers).all(dim=1).float()  # (B,)
        advantage = reward - reward.view(-1, group).mean(dim=1).repeat_interleave(group)
        per_token_advantage = advantage[:, None].expand_as(out.logp)
        return opd_pg_loss(out.logp, per_token_advantage, out.mask), len(prompts)
    prompts = lm.make_prompts(pairs[:B])
    if method == "sft":
        teacher_tokens, _ = lm.sample_tokens(teacher, prompts, generator)
        return lm.supervised_loss(student, prompts, teacher_tokens), B
    out = lm.rollout(student, prompts, generator)
    teacher_logp, teacher_logits = lm.score(teacher, prompts, out.tokens)
    if method == "opd_sampled":
        rewards = reverse_kl_rewards(out.logp, teacher_logp, out.mask)
        return opd_pg_loss(out.logp, rewards, out.mask), B
    if method == "opd_full_vocab":
        return full_vocab_reverse_kl(out.logits, teacher_logits, out.mask), B
    raise ValueError(f"unknown method {method!r}")


def _evaluate(student, teacher, eval_pairs, seed):
    return (lm.greedy_accuracy(student, eval_pairs),
            lm.reverse_kl_on_own_samples(student, teacher, eval_pairs,
                                         torch.Generator().manual_seed(seed)))


def prepare(config, cache="read"):
    """Data split, teacher and the weak student's initial weights, as every method starts.

    ``cache``: how the teacher's cache file is used, one of [opd_literate.run.CACHE_MODES][].
    """
    torch.manual_seed(config["seed"])
    train_pairs, held_out = _split(config)
    train_answers = lm.answer_tokens(train_pairs)
    eval_pairs = held_out[: config["eval_prompts"]]
    teacher, cached = train_teacher(config, train_pairs, train_answers, cache)
    teacher.requires_grad_(False)

    torch.manual_seed(config["seed"] + 2)
    student0 = lm.TinyLM(config["student_hidden"], config["student_layers"])
    _supervised(student0, train_pairs, train_answers, config["student_pretrain_steps"],
                config["student_pretrain_batch"], config["pretrain_lr"],
                torch.Generator().manual_seed(config["seed"] + 3))
    initial_state = {k: v.clone() for k, v in student0.state_dict().items()}
    return train_pairs, eval_pairs, teacher, cached, initial_state


def run_experiment(config, methods=METHODS, progress=True, cache="read", on_method=None):
    """Run every method; return the ``results.json`` dictionary.

    ``cache`` is one of [opd_literate.run.CACHE_MODES][]. ``on_method``, if given, is called
    after each method with the results so far (the same dictionary, holding the methods
    finished): the CLI saves them, so that an interrupted run keeps its finished methods.
    """
    methods = list(methods)
    unknown = [m for m in methods if m not in METHODS]
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if unknown or repeated or not methods:
        raise ValueError(f"methods must be distinct names from {', '.join(METHODS)}; got "
                         f"{methods!r}")
    train_pairs, eval_pairs, teacher, cached, initial_state = prepare(config, cache)
    teacher_accuracy = lm.greedy_accuracy(teacher, eval_pairs)

    bar = _progress(len(methods) * len(config["lrs"]) * config["steps"], progress)
    target = config["target_fraction"] * teacher_accuracy
    results, search = {}, {}
    summary = {"teacher_accuracy": teacher_accuracy, "teacher_cached": cached, "config": config,
               "methods": results, "lr_search": search}
    try:
        for method in methods:
            runs = {lr: _train_one(method, lr, initial_state, teacher, train_pairs, eval_pairs,
                                   config, bar) for lr in config["lrs"]}
            best = min(runs, key=lambda lr: _rank(runs[lr], target))
            results[method] = dict(runs[best], lr=best)
            search[method] = {str(lr): dict(samples_to_target=_first_hit(run, target)[0],
                                            final_accuracy=run["accuracy"][-1])
                              for lr, run in runs.items()}
            if on_method is not None:
                on_method(summary)
    finally:
        bar.close()
    return summary


def _train_one(method, lr, initial_state, teacher, train_pairs, eval_pairs, config, bar):
    """Train one copy of the student with one method and learning rate; return its record."""
    student = lm.TinyLM(config["student_hidden"], config["student_layers"])
    student.load_state_dict(initial_state)
    optimizer = torch.optim.Adam(student.parameters(), lr=lr)
    # Linear warm-up: Adam's first steps move every weight by about lr whatever the gradient's
    # size, which a noisy estimator (sampled-token OPD, RL) turns into a random jump.
    warmup = max(config["warmup_steps"], 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / warmup))
    # The same prompt stream and sampling seed for every method and learning rate.
    prompt_gen = torch.Generator().manual_seed(config["seed"] + 10)
    sample_gen = torch.Generator().manual_seed(config["seed"] + 11)
    record = {"samples": [], "accuracy": [], "reverse_kl": [], "seconds": []}
    samples, elapsed = 0, 0.0

    def log():
        accuracy, kl = _evaluate(student, teacher, eval_pairs, config["seed"] + 12)
        for name, value in zip(record, (samples, accuracy, kl, round(elapsed, 4))):
            record[name].append(value)

    log()
    for step in range(1, config["steps"] + 1):
        start = time.perf_counter()
        idx = torch.randint(0, len(train_pairs), (config["batch_size"],), generator=prompt_gen)
        loss, used = _step_loss(method, student, teacher, train_pairs[idx], config, sample_gen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        elapsed += time.perf_counter() - start  # training time only, not evaluation
        samples += used
        bar.update(1)
        if step % config["eval_every"] == 0 or step == config["steps"]:
            log()
    return record


def _first_hit(record, target):
    """(samples, seconds) at the first evaluation with accuracy >= target, or (None, None)."""
    hit = next((i for i, a in enumerate(record["accuracy"]) if a >= target), None)
    return (None, None) if hit is None else (record["samples"][hit], record["seconds"][hit])


def _rank(record, target):
    """Sort key of a run: fewest samples to the target first, then the best final accuracy."""
    samples, _ = _first_hit(record, target)
    return (samples is None, samples or 0, -record["accuracy"][-1])


def gradient_agreement(config, batch_sizes=(16, 64, 256), reference=4096, repeats=4):
    r"""How well one batch's OPD gradient points along the expected gradient.

    For the weak student of ``config`` (before any OPD update), the expected gradient of each
    OPD loss is estimated from ``reference`` fresh rollouts; each batch of ``B`` rollouts then
    gives a gradient, and its cosine with the reference measures how much of it is signal
    rather than sampling noise (1 would mean none; the reference is itself an estimate from
    finitely many rollouts).
    Returns ``{method: {B: mean cosine over repeats}}`` for ``opd_sampled`` and
    ``opd_full_vocab``. Both reference gradients are computed at the same rollouts.
    """
    train_pairs, _, teacher, _, initial_state = prepare(config)
    student = lm.TinyLM(config["student_hidden"], config["student_layers"])
    student.load_state_dict(initial_state)
    generator = torch.Generator().manual_seed(config["seed"] + 20)

    def gradients(pairs):
        prompts = lm.make_prompts(pairs)
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


def headline(results):
    """Per method: samples and seconds to first reach ``target_fraction`` of the teacher.

    Returns ``{method: {"samples": int or None, "seconds": float or None, "lr",
    "initial_accuracy", "final_accuracy", "initial_reverse_kl", "final_reverse_kl"}}``; None
    means never within the budget.
    """
    target = results["config"]["target_fraction"] * results["teacher_accuracy"]
    table = {}
    for method, record in results["methods"].items():
        samples, seconds = _first_hit(record, target)
        table[method] = dict(
            samples=samples, seconds=seconds, lr=record.get("lr"),
            final_accuracy=record["accuracy"][-1],
            final_reverse_kl=record["reverse_kl"][-1],
            initial_accuracy=record["accuracy"][0],
            initial_reverse_kl=record["reverse_kl"][0],
        )
    return table


def format_headline(results):
    """The summary table as text (Markdown), with the RL/OPD and SFT/OPD ratios."""
    table = headline(results)
    target = results["config"]["target_fraction"]
    lines = [f"teacher accuracy {results['teacher_accuracy']:.3f}; target "
             f"{target:.0%} of it = {target * results['teacher_accuracy']:.3f}", "",
             "| method | best lr | start acc. | final acc. | final reverse KL "
             "| samples to target | seconds to target |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for method, row in table.items():
        samples = "never" if row["samples"] is None else f"{row['samples']:,}"
        seconds = "never" if row["seconds"] is None else f"{row['seconds']:.2f}"
        lines.append(f"| {method} | {row['lr']:g} | {row['initial_accuracy']:.3f} "
                     f"| {row['final_accuracy']:.3f} "
                     f"| {row['final_reverse_kl']:.4f} | {samples} | {seconds} |")
    opd = [table[m]["samples"] for m in ("opd_sampled", "opd_full_vocab")
           if m in table and table[m]["samples"] is not None]
    if opd:
        best = min(opd)
        lines.append("")
        for other in ("rl", "sft"):
            if other in table:
                ratio = ("never reached (ratio > "
                         f"{results['methods'][other]['samples'][-1] / best:.1f}x)"
                         if table[other]["samples"] is None
                         else f"{table[other]['samples'] / best:.1f}x")
                lines.append(f"- samples {other.upper()} / best OPD: {ratio}")
    return "\n".join(lines)


def write_plots(results, out_dir):
    """``accuracy.png`` and ``reverse_kl.png`` against student samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label in (("accuracy", "greedy accuracy (held-out)"),
                       ("reverse_kl", "reverse KL per token, own samples")):
        fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
        for method, record in results["methods"].items():
            ax.plot(record["samples"], record[key], marker=".", label=method)
        if key == "accuracy":
            ax.axhline(results["teacher_accuracy"], color="k", ls="--", lw=1, label="teacher")
        else:
            ax.set_yscale("log")
        ax.set_xlabel("student samples")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = pathlib.Path(out_dir) / f"{key}.png"
        fig.savefig(path)
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
                             "12 s on 2 cores with the teacher cached)")
    parser.add_argument("--out", default="runs/latest",
                        help="output folder, created if missing (default %(default)s)")
    parser.add_argument("--methods", type=_methods, default=list(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}, each at most once")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"random seed (default {DEFAULTS['seed']})")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help=f"updates per method and learning rate (default {DEFAULTS['steps']}"
                             f", with --quick {QUICK['steps']})")
    parser.add_argument("--no-cache", action="store_true",
                        help="retrain the teacher instead of loading it, and rewrite its cache "
                             "file (which also repairs a corrupt one)")
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


def main(argv=None):
    """The command line (see ``--help``).

    Bad arguments, an ``--out`` that cannot be created or written, or a method named twice
    exit with code 2 and one line on stderr, before any training. Ctrl-C exits with code 130
    and one line saying what was kept: the teacher cache, and the methods finished so far,
    saved in ``results.partial.json`` in ``--out`` after each method.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    out_dir = _check_out(parser, args.out)
    config = dict(QUICK if args.quick else DEFAULTS)
    if args.seed is not None:
        config["seed"] = args.seed
    if args.steps is not None:
        config["steps"] = args.steps
    cache = "refresh" if args.no_cache else "read"
    partial = out_dir / "results.partial.json"
    finished = []

    def save_partial(results):
        _replace_atomically(partial, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
        finished[:] = list(results["methods"])

    results_path = out_dir / "results.json"
    written = []
    try:
        results = run_experiment(config, args.methods, progress=not args.no_progress,
                                 cache=cache, on_method=save_partial)
        _replace_atomically(results_path,
                            lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
        written.append(results_path)
        partial.unlink(missing_ok=True)  # superseded by results.json
        write_plots(results, out_dir)
    except KeyboardInterrupt:
        teacher = teacher_cache_path(config)
        if written:
            methods = f"every method in {results_path} (the plots were not written)"
        elif finished:
            methods = f"finished methods {', '.join(finished)} in {partial}"
        else:
            methods = "no finished method"
        teacher_text = f"teacher cache {teacher}" if teacher.exists() else "no teacher cache"
        print(f"opd-experiment: interrupted; kept: {teacher_text}; {methods}", file=sys.stderr)
        return 130
    print(format_headline(results))
    print(f"\nwrote {results_path}, accuracy.png, reverse_kl.png")
    return 0

if __name__ == "__main__":
    sys.exit(main())
