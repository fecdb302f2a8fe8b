#!/usr/bin/env bash
# Create or update the repo's virtual environment (.venv) from requirements-dev.txt and the
# package itself. A no-op when nothing changed since the last run (hash stamp).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.neuron-tp-stamp"
py=$(command -v python3.11 || command -v python3)
want=$(cat "$root/requirements-dev.txt" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[env] installing the pinned environment into $venv (first run: a few minutes)" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$root/requirements-dev.txt"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -e "$root"
  echo "$want" > "$stamp"
fi
