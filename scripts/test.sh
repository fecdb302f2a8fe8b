#!/usr/bin/env bash
# Lint (ruff check, ruff format --check), type-check the package (mypy; both configured in
# pyproject.toml), then run the whole test suite on this CPU machine (gloo ranks + torch-xla's
# CPU device). Creates/updates .venv first. Extra arguments go to pytest (e.g. -k linear). A
# lint or type finding fails the run before any test starts; fix lint with
# .venv/bin/ruff check --fix . && .venv/bin/ruff format .
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/env.sh"
cd "$root"
"$root/.venv/bin/ruff" check .
"$root/.venv/bin/ruff" format --check .
# Incremental from .mypy_cache after the first run (which reads torch's types: ~70 s of CPU).
"$root/.venv/bin/mypy"
export PJRT_DEVICE=CPU OMP_NUM_THREADS=1
exec "$root/.venv/bin/python" -m pytest -q --durations=15 tests "$@"
