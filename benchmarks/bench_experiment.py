"""Benchmark: the cost of a rollout and of a training step of each method of the OPD experiment.

Run: ``python benchmarks/bench_experiment.py``. Prints the milliseconds of one rollout of a
batch (sampling, then the teacher-forced pass with gradient) for the default student and
teacher, and the training steps per second of each method at the default batch size (the
teacher comes from the cache, or is trained once first). The figures the docs state (the
rollout time in ``opd_literate.tinylm``) are what this prints on a 2-core machine.
"""

import time

import torch

from opd_literate import tinylm as lm
from opd_literate.run import DEFAULTS, METHODS, _split, _step_loss, train_teacher


def _best_ms(function, repeats=200):
    """The fastest of ``repeats`` calls, in ms (the least disturbed by other processes)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main(steps=100):
    config = dict(DEFAULTS)
    train_pairs, _ = _split(config)
    teacher, _ = train_teacher(config, train_pairs, lm.answer_tokens(train_pairs))
    B = config["batch_size"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {B}")
    torch.manual_seed(0)
    student = lm.TinyLM(config["student_hidden"], config["student_layers"])
    prompts = lm.make_prompts(train_pairs[:B])
    gen = torch.Generator().manual_seed(0)
    for name, model in (("student", student), ("teacher", teacher)):
        sample = _best_ms(lambda model=model: lm.sample_tokens(model, prompts, gen))
        full = _best_ms(lambda model=model: lm.rollout(model, prompts, gen))
        print(f"  rollout of {B}, {name:7s}: {full:.2f} ms (sampling alone {sample:.2f} ms), "
              "fastest of 200")
    print(f"{steps} steps per method:")
    for method in METHODS:
        torch.manual_seed(0)
        student = lm.TinyLM(config["student_hidden"], config["student_layers"])
        optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        for _ in range(steps):
            idx = torch.randint(0, len(train_pairs), (B,), generator=gen)
            loss, _ = _step_loss(method, student, teacher, train_pairs[idx], config, gen)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        elapsed = time.perf_counter() - start
        print(f"  {method:15s} {steps / elapsed:7.1f} steps/s  "
              f"({1e3 * elapsed / steps:.2f} ms/step)")


if __name__ == "__main__":
    main()
