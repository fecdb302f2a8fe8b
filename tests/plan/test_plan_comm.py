"""The planner's communication prediction (neuron_tp.plan) against the HLO, on both tiers.

CPU tier: a layout's prediction (traces at 1|2 layers x b0|2 b0 sequences, extended
bilinearly by ``predict.extend``) equals a direct trace at the real depth and micro-batch:
ring bytes and number of the micro-batch and once-per-step collectives (in total and per
kind, and per kind and group size), buffer bytes, matrix-product FLOPs and saved activation
bytes, for 1d, 1d + SP, 1d with replicated kv heads, 2d and 3d (dp, ZeRO-1, recompute varied).

Executed XLA tier: the training step that really runs on 4 XLA CPU devices
(``neuron_tp.train.loop.train`` on tests/helpers/xla_dist.py, see plan_xla_cases.py) records its HLO
at the end of forward + backward (micro part) and at the step boundary (whole step; step part
= whole minus micro, a multiset difference); every rank's collectives, by kind and by kind and
group size (ring bytes and counts), equal the planner's prediction for the same layout; the
one exception, with full recompute, is explained and counted exactly in ``dead_recomputed``.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import plan_xla_cases  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import xla_dist  # noqa: E402
from neuron_tp.job.presets import PRESETS, model_config  # noqa: E402
from neuron_tp.plan.predict import extend  # noqa: E402
from neuron_tp.plan.trace import Spec, trace_in_subprocess  # noqa: E402

SEQ = 32
GRID = ((1, 1), (2, 1), (1, 2), (2, 2))  # (layers, k): the planner's four traces


def b0(tp: int, mode: str) -> int:
    """Sequences per micro-batch step: the batch split of 2d (q) and 3d (q^2)."""
    if mode == "2d":
        return round(math.sqrt(tp))
    if mode == "3d":
        return round(tp ** (1 / 3)) ** 2
    return 1


# ---- CPU tier: extension vs a direct trace at L=5, k=3 -------------------------------------

CONFIG = LlamaConfig(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=257,  # padded to a multiple of the tp degree by the vocab-parallel layers
    num_hidden_layers=5,
)
LAYERS, K = 5, 3
MODES = {  # name: Spec fields (layers and micro_batch set per trace)
    "1d_tp2": dict(tp=2),
    "1d_sp_tp2_dp2_zero1_full": dict(
        tp=2, sequence_parallel=True, dp=2, zero1=True, recompute="full"
    ),
    "1d_tp4_kv_replicated_dp2_fp32_selective": dict(tp=4, dp=2, bf16=False, recompute="selective"),
    "2d_tp4_zero1_full": dict(tp=4, tp_mode="2d", zero1=True, recompute="full"),
    "3d_tp8_dp2_zero1": dict(tp=8, tp_mode="3d", dp=2, zero1=True),
}

# ---- executed XLA tier: layouts run by plan_xla_cases.run_layouts ---------------------------

# name: (devices, tp, tp_mode, micro_batch, train options). micro_batch = 3 b0 (k = 3). One
# launch of 4 devices (plain 1d tp 2 is on the CPU tier).
XLA_LAYOUTS = {
    "xla_1d_sp_tp2_dp2": (4, 2, "1d", 3, ["--sequence-parallel"]),
    "xla_1d_tp2_dp2_zero1": (4, 2, "1d", 3, ["--zero1"]),
    "xla_1d_tp4_full": (4, 4, "1d", 3, ["--activation-checkpointing", "full"]),
    "xla_2d_tp4_bf16": (4, 4, "2d", 6, ["--bf16"]),
}
XLA_VOCAB = 257  # the byte tokenizer of neuron-tp train (256 bytes + end of text)


def xla_spec(name: str, layers: int, k: int) -> Spec:
    devices, tp, mode, _, extra = XLA_LAYOUTS[name]
    bf16 = "--bf16" in extra
    flag = "--activation-checkpointing"
    recompute = extra[extra.index(flag) + 1] if flag in extra else "none"
    return Spec(
        tp=tp,
        tp_mode=mode,
        sequence_parallel="--sequence-parallel" in extra,
        recompute=recompute,
        micro_batch=k * b0(tp, mode),
        seq_len=SEQ,
        dp=devices // tp,
        zero1="--zero1" in extra or bf16,  # neuron-tp train: ZeRO-1 always on with --bf16
        bf16=bf16,
        layers=layers,
    )


def _specs() -> dict:
    """Every trace both tiers need, keyed (tier, name, layers, k)."""
    specs = {}
    for name, kw in MODES.items():
        mode, tp = kw.get("tp_mode", "1d"), kw["tp"]
        for layers, k in (*GRID, (LAYERS, K)):
            specs[("cpu", name, layers, k)] = Spec(
                **kw, seq_len=SEQ, layers=layers, micro_batch=k * b0(tp, mode)
            )
    for name in XLA_LAYOUTS:
        for layers, k in GRID:
            specs[("xla", name, layers, k)] = xla_spec(name, layers, k)
    return specs


@pytest.fixture(scope="module")
def traces():
    """All traces in ONE child process (a few seconds)."""
    specs = _specs()
    cpu = {k: s for k, s in specs.items() if k[0] == "cpu"}
    xla = {k: s for k, s in specs.items() if k[0] == "xla"}
    cpu_res = trace_in_subprocess(CONFIG, list(cpu.values()))
    xla_res = trace_in_subprocess(model_config("tiny-llama", XLA_VOCAB), list(xla.values()))
    out = dict(zip(cpu, cpu_res)) | dict(zip(xla, xla_res))
    bad = {k: v for k, v in out.items() if isinstance(v, str)}
    assert not bad, f"layouts refused: {bad}"
    return out


def _ring(kind: str, buffer_bytes: float, group: int) -> float:
    factor = 2 * (group - 1) / group if kind == "all-reduce" else (group - 1) / group
    return factor * buffer_bytes


def summary(comms) -> dict[str, float]:
    """Ring bytes, counts and buffer bytes of ``comms`` ((kind, buffer bytes, ring bytes,
    group size) tuples): in total, per kind, per (kind, group size)."""
    s: Counter = Counter()
    for kind, buf, ring, group in comms:
        for key in ("all", kind, f"{kind}/g{group}"):
            s[f"ring[{key}]"] += ring
            s[f"count[{key}]"] += 1
        s["buffer[all]"] += buf
    return dict(s)


def _planner_rows(trace, part: str):
    return [(c.kind, c.buffer_bytes, c.ring_bytes, len(c.group)) for c in getattr(trace, part)]


def predicted(grid: dict, part: str, layers: int, k: int) -> dict[str, float]:
    """Every summary figure of ``part`` extended from the four traces (missing = 0)."""
    per = {key: summary(_planner_rows(t, part)) for key, t in grid.items()}
    keys = set().union(*per.values())
    return {key: extend(per, layers, k, lambda s, key=key: s.get(key, 0)) for key in keys}


def assert_same(pred: dict, actual: dict, what: str) -> None:
    keys = sorted(set(pred) | set(actual))
    bad = {
        k: (pred.get(k, 0), actual.get(k, 0))
        for k in keys
        if pred.get(k, 0) != pytest.approx(actual.get(k, 0), rel=1e-9, abs=1e-9)
    }
    table = "\n".join(
        f"  {k}: predicted {pred.get(k, 0):g}, actual {actual.get(k, 0):g}" for k in keys
    )
    assert not bad, f"{what}: predicted != actual for {bad}\n{table}"
    print(f"\n{what}\n{table}")


@pytest.mark.parametrize("mode", list(MODES))
def test_extension_equals_direct_trace(traces, mode):
    grid = {(L, k): traces[("cpu", mode, L, k)] for L, k in GRID}
    direct = traces[("cpu", mode, LAYERS, K)]
    for part in ("micro", "step"):
        assert_same(
            predicted(grid, part, LAYERS, K),
            summary(_planner_rows(direct, part)),
            f"{mode} {part} (L={LAYERS}, k={K})",
        )
    for attr in ("flops", "saved_bytes"):
        pred = extend(grid, LAYERS, K, lambda t, a=attr: getattr(t, a))
        assert pred == pytest.approx(getattr(direct, attr), rel=1e-9), (attr, pred)
        print(f"{mode} {attr}: predicted {pred:g}, direct {getattr(direct, attr)}")
    # the once-per-step part (gradient reduction, norm, ZeRO-1) does not depend on the
    # micro-batch: a micro-batch collective counted in it would make it grow with k
    for L in (1, 2):
        assert summary(_planner_rows(grid[(L, 1)], "step")) == summary(
            _planner_rows(grid[(L, 2)], "step")
        ), f"step collectives change with the micro-batch at {L} layers"
    # the extension is not trivial: both depth and micro-batch change the communication
    micro = [summary(_planner_rows(t, "micro"))["ring[all]"] for t in grid.values()]
    assert len(set(micro)) == 4, micro


# ---- executed XLA tier ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Per layout, every rank's collectives of the step that ran (one xla_dist run per device
    count)."""
    out = {}
    for devices in sorted({v[0] for v in XLA_LAYOUTS.values()}):
        layouts = [
            (name, tp, mode, ["--micro-batch", str(mb), *extra])
            for name, (d, tp, mode, mb, extra) in XLA_LAYOUTS.items()
            if d == devices
        ]
        tmp = str(tmp_path_factory.mktemp(f"xla{devices}"))
        ranks = xla_dist.run(plan_xla_cases.run_layouts, tmp, layouts, devices=devices, timeout=300)
        for per_rank in zip(*ranks):
            out[per_rank[0]["name"]] = list(per_rank)
    return out


def dead_recomputed(name: str, layers: int) -> Counter:
    """Collectives the planner counts that the executed XLA:CPU graph does not contain.

    Full recompute (torch_xla.utils.checkpoint) re-runs each decoder layer's forward in
    backward, including its last row-parallel all-reduce (the MLP output), whose result nothing
    uses. In the form traced for Neuron (neuronx-distributed's, the planner's) every collective
    threads torch-xla's ordering token, so that dead all-reduce stays in the graph and runs; the
    channel-id form the CPU devices execute has no token, and the dead op is not in the HLO.
    One activation-sized tp all-reduce per layer (1d without SP, the layout tested here)."""
    devices, tp, mode, mb, extra = XLA_LAYOUTS[name]
    if "full" not in extra:
        return Counter()
    assert mode == "1d" and "--sequence-parallel" not in extra
    hidden = PRESETS["tiny-llama"]["hidden_size"]
    dtype, size = ("bf16", 2) if "--bf16" in extra else ("f32", 4)
    return Counter({("all-reduce", dtype, mb * SEQ * hidden * size, tp): layers})


def _executed_rows(rows):
    return [(kind, buf, _ring(kind, buf, g), g) for kind, _dt, buf, g in rows]


@pytest.mark.parametrize("name", list(XLA_LAYOUTS))
def test_prediction_equals_executed_hlo(traces, executed, name):
    devices, tp, mode, mb, extra = XLA_LAYOUTS[name]
    layers = PRESETS["tiny-llama"]["num_hidden_layers"]
    k = mb // b0(tp, mode)
    grid = {(L, kk): traces[("xla", name, L, kk)] for L, kk in GRID}
    ranks = executed[name]
    assert [r["rank"] for r in ranks] == list(range(devices))
    for r in ranks:
        log = r["log"]
        assert log and math.isfinite(log[0]["loss"]) and math.isfinite(log[0]["grad_norm"]), log
        assert r["total_hlo_has_channel_ids"]  # the executed (channel-id) form, not the virtual
        micro = Counter(r["micro"])
        total = Counter(r["total"])
        assert not micro - total, f"micro collectives missing from the step: {micro - total}"
        step = total - micro
        micro = micro + dead_recomputed(name, layers)
        for part, rows in (("micro", micro), ("step", step)):
            assert_same(
                predicted(grid, part, layers, k),
                summary(_executed_rows(rows.elements())),
                f"{name} rank {r['rank']} {part} (L={layers}, micro-batch {mb})",
            )
