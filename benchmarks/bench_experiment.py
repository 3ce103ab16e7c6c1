"""Benchmark: training steps per second of each method of the OPD experiment.

Run: ``python benchmarks/bench_experiment.py``. Prints steps/s at the default batch size (the
teacher comes from the cache, or is trained once first).
"""

import time

import torch

from opd_literate import tinylm as lm
from opd_literate.run import DEFAULTS, METHODS, _split, _step_loss, train_teacher


def main(steps=100):
    config = dict(DEFAULTS)
    train_pairs, _ = _split(config)
    teacher, _ = train_teacher(config, train_pairs, lm.answer_tokens(train_pairs))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"batch {config['batch_size']}, {steps} steps per method")
    for method in METHODS:
        torch.manual_seed(0)
        student = lm.TinyLM(config["student_hidden"], config["student_layers"])
        optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        for _ in range(steps):
            idx = torch.randint(0, len(train_pairs), (config["batch_size"],), generator=gen)
            loss, _ = _step_loss(method, student, teacher, train_pairs[idx], config, gen)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        elapsed = time.perf_counter() - start
        print(f"  {method:15s} {steps / elapsed:7.1f} steps/s  "
              f"({1e3 * elapsed / steps:.2f} ms/step)")


if __name__ == "__main__":
    main()
