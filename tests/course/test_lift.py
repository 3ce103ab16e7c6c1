"""The snippets of ``opd_literate.course.lift``: self-contained, ruff-clean, doctests pass.

Every public function of the copy-ready modules is written out as its snippet and run in a
fresh interpreter that has numpy and torch but not this package (the editable install's finder
is removed and ``import opd_literate`` is checked to fail there); the function's own doctests
run on the snippet's namespace with the project's doctest flags and print options. One
subprocess per module, not one per function, keeps this to a few seconds.
"""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from opd_literate.course import lift
from opd_literate.course.lift import COPY_READY_MODULES, CopyError, public_functions, snippet
from opd_literate.course.markers import strip_solutions

REPO = pathlib.Path(__file__).resolve().parents[2]
NUMPY_ONLY = {"mismatch.toy", "mismatch.estimators", "mismatch.opd_mismatch"}

# Run inside the fresh interpreter before anything is collected: no opd_literate anywhere.
ISOLATING_CONFTEST = '''
import importlib
import os
import sys

def _editable(hook):
    return "__editable__" in getattr(hook, "__module__", "")


sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _editable(h)]
# The repository's root (where opd_literate/ is) is dropped, compared as a resolved path: a
# virtual environment inside the clone (.venv) or beside it with a common prefix keeps its
# site-packages.
def _is_repo_root(entry):
    try:
        return os.path.samefile(entry or ".", {repo!r})
    except OSError:
        return False


sys.path[:] = [p for p in sys.path if not _is_repo_root(p) and "__editable__" not in p]
sys.path_importer_cache.clear()
try:
    importlib.import_module("opd_literate")
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("opd_literate is importable in the isolated interpreter")

import numpy as np
import pytest

TORCH = {torch!r}
if TORCH:
    import torch


@pytest.fixture(autouse=True)
def _stable_numerics(doctest_namespace):
    # the print options and seed of the project's conftest.py
    np.set_printoptions(precision=4, suppress=True, legacy=False)
    doctest_namespace["np"] = np
    if TORCH:
        torch.set_printoptions(precision=4, sci_mode=False)
        torch.manual_seed(0)
        doctest_namespace["torch"] = torch
    yield
'''

ISOLATION_TEST = '''
import importlib
import sys


def test_isolated():
    assert "opd_literate" not in sys.modules
    try:
        importlib.import_module("opd_literate")
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("opd_literate is importable")
    names = {names!r}
    for name in names:
        importlib.import_module(name)  # already imported by the doctest collection
    if not {torch!r}:
        assert "torch" not in sys.modules, "a numpy-only snippet imported torch"
'''


def _function_node(module: str, function: str) -> ast.FunctionDef:
    tree = ast.parse(lift._module_path(module).read_text())
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)


def _isolate(folder: pathlib.Path, uses_torch: bool) -> None:
    """The conftest that hides this package, and the project's doctest flags, in ``folder``."""
    (folder / "conftest.py").write_text(ISOLATING_CONFTEST.format(repo=str(REPO),
                                                                  torch=uses_torch))
    (folder / "pytest.ini").write_text(textwrap.dedent("""\
        [pytest]
        doctest_optionflags = NUMBER ELLIPSIS NORMALIZE_WHITESPACE
        filterwarnings = error::RuntimeWarning
        """))


def _write_module_snippets(module: str, folder: pathlib.Path, compact: bool = False,
                           functions=None) -> list[str]:
    folder.mkdir()
    uses_torch = module not in NUMPY_ONLY
    _isolate(folder, uses_torch)
    node_ids, names = [], []
    for function in functions or public_functions(module):
        name = f"snippet_{module.replace('.', '_')}_{function}"
        (folder / f"{name}.py").write_text(snippet(f"{module}.{function}", compact=compact))
        names.append(name)
        if ">>>" in (ast.get_docstring(_function_node(module, function)) or ""):
            node_ids.append(f"{name}.py::{name}.{function}")
    (folder / "test_isolated.py").write_text(ISOLATION_TEST.format(names=names, torch=uses_torch))
    return node_ids


def _run_alone(folder: pathlib.Path, node_ids: list[str]) -> None:
    environment = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    environment.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-I", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(folder), "--doctest-modules", *node_ids, "test_isolated.py"],
        cwd=folder, env=environment, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # every function has its doctest item, and every item ran (none silently uncollected)
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) == len(node_ids) + 1, result.stdout[-2000:]


def _opd_fast_rest_slow(modules):
    """Each module a case; the OPD module's in the fast tier, the others' in the slow one (each
    runs a pytest of its own)."""
    return [pytest.param(m, marks=() if m == "opd" else pytest.mark.slow) for m in modules]


@pytest.mark.parametrize("module", _opd_fast_rest_slow(COPY_READY_MODULES))
def test_snippets_run_alone_with_their_doctests(module, tmp_path):
    folder = tmp_path / module
    _run_alone(folder, _write_module_snippets(module, folder))


@pytest.mark.parametrize("module", _opd_fast_rest_slow(COPY_READY_MODULES))
def test_snippets_are_ruff_clean(module, tmp_path):
    for number, (qualname, code) in enumerate(_every_snippet(module)):
        (tmp_path / f"{qualname.replace('.', '_')}_{number}.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
         str(REPO / "pyproject.toml"), str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout[-4000:]


def _top_level(code: str) -> dict[str, ast.AST]:
    found = {}
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                found[target.id] = node
    return found


@pytest.mark.parametrize("module", _opd_fast_rest_slow(COPY_READY_MODULES))
def test_every_definition_is_used_and_the_function_is_last(module):
    """No dead weight: each helper is named by another definition of the snippet (or by the
    examples), and the function itself closes the part a reader needs."""
    for function in public_functions(module):
        code = snippet(f"{module}.{function}")
        needed = code.split(lift._EXAMPLES_BANNER)[0]
        definitions = _top_level(needed)
        assert list(definitions)[-1] == function
        for name, node in definitions.items():
            if name == function:
                continue
            rest = code.replace(ast.get_source_segment(needed, node), "")
            assert re.search(rf"\b{name}\b", rest), f"{module}.{function}: {name} is unused"


def test_known_helpers_are_found():
    """Against a hand reading of the source: full_vocab_reverse_kl's helpers in opd and
    _numerics, and token_tis's helpers in estimators, toy and _numerics."""
    kl = _top_level(snippet("opd.full_vocab_reverse_kl"))
    for helper in ["_check_logits_pair", "_log_softmax_pair", "_kl_from_log_probs",
                   "masked_mean", "select", "check_float_tensor", "check_same_shape", "check_mask",
                   "compute_dtype", "check_finite_number"]:
        assert helper in kl, helper
    assert "aggregate_loss" not in kl and "REDUCTIONS" not in kl
    tis = snippet("mismatch.estimators.token_tis").split(lift._EXAMPLES_BANNER)
    needed = _top_level(tis[0])
    for helper in ["token_ratios", "exp_ratio", "MAX_LOG_RATIO", "_finish", "weighted_score",
                   "check_toy", "check_finite_number"]:
        assert helper in needed, helper
    # toy_from_logits is used by the example only
    assert "toy_from_logits" not in needed and "toy_from_logits" in _top_level(tis[0] + tis[1])


@pytest.mark.slow
def test_numpy_snippets_do_not_import_torch():
    for module in NUMPY_ONLY:
        for function in public_functions(module):
            tree = ast.parse(snippet(f"{module}.{function}"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    assert all(a.name.split(".")[0] != "torch" for a in node.names), function
                if isinstance(node, ast.ImportFrom):
                    assert (node.module or "").split(".")[0] != "torch", function


def test_cli_prints_the_snippet(capsys):
    assert lift.main(["opd_literate.opd.full_vocab_reverse_kl"]) == 0
    assert capsys.readouterr().out == snippet("opd.full_vocab_reverse_kl")


@pytest.mark.parametrize("qualname, message", [
    ("opd._select", "is private"),
    ("opd.no_such_function", "defines no 'no_such_function'"),
    ("_numerics.check_mask", "not a module with copy-ready functions"),
    ("nomodule.f", "no module opd_literate.nomodule"),
    ("full_vocab_reverse_kl", "expected MODULE.NAME"),
])
def test_cli_errors_are_one_line_rc_2(qualname, message, capsys):
    assert lift.main([qualname]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("opd-copy: error: ") and message in lines[0]
    with pytest.raises(CopyError):
        snippet(qualname)


def test_python_dash_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "opd_literate.course.lift",
                             "mismatch.toy.log_softmax"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0 and result.stdout == snippet("mismatch.toy.log_softmax")
    bad = subprocess.run([sys.executable, "-m", "opd_literate.course.lift",
                          "mismatch.toy._enumerate"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1


@functools.cache  # several tests read a module's snippets: lift them once
def _every_snippet(module):
    return tuple((f"{module}.{function}", snippet(f"{module}.{function}", compact=compact))
                 for function in public_functions(module) for compact in (False, True))


@pytest.mark.parametrize("module", _opd_fast_rest_slow(COPY_READY_MODULES))
def test_solution_markers_are_balanced_and_strip(module):
    """A snippet that holds a lab solution keeps both of its markers (the END SOLUTION after the
    last statement is a comment the syntax tree leaves out), so the project's handout tool, or
    nbgrader, turns it into a student version that still compiles."""
    with_solutions = set()
    for qualname, code in _every_snippet(module):
        begins = len(re.findall(r"^\s*### BEGIN SOLUTION", code, re.M))
        ends = len(re.findall(r"^\s*### END SOLUTION\s*$", code, re.M))
        assert begins == ends, (qualname, begins, ends)
        student, tasks = strip_solutions(code, qualname)
        assert len(tasks) == begins
        ast.parse(student)
        if tasks:
            with_solutions.add(qualname)
    # the lab functions and the helper that holds Task 3's KL are among them
    expected = {"opd": {"opd.full_vocab_reverse_kl", "opd.reverse_kl_rewards"},
                "mismatch.estimators": {"mismatch.estimators.token_tis"}}
    assert expected.get(module, set()) <= with_solutions


@pytest.mark.parametrize("module", _opd_fast_rest_slow(COPY_READY_MODULES))
def test_site_cross_references_become_plain_text(module):
    """``[opd_literate.opd.opd_pg_loss][]`` resolves on the site only; a snippet says
    ``opd_pg_loss``, and ``[text][opd_literate.x.y]`` keeps its text."""
    for qualname, code in _every_snippet(module):
        assert not re.search(r"\]\[(opd_literate[\w.]*)?\]", code), qualname
    code = snippet("opd.full_vocab_reverse_kl")
    assert "[opd_literate.opd.opd_pg_loss][]" in lift._module_path("opd").read_text()
    assert "``opd_pg_loss`` (see there)" in code
    assert lift._render(lift._Definition("m", "f", ast.parse("x = 1").body[0],
                                         "# see [the loss][opd_literate.opd.opd_pg_loss]")) == (
        "# see the loss")


@pytest.mark.parametrize("module", _opd_fast_rest_slow(COPY_READY_MODULES))
def test_imports_inside_helpers_are_hoisted(module):
    """``_numerics``' checks import torch inside the function (so numpy modules never load it);
    in a snippet that import joins the import block at the top."""
    assert "    import torch" in lift._module_path("_numerics").read_text()
    for qualname, code in _every_snippet(module):
        tree = ast.parse(code)
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        every = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert top == every, qualname
    code = snippet("opd.full_vocab_reverse_kl")
    assert "\nimport torch\n" in code and "    import torch" not in code


def test_a_relative_import_inside_a_function_is_inlined():
    """``engine.kept_mass_table`` imports ``seq_is`` inside its body (the engine lab's folder
    holds no estimators.py): its snippet carries ``seq_is``'s definition and no import of it."""
    source = lift._module_path("mismatch.engine").read_text()
    assert "    from .estimators import seq_is\n" in source
    assert "\nfrom .estimators import" not in source
    code = snippet("mismatch.engine.kept_mass_table")
    assert "\ndef seq_is(" in code and "import seq_is" not in code
    tree = ast.parse(code)
    assert [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level] == []


def _lab_functions():
    """The public functions that hold a lab task, as ``(module, function)``."""
    from opd_literate.course.labs import LABS, source_of

    found = []
    for lab in LABS.values():
        for name in lab.student_modules:
            path = source_of(name)
            module = ".".join(path.relative_to(lift.PACKAGE_DIR).with_suffix("").parts)
            tasks = strip_solutions(path.read_text(), str(path))[1]
            found += sorted({(module, f) for _, f in tasks if not f.startswith("_")})
    return found


LAB_FUNCTIONS = _lab_functions()


@pytest.mark.parametrize("module, function", LAB_FUNCTIONS)
def test_compact_snippet_is_at_most_twice_the_function(module, function):
    own = len(lift._parse(module).definitions[function].text.splitlines())
    compact = snippet(f"{module}.{function}", compact=True).splitlines()
    assert len(compact) < len(snippet(f"{module}.{function}").splitlines())
    assert len(compact) <= 2 * own, (len(compact), own)


def test_compact_snippets_import_only_what_every_lab_hands_out():
    """A compact snippet imports the package's public API and the shared numerics, never a
    private name, and every lab folder holds the shared numerics whole (``HANDOUT_GIVEN``)."""
    from opd_literate.course.labs import LABS

    assert all(set(lift.HANDOUT_GIVEN) <= set(lab.given_modules) for lab in LABS.values())
    imported = set()
    for module, function in LAB_FUNCTIONS:
        tree = ast.parse(snippet(f"{module}.{function}", compact=True))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module.startswith("opd_literate"):
                below = node.module.removeprefix("opd_literate.")
                imported.add(below)
                assert not any(a.name.startswith("_") for a in node.names), ast.unparse(node)
                assert (below in lift.HANDOUT_GIVEN
                        or not any(p.startswith("_") for p in below.split("."))), below
                # not a task of the lab: a handout's student module has a stub there
                assert not {a.name for a in node.names} & {f for _, f in LAB_FUNCTIONS}
    assert {"_numerics", "mismatch.toy"} <= imported


@pytest.mark.slow
@pytest.mark.parametrize("lab_name", ["opd", "mismatch"])
def test_compact_snippets_run_in_the_lab_folder(lab_name, tmp_path):
    """Each lab function's compact snippet, its imports flattened as the lab writer flattens
    the student module's, passes its doctests inside the lab folder (the student module with
    its stubs and the given modules beside it), in an interpreter without this package."""
    from opd_literate.course.handouts import write_lab
    from opd_literate.course.labs import LABS, flatten_imports

    folder = tmp_path / lab_name
    write_lab(lab_name, folder)
    lab = LABS[lab_name]
    uses_torch = lab_name == "opd"
    _isolate(folder, uses_torch)  # replaces the lab's conftest.py and pytest.ini
    node_ids, names = [], []
    modules = {m.split(".")[-1] for m in lab.student_modules}
    for module, function in LAB_FUNCTIONS:
        if module.split(".")[-1] not in modules:
            continue
        name = f"compact_{function}"
        (folder / f"{name}.py").write_text(
            flatten_imports(snippet(f"{module}.{function}", compact=True)))
        names.append(name)
        node_ids.append(f"{name}.py::{name}.{function}")
    (folder / "test_isolated.py").write_text(ISOLATION_TEST.format(names=names,
                                                                   torch=uses_torch))
    assert node_ids
    _run_alone(folder, node_ids)


def test_compact_form_asserts_instead_of_checks():
    """The checks of ``_numerics`` that only raise become one-line asserts at the call: no
    ``check_float_tensor`` left in ``opd_pg_loss``'s compact snippet, its shape check an
    assert; the full form stays the default."""
    code = snippet("opd.opd_pg_loss", compact=True)
    assert "check_float_tensor" not in code and "check_same_shape" not in code
    assert "    assert student_logp.shape == rewards.shape" in code
    assert "check_float_tensor" in snippet("opd.opd_pg_loss")


def test_cli_compact(capsys):
    assert lift.main(["--compact", "opd.full_vocab_reverse_kl"]) == 0
    assert capsys.readouterr().out == snippet("opd.full_vocab_reverse_kl", compact=True)





def test_a_name_the_converted_condition_reads_stays(tmp_path, monkeypatch):
    """A check's ``end = 0`` that its condition reads (and its message too) is no message-only
    statement: the compact form keeps it (it was dropped, leaving ``end`` undefined)."""
    package = tmp_path / "opd_literate"
    package.mkdir()
    (package / "spans.py").write_text(
        '__all__ = ["tile"]\n\n\n'
        'def _check_spans(spans):\n'
        '    """Spans that tile from 0."""\n'
        '    end = 0\n'
        '    for span in spans:\n'
        '        if span[0] != end:\n'
        '            raise ValueError(f"a gap after {end}")\n'
        '        end = span[1]\n\n\n'
        'def tile(spans):\n'
        '    """The end of tiling spans."""\n'
        '    _check_spans(spans)\n'
        '    return spans[-1][1]\n')
    monkeypatch.setattr(lift, "PACKAGE_DIR", package)
    lift._parse.cache_clear()
    try:
        code = snippet("spans.tile", compact=True)
    finally:
        lift._parse.cache_clear()
    assert "    end = 0\n" in code and "assert span[0] == end" in code
    namespace = {}
    exec(compile(code, "<snippet>", "exec"), namespace)
    assert namespace["tile"]([(0, 2), (2, 3)]) == 3
    with pytest.raises(AssertionError):
        namespace["tile"]([(0, 2), (3, 4)])
