#!/usr/bin/env bash
# Precompile every graph of a training run into the Neuron cache, then run it, with IDENTICAL
# arguments (any difference in shapes, flags or hyper-parameters means new graphs):
#
#   scripts/compile_and_train.sh NPROC [scripts/train.py options...]
#   e.g. scripts/compile_and_train.sh 32 --tp 8 --sequence-parallel --model /fsx/llama --bf16
#
# 1. `neuron_parallel_compile torchrun ... train.py ARGS`: the trial run. The tool sets
#    NEURON_EXTRACT_GRAPHS_ONLY=1; train.py then traces a few steps (the same graphs as the real
#    run), writes no checkpoint, skips resume, and the graphs are compiled in parallel.
# 2. `torchrun ... train.py ARGS`: the real run; every graph is a cache hit.
#
# Multi-node: set TORCHRUN_ARGS (default "--standalone"), e.g.
#   TORCHRUN_ARGS="--nnodes=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 --rdzv_id=job1"
# NEURON_CC_FLAGS you export are kept verbatim (train.py only adds --model-type=transformer
# when you did not choose a model type). Use one compile cache per node, not a shared NFS one.
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 NPROC_PER_NODE [train.py options...]" >&2
  exit 2
fi
nproc=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
read -r -a launch <<< "${TORCHRUN_ARGS:---standalone}"
if ! command -v neuron_parallel_compile > /dev/null; then
  echo "neuron_parallel_compile not found: run inside a Neuron SDK environment" >&2
  exit 2
fi
cmd=(torchrun "${launch[@]}" --nproc_per_node="$nproc" "$root/scripts/train.py" "$@")
echo "== precompile: neuron_parallel_compile ${cmd[*]}"
neuron_parallel_compile "${cmd[@]}"
echo "== train: ${cmd[*]}"
"${cmd[@]}"
