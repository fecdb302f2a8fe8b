"""The collectives of one decoder layer of a patched transformers Llama, traced for the last
rank of a virtual 2D P=16 (q=4) and 3D P=64 (q=4) job (tests/hf/xla_trace_nd_layer.py), are
exactly the documented schedule (neuron_tp/hf/parallelize_nd.py): per linear (7 per layer)
2D: 4 all-gathers (X and W forward, both again in backward) + 2 reduce-scatters (dX, dW) over
q ranks; 3D: 5 all-gathers + 3 reduce-scatters over q ranks; per RMSNorm (2 per layer) 3
all-reduces (statistics forward and backward, weight gradient): 2D all over q ranks, 3D the
weight gradient over q^2."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

import xla_zygote

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LINEARS, NORMS = 7, 2


def _trace(P: int, mode: str) -> list:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    script = os.path.join(HERE, "xla_trace_nd_layer.py")
    proc = xla_zygote.python([script, "--tp", str(P), "--mode", mode], env, 240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    return json.loads(line[4:])["collectives"]


@pytest.mark.parametrize("P,mode", [(16, "2d"), (64, "3d")])
def test_llama_layer_collectives_are_the_documented_schedule(P, mode):
    q = 4
    got = Counter((kind, len(groups[0]), len(groups)) for kind, _, groups in _trace(P, mode))
    if mode == "2d":
        want = {
            ("all-gather", q, P // q): 4 * LINEARS,
            ("reduce-scatter", q, P // q): 2 * LINEARS,
            ("all-reduce", q, P // q): 3 * NORMS,
        }
    else:
        want = {
            ("all-gather", q, P // q): 5 * LINEARS,
            ("reduce-scatter", q, P // q): 3 * LINEARS,
            ("all-reduce", q, P // q): 2 * NORMS,
            ("all-reduce", q * q, P // (q * q)): NORMS,
        }
    assert dict(got) == want
