#!/usr/bin/env bash
# Build .venv-verl, the environment of the verl integration tests (marker "verl").
#
# verl's own requirements (vllm, flash attention, a CUDA torch, ...) cannot be met on a CPU
# machine, and its transformers pin conflicts with the trl extra's, so verl gets an environment
# of its own: it sees the system's packages (the CPU torch 2.13.0, pytest, hypothesis), installs
# verl without its dependencies, then the few that verl.trainer.ppo.rollout_corr_helper and
# core_algos import at module level (the verl extra of pyproject.toml, pinned there).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VERL_VENV:-.venv-verl}
python3 -m venv "$venv" --system-site-packages
extra=$(python3 - <<'PY'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["verl"]
print("\n".join(deps))
PY
)
verl_pin=$(grep '^verl==' <<<"$extra")
"$venv/bin/python" -m pip install --quiet --no-deps "$verl_pin"
# the rest of the extra, with their dependencies; torch is already there (the CPU build)
grep -v '^verl==' <<<"$extra" | xargs "$venv/bin/python" -m pip install --quiet
"$venv/bin/python" -c "import torch, verl.trainer.ppo.rollout_corr_helper, verl.trainer.ppo.core_algos; print('verl', verl.__version__, 'torch', torch.__version__)"
