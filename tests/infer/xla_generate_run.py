"""Run by test_generate.py in a fresh process: generation on the XLA CPU device; prints the
compile count after each call and whether greedy tokens equal the eager CPU model's."""

import copy
import json

import neuron_tp as ntp

dev = ntp.xla_device()
from neuron_tp import hf  # noqa: E402
from neuron_tp.backend.graphs import graph_counters  # noqa: E402
from neuron_tp.infer.static_generator import generate  # noqa: E402
from neuron_tp.job.presets import build_model  # noqa: E402

cpu_model = build_model("tiny-llama", 257, 0).eval()
model = hf.parallelize(copy.deepcopy(cpu_model), ntp.Mesh(1, 0)).eval().to(dev)
short, long = [[5, 6, 7, 8, 9], [10, 11, 12]], [list(range(20, 33)), [40, 41]]
report = {"compiles": [], "equal": []}
for prompts, n in ((short, 4), (short, 24), (long, 40), (short, 9)):
    got = generate(model, prompts, n, [8, 16])
    report["compiles"].append(graph_counters()["compiles"])
    report["equal"].append(got == generate(cpu_model, prompts, n, [8, 16]))
print("JSON" + json.dumps(report))
