#!/usr/bin/env bash
# Build one of the project's virtual environments from nothing, in FOLDER (removed first).
#
#   bash tools/env.sh ENV FOLDER            # with the lock requirements/ENV.txt
#   bash tools/env.sh ENV FOLDER --newest   # today's releases (what requirements/ENV.txt refreshes from)
#
# ENV is one of
#   dev       the README's environment: the project with its dev extra (tests, docs, notebooks)
#   trl       dev and the trl extra (tests/integration/test_trl.py, marker "trl")
#   verl      the test extra and verl, installed without its dependencies (its own pins want vllm,
#             flash attention and a CUDA torch, and its transformers conflicts with the trl
#             extra's), then the few packages that verl.trainer.ppo.rollout_corr_helper and
#             core_algos import on a CPU machine: the verl extra of pyproject.toml
#   nbgrader  nbgrader 0.9.6 and what the lab notebooks need (numpy, torch, and pytest, which
#             their check cells run), for the slow tier's nbgrader test ($OPD_NBGRADER)
#
# Every environment takes torch==2.13.0 first, the CPU build: a looser requirement can pull a
# CUDA build of several GB. --newest keeps that one pin (the newest torch that pip serves here is
# a CUDA build) and upgrades pip itself; everything else is whatever the index offers today.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ] || [ $# -gt 3 ] || { [ $# -eq 3 ] && [ "$3" != --newest ]; }; then
    echo "usage: bash tools/env.sh {dev,trl,verl,nbgrader} FOLDER [--newest]" >&2
    exit 2
fi
env=$1 folder=$2 newest=${3:-}
case $env in dev|trl|verl|nbgrader) ;; *)
    echo "tools/env.sh: unknown environment '$env' (expected dev, trl, verl or nbgrader)" >&2
    exit 2;;
esac
lock=()
if [ -z "$newest" ]; then
    lock=(-c "requirements/$env.txt")
    [ -f "requirements/$env.txt" ] || { echo "no lock requirements/$env.txt" >&2; exit 1; }
fi

rm -rf "$folder"
python3 -m venv "$folder"
pip=("$folder/bin/python" -m pip --disable-pip-version-check)
if [ -n "$newest" ]; then "${pip[@]}" install --quiet --upgrade pip; fi
case $env in
    dev) "${pip[@]}" install --quiet "${lock[@]}" torch==2.13.0 -e ".[dev]";;
    trl) "${pip[@]}" install --quiet "${lock[@]}" torch==2.13.0 -e ".[dev,trl]";;
    verl)
        extra=$("$folder/bin/python" - <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["verl"]))
PY
)
        "${pip[@]}" install --quiet "${lock[@]}" torch==2.13.0 -e ".[test]"
        "${pip[@]}" install --quiet "${lock[@]}" --no-deps "$(grep '^verl==' <<<"$extra")"
        grep -v '^verl==' <<<"$extra" | xargs "${pip[@]}" install --quiet "${lock[@]}"
        "$folder/bin/python" -c "import torch, verl.trainer.ppo.rollout_corr_helper, verl.trainer.ppo.core_algos; print('verl', verl.__version__, 'torch', torch.__version__)"
        ;;
    nbgrader) "${pip[@]}" install --quiet "${lock[@]}" torch==2.13.0 numpy pytest "nbgrader==0.9.6";;
esac
