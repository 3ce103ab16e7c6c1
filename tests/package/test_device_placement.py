r"""Every tensor a library function creates is placed on its inputs' device.

A CPU-only test suite cannot see a forgotten ``device=``: on the CPU every tensor is on the
right device. ``chunked_divergence`` allocated its gradient buffers and its accumulator with
``torch.zeros(shape, dtype=dtype)`` and failed at its first chunk on a GPU. Two guards:

**The source rule** (``off_device_calls``), read with ``ast`` from every module of
``opd_literate`` that imports torch (docstrings are strings to ``ast``, so their doctests are not
read). A call of a torch factory (``FACTORIES``: ``torch.zeros``, ``ones``, ``empty``, ``full``,
``arange``, ``tensor``, ``as_tensor``, ``eye``, ``linspace``, ``rand``, ``randn``, ``randint``, ...,
also ``torch.Generator``, and ``from_numpy``, which can only make CPU tensors), written as
``torch.F(...)`` under any alias of ``torch`` (``import torch as th``, ``t = torch``), as
``F(...)`` imported or bound from ``torch`` (``E = torch.empty``) or as ``getattr(torch, "F")``, is
reported unless

1. it has a ``device=`` keyword that is not a constant (``device="cpu"`` and ``device=None`` do
   not take the device from an input; a ``**kwargs`` does not count: the rule cannot see into
   it), and, for a factory whose result is floating by default (``FLOATING_FACTORIES``), a
   ``dtype=`` keyword too (a float32 buffer under float64 inputs is the same defect in dtype);
2. or it carries the marker ``CPU by design`` in a comment, on one of the lines the call spans or
   in the block of comment-only lines directly above the line where it starts (experiment code
   that runs on the CPU on purpose says so where it does);
3. or it is a 0-dimensional constant used as an operand: ``torch.zeros(())``, ``ones(())``,
   ``empty(())``, ``full((), c)``, or ``torch.tensor(c)``, ``as_tensor(c)``, ``scalar_tensor(c)``
   with ``c`` a number literal, ``math.inf``, ``math.nan``, ``math.pi``, ``math.e`` (signed or
   not), written directly as an argument of a call or an operand of an arithmetic or comparison
   operator. torch accepts a 0-dimensional CPU tensor there next to tensors of any device (it
   is read as a scalar). Bound to a name it is reported: it can then be written into, and an
   in-place ``total += loss.sum()`` into a CPU tensor from a CUDA one fails (the accumulator of
   ``chunked_divergence`` was such a constant).

The ``*_like`` factories and ``x.new_*`` methods take the device of their argument and are not
factories here. ``from torch import *`` is reported: its factories cannot be told apart.

**The behaviour**: the chunked losses run under a ``meta`` default device with CPU float64
inputs. A tensor created without ``device=`` lands on ``meta`` there, so the loss or a gradient
would come back on ``meta`` (or the call fails mixing devices); they must come back on the CPU,
in float64, equal to the plain run.
"""

from __future__ import annotations

import ast
import contextlib
import io
import tokenize
from pathlib import Path

import pytest
import torch

from opd_literate.large_vocab import chunked as large_vocab

PACKAGE = Path(__file__).resolve().parents[2] / "opd_literate"
MARKER = "CPU by design"
FLOATING_FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "eye", "linspace", "logspace", "rand", "randn", "normal",
    "empty_strided", "hann_window", "hamming_window", "blackman_window", "bartlett_window",
    "kaiser_window",
})
"""Factories whose result is floating by default (torch's default dtype, float32): they must
say their dtype too, or a float64 input meets a float32 buffer."""
FACTORIES = FLOATING_FACTORIES | frozenset({
    "arange", "range", "tensor", "as_tensor", "asarray", "scalar_tensor", "randint", "randperm",
    "tril_indices", "triu_indices", "Generator", "from_numpy", "frombuffer", "sparse_coo_tensor",
    "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
    "IntTensor", "BoolTensor",
})
_ZERO_DIM_SHAPED = {"zeros", "ones", "empty", "full"}  # the first argument is the shape ()
_ZERO_DIM_VALUED = {"tensor", "as_tensor", "scalar_tensor"}  # the only argument is a scalar
_MATH_CONSTANTS = {"inf", "nan", "pi", "e", "tau"}


def _comments(source: str) -> dict[int, str]:
    """Comment text by line number."""
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    return comments


def _torch_names(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to the torch module, and names bound to a factory imported from torch."""
    modules, factories = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or (alias.name.startswith("torch.")
                                             and alias.asname is None):
                    modules.add(alias.asname or "torch")  # import torch.nn binds torch too
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for alias in node.names:
                if alias.name in FACTORIES:
                    factories[alias.asname or alias.name] = alias.name
    # Plain aliases, `t = torch` and `E = torch.empty`, wherever they are bound.
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            value, name = node.value, node.targets[0].id
            if isinstance(value, ast.Name) and value.id in modules:
                modules.add(name)
            elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) \
                    and value.value.id in modules and value.attr in FACTORIES:
                factories[name] = value.attr
    return modules, factories


def _factory(call: ast.Call, modules, factories) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
            and func.value.id in modules and func.attr in FACTORIES:
        return func.attr
    if isinstance(func, ast.Name) and func.id in factories:
        return factories[func.id]
    # getattr(torch, "zeros")(...)
    if isinstance(func, ast.Call) and isinstance(func.func, ast.Name) \
            and func.func.id == "getattr" and len(func.args) >= 2 \
            and isinstance(func.args[0], ast.Name) and func.args[0].id in modules \
            and isinstance(func.args[1], ast.Constant) and func.args[1].value in FACTORIES:
        return func.args[1].value
    return None


def _device_from_an_input(call: ast.Call) -> bool:
    """``device=`` given, and not as a constant (``"cpu"``, ``None``): taken from an input."""
    device = next((k.value for k in call.keywords if k.arg == "device"), None)
    return device is not None and not isinstance(device, ast.Constant)


def _is_scalar_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, complex)
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "math" and node.attr in _MATH_CONSTANTS)


def _is_zero_dim_constant(call: ast.Call, factory: str) -> bool:
    args = call.args
    if factory in _ZERO_DIM_SHAPED:
        n_args = 2 if factory == "full" else 1
        return (len(args) == n_args and isinstance(args[0], ast.Tuple) and not args[0].elts
                and (factory != "full" or _is_scalar_literal(args[1])))
    return factory in _ZERO_DIM_VALUED and len(args) == 1 and _is_scalar_literal(args[0])


def _is_operand(node: ast.AST, parent: ast.AST | None) -> bool:
    """Directly an argument of a call, or an operand of an arithmetic or comparison operator."""
    if isinstance(parent, ast.Call):
        return node in parent.args  # not the called function: torch.zeros(()).add_(x)
    # a keyword argument's parent is its ast.keyword
    return isinstance(parent, (ast.keyword, ast.BinOp, ast.Compare))


def _marked(call: ast.Call, comments: dict[int, str], lines: list[str]) -> bool:
    if any(MARKER in comments.get(n, "") for n in range(call.lineno, call.end_lineno + 1)):
        return True
    n = call.lineno - 1  # the block of comment-only lines directly above
    while n >= 1 and lines[n - 1].lstrip().startswith("#"):
        if MARKER in lines[n - 1]:
            return True
        n -= 1
    return False


def off_device_calls(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` for each factory call of ``source`` that breaks the module's rule."""
    tree = ast.parse(source)
    modules, factories = _torch_names(tree)
    comments, lines = _comments(source), source.splitlines()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    reports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch" \
                and any(alias.name == "*" for alias in node.names):
            reports.append((node.lineno, "from torch import * (its factories cannot be checked)"))
        if not isinstance(node, ast.Call):
            continue
        factory = _factory(node, modules, factories)
        if factory is None:
            continue
        if _is_zero_dim_constant(node, factory) and _is_operand(node, parents.get(node)):
            continue
        has_dtype = any(k.arg == "dtype" for k in node.keywords)
        if _device_from_an_input(node) and (has_dtype or factory not in FLOATING_FACTORIES):
            continue
        if _marked(node, comments, lines):
            continue
        reports.append((node.lineno, ast.get_source_segment(source, node)))
    return sorted(reports)


def _imports_torch(source: str) -> bool:
    return any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names)
               or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch"
               for n in ast.walk(ast.parse(source)))


TORCH_MODULES = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                       if _imports_torch(p.read_text()))


# ---------------------------------------------------------------------------------------------
# The library follows the rule
# ---------------------------------------------------------------------------------------------
def test_the_scan_reads_every_torch_module_of_the_library():
    assert {"opd.py", "mismatch/correction.py", "large_vocab/chunked.py", "large_vocab/topk.py",
            "experiment/tinylm.py", "experiment/run.py"} <= set(TORCH_MODULES)


@pytest.mark.parametrize("module", TORCH_MODULES)
def test_every_tensor_factory_call_names_its_device(module):
    reports = off_device_calls((PACKAGE / module).read_text())
    assert reports == [], (
        f"{module}: tensor factories without device= (take it from an input, or mark CPU "
        f"experiment code with '# {MARKER}: <why>'): {reports}")


# ---------------------------------------------------------------------------------------------
# The checker finds what it should (so the test above can fail)
# ---------------------------------------------------------------------------------------------
def test_checker_reports_a_buffer_made_without_a_device():
    source = ("import torch\n"
              "def grads(x, d):\n"
              "    return torch.zeros(x.shape, dtype=d)\n")
    assert off_device_calls(source) == [(3, "torch.zeros(x.shape, dtype=d)")]


def test_checker_reports_aliases_and_names_imported_from_torch():
    source = ("import torch as th\n"
              "from torch import arange as ar, randn\n"
              "a = th.ones(3, dtype=x.dtype, device=x.device)\n"
              "b = th.empty(3)\n"
              "c = ar(5)\n"
              "d = randn(2, generator=g)\n")
    assert [line for line, _ in off_device_calls(source)] == [4, 5, 6]


def test_checker_resolves_plain_aliases_getattr_and_refuses_a_star_import():
    source = ("import torch\n"
              "t = torch\n"
              "E = torch.empty\n"
              "a = t.zeros(3)\n"
              "b = E(3)\n"
              "c = getattr(torch, 'zeros')(3)\n"
              "from torch import *\n")
    assert [line for line, _ in off_device_calls(source)] == [4, 5, 6, 7]


def test_checker_knows_the_less_common_factories():
    source = ("import torch\n"
              "a = torch.asarray([1.0])\n"
              "b = torch.Tensor([1.0])\n"
              "c = torch.LongTensor([1])\n"
              "d = torch.normal(0.0, 1.0, size=(3,))\n"
              "e = torch.hann_window(8)\n")
    assert [line for line, _ in off_device_calls(source)] == [2, 3, 4, 5, 6]


def test_checker_wants_the_device_of_an_input_and_a_dtype_for_floating_buffers():
    """``device="cpu"`` or ``device=None`` is not taken from an input; a float32 default
    buffer under a float64 input is the dtype half of the same defect."""
    source = ("import torch\n"
              "a = torch.zeros(3, dtype=x.dtype, device='cpu')\n"
              "b = torch.zeros(3, dtype=x.dtype, device=None)\n"
              "c = torch.zeros(x.shape, device=x.device)\n"
              "d = torch.arange(3, device=x.device)\n"      # integer indices: no dtype needed
              "e = torch.zeros(x.shape, dtype=x.dtype, device=x.device)\n")
    assert [line for line, _ in off_device_calls(source)] == [2, 3, 4]


def test_checker_accepts_a_device_keyword_and_the_like_factories():
    source = ("import torch\n"
              "a = torch.zeros(x.shape, dtype=d, device=x.device)\n"
              "b = torch.zeros_like(x)\n"
              "c = x.new_zeros(3)\n"
              "e = torch.full_like(x, 1.0)\n")
    assert off_device_calls(source) == []


def test_checker_honours_the_cpu_by_design_marker_on_the_line_or_the_comment_above():
    source = ("import torch\n"
              "a = torch.arange(10)  # CPU by design: the experiment runs on the CPU\n"
              "# Seeded draws of the experiment.\n"
              "# CPU by design: the experiment runs on the CPU\n"
              "g = torch.Generator().manual_seed(0)\n"
              "# CPU by design: this comment is not directly above the next call\n"
              "x = 1\n"
              "b = torch.randn(3)\n")
    assert off_device_calls(source) == [(8, "torch.randn(3)")]


def test_checker_allows_a_zero_dim_constant_as_an_operand_only():
    source = ("import math\n"
              "import torch\n"
              "a = torch.where(m, x, torch.zeros((), dtype=d))\n"
              "b = x * torch.tensor(-math.inf)\n"
              "total = torch.zeros((), dtype=d)\n"  # bound: may be written into in place
              "c = torch.where(m, x, torch.tensor([0.0]))\n"  # 1-dimensional
              "e = torch.where(m, x, torch.zeros((), dtype=d).add_(y))\n")  # not an operand
    assert [line for line, _ in off_device_calls(source)] == [5, 6, 7]


def test_checker_does_not_read_docstrings():
    source = ('import torch\n'
              'def f(x):\n'
              '    """Doc.\n\n'
              '    >>> torch.zeros(3)\n'
              '    """\n'
              '    return torch.zeros_like(x)\n')
    assert off_device_calls(source) == []


# ---------------------------------------------------------------------------------------------
# The chunked losses: buffers on the inputs' device and in their dtype
# ---------------------------------------------------------------------------------------------
def _chunked_inputs(teacher):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 3, generator=g, dtype=torch.float64)
    W = torch.randn(5, 3, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64)
    if teacher == "logits":
        kw = {"teacher_logits": torch.randn(7, 5, generator=g, dtype=torch.float64)}
    else:
        kw = {"teacher_hidden": torch.randn(7, 2, generator=g, dtype=torch.float64),
              "teacher_weight": torch.randn(5, 2, generator=g, dtype=torch.float64),
              "teacher_bias": torch.randn(5, generator=g, dtype=torch.float64)}
    return h, W, b, torch.tensor([1, 1, 0, 1, 1, 1, 0]), kw


def _loss_and_grads(divergence, inputs, default_device=None):
    """The loss and its gradients, the call (forward and backward) under ``default_device``."""
    h, W, b, mask, kw = inputs
    leaves = [x.detach().clone().requires_grad_(True) for x in (h, W, b)]
    with torch.device(default_device) if default_device else contextlib.nullcontext():
        # chunk_size 2 does not divide the 5 masked-in rows: several chunks and a short one
        loss = large_vocab.chunked_divergence(*leaves[:2], mask, student_bias=leaves[2],
                                              divergence=divergence, chunk_size=2, **kw)
        loss.backward()
    return loss.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("teacher", ["logits", "hidden"])
@pytest.mark.parametrize("divergence", large_vocab.DIVERGENCES)
def test_chunked_losses_create_their_buffers_on_the_inputs_device_and_dtype(divergence, teacher):
    inputs = _chunked_inputs(teacher)  # CPU, float64
    expected_loss, expected_grads = _loss_and_grads(divergence, inputs)
    # a tensor made without device= is a meta tensor there
    loss, grads = _loss_and_grads(divergence, inputs, default_device="meta")
    for x in (loss, *grads):
        assert (x.device, x.dtype) == (torch.device("cpu"), torch.float64)
    assert torch.equal(loss, expected_loss)
    for grad, expected in zip(grads, expected_grads):
        assert torch.equal(grad, expected)
