#!/usr/bin/env bash
# Mutation testing with mutmut 3, a measurement run by hand (docs/mutation.md), not CI.
#
#   tools/mutation.sh                      # opd and mismatch.{opd_mismatch,toy,estimators}
#   tools/mutation.sh mismatch.toy         # only these (dotted below opd_literate)
#   MUTMUT_CHILDREN=2 tools/mutation.sh    # two test processes at once
#   MUTMUT_ONLY='x_answer_toy__*' tools/mutation.sh experiment.quantized
#                                          # only these mutants of it (after new tests: the
#                                          # others keep their results, the line counts all)
#
# A module named in the [tool.opd-mutation] table of pyproject.toml is measured in a copy of the
# working tree of its own, mutants-runs/MODULE/, whose [tool.mutmut] is narrowed to that module
# and the tests the table lists; two such modules can run at once (tools/mutation.sh A & B).
# Any other module runs here, with [tool.mutmut] as it is; mutmut keeps its copy and cache in
# mutants/ (git-ignored; delete it, or mutants-runs/MODULE, to start afresh).
#
# One line per module: mutants, killed, survived, timeout, other, score = killed + timeout over
# all mutants, and the wall time. The survivors: `mutmut results`, then `mutmut show NAME`, run
# in the folder that holds that module's mutants/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

children="${MUTMUT_CHILDREN:-1}"
if [ "$#" -gt 0 ]; then modules=("$@"); else modules=(mismatch.opd_mismatch mismatch.toy opd mismatch.estimators); fi
# mutmut forks its workers from a process that has imported torch: one OpenMP thread each, so
# that no forked thread pool is reused and the workers do not fight over the cores.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# The folder a module is measured in: its own narrowed copy, or the repository itself.
prepare() {
    python - "$1" <<'PY'
import pathlib
import re
import shutil
import sys
import tomllib

module = sys.argv[1]
root = pathlib.Path.cwd()
table = tomllib.loads((root / "pyproject.toml").read_text())["tool"].get("opd-mutation", {})
if module not in table:
    print(root)
    raise SystemExit
work = root / "mutants-runs" / module
keep = {"mutants"}  # an earlier run's mutants and cache are kept (mutmut reruns what changed)
work.mkdir(parents=True, exist_ok=True)
for entry in work.iterdir():
    if entry.name not in keep:
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
skip = shutil.ignore_patterns(".git", ".venv*", "mutants", "mutants-runs", "site", "build",
                              "__pycache__", "*.egg-info", ".hypothesis", ".pytest_cache")
for entry in root.iterdir():
    if skip(str(root), [entry.name]):
        continue
    target = work / entry.name
    if entry.is_dir():
        shutil.copytree(entry, target, ignore=skip, symlinks=True)
    else:
        shutil.copy2(entry, target)
path = "opd_literate/" + module.replace(".", "/") + ".py"
text = (work / "pyproject.toml").read_text()
def toml_list(items):
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"
text, n_only = re.subn(r"(?ms)^only_mutate = \[.*?\]\n", f"only_mutate = {toml_list([path])}\n", text)
text, n_tests = re.subn(r"(?ms)^pytest_add_cli_args_test_selection = \[.*?\]\n",
                        f"pytest_add_cli_args_test_selection = {toml_list(table[module])}\n", text)
if (n_only, n_tests) != (1, 1):
    raise SystemExit("tools/mutation.sh: cannot narrow [tool.mutmut] in pyproject.toml")
(work / "pyproject.toml").write_text(text)
print(work)
PY
}

for module in "${modules[@]}"; do
    work=$(prepare "$module")
    mkdir -p "$work/mutants"
    log="$work/mutants/${module}.log"
    start=$(date +%s)
    # Naming the mutants makes mutmut run every one of them again, even when cached.
    if ! (cd "$work" && nice -n 10 mutmut run --max-children "$children" "opd_literate.${module}.${MUTMUT_ONLY:-*}" \
            > "$log" 2>&1); then
        echo "mutmut failed on ${module}; see $log" >&2
        exit 1
    fi
    (cd "$work" && python - "$module" "$(( $(date +%s) - start ))" <<'PY'
import json
import sys

from mutmut.stats import status_by_exit_code

module, seconds = sys.argv[1], sys.argv[2]
with open(f"mutants/opd_literate/{module.replace('.', '/')}.py.meta") as f:
    exit_codes = json.load(f)["exit_code_by_key"].values()
status = [status_by_exit_code[code] for code in exit_codes]
killed, survived, timeout = (status.count(s) for s in ("killed", "survived", "timeout"))
other = len(status) - killed - survived - timeout
score = 100.0 * (killed + timeout) / max(len(status), 1)
print(f"{module:13s} mutants {len(status):4d}  killed {killed:4d}  survived {survived:3d}  "
      f"timeout {timeout:2d}  other {other:2d}  score {score:5.1f}%  wall {seconds} s")
PY
    )
done
