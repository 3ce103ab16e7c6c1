#!/usr/bin/env bash
# Refresh the locks: every environment of tools/env.sh built at today's releases, and each one's
# resolved versions (direct and transitive) written to requirements/ENV.txt, which the README's
# install and .ci/run use as pip constraints. Run it, then .ci/run: commit the locks it passed.
#
#   bash tools/lock.sh            # all four (dev, trl, verl, nbgrader): about 8 minutes on 2 cores
#   bash tools/lock.sh dev verl   # some of them
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for env in "${@:-dev trl verl nbgrader}"; do
    for one in $env; do
        echo "== $one"
        bash tools/env.sh "$one" "$work/$one" --newest
        {
            echo "# The lock of tools/env.sh's '$one' environment: every package and version it resolved"
            echo "# on $(date -u +%Y-%m-%d) with $("$work/$one/bin/python" --version), refreshed by bash tools/lock.sh."
            echo "# Used as pip constraints (-c): a package the install does not ask for is not installed."
            # torch's local label (+cpu) names the build that pip found here; the constraint keeps
            # the version, which PyPI's CPU-only machines resolve too.
            "$work/$one/bin/python" -m pip freeze --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/'
        } > "requirements/$one.txt"
        echo "requirements/$one.txt: $(grep -vc '^#' "requirements/$one.txt") packages"
    done
done
