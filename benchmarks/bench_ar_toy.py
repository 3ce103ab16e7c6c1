"""Benchmark: every table and figure of the autoregressive section of docs/mismatch.md.

Target (issue 10): each under 2 s on a 2-core machine (V = 3, T up to 8). Prints, for each, the
best of 3 wall-clock times of the computation the docs hook runs (the figure without its
matplotlib drawing, which the hook adds), and the size of the toys.
Run: ``python benchmarks/bench_ar_toy.py``.
"""

import time

from opd_literate.mismatch.estimators import comparison_table, length_sweep
from opd_literate.mismatch.opd_mismatch import (
    OPD_RECIPES,
    PREFIX_RECIPES,
    add_teacher,
    opd_mismatch_table,
    reduction_table,
)
from opd_literate.mismatch.toy import ar_num_responses, ar_toy_nbytes, make_ar_toy, make_toy

SIZE = dict(T=5, V=3)


def estimator_table():
    comparison_table(make_toy(**SIZE, mismatch=0.3))
    comparison_table(make_ar_toy(**SIZE, mismatch=0.3))


def opd_table():
    for autoregressive in (False, True):
        opd_mismatch_table([0.1, 0.3, 1.0], **SIZE, recipes=OPD_RECIPES + PREFIX_RECIPES,
                           autoregressive=autoregressive)


def bias_against_length():
    names = ["token_is", "token_tis", "seq_is", "seq_tis"]
    for kwargs in (dict(eos=True), dict(eos=False), dict(autoregressive=False)):
        length_sweep(range(1, 9), names, mismatch=0.3, V=3, **kwargs)


def reductions():
    reduction_table(add_teacher(make_ar_toy(**SIZE)), batch_sizes=(1, 8))
    reduction_table(add_teacher(make_ar_toy(**SIZE, eos=False)), batch_sizes=(8,))


def best_of_3(fn):
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    estimator_table()  # warm-up: imports, allocator
    for name, fn in [("estimator table, independent and AR", estimator_table),
                     ("OPD recipes, 2 toys x 3 mismatches", opd_table),
                     ("bias against T = 1..8, 3 toys x 5 seeds", bias_against_length),
                     ("reductions, gamma 0/1, B 1/8", reductions)]:
        print(f"{name:42s} {best_of_3(fn):.3f} s (best of 3; target < 2 s)")
    print("\nmake_ar_toy size, V = 3, with <eos> / without:")
    for T in (5, 8, 12, 18):
        with_eos, without = ar_num_responses(T, 3), ar_num_responses(T, 3, eos=False)
        print(f"  T={T:2d}: M = {with_eos:>9,d} / {without:>12,d} responses, "
              f"{ar_toy_nbytes(T, 3) / 2**20:8.1f} MiB with <eos>")


if __name__ == "__main__":
    main()
