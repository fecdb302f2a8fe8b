#!/usr/bin/env bash
# The quickstart job: a tiny Llama (random init, neuron_tp.parallelize) trained with TP=2 on two
# CPU ranks (gloo) on the corpus shipped in data/. Creates/updates .venv first.
# Extra arguments go to scripts/train.py (e.g. --sequence-parallel, --steps 100).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/env.sh"
export OMP_NUM_THREADS=1
exec "$root/.venv/bin/torchrun" --standalone --nproc_per_node=2 "$root/scripts/train.py" \
  --device cpu --tp 2 --steps 40 --log-every 5 --seq-len 64 --lr 3e-3 \
  --output-dir "$root/runs/quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
