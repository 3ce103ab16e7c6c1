"""Benchmark: exact moments of 8 estimators at 25 mismatch values, and make_toy's memory.

Target (issue 3): under 1 s on a 2-core machine. Run: ``python benchmarks/bench_estimators.py``.
"""

import time

import numpy as np

from opd_literate.mismatch.estimators import REGISTRY, comparison_table
from opd_literate.mismatch.toy import make_toy, toy_nbytes

NAMES = ["naive", "token_is", "seq_is", "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_rs"]


def main():
    mismatches = np.linspace(0.0, 1.5, 25)
    comparison_table(make_toy(), names=NAMES)  # warm-up: imports, allocator
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for m in mismatches:
            comparison_table(make_toy(mismatch=float(m)), names=NAMES)
        best = min(best, time.perf_counter() - start)
    print(f"{len(NAMES)} estimators x {len(mismatches)} mismatch values, exact moments "
          f"(toy built each time): {best:.3f} s (best of 3; target < 1 s)")

    toy = make_toy()
    start = time.perf_counter()
    comparison_table(toy)
    print(f"all {len(REGISTRY)} registered estimators on the default toy: "
          f"{time.perf_counter() - start:.3f} s")

    print("\nmake_toy memory (all arrays), T x V:")
    for T, V in [(6, 4), (8, 4), (6, 8), (10, 4), (8, 6), (12, 4)]:
        print(f"  T={T:2d} V={V}: M = {V**T:>10,d} sequences, {toy_nbytes(T, V) / 2**20:10.1f} MiB")


if __name__ == "__main__":
    main()
