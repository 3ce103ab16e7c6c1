"""``--format notebook``: the lab as a Jupyter notebook that runs top to bottom when solved, and
that the grader grades like a folder of files."""

import dataclasses
import json
import shutil
import textwrap
import time

import pytest

from opd_literate.course.grade import grade
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import LABS, notebook_modules, render_notebook

nbformat = pytest.importorskip("nbformat", reason="the notebook extra: pip install .[notebook]")


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    """The mismatch lab as a notebook, with every task's solution restored."""
    folder = write_lab("mismatch", tmp_path_factory.mktemp("nb") / "lab", format="notebook")[0]
    notebook = render_notebook(LABS["mismatch"], keep=set(range(1, 9)))
    (folder / "mismatch.ipynb").write_text(json.dumps(notebook, indent=1))
    return folder


def test_the_notebook_is_valid_and_holds_stubs_and_a_check_per_task(tmp_path):
    folder = write_lab("mismatch", tmp_path / "lab", format="notebook")[0]
    assert not (folder / "estimators.py").exists()  # the student module is the notebook
    notebook = nbformat.read(folder / "mismatch.ipynb", as_version=4)
    nbformat.validate(notebook)
    code = [c.source for c in notebook.cells if c.cell_type == "code"]
    for n in range(1, 9):
        assert sum(f'raise NotImplementedError("Task {n}:' in s for s in code) == 1
        assert f"check({n})" in code
    markdown = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    assert "## Task 3: `seq_is`" in markdown and "Unbiased" in markdown  # docstrings kept
    assert json.loads((folder / "lab.json").read_text())["format"] == "notebook"
    assert "mismatch.ipynb" in (folder / "README.md").read_text()


@pytest.mark.slow
def test_the_solved_notebook_runs_top_to_bottom_and_passes(solved, monkeypatch):
    """One notebook run (a kernel start is a second or more): every check cell passes."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the kernel's pytest: faster
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(solved / "mismatch.ipynb", as_version=4)
    start = time.monotonic()
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(solved)}}).execute()
    checks = [c for c in notebook.cells if c.metadata.get("tags", [""])[0].startswith("check:")]
    assert len(checks) == 8
    for cell in checks:
        text = "".join(o.get("text", "") for o in cell.outputs)
        assert " passed" in text and "failed" not in text, text
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_the_grader_grades_a_notebook_task_by_task(solved, tmp_path):
    """The solved notebook with Task 4 wrong (token_tis truncating at twice the cap): the
    full solution's marks, less one."""
    folder = tmp_path / "lab"
    shutil.copytree(solved, folder)
    text = (folder / "mismatch.ipynb").read_text()
    assert text.count("np.minimum(token_ratios(toy), cap)") == 1
    (folder / "mismatch.ipynb").write_text(text.replace("np.minimum(token_ratios(toy), cap)",
                                                        "np.minimum(token_ratios(toy), 2 * cap)"))
    result = grade(folder)
    assert result["format"] == "notebook" and result["files"] == {}
    assert result["tasks"][4]["status"] == "failed"
    others = [t for n, t in result["tasks"].items() if n != 4]
    assert len(others) == 7 and all(t["status"] == "passed" and t["passed"] == t["tests"] > 0
                                    for t in others)
    assert result["score"] == result["total"] - 1 == 7


def _code(source, tags=()):
    return {"cell_type": "code", "metadata": {"tags": list(tags)} if tags else {},
            "execution_count": None, "outputs": [], "source": source}


def test_a_helper_in_a_new_untagged_cell_is_part_of_the_graded_module():
    """The definitions of a cell a student added (Jupyter leaves it untagged) join the module
    in the notebook's order; its scratch statements, a cell of IPython syntax and the check
    cells do not."""
    notebook = render_notebook(LABS["mismatch"])
    tagged = [c for c in notebook["cells"] if "module:estimators" in c["metadata"].get("tags", [])]
    at = notebook["cells"].index(tagged[-1]) + 1
    notebook["cells"][at:at] = [
        _code(["import math\n", "\n", "CAP = 2.0\n", "\n", "@staticmethod\n",
               "def clipped(x):\n", "    return min(x, CAP)\n", "\n",
               "print(clipped(3.0))\n", "for i in range(3):\n", "    print(i)\n"]),
        _code("%timeit clipped(1.0)"),
        _code("check(1)"),  # a student's extra call, untagged: scratch, not a definition
    ]
    module = notebook_modules(notebook, LABS["mismatch"])["estimators"]
    assert module.startswith("\n\n\n".join(c["source"] for c in tagged))
    tail = module[len("\n\n\n".join(c["source"] for c in tagged)):]
    assert tail == ("\n\n\nimport math\n\nCAP = 2.0\n\n@staticmethod\ndef clipped(x):\n"
                    "    return min(x, CAP)\n\n\n# (code cell "
                    f"{sum(c['cell_type'] == 'code' for c in notebook['cells'][:at + 2])} "
                    "left out: it is not plain Python)\n")
    compile(module, "estimators.py", "exec")
    assert "def check(" not in module and "check(1)" not in module


def test_notebook_modules_refuses_what_is_not_a_notebook():
    with pytest.raises(ValueError, match="not a Jupyter notebook"):
        notebook_modules({"worksheets": []}, LABS["mismatch"])
    with pytest.raises(ValueError, match="a notebook holds one student module"):
        notebook_modules({"cells": []}, dataclasses.replace(
            LABS["mismatch"], student_modules=("estimators", "toy")))


@pytest.mark.slow
def test_the_grader_keeps_a_helper_cell_of_a_notebook(solved, tmp_path):
    """Task 1 (naive) answered through a helper defined in a new, untagged cell."""
    folder = tmp_path / "lab"
    shutil.copytree(solved, folder)
    notebook = json.loads((folder / "mismatch.ipynb").read_text())
    cell = next(c for c in notebook["cells"] if "def naive(" in c["source"])
    body = cell["source"].split('"""')[-1]
    cell["source"] = cell["source"][:-len(body)] + "\n    return _naive_weights(toy, baseline, " \
        "return_weights)\n"
    notebook["cells"].insert(notebook["cells"].index(cell) + 1, _code(
        "def _naive_weights(toy, baseline, return_weights):\n" + textwrap.indent(
            textwrap.dedent(body), "    ").rstrip() + "\n"))
    (folder / "mismatch.ipynb").write_text(json.dumps(notebook))
    assert grade(folder)["tasks"][1]["status"] == "passed"
