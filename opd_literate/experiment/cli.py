r"""The OPD experiment: on-policy distillation against off-policy distillation and RL.

``python -m opd_literate.experiment`` (or ``opd-experiment``): the command line of
[opd_literate.experiment.run.run_experiment][]. It picks a configuration
([opd_literate.experiment.config][]: ``--quick``, ``--long``, or the default) with a few
overrides, runs the study or the gradient agreement, writes ``results.json`` and the figures
into ``--out``, and prints the headline table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import signal
import sys
import tempfile

from .._files import replace_atomically
from ._workers import Terminated, WorkerError, available_cpus, sigterm_as_interrupt
from .config import DEFAULT, LONG, METHODS, QUICK
from .plots import write_plots
from .run import gradient_agreement_record, run_experiment, teacher_cache_path
from .stats import format_headline

__all__ = ["build_parser", "main", "nucleus_disagreement_record"]


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
                        help=f"random seed (default {DEFAULT.seed})")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help=f"updates per method and learning rate (default {DEFAULT.steps}"
                             f", with --quick {QUICK.steps})")
    parser.add_argument("--seeds", type=_positive_int, default=None,
                        help=f"seeds per method and learning rate (default {DEFAULT.seeds}, "
                             f"with --quick {QUICK.seeds})")
    parser.add_argument("--gradient-agreement", action="store_true",
                        help="instead of training, write gradient_agreement.json (the table of "
                             "the OPD chapter, from the configuration's weak student) to --out")
    parser.add_argument("--clamp-study", action="store_true",
                        help="instead of training, write clamp_study.json (verl's clamped top-k "
                             "forward KL on the teacher against the weak students, exactly, with "
                             "the clamps of the config verl's trainer composes and with its "
                             "dataclass's; the large-vocabulary chapter's tables) to --out")
    parser.add_argument("--tinylm-mismatch", action="store_true",
                        help="instead of training, write tinylm_mismatch.json (the weak students "
                             "run as int8/int4/bf16/fp16 samplers: their mismatch, and every "
                             "estimator's exact bias on tinylm; the mismatch chapter's tables) "
                             "to --out")
    parser.add_argument("--nucleus-disagreement", action="store_true",
                        help="instead of training, write nucleus_disagreement.json (where vLLM's, "
                             "transformers' and SGLang's top-p keep another set than the exact "
                             "nucleus, over every four-token distribution in hundredths at every "
                             "top-p in hundredths; the mismatch chapter's table) to --out (under "
                             "15 s on 2 cores)")
    parser.add_argument("--mismatch-training", action="store_true",
                        help="instead of the study, train RL and sampled-token OPD with the weak "
                             "students' quantized samplers, with and without corrections, and "
                             "write mismatch_training.json and mismatch_training.png to --out "
                             "(about 3 minutes on 2 cores; --quick: under 30 s)")
    parser.add_argument("--strongest", action="store_true",
                        help="with --mismatch-training: the second study, the corrections of "
                             "STRONGEST_CORRECTIONS beside the uncorrected fp32 and int4 runs, "
                             "sequence TIS and KPop's mask (about 2 minutes on 2 cores)")
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


def _write_record(path, record):
    """One of the records the docs build reads, written atomically; the command's exit code."""
    replace_atomically(path, lambda tmp: tmp.write_text(json.dumps(record, indent=1)))
    print(f"wrote {path}")
    return 0


def nucleus_disagreement_record():
    """``nucleus_disagreement.json``: [opd_literate.mismatch.engine.nucleus_disagreement][] of
    every sampler of ``SAMPLERS``, at its defaults (four tokens, hundredths), with those arguments.

    Written by ``python -m opd_literate.experiment --nucleus-disagreement --out
    docs/data/engine`` (15.5 million rows a sampler, under 15 s on 2 cores); the docs build
    reads it. Every number of it is a count or a quotient of two integers, the same on any CPU
    whose float64 ``exp`` and ``log`` lie within 100 ulps of those of the machine that wrote it
    (``tests/mismatch/test_engine.py`` says why).
    """
    import inspect

    from ..mismatch.engine import SAMPLERS, nucleus_disagreement

    arguments = {name: parameter.default for name, parameter
                 in inspect.signature(nucleus_disagreement).parameters.items()
                 if parameter.default is not inspect.Parameter.empty}
    return {"arguments": arguments,
            "samplers": {s: nucleus_disagreement(s, **arguments) for s in SAMPLERS}}


def _interrupted(stop, kept):
    """Ctrl-C or SIGTERM: one line saying which and what was kept; the exit code 128 + N."""
    number = signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT
    what = "terminated (SIGTERM)" if number == signal.SIGTERM else "interrupted"
    print(f"opd-experiment: {what}; {kept}", file=sys.stderr)
    return 128 + number


def _worker_failed(error, kept):
    """A worker process failed: the first line says what happened and what was kept, the
    worker's traceback (for a bug report) follows, indented; the exit code 1."""
    lines = str(error).splitlines()
    print(f"opd-experiment: error: {lines[0]}; {kept}", file=sys.stderr)
    for line in lines[1:]:
        print(f"  {line}", file=sys.stderr)
    return 1


def _mismatch_training(parser, args, out_dir):
    """``--mismatch-training``: the study of
    [opd_literate.experiment.mismatch_training][], its record, its figure and its table."""
    from .mismatch_training import (
        MISMATCH_DEFAULT,
        MISMATCH_QUICK,
        MISMATCH_STRONGEST,
        format_summary,
        run_mismatch_training,
    )
    from .plots import write_mismatch_plot

    if args.long:
        parser.error("--mismatch-training runs the two-digit students; --long is not supported")
    study = MISMATCH_QUICK if args.quick else MISMATCH_DEFAULT
    if args.strongest:
        study = dataclasses.replace(study, levels=MISMATCH_STRONGEST.levels,
                                    corrections=MISMATCH_STRONGEST.corrections)
    # --seed and --seeds choose the students; --steps the study's own updates
    experiment = dataclasses.replace(study.experiment, **{
        name: value for name, value in (("seed", args.seed), ("seeds", args.seeds))
        if value is not None})
    study = dataclasses.replace(study, experiment=experiment,
                                steps=args.steps if args.steps is not None else study.steps)
    try:
        with sigterm_as_interrupt():
            workers = args.workers or min(2, available_cpus())
            results = run_mismatch_training(study, progress=not args.no_progress,
                                            workers=workers,
                                            cache="refresh" if args.no_cache else "read")
    except KeyboardInterrupt as stop:
        return _interrupted(stop, "nothing written")
    except WorkerError as error:
        return _worker_failed(error, "nothing written")
    _write_record(out_dir / "mismatch_training.json", results)
    write_mismatch_plot(results, out_dir / "mismatch_training.png")
    print(format_summary(results))
    print(f"wrote {out_dir / 'mismatch_training.png'}")
    return 0


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
    overrides = {name: value for name, value in
                 (("seed", args.seed), ("steps", args.steps), ("seeds", args.seeds))
                 if value is not None}
    config = dataclasses.replace(QUICK if args.quick else LONG if args.long else DEFAULT,
                                 **overrides)
    chosen = [name for name, flag in (("--gradient-agreement", args.gradient_agreement),
                                      ("--clamp-study", args.clamp_study),
                                      ("--tinylm-mismatch", args.tinylm_mismatch),
                                      ("--mismatch-training", args.mismatch_training),
                                      ("--nucleus-disagreement", args.nucleus_disagreement))
              if flag]
    if len(chosen) > 1:
        parser.error(f"{' and '.join(chosen)} write different files; choose one")
    if args.strongest and not args.mismatch_training:
        parser.error("--strongest chooses the corrections of --mismatch-training; it needs it")
    if args.nucleus_disagreement:
        # the count trains nothing and draws nothing: an option of the training is a mistake
        given = [option for option, value in (
            ("--quick", args.quick), ("--long", args.long), ("--seed", args.seed),
            ("--steps", args.steps), ("--seeds", args.seeds), ("--workers", args.workers),
            ("--no-cache", args.no_cache), ("--methods", args.methods != list(METHODS)))
            if value is not None and value is not False]  # --seed 0 is given too
        if given:
            parser.error(f"--nucleus-disagreement trains nothing; {' and '.join(given)} "
                         f"{'is' if len(given) == 1 else 'are'} not supported")
        return _write_record(out_dir / "nucleus_disagreement.json",
                             nucleus_disagreement_record())
    if args.mismatch_training:
        return _mismatch_training(parser, args, out_dir)
    if args.tinylm_mismatch:
        from .quantized import mismatch_study_record

        return _write_record(out_dir / "tinylm_mismatch.json", mismatch_study_record(
            config, cache="refresh" if args.no_cache else "read"))
    if args.clamp_study:
        from .exact import clamp_study_record

        return _write_record(out_dir / "clamp_study.json", clamp_study_record(
            config, cache="refresh" if args.no_cache else "read"))
    if args.gradient_agreement:
        return _write_record(out_dir / "gradient_agreement.json",
                             gradient_agreement_record(config))
    cache = "refresh" if args.no_cache else "read"
    partial = out_dir / "results.partial.json"
    finished = []

    def save_partial(results):
        replace_atomically(partial, lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
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

    try:
        with sigterm_as_interrupt():
            workers = args.workers or min(len(args.methods), available_cpus())
            results = run_experiment(config, args.methods, progress=not args.no_progress,
                                     cache=cache, on_method=save_partial, workers=workers)
            replace_atomically(results_path,
                               lambda tmp: tmp.write_text(json.dumps(results, indent=1)))
            written.append(results_path)
            partial.unlink(missing_ok=True)  # superseded by results.json
            write_plots(results, out_dir)
    except KeyboardInterrupt as stop:
        return _interrupted(stop, kept())
    except WorkerError as error:
        return _worker_failed(error, kept())
    print(format_headline(results))
    print(f"\nwrote {results_path}, accuracy.png, reverse_kl.png")
    return 0
