"""The grading runner: the one program of ``opd_literate.course.grade`` that runs student code.

The grader starts it inside the sandbox (``course/sandbox.py``), in a folder that holds the
student's modules (``lab/``), the calls to make (``spec.json``) and their inputs
(``inputs.npz``). It imports the standard library, numpy and torch only (never this package,
which the sandbox does not show), then runs each task in a forked child: the child imports the
student's modules, makes the task's calls (a function of the student's module on the given
inputs, then ``backward()`` where asked) and writes what came out to ``out/``: ``task<N>.json``,
the status of each call (``ok``, or the exception's type name and first line) with the shape
facts that are not values (``requires_grad``, a ``grad_fn``, the dtype), and ``task<N>.npz``,
the values and input gradients as plain numeric arrays.

Nothing here judges. The grader reads these files back (``allow_pickle=False``), validates them
and compares them with the reference it computes in its own process. Student code can write
anything into ``out/``; what it writes is data the grader checks like any other output, and a
right value needs the student's code to compute it.

The runner's own account (which task timed out, how each process ended, or why the runner
itself failed) is its standard output's last line, ``{"opd_runner_states": ...}``: student code
cannot write there. Each task's process points its output at ``/dev/null`` before it imports
anything of the student's, and the runner makes itself not dumpable first, so that no process
of the same user opens its pipe through ``/proc/<pid>/fd`` (nor ptraces it).
"""

import ctypes
import importlib
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

MESSAGE_LIMIT = 500  # characters of an exception's first line
NUMERIC_KINDS = "biuf"  # bool, signed and unsigned integers, floats: nothing else comes back
TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}


def first_line(error):
    lines = [line.strip() for line in str(error).split("\n") if line.strip()] or [""]
    return lines[0][:MESSAGE_LIMIT]


def describe_import_error(error, lab):
    """One line naming the cause of an exception raised while importing the student's code, with
    the file and line inside the lab folder where it happened."""
    if isinstance(error, SyntaxError):
        where = os.path.relpath(error.filename, lab) if error.filename else "?"
        return f"syntax error in {where}, line {error.lineno}: {error.msg}"
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f.filename and os.path.realpath(f.filename).startswith(lab + os.sep)]
    where = (f" ({os.path.relpath(frames[-1].filename, lab)}, line {frames[-1].lineno})"
             if frames else "")
    return f"{type(error).__name__}: {first_line(error)}{where}"


def build_argument(spec, arrays, toys):
    """A fresh input for one call (a student may change its inputs in place)."""
    if not isinstance(spec, dict):
        return spec
    if "float" in spec:  # JSON has no infinities
        return float(spec["float"])
    if "tensor" in spec:
        # CPU by design: the grading inputs, on the CPU the sandbox has
        tensor = torch.from_numpy(arrays[spec["tensor"]].copy()).to(TORCH_DTYPES[spec["dtype"]])
        return tensor.requires_grad_(True) if spec.get("requires_grad") else tensor
    if "array" in spec:
        return arrays[spec["array"]].copy()
    if "toy" in spec:
        toy = toys[spec["toy"]]
        return dict({k: arrays[v].copy() for k, v in toy["arrays"].items()}, **toy["scalars"])
    raise ValueError(f"unknown argument {spec!r}")


def to_plain(value):
    """``(array, facts)`` for a returned tensor, array or number; TypeError for anything else."""
    facts = {}
    if isinstance(value, torch.Tensor):
        facts = dict(requires_grad=bool(value.requires_grad),
                     grad_fn=value.grad_fn is not None, dtype=str(value.dtype).split(".")[-1])
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16; the dtype stays in facts
            value = value.float()
        array = value.numpy()
    elif isinstance(value, (np.ndarray, np.generic, bool, int, float)):
        array = np.asarray(value)
        facts["dtype"] = str(array.dtype) if isinstance(value, (np.ndarray, np.generic)) \
            else type(value).__name__
    else:
        raise TypeError(f"returned a {type(value).__name__}, not a tensor, array or number")
    array = np.array(array, copy=True)
    if type(array) is not np.ndarray or array.dtype.kind not in NUMERIC_KINDS:
        raise TypeError(f"returned values of dtype {array.dtype}, not numbers")
    return array, facts


def run_call(module, call, arrays, toys, key, results):
    """Call the student's function once; the arrays go into ``results``, the record is returned."""
    try:
        args = [build_argument(a, arrays, toys) for a in call["args"]]
        kwargs = {k: build_argument(v, arrays, toys) for k, v in call["kwargs"].items()}
    except Exception as error:  # the runner's own inputs: not the student's failure
        return dict(status="runner error", message=f"{type(error).__name__}: {error}")
    stage = "call"
    try:
        value = getattr(module, call["function"])(*args, **kwargs)
        stage = "output"
        array, facts = to_plain(value)
        if call.get("backward") and isinstance(value, torch.Tensor) and value.requires_grad:
            stage = "backward"
            value.backward()
        grads = {}
        for name, argument in [*enumerate(args), *kwargs.items()]:
            if isinstance(argument, torch.Tensor) and argument.requires_grad:
                stage = "gradient"
                grads[str(name)] = argument.grad is not None
                if argument.grad is not None:
                    results[f"{key}.grad.{name}"] = to_plain(argument.grad)[0]
    except BaseException as error:  # pytest.skip, SystemExit, MemoryError: all are failures
        if isinstance(error, KeyboardInterrupt):
            raise
        return dict(status="raised", stage=stage, type=type(error).__name__,
                    message=first_line(error))
    results[f"{key}.value"] = array
    return dict(status="ok", grads=grads, **facts)


def run_task(spec, task, arrays, lab):
    """In the forked child: import the student's modules and make the calls of one task."""
    os.chdir(lab)
    sys.path.append(lab)  # last: the student's files never shadow an installed package
    record, results = {"task": task, "calls": {}}, {}
    modules = {}
    for name in spec["student_modules"]:
        if not os.path.isfile(os.path.join(lab, f"{name}.py")):
            record["import_error"] = f"the lab folder has no {name}.py"
            return record, results
        try:
            modules[name] = importlib.import_module(name)
        except BaseException as error:  # anything the student's module raises at import
            record["import_error"] = describe_import_error(error, lab)
            return record, results
    for key, call in spec["calls"][str(task)].items():
        record["calls"][key] = run_call(modules[call["module"]], call, arrays, spec["toys"],
                                        key, results)
    return record, results


def not_dumpable():
    """Make this process not dumpable (``prctl(PR_SET_DUMPABLE, 0)``): its ``/proc/<pid>/fd``
    then belongs to root, and a process of the same user can neither open its pipes there nor
    ptrace it. True when it took effect."""
    PR_SET_DUMPABLE = 4
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child(spec, task, arrays, out, lab):
    """A task's process: its output goes to /dev/null, its record and arrays to ``out``."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        record, results = run_task(spec, task, arrays, lab)
        np.savez(os.path.join(out, f"task{task}.npz"), **results)
        text = json.dumps(record)
        with open(os.path.join(out, f"task{task}.json.part"), "w") as file:
            file.write(text)
        os.replace(os.path.join(out, f"task{task}.json.part"),
                   os.path.join(out, f"task{task}.json"))
    finally:
        os._exit(0)


def main():
    """Run every task, then print the account: the last line of standard output."""
    try:
        states = run_tasks()
    except BaseException as error:  # the runner's own failure, before or between the tasks
        states = {"runner_error": f"{type(error).__name__}: {first_line(error)}"}
    sys.stdout.write("\n" + json.dumps({"opd_runner_states": states}) + "\n")
    sys.stdout.flush()


def run_tasks():
    """Fork a process per task, at most ``jobs`` at a time; return how each ended."""
    not_dumpable()
    sys.dont_write_bytecode = True  # nothing of the student's is compiled into the folder
    here = os.getcwd()
    script_folder = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p not in ("", here, script_folder)]
    with open("spec.json") as file:
        spec = json.load(file)
    with np.load("inputs.npz", allow_pickle=False) as inputs:
        arrays = {name: inputs[name] for name in inputs.files}
    out, lab = os.path.join(here, "out"), os.path.join(here, "lab")
    os.makedirs(out, exist_ok=True)
    pending, running, states = list(spec["tasks"]), {}, {}
    while pending or running:
        while pending and len(running) < spec["jobs"]:
            task = pending.pop(0)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                child(spec, task, arrays, out, lab)
            running[pid] = (task, time.monotonic() + spec["timeout"])
        time.sleep(0.01)
        for pid, (task, deadline) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() >= deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                states[task] = dict(timed_out=spec["timeout"])
            elif done:
                states[task] = dict(wait_status=status)
            else:
                continue
            del running[pid]
    return states


if __name__ == "__main__":
    main()
