"""The home page is a front door: the code it shows runs and prints what it says, its claims hold,
and each reader's path leads, by links alone, to a page that exists; the student's to the first
chapter's graded exercise.
"""

import contextlib
import io
import pathlib
import re

import pytest
import yaml

import opd_literate
from opd_literate.course.labs import LABS, lab_points, tasks_of
from tests.helpers.committed import assert_matches_committed

ROOT = pathlib.Path(opd_literate.__file__).resolve().parents[1]
HOME = (ROOT / "docs" / "index.md").read_text()


def _block(marker: str) -> str:
    """The fenced block right after ``<!-- home:MARKER -->``."""
    after = HOME.split(f"<!-- home:{marker} -->", 1)[1]
    return re.match(r"\s*```\w*\n(.*?)```", after, re.S).group(1)


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+", text)]


def _slug(heading: str) -> str:
    """Python-Markdown's toc anchor of a heading (its default slugify)."""
    from markdown.extensions.toc import slugify

    return slugify(heading, "-")


def _anchors(page: str) -> set[str]:
    text = re.sub(r"```.*?```", "", (ROOT / "docs" / page).read_text(), flags=re.S)
    return {_slug(re.sub(r"[`*]", "", m)) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_the_quickstart_prints_what_the_page_shows():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_block("quickstart"), "docs/index.md", "exec"), {})
    shown = _block("quickstart-output")
    # the same lines, the numbers as printed to 4 decimals (kernels may differ in the last bits)
    words = re.sub(r"-?\d+\.\d+", "#", printed.getvalue())
    assert words == re.sub(r"-?\d+\.\d+", "#", shown)  # committed-exact: text, numbers blanked
    assert_matches_committed(_numbers(printed.getvalue()), _numbers(shown), rtol=0, atol=1e-4,
                             why="printed with 4 decimals; a float32 softmax and float64 sums "
                                 "differ across CPUs far below that")


def test_the_sentence_after_the_quickstart_reads_its_numbers():
    """"Ignoring the mismatch leaves half of the gradient's norm as bias; truncated importance
    sampling removes most of it"."""
    assert ("Ignoring the mismatch leaves half of the gradient's norm as bias; truncated "
            "importance sampling removes most of it") in " ".join(HOME.split())
    _, naive, tis = _numbers(_block("quickstart-output"))
    assert 0.45 <= naive <= 0.55 and tis < naive / 2


def test_every_link_of_the_home_page_lands_on_a_page_and_anchor_that_exist():
    links = re.findall(r"\]\(([^)#\s]+\.md)(?:#([^)\s]+))?\)", HOME)
    assert len(links) >= 10
    for page, anchor in links:
        assert (ROOT / "docs" / page).is_file(), page
        if anchor:
            assert anchor in _anchors(page), f"{page}#{anchor}"  # committed-exact: anchor names


def test_three_paths_come_before_the_chapter_list_and_it_before_any_table_or_figure():
    start = HOME.split("## The chapters", 1)[0]
    paths = re.findall(r"as an? \*\*(student|instructor|practitioner)\*\* with",
                       " ".join(start.split()))
    assert paths == ["student", "instructor", "practitioner"]
    assert "|" not in start and "![" not in start and "--8<--" not in start
    assert len(start.splitlines()) <= 10  # a title, one sentence, the three paths


def test_the_chapter_list_is_the_navigations_order():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    chapters = next(item["Chapters"] for item in config["nav"] if "Chapters" in item)
    nav = [(title, page) for entry in chapters for title, page in entry.items()]
    section = HOME.split("## The chapters", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\d+\. \[([^\]]+)\]\(([^)]+)\)", section, re.M) == nav


def test_the_students_path_ends_at_the_first_chapters_graded_lab():
    """Home -> the first chapter's Exercises -> the commands that write and test the lab whose
    tasks, functions and points it lists."""
    student = re.search(r"as a \*\*student\*\* with (.*?);", " ".join(HOME.split())).group(1)
    assert student == "chapter 1 and [its lab](opd.md#exercises)"
    assert HOME.split("## The chapters", 1)[1].split("\n")[2].startswith("1. [On-policy "
                                                                       "distillation](opd.md)")
    chapter = (ROOT / "docs" / "opd.md").read_text()
    exercises = chapter.split("\n## Exercises\n", 1)[1]
    assert "python -m opd_literate.course labs/opd --lab opd" in exercises
    assert "python -m pytest --task 1" in exercises
    lab = LABS["opd"]
    points = lab_points(lab)
    public = {}
    for number, function, _ in tasks_of(lab):  # a task's private helpers come with it
        if not function.startswith("_"):
            public.setdefault(number, []).append(function)
    assert sorted(public) == sorted(points)
    for number, functions in public.items():
        for function in functions:
            assert re.search(rf"\*\*Task {number}\*\* \({points[number]:g} points\), "
                             rf"\[`{function}`\]", exercises), (number, function)


@pytest.mark.parametrize("chapter, lab", [("opd.md", "opd"), ("mismatch.md", "mismatch"),
                                          ("mismatch_practice.md", "engine")])
def test_each_chapters_exercises_are_its_lab(chapter, lab):
    """A chapter's Exercises name its lab's command and every task with its points and
    functions, as the handout's README does."""
    exercises = (ROOT / "docs" / chapter).read_text().split("\n## Exercises\n", 1)[1]
    exercises = exercises.split("\n## ", 1)[0]
    assert f"python -m opd_literate.course labs/{lab} --lab {lab}" in exercises
    points = lab_points(LABS[lab])
    functions = {}
    for number, function, _ in tasks_of(LABS[lab]):
        functions.setdefault(number, []).append(function)
    public = {n: [f for f in names if not f.startswith("_")] or names
              for n, names in functions.items()}
    assert sorted(public) == sorted(points)
    for number, names in public.items():
        item = re.search(rf"\*\*Task {number}\*\* \({points[number]:g} points?\), (.*)",
                         exercises)
        assert item, (chapter, number)
        assert all(f"`{name}`" in item.group(1) for name in names), (chapter, number, names)


@pytest.mark.parametrize("command", [
    'pip install -c requirements/dev.txt torch==2.13.0 -e ".[dev]"', "python -m pytest"])
def test_the_install_steps_are_the_readmes(command):
    install = HOME.split("## Install", 1)[1].split("\n## ", 1)[0]
    readme = (ROOT / "README.md").read_text()
    assert command in install and command in readme


@pytest.mark.parametrize("chapter", ["opd.md", "mismatch.md", "mismatch_practice.md"])
def test_the_exercises_commands_work_as_written(chapter, tmp_path, monkeypatch, capsys):
    """The Exercises' two commands run: the handout command writes the folder the ``cd`` goes
    into (a single lab is written into OUTDIR itself, not into OUTDIR/<lab>)."""
    import shlex

    from opd_literate.course import cli

    exercises = (ROOT / "docs" / chapter).read_text().split("\n## Exercises\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", exercises, re.S).group(1)
    write, enter = [line.split("#", 1)[0].strip() for line in block.strip().split("\n")]
    words = shlex.split(write)
    assert words[:3] == ["python", "-m", "opd_literate.course"]
    monkeypatch.chdir(tmp_path)
    assert cli.main(words[3:]) == 0
    capsys.readouterr()
    folder = enter.split("&&")[0].strip().removeprefix("cd ").strip()
    assert (tmp_path / folder / "lab.json").is_file() and (tmp_path / folder / "tests").is_dir()
    assert "python -m pytest --task 1" in enter
