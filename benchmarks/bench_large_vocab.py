"""Memory and time of the full-vocabulary reverse KL: dense (``opd.py``) against chunked.

    python benchmarks/bench_large_vocab.py            # V = 151,936, H = 1,024, 2,048 tokens
    python benchmarks/bench_large_vocab.py --small    # a quick check while developing

Each variant runs in a process of its own, so that one's memory cannot hide in the other's. In
the process the inputs are allocated first: the student's hidden states and LM head (with their
gradient buffers already allocated, as after a first optimizer step) and the teacher's hidden
states and head, all float32 on the CPU. Then the peak resident set size (``VmHWM``) is reset
and one forward plus backward pass of the loss runs. Reported:

* added memory: peak RSS during the loss minus the RSS just before it (what the loss adds on
  top of its inputs, weights and weight gradients);
* time: wall-clock seconds of the forward plus backward pass (best of ``--repeats`` runs,
  variants alternated so a busy machine hurts both alike).

The dense variant builds the student's ``(N, V)`` logits with autograd and the teacher's
without, then calls [opd_literate.opd.full_vocab_reverse_kl][]. The chunked variant calls
[opd_literate.large_vocab.chunked.chunked_reverse_kl][] on the same hidden states and heads. Where
the ``trl`` extra is installed, a third variant, ``trl``, runs the loss that
``trl.DistillationTrainer`` computes on the same inputs: ``_chunked_divergence_loss`` of
``trl/trainer/distillation_trainer.py`` with ``beta=1.0`` (TRL's reverse KL), which calls
TRL's ``ChunkedDivergenceFunction`` (``trl/kernels/chunked_divergence.py``; on a CPU, its
torch fallback of the Triton kernels). Its line ``trl/dense: memory X, time Y`` comes before
the last line, which reads ``chunked/dense: memory X, time Y``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import resource
import subprocess
import sys
import time

FULL = {"tokens": 2048, "vocab": 151_936, "hidden": 1024}
SMALL = {"tokens": 256, "vocab": 32_768, "hidden": 256}


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (this benchmark needs Linux)")


def _reset_peak_rss() -> None:
    """Set the peak RSS (VmHWM) to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def child(variant: str, tokens: int, vocab: int, hidden_size: int, chunk_size: int) -> dict:
    """Allocate the inputs, run one forward + backward pass of ``variant``, measure it."""
    import torch
    import torch.nn.functional as F

    from opd_literate.large_vocab.chunked import chunked_reverse_kl
    from opd_literate.opd import full_vocab_reverse_kl

    def loss_fn(h, W, th, tW, mask):
        if variant == "dense":
            logits = F.linear(h, W)  # (N, V), kept for the backward pass
            with torch.no_grad():
                teacher_logits = F.linear(th, tW)  # (N, V)
            return full_vocab_reverse_kl(logits[None], teacher_logits[None], mask[None])
        if variant == "trl":
            from trl.trainer.distillation_trainer import _chunked_divergence_loss

            # (B, K, H) hidden states and a (B, K) completion mask, as the trainer passes them;
            # beta = 1 is TRL's reverse KL. Returns (loss, entropy sum, number of tokens).
            loss, _, _ = _chunked_divergence_loss(h[None], th[None], W, tW, mask[None],
                                                  beta=1.0)
            return loss
        return chunked_reverse_kl(h, W, mask, teacher_hidden=th, teacher_weight=tW,
                                  chunk_size=chunk_size)

    def inputs(n):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(n, hidden_size, generator=g).requires_grad_(True)
        W = torch.randn(vocab, hidden_size, generator=g).mul_(0.05).requires_grad_(True)
        th = torch.randn(n, hidden_size, generator=g)
        tW = torch.randn(vocab, hidden_size, generator=g).mul_(0.05)
        h.grad, W.grad = torch.zeros_like(h), torch.zeros_like(W)
        return h, W, th, tW, torch.ones(n)

    # Warm up on 2 tokens (loads the kernels), then drop those inputs.
    loss_fn(*inputs(2)).backward()
    h, W, th, tW, mask = inputs(tokens)
    _reset_peak_rss()
    before = _status_kib("VmRSS")
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    loss = loss_fn(h, W, th, tW, mask)
    loss.backward()
    seconds = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    peak = _status_kib("VmHWM")
    record = {"variant": variant, "loss": loss.item(), "added_mib": (peak - before) / 1024,
              "seconds": seconds, "torch": torch.__version__,
              # CPU seconds of the timed pass, all threads: in user code, and in the kernel
              # (mapping and zeroing fresh memory is kernel time)
              "user_s": cpu_after.ru_utime - cpu_before.ru_utime,
              "system_s": cpu_after.ru_stime - cpu_before.ru_stime,
              "threads": torch.get_num_threads()}
    if variant == "trl":
        import trl

        record["trl"] = trl.__version__
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help=f"sizes {SMALL} instead of {FULL}")
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=["dense", "chunked", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = SMALL if args.small else FULL
    if args.child:
        result = child(args.child, sizes["tokens"], sizes["vocab"], sizes["hidden"],
                       args.chunk_size)
        print(json.dumps(result))
        return

    runs = {"dense": [], "chunked": []}
    has_trl = importlib.util.find_spec("trl") is not None
    if has_trl:
        runs["trl"] = []
    for _ in range(args.repeats):
        for variant in runs:
            command = [sys.executable, __file__, "--child", variant,
                       "--chunk-size", str(args.chunk_size)] + (["--small"] if args.small else [])
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    first = runs["dense"][0]
    versions = f", trl {runs['trl'][0]['trl']}" if has_trl else ""
    print(f"bench_large_vocab: {sizes['tokens']:,} tokens, V = {sizes['vocab']:,}, "
          f"H = {sizes['hidden']:,}, float32, CPU ({platform.processor() or platform.machine()}),"
          f" torch {first['torch']}{versions}, {first['threads']} threads, "
          f"chunk_size {args.chunk_size}, best of {args.repeats}")
    print(f"{'variant':<10}{'loss':>12}{'added peak RSS (MiB)':>24}{'forward+backward (s)':>24}")
    best = {}
    for variant, results in runs.items():
        best[variant] = {"added_mib": min(r["added_mib"] for r in results),
                         "seconds": min(r["seconds"] for r in results)}
        print(f"{variant:<10}{results[0]['loss']:>12.6f}{best[variant]['added_mib']:>24.1f}"
              f"{best[variant]['seconds']:>24.2f}")
    print("CPU seconds of the fastest run (user, system): " + "; ".join(
        f"{variant} {fastest['user_s']:.1f}, {fastest['system_s']:.1f}"
        for variant, results in runs.items()
        for fastest in [min(results, key=lambda r: r["seconds"])]))
    print("all runs (MiB, s): " + "; ".join(
        f"{r['variant']} {r['added_mib']:.1f}, {r['seconds']:.2f}"
        for pair in zip(*runs.values()) for r in pair))
    if not has_trl:
        print("trl not installed (the trl extra): its variant skipped")
    for variant in ("trl", "chunked") if has_trl else ("chunked",):
        memory = best[variant]["added_mib"] / best["dense"]["added_mib"]
        seconds = best[variant]["seconds"] / best["dense"]["seconds"]
        print(f"{variant}/dense: memory {memory:.3f}, time {seconds:.2f}")


if __name__ == "__main__":
    main()
