"""Memory of building a support chunk by chunk (``large_vocab.supports.build_support``).

    python benchmarks/bench_supports.py            # 2,048 tokens, V = 151,936, k = 100
    python benchmarks/bench_supports.py --small    # a quick check while developing

For each rule that reads whole rows (the teacher's top-k, the student's, their union), each
dtype of the logits (bfloat16, as a model returns them, and float32) and two chunk sizes (128
rows, and all the rows at once), one process allocates the student's and the teacher's
``(tokens, V)`` logits, resets its peak resident set size (``VmHWM``), builds the support and
reports:

* the added peak RSS (MiB), and the same in ``(chunk, V)`` float32 buffers of the chunked run
  (the unit the module docstring counts in);
* a hash of the support's bytes, so that the chunked and the unchunked build are compared
  exactly (``same`` in the last column).

Each run has a process of its own, with every large block its own ``mmap`` (so that a freed
buffer leaves the RSS at once) and one thread.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys

FULL = {"tokens": 2048, "vocab": 151_936, "k": 100}
SMALL = {"tokens": 256, "vocab": 32_768, "k": 20}
RULES = ("teacher_topk", "student_topk", "union")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


def child(rule: str, dtype: str, tokens: int, vocab: int, k: int, chunk_size: int) -> dict:
    """Allocate the logits, build one support, measure the added peak RSS."""
    import torch

    from opd_literate.large_vocab.supports import build_support

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    kind = getattr(torch, dtype)
    student = torch.randn(tokens, vocab, generator=g).mul_(2).to(kind)
    teacher = torch.randn(tokens, vocab, generator=g).mul_(2).to(kind)
    build_support(rule, k, student[:2], teacher[:2], chunk_size=chunk_size)  # warm up
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # peak RSS := current RSS
    before = _status_kib("VmRSS")
    support = build_support(rule, k, student, teacher, chunk_size=chunk_size)
    peak = _status_kib("VmHWM")
    digest = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in support))
    return {"added_mib": (peak - before) / 1024, "sha256": digest.hexdigest(),
            "torch": torch.__version__, "output_mib": sum(t.numel() * t.element_size()
                                                          for t in support) / 2**20}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help=f"sizes {SMALL} instead of {FULL}")
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--child", nargs=3, metavar=("RULE", "DTYPE", "CHUNK"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = SMALL if args.small else FULL
    if args.child:
        rule, dtype, chunk = args.child
        print(json.dumps(child(rule, dtype, sizes["tokens"], sizes["vocab"], sizes["k"],
                               int(chunk))))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    buffer_mib = args.chunk_size * sizes["vocab"] * 4 / 2**20
    rows = []
    for dtype in ("bfloat16", "float32"):
        for rule in RULES:
            results = {}
            for chunk in (args.chunk_size, sizes["tokens"]):
                command = [sys.executable, __file__, "--child", rule, dtype, str(chunk)] + (
                    ["--small"] if args.small else [])
                out = subprocess.run(command, capture_output=True, text=True, check=True,
                                     env=env).stdout
                results[chunk] = json.loads(out.strip().splitlines()[-1])
            rows.append((dtype, rule, results))
    torch_version = rows[0][2][args.chunk_size]["torch"]
    print(f"bench_supports: {sizes['tokens']:,} tokens, V = {sizes['vocab']:,}, "
          f"k = {sizes['k']}, CPU ({platform.processor() or platform.machine()}), torch "
          f"{torch_version}, 1 thread; one (chunk, V) float32 buffer = {buffer_mib:.1f} MiB "
          f"at chunk_size {args.chunk_size}")
    print(f"{'logits':<10}{'rule':<14}{'chunked (MiB)':>15}{'buffers':>9}"
          f"{'unchunked (MiB)':>17}{'buffers':>9}  same")
    for dtype, rule, results in rows:
        chunked, whole = results[args.chunk_size], results[sizes["tokens"]]
        print(f"{dtype:<10}{rule:<14}{chunked['added_mib']:>15.1f}"
              f"{chunked['added_mib'] / buffer_mib:>9.2f}{whole['added_mib']:>17.1f}"
              f"{whole['added_mib'] / buffer_mib:>9.2f}  "
              f"{'yes' if chunked['sha256'] == whole['sha256'] else 'NO'}")
    print(f"the supports themselves (ids, valid, teacher log-probs): "
          f"{rows[0][2][args.chunk_size]['output_mib']:.1f} MiB (teacher_topk) to "
          f"{rows[2][2][args.chunk_size]['output_mib']:.1f} MiB (union)")


if __name__ == "__main__":
    main()
