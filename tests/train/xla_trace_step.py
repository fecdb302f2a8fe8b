"""Run by test_train_xla.py in a fresh process: trace (not execute) one full optimizer step of
``neuron-tp train`` (tiny preset, SP, grad accumulation 2) for rank RANK of a virtual 4-rank
tp2 x dp2 job and print a hash of the HLO plus its collectives."""

import hashlib
import json
import sys

import neuron_tp as ntp

dev = ntp.xla_device()
import torch_xla  # noqa: E402

from neuron_tp.backend import hlo  # noqa: E402
from neuron_tp.cli.args import train_parser  # noqa: E402
from neuron_tp.train import loop  # noqa: E402

mesh = ntp.Mesh.virtual(world_size=4, rank=int(sys.argv[1]), tp=2)
args = train_parser().parse_args(
    [
        "--device",
        "xla",
        "--tp",
        "2",
        "--sequence-parallel",
        "--seq-len",
        "32",
        "--micro-batch",
        "1",
        "--grad-accum",
        "2",
    ]
)
run = loop.setup(args, mesh)
captured = {}


def capture(device):  # instead of mark_step: the graph the step would compile
    outs = [p for p in run.model.parameters()]
    outs += [t for st in run.optimizer.state.values() for t in st.values()]
    captured["hlo"] = torch_xla._XLAC._get_xla_tensors_hlo(outs)


loop.step_boundary = capture  # the graph cut the training loop calls
loop.train_step(run, log_this_step=False, on_log=None)
text = captured["hlo"]
print(
    "JSON"
    + json.dumps(
        {
            "hash": hashlib.sha256(text.encode()).hexdigest(),
            "collectives": [
                [c.kind, [list(g) for g in c.replica_groups]] for c in hlo.parse_collectives(text)
            ],
        }
    )
)
