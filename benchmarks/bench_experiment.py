"""Benchmark: the OPD experiment's training step, batched against one model at a time.

Run: ``python benchmarks/bench_experiment.py``. For each method of the experiment it times
the training of the default run's ``M = seeds * len(lrs)`` students two ways, on one CPU
thread as the experiment runs:

* **batched**: one [opd_literate.experiment.tinylm.EnsembleLM][] of ``M`` models, one loss (the sum
  of
  the models' losses), one [opd_literate.experiment.ensemble.BatchedAdam][] step;
* **loop**: ``M`` separate TinyLMs, each with its own ``torch.optim.Adam``, stepped one after
  another (what the experiment did before it was batched).

Each is warmed up (``warmup`` steps, not timed), then timed over ``steps`` steps, ``repeats``
times; it prints the median of the repeats as model-steps per second (one model-step is one
update of one of the ``M`` students), so the two columns count the same work. It also prints
the milliseconds of one rollout of a batch (sampling, then the teacher-forced pass with
gradient) for one student, the figure stated in ``opd_literate.experiment.tinylm``. Other processes
slow it down: note the machine's load (``uptime``) beside the figures.
"""

import statistics
import time

import torch

from opd_literate.experiment import tinylm as lm
from opd_literate.experiment.config import DEFAULT, METHODS
from opd_literate.experiment.ensemble import BatchedAdam
from opd_literate.experiment.run import _split, train_teacher
from opd_literate.experiment.train import _method_loss


def _best_ms(function, repeats=200):
    """The fastest of ``repeats`` calls, in ms (the least disturbed by other processes)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def _timed(step, warmup, steps, repeats):
    """Median seconds of ``steps`` calls of ``step``, over ``repeats``, after a warm-up."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(steps=20, warmup=5, repeats=3):
    torch.set_num_threads(1)
    config = DEFAULT
    train_pairs, _ = _split(config)
    teacher, _ = train_teacher(config, train_pairs, lm.answer_tokens(train_pairs))
    teacher.requires_grad_(False)
    fast_teacher = lm.EnsembleLM.from_models([teacher]).requires_grad_(False)
    B, M = config.batch_size, config.seeds * len(config.lrs)
    print(f"torch {torch.__version__}, 1 thread, batch {B}, M = {M} students "
          f"({config.seeds} seeds x {len(config.lrs)} learning rates)")
    torch.manual_seed(0)
    student = lm.TinyLM(config.student_hidden, config.student_layers)
    prompts = lm.make_prompts(train_pairs[:B])
    gen = torch.Generator().manual_seed(0)
    full = _best_ms(lambda: lm.rollout(student, prompts, gen))
    print(f"rollout of {B} by one student: {full:.2f} ms, fastest of 200")
    print(f"model-steps per second, median of {repeats} x {steps} steps after {warmup} warm-up:")
    print(f"  {'method':15s} {'batched':>9s} {'loop':>9s}  speed-up")
    for method in METHODS:
        torch.manual_seed(0)
        models = [lm.TinyLM(config.student_hidden, config.student_layers)
                  for _ in range(M)]
        ensemble = lm.EnsembleLM.from_models(models)
        batched_opt = BatchedAdam(ensemble.parameters(), [1e-3] * M)
        loop_opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
        gen = torch.Generator().manual_seed(0)

        def batched_step(method=method, ensemble=ensemble, batched_opt=batched_opt, gen=gen):
            idx = torch.randint(0, len(train_pairs), (M, B), generator=gen)
            loss, _ = _method_loss(method, ensemble, fast_teacher, train_pairs[idx], config, gen)
            batched_opt.zero_grad()
            loss.backward()
            batched_opt.step()

        def loop_step(method=method, models=models, loop_opts=loop_opts, gen=gen):
            for model, optimizer in zip(models, loop_opts):
                idx = torch.randint(0, len(train_pairs), (B,), generator=gen)
                loss, _ = _method_loss(method, model, teacher, train_pairs[idx], config, gen)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

        batched = M * steps / _timed(batched_step, warmup, steps, repeats)
        loop = M * steps / _timed(loop_step, warmup, steps, repeats)
        print(f"  {method:15s} {batched:9.1f} {loop:9.1f}  {batched / loop:.2f}x")


if __name__ == "__main__":
    main()
