#!/usr/bin/env bash
# Run the whole test suite on this CPU machine (gloo ranks + torch-xla's CPU device).
# Creates/updates .venv first. Extra arguments go to pytest (e.g. -k linear).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/env.sh"
cd "$root"
export PJRT_DEVICE=CPU OMP_NUM_THREADS=1
exec "$root/.venv/bin/python" -m pytest -q tests "$@"
