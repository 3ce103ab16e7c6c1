r"""Solution markers: the comment lines that make one source both the library and the lab.

The library's modules mark each lab task's solution with comment lines, in the manner of
nbgrader:

    ### BEGIN SOLUTION Task 1: teacher_logp - student_logp, detached; exactly 0 where mask is 0
    log_ratio = teacher_logp.detach() - student_logp.detach()
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ### END SOLUTION

Because the markers are comments, the library, its doctests and its tests run unchanged.
[strip_solutions][opd_literate.course.markers.strip_solutions] replaces every marked region
with its hint and a stub:

    # TODO (Task 1): teacher_logp - student_logp, detached; exactly 0 where mask is 0
    raise NotImplementedError("Task 1: reverse_kl_rewards")

[nbgrader_solutions][opd_literate.course.markers.nbgrader_solutions] writes the same regions in
nbgrader's own form, for an nbgrader *source* notebook. This module only reads text: the lab
folders are written by ``course.labs``, graded by ``course.grade``.
"""

from __future__ import annotations

import re

__all__ = ["MarkerError", "strip_solutions", "solution_lines", "nbgrader_solutions"]

BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION(?P<rest>.*)$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
TASK = re.compile(r"^\s*Task\s+(?P<task>\d+)\s*:\s*(?P<hint>\S.*)$")
DEF = re.compile(r"^\s*def\s+(?P<name>\w+)\s*\(")


class MarkerError(ValueError):
    """Unbalanced, nested or malformed solution markers; the message names file and line."""



def strip_solutions(text: str, filename: str = "<string>",
                    keep=frozenset()) -> tuple[str, list[tuple[int, str]]]:
    """Replace every solution region of ``text`` by its TODO hint and a stub.

    Returns the student text and the tasks found, ``[(number, function name)]``. The regions of
    the task numbers in ``keep`` stay as they are (only their marker lines go): a partial
    solution, as a student who has done those tasks would have it.

    Raises
    ------
    MarkerError
        For a BEGIN without END, an END without BEGIN, nested regions, or a BEGIN without
        ``Task N: hint``; the message names ``filename`` and the line.

    Examples
    --------
    >>> source = '''def f(x):
    ...     ### BEGIN SOLUTION Task 7: double it
    ...     return 2 * x
    ...     ### END SOLUTION
    ... '''
    >>> student, tasks = strip_solutions(source)
    >>> print(student)
    def f(x):
        # TODO (Task 7): double it
        raise NotImplementedError("Task 7: f")
    <BLANKLINE>
    >>> tasks
    [(7, 'f')]
    """
    out, tasks = [], []
    open_at = None  # (line number, indent, task, hint, function)
    function = None
    for number, line in enumerate(text.split("\n"), start=1):
        begin, end = BEGIN.match(line), END.match(line)
        if open_at is None:
            match = DEF.match(line)
            if match:
                function = match.group("name")
        if begin:
            if open_at is not None:
                raise MarkerError(f"{filename}:{number}: nested BEGIN SOLUTION (the region "
                                  f"opened at line {open_at[0]} is not closed)")
            task = TASK.match(begin.group("rest"))
            if task is None:
                raise MarkerError(f"{filename}:{number}: BEGIN SOLUTION needs 'Task N: hint'")
            open_at = (number, begin.group("indent"), int(task.group("task")),
                       task.group("hint").strip(), function)
            continue
        if end:
            if open_at is None:
                raise MarkerError(f"{filename}:{number}: END SOLUTION without BEGIN SOLUTION")
            _, indent, task_number, hint, name = open_at
            if task_number not in keep:
                out.append(f"{indent}# TODO (Task {task_number}): {hint}")
                out.append(f'{indent}raise NotImplementedError("Task {task_number}: {name}")')
            tasks.append((task_number, name))
            open_at = None
            continue
        if open_at is None or open_at[2] in keep:
            out.append(line)
    if open_at is not None:
        raise MarkerError(f"{filename}:{open_at[0]}: BEGIN SOLUTION is never closed")
    return "\n".join(out), tasks


def solution_lines(text: str) -> list[str]:
    """The code lines inside solution regions (stripped, without blank lines and comments)."""
    lines, inside = [], False
    for line in text.split("\n"):
        if BEGIN.match(line):
            inside = True
        elif END.match(line):
            inside = False
        elif inside and line.strip() and not line.strip().startswith("#"):
            lines.append(line.strip())
    return lines


def nbgrader_solutions(text: str, filename: str = "<string>") -> str:
    r"""``text`` with every solution region in nbgrader's form: the hint on a ``# TODO`` line
    above a plain ``### BEGIN SOLUTION``, so that ``nbgrader generate_assignment``, which
    replaces each region (its BEGIN line included) by its own stub, keeps the hint.

    Raises MarkerError as [strip_solutions][opd_literate.course.markers.strip_solutions] does.

    Examples
    --------
    >>> source = '''def f(x):
    ...     ### BEGIN SOLUTION Task 7: double it
    ...     return 2 * x
    ...     ### END SOLUTION
    ... '''
    >>> nbgrader_solutions(source).split("\n")[:4]  # (printed, the lines would be markers)
    ['def f(x):', '    # TODO (Task 7): double it', '    ### BEGIN SOLUTION', '    return 2 * x']
    """
    strip_solutions(text, filename)  # the same checks: balanced, not nested, "Task N: hint"
    out = []
    for line in text.split("\n"):
        begin = BEGIN.match(line)
        if begin:
            task = TASK.match(begin.group("rest"))
            indent = begin.group("indent")
            out += [f"{indent}# TODO (Task {task.group('task')}): {task.group('hint').strip()}",
                    f"{indent}### BEGIN SOLUTION"]
        else:
            out.append(line)
    return "\n".join(out)
