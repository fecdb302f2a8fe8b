#!/usr/bin/env bash
# The quickstart job: a small GPT made of neuron_tp layers, TP=2 on two CPU ranks (gloo).
# Creates/updates .venv first. Extra arguments go to the training script.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/env.sh"
export OMP_NUM_THREADS=1
exec "$root/.venv/bin/torchrun" --standalone --nproc_per_node=2 "$root/scripts/demo_tiny_gpt.py" --tp 2 "$@"
