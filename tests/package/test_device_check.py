"""``benchmarks/device_check.py``: it runs on the CPU, covers every public torch function of the
loss modules, and fails on a mismatch, an output off the device and a missing CUDA."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device_check.py"
MODULES = {"opd": "opd", "correction": "mismatch.correction", "large_vocab": "large_vocab.chunked",
           "topk": "large_vocab.topk"}  # row label -> module below opd_literate
# The public functions that take no tensor to place: the script lists each with a reason.
NOT_RUN = {"topk.zipf_pair", "topk.topk_bias_figure_data", "topk.format_topk_bias_table",
           "topk.plot_topk_bias"}


def _load_script():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


dc = _load_script()


def _public_functions():
    """Read here, not from the script: a function added to an ``__all__`` must get a row."""
    names = set()
    for module in MODULES:
        mod = importlib.import_module(f"opd_literate.{MODULES[module]}")
        names |= {f"{module}.{n}" for n in mod.__all__ if inspect.isfunction(getattr(mod, n))}
    return names


@pytest.fixture(scope="module")
def quick_cpu_run():
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def _rows(stdout):
    """``{"module.function": result}`` from the table."""
    pattern = re.compile(rf"^((?:{'|'.join(MODULES)})\.\w+)\s.*?(pass|FAIL.*|not run: .*)$")
    return {m[1]: m[2] for line in stdout.splitlines() if (m := pattern.match(line))}


@pytest.mark.slow
def test_quick_cpu_run_passes_and_has_a_row_for_every_public_torch_function(quick_cpu_run):
    assert quick_cpu_run.returncode == 0, quick_cpu_run.stdout + quick_cpu_run.stderr
    rows = _rows(quick_cpu_run.stdout)
    assert set(rows) == _public_functions()
    assert {name for name, result in rows.items() if result.startswith("not run")} == NOT_RUN
    assert {result for name, result in rows.items() if name not in NOT_RUN} == {"pass"}


@pytest.mark.slow
def test_quick_cpu_run_reports_the_benchmark_rows_and_leaves_the_targets_unjudged(
        quick_cpu_run):
    out = quick_cpu_run.stdout
    assert re.search(r"^bench dense\s+.* ms", out, re.M)
    assert re.search(r"^bench chunked\s+.* ms", out, re.M)
    assert "target chunked/dense memory <= 0.1" in out
    assert re.search(r"target chunked/dense time <= 1.2 .*not judged", out)


def test_compare_reports_a_value_mismatch_beyond_the_tolerance():
    reference = ({"loss": torch.tensor(1.0, dtype=torch.float64)}, {})
    # float32 allows 3e-5 of the value: 1e-6 passes, 1e-3 does not
    assert dc.compare(({"loss": torch.tensor(1.0 + 1e-6)}, {}), reference, torch.float32).ok
    mismatch = dc.compare(({"loss": torch.tensor(1.001)}, {}), reference, torch.float32)
    assert not mismatch.ok and mismatch.value > 1


def test_compare_reports_a_gradient_mismatch_and_misplaced_infinities():
    g = torch.linspace(-1, 1, 9, dtype=torch.float64)
    reference = (torch.tensor(0.5, dtype=torch.float64), {"d/d x": g})
    rounded = (torch.tensor(0.5), {"d/d x": g.to(torch.bfloat16)})
    assert dc.compare(rounded, reference, torch.bfloat16).ok  # bfloat16's own rounding
    off = (torch.tensor(0.5), {"d/d x": (g * 1.01).to(torch.bfloat16)})
    assert not dc.compare(off, reference, torch.bfloat16).ok
    infinite = (torch.tensor(float("inf")), {"d/d x": g.float()})
    assert dc.compare(infinite, reference, torch.float32).problems


def _case_off_by(error):
    """kl_estimator's case, its device result (not the float64 reference) moved by ``error``."""
    def call(fn, x):
        out = fn(x["student_logp"], x["teacher_logp"], "k1")
        return out if out.dtype == torch.float64 else out + error
    return dc.Case("opd.kl_estimator", dc._token_pair, call, ("student_logp",))


@pytest.mark.slow
def test_a_mismatching_function_makes_the_check_exit_non_zero(capsys):
    assert dc.main(["--device", "cpu", "--quick"], cases=[_case_off_by(0.0)]) == 0
    assert dc.main(["--device", "cpu", "--quick"], cases=[_case_off_by(1e-3)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^opd\.kl_estimator .*FAIL$", out, re.M)
    assert "problem: opd.kl_estimator float32" in out


def test_a_device_error_in_the_chunked_benchmark_makes_the_check_exit_non_zero(capsys,
                                                                            monkeypatch):
    from opd_literate.large_vocab import chunked

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(chunked, "chunked_reverse_kl", broken)
    # TRL's variant is beside the point, and importing TRL is most of the run's time: absent.
    monkeypatch.setitem(sys.modules, "trl", None)
    assert dc.main(["--device", "cpu", "--quick"], cases=[_case_off_by(0.0)]) == 1
    out = capsys.readouterr().out
    assert "problem: bench chunked: error: RuntimeError: CUDA error" in out


def test_a_tensor_made_without_a_device_is_a_device_error_on_the_cpu():
    # under the check's meta default device, torch.zeros(3) is a meta tensor
    case = dc.Case("opd.kl_estimator", dc._token_pair,
                   lambda fn, x: fn(x["student_logp"], x["teacher_logp"]) + torch.zeros(3))
    bound = dc.Case("opd.kl_estimator", dc._token_pair, lambda fn, x: torch.zeros(3))
    for broken in (case, bound):
        comparison = dc.check_case(broken, dc.QUICK, torch.device("cpu"), torch.float32,
                                   meta_default=True)
        assert not comparison.ok and comparison.problems


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_without_cuda_exits_2_with_one_line(capsys):
    assert dc.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "CUDA is not available" in err
