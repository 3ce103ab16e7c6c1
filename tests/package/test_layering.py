"""The package's layering, as the package docstring states it, checked from the source.

``opd_literate/__init__.py`` says which third-party packages each module imports and that the
numpy-only modules never load torch. Both are claims a reader relies on when lifting a module
into course material, so both are read back here: the imports from each module's syntax tree
(every ``import`` statement, including those inside functions), and ``sys.modules`` of a fresh
interpreter after importing a numpy-only module.
"""

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

import opd_literate

PACKAGE = pathlib.Path(opd_literate.__file__).parent

# What the package docstring promises, module by module: third-party top-level packages only
# (the standard library and the package's own modules are always allowed).
THIRD_PARTY = {
    "_numerics": {"torch", "numpy"},  # each imported inside the functions that use it only
    "_figures": {"matplotlib"},  # imported inside its functions only
    "_files": set(),
    "opd": {"torch"},
    "mismatch.toy": {"numpy"},
    "mismatch.estimators": {"numpy"},
    "mismatch.opd_mismatch": {"numpy"},
    "mismatch.correction": {"torch"},
    "mismatch.engine": {"numpy"},
    "mismatch.task_rewards": {"numpy"},
    "mismatch.groups": {"numpy"},
    "teachers.cross_tokenizer": {"numpy"},
    "teachers.many_teachers": {"numpy"},
    "teachers.teacher_targets": {"torch"},
    "large_vocab.chunked": {"torch"},
    "large_vocab.topk": {"torch"},  # its figure through _figures
    "large_vocab.clamps": {"torch"},
    "large_vocab.supports": {"torch"},  # its figure through _figures
    "experiment.tinylm": {"torch"},
    "experiment.exact": {"torch"},
    "experiment.quantized": {"numpy", "torch"},
    "experiment.mismatch_training": {"torch"},
    "experiment.config": set(),
    "experiment.ensemble": {"torch"},
    "experiment.train": {"torch"},
    "experiment.run": {"torch"},
    "experiment._cache": {"torch", "filelock"},
    "experiment._workers": {"torch", "tqdm"},
    "experiment.stats": {"numpy"},
    "experiment.plots": {"matplotlib"},  # through _figures, and for the PNGs
    "experiment.cli": set(),
    "course.markers": set(),
    "course.labs": set(),
    "course.grade": {"numpy"},  # reads the runner's arrays back
    "course.cases": {"numpy", "torch"},
    "course._runner": {"numpy", "torch"},  # run in the grading sandbox, never imported
    "course.sandbox": set(),
    "course.cli": set(),
    "course.gradescope": set(),
    "course.handouts": set(),
    "course.lift": set(),
}
NUMPY_ONLY = ("mismatch.toy", "mismatch.estimators", "mismatch.opd_mismatch", "mismatch.groups",
              "teachers.cross_tokenizer", "teachers.many_teachers")


def _path(module: str) -> pathlib.Path:
    return PACKAGE / (module.replace(".", "/") + ".py")


def _modules() -> set[str]:
    """Every module of the package, dotted below it; packages' __init__ and __main__ aside."""
    return {".".join(p.relative_to(PACKAGE).with_suffix("").parts)
            for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")}


@functools.cache
def _nodes(path: pathlib.Path) -> tuple:
    """Every node of a module's syntax tree, parsed once per test process (several tests
    read every module)."""
    return tuple(ast.walk(ast.parse(path.read_text())))


def _imported_top_levels(path: pathlib.Path) -> set[str]:
    """Top-level names of every absolute import in a module (relative imports are the package)."""
    names = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_module_is_listed():
    assert _modules() == set(THIRD_PARTY), "update THIRD_PARTY and the package docstring"


@pytest.mark.parametrize("module", sorted(THIRD_PARTY))
def test_third_party_imports_are_the_documented_ones(module):
    imported = _imported_top_levels(_path(module))
    third_party = {
        name for name in imported
        if name not in sys.stdlib_module_names and name not in ("opd_literate", "__future__")
    }
    assert third_party == THIRD_PARTY[module]


def test_the_package_docstring_lists_the_same_imports():
    # One bullet a module: "* ``opd_literate.NAME``: ... (imports: a, b; ...)."; a chapter
    # package's bullet has no "(imports:" of its own.
    bullets = " ".join(opd_literate.__doc__.split()).split("* ``opd_literate.")[1:]
    listed = {}
    for bullet in bullets:
        if "(imports: " not in bullet.split("* ``")[0]:
            continue  # a chapter package's own line: its modules follow
        name = bullet.split("``")[0]
        packages = bullet.split("(imports: ")[1].split(")")[0].split(";")[0]
        listed[name] = set(packages.replace(",", " ").split()) - {"nothing"}
    expected = {name: packages for name, packages in THIRD_PARTY.items() if name != "_numerics"}
    assert listed == expected


@pytest.mark.parametrize("module", NUMPY_ONLY)
def test_numpy_only_modules_never_load_torch(module):
    code = (
        f"import sys, opd_literate.{module}; "
        "print(sorted(m for m in ('torch', 'matplotlib', 'tqdm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_the_package_imports_no_submodule():
    code = (
        "import sys, opd_literate; "
        "print(sorted(m for m in sys.modules if m.startswith('opd_literate.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _package_imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports, dotted below ``opd_literate``."""
    parents = module.split(".")[:-1]
    found = set()
    for node in _nodes(_path(module)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = parents[:len(parents) - (node.level - 1)]
            if node.module:
                found.add(".".join(base + node.module.split(".")))
            else:  # from . import tinylm
                found.update(".".join(base + [alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("opd_literate."):
            found.add(node.module.removeprefix("opd_literate."))
    return found & set(THIRD_PARTY)


def test_numerics_imports_nothing_of_the_package():
    """CONTRIBUTING.md: an import never goes up; ``_numerics`` is the bottom layer."""
    assert _package_imports("_numerics") == set()


@pytest.mark.parametrize("module", ["experiment.train", "experiment.ensemble"])
def test_the_training_code_never_imports_the_process_workers(module):
    """CONTRIBUTING.md: process management stays in ``_workers``; the loss, the step and the
    loop never import it (``run`` drives the workers)."""
    assert "experiment._workers" not in _package_imports(module)
    assert "experiment.run" in {m for m in THIRD_PARTY if "experiment._workers"
                                in _package_imports(m)}


def test_no_modules_import_each_other_in_a_cycle():
    """CONTRIBUTING.md: an import never goes up, so the package's import graph (every import
    statement, those inside functions included) has no cycle. ``course/`` reads bottom-up:
    ``labs`` (what a lab is), ``cases`` and ``grade``, ``gradescope``, ``handouts``, ``cli``."""
    graph = {module: _package_imports(module) for module in THIRD_PARTY}
    finished, on_path = set(), []

    def visit(module):
        if module in on_path:
            return on_path[on_path.index(module):] + [module]
        if module in finished:
            return None
        on_path.append(module)
        for imported in sorted(graph[module]):
            cycle = visit(imported)
            if cycle:
                return cycle
        on_path.pop()
        finished.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        assert cycle is None, "an import cycle: " + " -> ".join(cycle)
    layers = ("course.labs", "course.cases", "course.grade", "course.gradescope",
              "course.handouts", "course.cli")
    for i, lower in enumerate(layers):  # each layer imports only those below it
        assert not graph[lower] & set(layers[i:]), f"{lower} imports a layer above it"
