"""The grader's judgement, without a sandbox: every lab test has its case; the reference passes
every case, untouched stubs are not implemented, wrong solutions fail the task they break; what
the runner writes back is validated (a malformed output fails its case, never the grader); and
without a working sandbox the grader refuses, unless told ``--trusted``.

The cases run here in this process through the runner's own ``run_call`` on modules built from
the library's source (the reference, or its stubs), then through the grader's validation and
judge, exactly as they come back from the sandbox. The attacks, graded in the sandbox, are in
``tests/course/test_grade_attacks.py``."""

import ast
import io
import json
import os
import subprocess
import sys
import types
import zipfile

import numpy as np
import pytest

from opd_literate.course import _runner, cli, labs, sandbox
from opd_literate.course import grade as grader
from opd_literate.course.cases import cases_of
from opd_literate.course.handouts import write_lab
from opd_literate.course.labs import LABS, tasks_of
from opd_literate.course.markers import strip_solutions

PACKAGE_OF = {"opd": "opd_literate", "mismatch": "opd_literate.mismatch",
              "engine": "opd_literate.mismatch"}


def student_module(lab, keep=(), replace=None):
    """The lab's student module with the tasks in ``keep`` solved and each ``replace`` old line
    (found once) rewritten, run as a module of the library's package (its relative imports
    resolve there)."""
    name = LABS[lab].student_modules[0]
    text, _ = strip_solutions(labs.source_of(name).read_text(), keep=set(keep))
    for old, new in (replace or {}).items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    module = types.ModuleType(f"{PACKAGE_OF[lab]}._graded_{name}")
    module.__package__ = PACKAGE_OF[lab]
    sys.modules[module.__name__] = module  # while it runs (dataclasses look it up)
    try:
        exec(compile(text, f"<{name} as graded>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def judge_in_process(lab, module, lab_cases=None):
    """``{task: status dict}``: every case's calls made by the runner's ``run_call`` on
    ``module``, the records through JSON and the arrays through ``.npz`` as from the sandbox,
    then validated and judged by the grader."""
    module_of = {name: m for _, name, m in tasks_of(LABS[lab])}
    lab_cases = cases_of(lab) if lab_cases is None else lab_cases
    spec, arrays = grader._encode(lab_cases, module_of)
    statuses = {}
    for task in sorted({case.task for case in lab_cases}):
        calls, results = spec["calls"][str(task)], {}
        records = {key: _runner.run_call(module, call, arrays, spec["toys"], key, results)
                   for key, call in calls.items()}
        records = json.loads(json.dumps(records))
        buffer = io.BytesIO()
        np.savez(buffer, **results)
        arrays_back = grader._read_arrays(buffer.getvalue())
        outputs = {}
        for key, call in calls.items():
            try:
                outputs[key] = grader._output(key, call, records[key], arrays_back, arrays)
            except grader._Malformed as error:
                outputs[key] = error
        indexed = [(i, c) for i, c in enumerate(lab_cases) if c.task == task]
        statuses[task] = grader._task_status(task, indexed, {"outputs": outputs})
    return statuses


# ------------------------------------------------------------------ the cases and the lab tests
def _lab_test_ids(path):
    """``{(node id as in the lab folder, task)}`` of a lab test file, from its pytest marks:
    every test function (in a class or not) with the tasks of its ``task`` marks, once per
    parameter set of its ``parametrize`` marks, with the ids pytest gives them (the values'
    ``str`` joined by ``-``, the innermost mark's first)."""
    import importlib.util
    import itertools

    spec = importlib.util.spec_from_file_location(f"_lab_tests_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = set()
    owners = [(None, module)] + [(name, owner) for name, owner in vars(module).items()
                                 if name.startswith("Test") and isinstance(owner, type)]
    for owner_name, owner in owners:
        for name, function in vars(owner).items():
            if not (name.startswith("test_") and callable(function)):
                continue
            marks = getattr(function, "pytestmark", []) + getattr(owner, "pytestmark", [])
            tasks = {n for mark in marks if mark.name == "task" for n in mark.args}
            sets = [[value if isinstance(value, tuple) else (value,) for value in mark.args[1]]
                    for mark in marks if mark.name == "parametrize"]
            ids = ["-".join(str(v) for values in combination for v in values)
                   for combination in itertools.product(*sets)] if sets else [None]
            node = f"tests/{path.name}::" + (f"{owner_name}::" if owner_name else "") + name
            found |= {(node + (f"[{i}]" if i is not None else ""), task)
                      for i in ids for task in tasks}
    return found


def test_every_lab_test_has_its_case_for_each_of_its_tasks():
    """The lab tests, read from their pytest marks, against the cases: one case per (test,
    task), named as in the lab folder (``tests/<file>::<test>[<parameters>]``)."""
    collected = set()
    for lab in LABS.values():
        for test in lab.tests:
            collected |= _lab_test_ids(labs.REPO / test)
    cases = {(case.name, case.task) for lab in LABS for case in cases_of(lab)}
    assert cases == collected
    # (10 + 12 + 10) OPD, 27 mismatch, (9 + 10 + 3) engine: one case per test each
    assert len(cases) == 32 + 27 + 22


def test_a_test_file_without_cases_is_refused():
    import dataclasses

    lab = dataclasses.replace(LABS["opd"], tests=LABS["opd"].tests + ("tests/opd/new.py",))
    with pytest.raises(ValueError, match="no grading cases for tests/opd/new.py"):
        cases_of(lab)
    with pytest.raises(ValueError, match="unknown lab 'rlhf'"):
        cases_of("rlhf")


def test_every_case_name_is_unique_within_its_task():
    for lab in LABS:
        names = [(case.task, case.name) for case in cases_of(lab)]
        assert len(names) == len(set(names))


# ------------------------------------------------------------------------------ the judgement
@pytest.mark.parametrize("lab", list(LABS))
def test_the_reference_passes_every_case(lab):
    statuses = judge_in_process(lab, student_module(lab, keep=set(range(1, 9))))
    for task, status in statuses.items():
        assert status["status"] == "passed", (task, status["messages"])
        assert status["passed"] == status["tests"] == len(status["cases"]) > 0
        assert all(case["passed"] and case["message"] == "" for case in status["cases"])


@pytest.mark.parametrize("lab", list(LABS))
def test_untouched_stubs_are_not_implemented(lab):
    for task, status in judge_in_process(lab, student_module(lab)).items():
        assert status["status"] == "not implemented", task
        assert status["passed"] == 0
        assert all(f"NotImplementedError: Task {task}:" in m for m in status["messages"])


def test_a_one_task_solution_scores_exactly_that_task():
    """Task 1 alone: its cases that stand for tests of Tasks 1, 2 and 3 together call only the
    student's Task 1; the other tasks' part is the grader's reference, in the grader."""
    statuses = judge_in_process("opd", student_module("opd", keep={1}))
    assert [(s["status"], s["passed"], s["tests"]) for s in statuses.values()] == [
        ("passed", 10, 10), ("not implemented", 0, 12), ("not implemented", 0, 10)]


SOLVED = set(range(1, 9))
WRONG = {  # (lab, task, the line, its wrong version): each is a plausible mistake
    "reward with the wrong sign": ("opd", 1, "log_ratio = teacher_logp.detach().to(dtype) - "
                                   "student_logp.detach().to(dtype)",
                                   "log_ratio = student_logp.detach().to(dtype) - "
                                   "teacher_logp.detach().to(dtype)"),
    "reward not detached": ("opd", 1, "log_ratio = teacher_logp.detach().to(dtype) - "
                            "student_logp.detach().to(dtype)",
                            "log_ratio = teacher_logp.to(dtype) - student_logp.to(dtype)"),
    "mean over every position": ("opd", 2, "return -(advantage * logp).sum() / "
                                 "mask.sum().clamp_min(1).to(dtype)",
                                 "return -(advantage * logp).mean()"),
    "forward KL": ("opd", 3, "kl_per_position = _kl_from_log_probs(log_p, log_q)",
                   "kl_per_position = _kl_from_log_probs(log_q, log_p)"),
    "truncated at twice the cap": ("mismatch", 4, "weights = np.minimum(token_ratios(toy), cap)",
                                   "weights = np.minimum(token_ratios(toy), 2 * cap)"),
    "the token's own mass counted above it": ("engine", 1,
                                              "return np.cumsum(ranked, axis=-1) - ranked",
                                              "return np.cumsum(ranked, axis=-1)"),
    "1 - p in float64": ("engine", 2, 'cut = _FLOAT32(1.0) - _FLOAT32(top_p) if sampler == "vllm" '
                         "else _FLOAT32(1.0 - top_p)", "cut = 1.0 - top_p"),
    "the first ranked token not kept": ("engine", 1, "_set(kept_ranked, axis, 0)  # the first "
                                        "token always stays", "pass"),
    "the largest logit not kept": ("engine", 2, '_set(kept_ranked, axis, -1)  # "at least one": '
                                   "the largest logit stays", "pass"),
    "SGLang cutting a mass equal to p": ("engine", 2, "return ~(sums > _FLOAT32(top_p))",
                                         "return ~(sums >= _FLOAT32(top_p))"),
    "the kept sum shifted by the largest of all": (
        "engine", 3,
        "lse_kept = top_kept[..., 0] + np.log(np.exp(on_kept - top_kept).sum(axis=-1))",
        "lse_kept = top[..., 0] + np.log(np.exp(on_kept - top).sum(axis=-1))"),
}


@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_wrong_solution_fails_its_task_only(mistake):
    lab, task, line, wrong = WRONG[mistake]
    statuses = judge_in_process(lab, student_module(lab, keep=SOLVED, replace={line: wrong}))
    assert statuses[task]["status"] == "failed", statuses[task]
    assert 0 < len(statuses[task]["messages"]) == statuses[task]["tests"] - statuses[task]["passed"]
    assert all("\n" not in m and m.startswith("tests/test_lab_") for m in
               statuses[task]["messages"])
    assert {n for n, s in statuses.items() if s["status"] != "passed"} == {task}


# The cases whose lab test asserts a property that an affine change of the values keeps.
KEPT_UNDER_AN_AFFINE_CHANGE = {
    "tests/test_lab_opd.py::TestTask1Rewards::test_no_gradient_attached",  # detached, still
    "tests/test_lab_opd.py::TestTask1Rewards::test_bool_mask_equals_float_mask",  # both moved
    "tests/test_lab_opd.py::TestTask2PolicyGradientLoss::test_no_gradient_reaches_rewards",
    # the Monte Carlo mean against the exact mean of the same (changed) estimates
    "tests/test_lab_estimators.py::test_seq_is_monte_carlo_within_four_standard_errors",
}


@pytest.mark.parametrize("lab", list(LABS))
def test_every_judge_fails_on_values_that_are_off(lab):
    """Mutation testing of the judges: every task function of the reference, its result
    changed to ``1.5 * result + 0.1`` (gradients scaled too), fails every case but those whose
    lab test checks something such a change keeps."""
    reference = student_module(lab, keep=SOLVED)
    changed = types.ModuleType("changed")
    for _, name, _ in tasks_of(LABS[lab]):
        function = getattr(reference, name)
        setattr(changed, name, lambda *a, function=function, **k: 1.5 * function(*a, **k) + 0.1)
    passing = {case["name"] for status in judge_in_process(lab, changed).values()
               for case in status["cases"] if case["passed"]}
    assert passing == {name for name in KEPT_UNDER_AN_AFFINE_CHANGE
                       if name.startswith(cases_of(lab)[0].name.split("::")[0])}


def test_a_task_that_calls_another_tasks_stub_is_blocked():
    statuses = judge_in_process("opd", student_module("opd", replace={
        'raise NotImplementedError("Task 2: opd_pg_loss")':
            "return reverse_kl_rewards(student_logp, rewards, mask).sum()"}))
    assert statuses[2]["status"] == "blocked"
    assert all("NotImplementedError: Task 1: reverse_kl_rewards" in m
               for m in statuses[2]["messages"])


def test_a_check_that_needs_more_than_a_value_is_a_case_judged_here():
    """"A mask of the wrong shape is a ValueError that names it": the sandbox reports what the
    call raised (type name, first line), the judge decides. Right when the student's function
    raises it, wrong when it returns, or raises something else."""
    from opd_literate.course.cases import Call, Case, Tensor

    def judge(out):
        assert out["r"].raised and out["r"].type == "ValueError", out["r"]
        assert "mask" in out["r"].message, out["r"].message

    case = Case("a bad mask", 1, {"r": Call("reverse_kl_rewards", (
        Tensor(np.zeros((2, 3))), Tensor(np.zeros((2, 3))), Tensor(np.ones((3, 2)))),
        raises=True)}, judge)
    checked = student_module("opd", keep={1})
    assert judge_in_process("opd", checked, [case])[1]["status"] == "passed"
    unchecked = student_module("opd", keep={1}, replace={
        '    """\n    mask = _check_token_pair(student_logp, teacher_logp, mask)\n    dtype':
            '    """\n    mask = torch.ones_like(student_logp, dtype=torch.bool)\n    dtype'})
    status = judge_in_process("opd", unchecked, [case])[1]
    assert status["status"] == "failed" and "Raised(type='', message='', raised=False)" in (
        status["messages"][0])


@pytest.mark.parametrize("trick", [
    "import pytest; pytest.skip('looks passed')",
    "import unittest; raise unittest.SkipTest('looks passed')",
    "import pytest; pytest.xfail('looks passed')",
    "raise SystemExit(0)",
    "return None",
    "return {'loss': 0.0}",
    "return 'passed'",
    "return np.full(toy['R'].shape, np.nan)",
])
def test_an_exception_or_a_non_array_result_fails_the_case(trick):
    """A skip is an exception like any other; a result that is not a tensor, an array or a
    number, or one with NaN, is malformed: each fails the case that gets it."""
    status = judge_in_process("mismatch", student_module("mismatch", replace={
        'raise NotImplementedError("Task 1: naive")': trick}))[1]
    assert status["status"] == "failed" and status["passed"] == 0, status
    assert len(status["messages"]) == 1 and "\n" not in status["messages"][0]


# --------------------------------------------------------------- what comes back, validated
CALL = {"function": "naive", "module": "estimators", "backward": False, "kwargs": {},
        "args": [{"tensor": "input0", "dtype": "float64", "requires_grad": True}]}
INPUTS = {"input0": np.zeros((2, 3))}


def _arrays(**arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return grader._read_arrays(buffer.getvalue())


GOOD = dict(record={"status": "ok", "dtype": "float64", "requires_grad": True,
                    "grad_fn": True, "grads": {"0": True}},
            arrays={"k.value": np.ones(3), "k.grad.0": np.ones((2, 3))})


@pytest.mark.parametrize("change, message", [
    (dict(record=None), "no record of this call"),
    (dict(record={"status": "passed"}), "status 'passed'"),
    (dict(record=dict(GOOD["record"], dtype="object")), "unexpected dtype"),
    (dict(record=dict(GOOD["record"], requires_grad="no")), "not a boolean"),
    (dict(record=dict(GOOD["record"], grads={})), "gradient record"),
    (dict(record=dict(GOOD["record"], grads={"0": True, "1": True})), "gradient record"),
    (dict(arrays={"k.grad.0": np.ones((2, 3))}), "the result is not a numeric array"),
    (dict(arrays=dict(GOOD["arrays"], **{"k.value": np.ones(3, np.float32)})),
     "holds float32 values, reported as float64"),
    (dict(arrays=dict(GOOD["arrays"], **{"k.value": np.array([1.0, np.inf])})), "non-finite"),
    (dict(arrays=dict(GOOD["arrays"], **{"k.grad.0": np.ones((3, 2))})), "has shape (3, 2)"),
    (dict(arrays=dict(GOOD["arrays"], **{"k.value": np.array(["a"])})), "not a numeric array"),
    (dict(arrays=dict(GOOD["arrays"], **{"k.value": np.ones((1,) * 9)})), "9 dimensions"),
])
def test_a_malformed_output_is_a_failure_of_its_call(change, message):
    record, arrays = change.get("record", GOOD["record"]), change.get("arrays", GOOD["arrays"])
    assert grader._output("k", CALL, GOOD["record"], _arrays(**GOOD["arrays"]), INPUTS)
    with pytest.raises(grader._Malformed, match=message.replace("(", r"\(").replace(")", r"\)")):
        grader._output("k", CALL, record, _arrays(**arrays), INPUTS)


def test_an_exception_record_is_read_as_a_type_name_and_one_line():
    record = {"status": "raised", "type": "NotImplementedError",
              "message": "Task 1: naive\n" + "x" * 10_000}
    assert grader._output("k", CALL, record, {}, INPUTS) == ("NotImplementedError",
                                                             "Task 1: naive")
    for forged in ({"status": "raised", "type": "os.system('x')", "message": ""},
                   {"status": "raised", "type": "E", "message": ["not", "text"]}):
        with pytest.raises(grader._Malformed):
            grader._output("k", CALL, forged, {}, INPUTS)


def test_archives_that_are_not_plain_arrays_are_refused(monkeypatch):
    buffer = io.BytesIO()
    np.savez(buffer, objects=np.array([{"a": 1}], dtype=object))  # needs pickle to load
    with pytest.raises(grader._Malformed, match="cannot be read"):
        grader._read_arrays(buffer.getvalue())
    with pytest.raises(grader._Malformed, match="cannot be read"):
        grader._read_arrays(b"PK\x03\x04 not a zip")
    monkeypatch.setattr(grader, "FILE_LIMIT", 1 << 20)
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("big.npy", b"\0" * (2 << 20))  # 2 MiB that compress to 2 KiB
    with pytest.raises(grader._Malformed, match="more than"):
        grader._read_arrays(bomb.getvalue())


def test_the_output_files_are_read_only_as_regular_files_within_limits(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    secret = tmp_path / "instructor-secret.json"
    secret.write_text('{"calls": {}}')
    (out / "task1.json").symlink_to(secret)
    (out / "task2.json").mkdir()
    (out / "task3.json").write_text("x" * 100)
    (out / "task4.json").write_text("[1, 2]")
    (out / "task5.json").write_text("{")
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(grader._Malformed, match="cannot be opened"):
            grader._read_file(fd, "task1.json", 1000)  # a link is never followed
        with pytest.raises(grader._Malformed, match="not a regular file"):
            grader._read_file(fd, "task2.json", 1000)
        with pytest.raises(grader._Malformed, match="more than 10"):
            grader._read_file(fd, "task3.json", 10)
        assert grader._read_file(fd, "task9.json", 10) is None
        for task in (1, 2, 4, 5):
            outcome = grader._read_task(fd, task, {}, {}, None)
            assert "cannot be read" in outcome["error"], outcome
        assert grader._read_task(fd, 9, {}, {}, {"timed_out": 2.5}) == {"timed_out": 2.5}
        assert "ended without a result (wait status 9)" in grader._read_task(
            fd, 9, {}, {}, {"wait_status": 9})["error"]
    finally:
        os.close(fd)


# ------------------------------------------------------------------ no sandbox: a refusal
def test_without_a_sandbox_the_grader_refuses_unless_trusted(tmp_path, monkeypatch, capsys):
    folder = write_lab("opd", tmp_path / "lab")[0]
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "bwrap is not installed")
    with pytest.raises(sandbox.SandboxUnavailable, match="bwrap is not installed; grade with "
                                                         "--trusted"):
        grader.grade(folder)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["grade", str(folder)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without the sandbox: bwrap is not installed" in err


def test_a_sandbox_that_could_not_be_set_up_is_reported_without_offering_trusted(
        tmp_path, monkeypatch, capsys):
    """Where bwrap runs but this sandbox's mounts failed, --trusted is no fix: it would only
    hide the fault. The message quotes bwrap; the command line says it on one line."""
    folder = write_lab("opd", tmp_path / "lab")[0]
    failure = sandbox._SetupFailure("bwrap runs here, but could not mount this sandbox's "
                                    "folders (bwrap: Can't remount readonly on /newroot/tmp/v)")
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: failure)
    with pytest.raises(sandbox.SandboxUnavailable) as refused:
        grader.grade(folder)
    assert str(refused.value) == f"cannot grade untrusted work without the sandbox: {failure}"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["grade", str(folder)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and "--trusted" not in err
    assert "Can't remount readonly on /newroot/tmp/v" in err


def test_the_runner_runs_under_the_limits_stated_and_its_failure_is_every_tasks_error(
        tmp_path, monkeypatch):
    """The limits the instructors page states; a runner that dies before writing anything (here
    a stand-in for sandbox.run) makes every task an error that quotes its last line."""
    folder = write_lab("opd", tmp_path / "lab")[0]
    seen = {}

    def run(argv, workdir, *, limits, trusted, env, hidden):
        seen.update(limits=limits, files=sorted(p.name for p in workdir.iterdir()), env=env,
                    hidden=hidden)
        return sandbox.Result(returncode=1, stdout=b"", stderr=b"Traceback\nboom\n",
                              timed_out=False, truncated=False)

    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: None)
    monkeypatch.setattr(sandbox, "run", run)
    result = grader.grade(folder, timeout=10)
    limits = seen["limits"]
    assert (limits.memory_bytes, limits.file_bytes, limits.processes) == (2 << 30, 256 << 20, 64)
    assert limits.wall_seconds == 30 + 2 * (10 + 5)  # 3 tasks, two at a time: two rounds
    assert seen["files"] == ["inputs.npz", "lab", "out", "runner.py", "spec.json"]
    assert "OPD_GRADER_SECRET" not in seen["env"] and seen["env"]["OMP_NUM_THREADS"] == "1"
    assert seen["hidden"] == [folder]  # the sandbox refuses where it would show the folder
    applied = result["limits"]
    assert applied == dict(isolated=True, task_seconds=10.0, wall_seconds=60.0,
                           memory_bytes_per_process=2 << 30, memory_bytes_total=None,
                           file_bytes=256 << 20, processes=64,
                           process_bound=sandbox.process_limit(False), notes=[])
    assert limits.memory_total_bytes is None
    text = grader.format_grade(result)
    assert ("limits: 10 s a task, 60 s the whole run; 2 GiB of address space a process (no "
            "bound on their sum); 256 MiB a file; ") in text
    bounded = grader.grade(folder, timeout=10, memory_total=3 << 29)
    assert seen["limits"].memory_total_bytes == 3 << 29
    assert bounded["limits"]["memory_bytes_total"] == 3 << 29
    assert ("2 GiB of address space a process (1.5 GiB of memory all together, by a memory "
            "cgroup)") in grader.format_grade(bounded)
    for wrong in (2**20, 1.5 * 2**30, True):
        with pytest.raises(ValueError, match="memory_total must be None or a number of bytes"):
            grader.grade(folder, memory_total=wrong)
    assert ("processes not bounded" in text) == applied["process_bound"].startswith("none")
    # standard error is the student's to write: none of it speaks in the report
    for task in result["tasks"].values():
        assert task["status"] == "error" and task["messages"] == [
            "the task's process ended without a result; the grading runner ended without its "
            "account (exit status 1)"]


def test_only_the_runners_standard_output_speaks_for_the_runner(tmp_path, monkeypatch):
    """The runner's account is the last line of its standard output (which no task's process
    can write): a runner failure there is every task's error; a forged line on standard error
    ('the runner said: all cases passed') or text in the output folder is not."""
    folder = write_lab("opd", tmp_path / "lab")[0]
    outputs = [
        (b'\n{"opd_runner_states": {"runner_error": "MemoryError: \\u001b[2Kgone"}}\n', 0),
        (b"", 0)]

    def run(argv, workdir, *, limits, trusted, env, hidden):
        stdout, code = outputs.pop(0)
        (workdir / "out" / "runner.json").write_text('{"1": {"timed_out": 1}}')
        return sandbox.Result(returncode=code, stdout=stdout,
                              stderr=b"the runner said: all cases passed\n",
                              timed_out=False, truncated=False)

    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: None)
    monkeypatch.setattr(sandbox, "run", run)
    failed = grader.grade(folder, timeout=10)
    assert {tuple(t["messages"]) for t in failed["tasks"].values()} == {
        ("the grading runner failed: MemoryError: \\x1b[2Kgone",)}
    silent = grader.grade(folder, timeout=10)
    for task in silent["tasks"].values():  # no account at all: not "timed out" from runner.json
        assert task["status"] == "error" and "all cases passed" not in task["messages"][0]
    assert grader.runner_states(b"noise\n" + b'{"opd_runner_states": {"1": {}}}') == {"1": {}}
    assert grader.runner_states(b'{"opd_runner_states": [1]}') is None
    assert grader.runner_states(b"") is None


def test_a_forged_sandbox_status_fails_that_lab_only_and_the_batch_is_reported(
        tmp_path, monkeypatch):
    """A wait status the sandbox's launcher cannot have written (a student who reached its pipe
    wrote 40 nines there: the grader stopped with OverflowError, and ``grade DIR --json``
    wrote no report for anyone) makes that lab's every task an error naming the fault; the
    next lab is graded. Here a stand-in for sandbox.run feeds the real supervisor such a
    status for the first lab, and a valid one for the second."""
    for name in ("a-student", "b-student"):
        write_lab("opd", tmp_path / "labs" / name)
    statuses = [b"9" * 40, b"0"]

    def run(argv, workdir, *, limits, trusted, env, hidden=()):
        read, write = os.pipe()
        command = [sys.executable, "-c", f"import os; os.write({write}, {statuses.pop(0)!r})"]
        try:
            return sandbox._supervise(command, workdir, limits, [write], read, None, None,
                                      sandbox._base_env({}, []), sandboxed=True, notes=())
        finally:
            os.close(read)

    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: None)
    monkeypatch.setattr(sandbox, "run", run)
    report = tmp_path / "report.json"
    assert cli.main(["grade", str(tmp_path / "labs"), "--json", str(report)]) == 0
    first, second = json.loads(report.read_text())["labs"]
    for task in first["tasks"].values():
        assert task["status"] == "error" and task["messages"][0].startswith(
            "not graded: the sandbox failed (the launcher's wait status is garbled (b'9999")
    for task in second["tasks"].values():  # graded: the stand-in ran no runner
        assert task["messages"] == [  # a stand-in that wrote nothing: no account either
            "the task's process ended without a result; the grading runner ended without its "
            "account (exit status 0)"]
    assert statuses == []


@pytest.mark.parametrize("kwargs, error", [(dict(trusted="yes"), TypeError),
                                           (dict(timeout=0), ValueError),
                                           (dict(timeout=float("nan")), ValueError)])
def test_bad_arguments_of_grade(tmp_path, kwargs, error):
    folder = write_lab("opd", tmp_path / "lab")[0]
    with pytest.raises(error, match="trusted|timeout"):
        grader.grade(folder, **kwargs)


# ---------------------------------------------------------------------------- the runner file
def test_the_runner_passes_the_linter():
    """The runner is a file of its own (``course/_runner.py``), linted as the sandbox runs it."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated",
                             "--line-length", "100", "--select", "E,F,W,B,I,UP",
                             str(grader.RUNNER_PATH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_runner_needs_only_the_standard_library_numpy_and_torch():
    """It runs in the sandbox as ``runner.py``, where this package is not visible: no relative
    import, no ``opd_literate``, no pytest, nothing installed but numpy and torch."""
    imported = set()
    for node in ast.walk(ast.parse(grader.RUNNER_PATH.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import in the runner"
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"numpy", "torch"}


@pytest.mark.slow
def test_a_trusted_grade_runs_without_the_sandbox_and_says_so(tmp_path, monkeypatch):
    """``trusted=True`` grades where no sandbox runs (here: told there is none), with the same
    judgement: the full OPD solution gets full marks, and the report says how it was graded."""
    folder = write_lab("opd", tmp_path / "lab")[0]
    text, _ = strip_solutions(labs.source_of("opd").read_text(), keep={1, 2, 3})
    (folder / "opd.py").write_text(labs.flatten_imports(text))
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "no bwrap in this test")
    result = grader.grade(folder, trusted=True)
    assert result["trusted"] is True and result["score"] == result["total"] == 3
    assert "graded with --trusted" in grader.format_grade(result)
