#!/usr/bin/env bash
# Mutation testing of opd and mismatch.{toy,estimators,opd_mismatch} with mutmut 3, configured by the
# [tool.mutmut] table of pyproject.toml. A measurement run by hand (docs/mutation.md), not CI.
#
#   tools/mutation.sh                      # the four modules, one after the other
#   tools/mutation.sh mismatch.toy         # only these (dotted below opd_literate)
#   MUTMUT_CHILDREN=2 tools/mutation.sh    # two test processes at once
#
# One line per module: mutants, killed, survived, timeout, other, score = killed + timeout over
# all mutants, and the wall time. The survivors: `mutmut results`, then `mutmut show NAME`.
# mutmut keeps its copy and cache in mutants/ (git-ignored); delete it to start afresh.
set -euo pipefail
cd "$(dirname "$0")/.."

children="${MUTMUT_CHILDREN:-1}"
if [ "$#" -gt 0 ]; then modules=("$@"); else modules=(mismatch.opd_mismatch mismatch.toy opd mismatch.estimators); fi
# mutmut forks its workers from a process that has imported torch: one OpenMP thread each, so
# that no forked thread pool is reused and the workers do not fight over the cores.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

mkdir -p mutants
for module in "${modules[@]}"; do
    start=$(date +%s)
    # Naming the mutants makes mutmut run every one of them again, even when cached.
    if ! nice -n 10 mutmut run --max-children "$children" "opd_literate.${module}.*" \
            > "mutants/${module}.log" 2>&1; then
        echo "mutmut failed on ${module}; see mutants/${module}.log" >&2
        exit 1
    fi
    python - "$module" "$(( $(date +%s) - start ))" <<'PY'
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
done
