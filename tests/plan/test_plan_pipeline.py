"""The planner's pipeline, context-parallel and attention terms (:mod:`neuron_tp.plan.pipeline`,
:mod:`neuron_tp.plan.stages`, :func:`neuron_tp.plan.state.stage_state_bytes`) against
independent hand calculations: the weights each stage holds (counted from the Llama
architecture, not from the model), the activations 1F1B keeps in flight (a step-by-step
simulation of the schedule), the bubble, the stage-boundary and K/V ring bytes, sdpa's score
bytes vs blockwise attention (real traces of a tiny Llama), and the layout <-> train flags
round trip. Nothing here runs the pipeline itself (its runtime is not in this branch)."""

from __future__ import annotations

import pytest

from neuron_tp.cli.args import train_parser
from neuron_tp.job.config import TrainConfig
from neuron_tp.plan import pipeline as pl
from neuron_tp.plan.layouts import TRAIN_OPTIONS, Layout
from neuron_tp.plan.predict import Memory
from neuron_tp.plan.stages import Shape, stage_memories, stage_timing
from neuron_tp.plan.state import stage_state_bytes
from neuron_tp.plan.trace import Comm, Trace


def _llama(layers=4, tie=False, vocab=64):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )


def _hand_counts(tp: int, h=32, inter=48, heads=4, kv=2, vocab=64) -> dict[str, int]:
    """One tp rank's parameter counts of a Llama, by part, from the architecture."""
    d = h // heads
    attn = (h * h + 2 * h * kv * d + h * h) // tp  # q, k, v, o: heads split over tp
    mlp = 3 * h * inter // tp  # gate, up, down
    table = vocab * h // tp  # vocabulary-parallel embedding / LM head rows
    return {"embed": table, "layer": attn + mlp + 2 * h, "norm": h, "head": table}


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2), (2, 4)])
def test_stage_weights_by_hand(tp, pp):
    """Stage i holds layers/pp decoder layers; the embedding only on the first stage, the final
    norm and LM head only on the last; AdamW moments and fp32 masters per stage sharded over the
    replicas (ZeRO-1: each parameter padded to a multiple of them)."""
    n = _hand_counts(tp)
    per_stage = 4 // pp
    states = stage_state_bytes(_llama(), tp, replicas=1, bf16=True, zero1=True, pp=pp)
    assert len(states) == pp
    for i, st in enumerate(states):
        numel = per_stage * n["layer"]
        numel += n["embed"] if i == 0 else 0
        numel += n["norm"] + n["head"] if i == pp - 1 else 0
        assert st.params == 2 * numel and st.grads == 2 * numel  # bf16
        assert st.masters == 4 * numel and st.optimizer == 8 * numel  # fp32, one replica
    whole = stage_state_bytes(_llama(), tp, bf16=True, zero1=True, pp=1)[0]
    assert sum(s.params for s in states) == whole.params  # nothing counted twice


def test_tied_embeddings_are_one_table_on_each_end_and_zero1_pads_per_parameter():
    n = _hand_counts(1)
    first, last = stage_state_bytes(_llama(tie=True), 1, replicas=3, zero1=True, pp=2)
    assert first.params == 4 * (n["embed"] + 2 * n["layer"])
    assert last.params == 4 * (2 * n["layer"] + n["norm"] + n["head"])  # its own table
    one = stage_state_bytes(_llama(tie=True), 1, zero1=True, pp=1)[0]
    assert one.params == 4 * (n["embed"] + 4 * n["layer"] + n["norm"])  # tied: once
    # ZeRO-1 over 3 replicas: every parameter's ceil(numel / 3) elements, 2 fp32 moments
    from transformers import AutoModelForCausalLM

    from neuron_tp.hf.loading import params_on_meta

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(_llama(tie=True))
    chunks = sum(
        -(-p.numel() // 3)
        for name, p in model.named_parameters()
        if "embed" in name or ".layers.0." in name or ".layers.1." in name
    )
    assert first.optimizer == 8 * chunks


def _simulated_in_flight(pp: int, m: int) -> list[int]:
    """Peak live micro-batches per stage, by walking 1F1B: stage i runs pp-i-1 warm-up
    forwards, then one forward / one backward until the m forwards are done, then the
    remaining backwards. A forward makes a micro-batch live, its backward frees it."""
    peaks = []
    for stage in range(pp):
        ops = ["F"] * min(pp - stage - 1, m)
        left = m - len(ops)
        ops += ["F", "B"] * left + ["B"] * (m - left)
        live = peak = 0
        for op in ops:
            live += 1 if op == "F" else -1
            peak = max(peak, live)
        assert live == 0
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("pp, m", [(2, 2), (4, 4), (4, 8), (8, 16), (4, 2)])
def test_1f1b_in_flight_matches_a_walk_of_the_schedule(pp, m):
    got = [pl.in_flight(s, pp, m) for s in range(pp)]
    assert got == _simulated_in_flight(pp, m)
    assert pl.in_flight(0, 1, m) == 1


def test_interleaved_holds_a_little_more_on_the_first_stage():
    # Megatron's interleaved warm-up on rank 0: 2 (pp-1) + (v-1) pp chunk forwards, then one
    # more; chunks of layers / (pp v): pp=4, v=2: (6 + 4 + 1) / 2 = 5.5 stage micro-batches
    assert pl.in_flight(0, 4, 8, "interleaved", 2) == 5.5
    assert pl.in_flight(3, 4, 8, "interleaved", 2) == 2.5
    assert pl.in_flight(0, 4, 8, "1f1b") == 4 < 5.5


def test_bubble_by_hand():
    assert pl.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pl.bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert pl.bubble_fraction(1, 8) == 0
    assert pl.bubble_slots(8, 2) == 3.5


def _trace(per_layer: int, rest: int, layers: int, k: int, flops=(0, 0), comm_bytes=0) -> Trace:
    """A made-up traced step linear in layers and micro-batch: ``per_layer`` and ``rest``
    saved bytes per sequence (``flops`` likewise), one tp all-reduce of ``comm_bytes``."""
    comms = tuple(Comm("all-reduce", comm_bytes, comm_bytes, (0, 1)) for _ in range(layers))
    saved = k * (per_layer * layers + rest)
    return Trace(k * (flops[0] * layers + flops[1]), saved, comms, ())


def _traces(per_layer, rest, **kw):
    return {(n, k): _trace(per_layer, rest, n, k, **kw) for n in (1, 2) for k in (1, 2)}


def _lay(**kw) -> Layout:
    base = dict(
        tp=2,
        tp_mode="1d",
        sequence_parallel=True,
        activation_checkpointing="none",
        micro_batch=1,
        grad_accum=8,
        zero1=True,
        dp=1,
    )
    return Layout(**{**base, **kw})


SHAPE = Shape(layers=8, hidden=32, heads_local=2, kv_local=1, head_dim=8, dtype_bytes=2, seq_len=64)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stage_activations_by_hand(pp):
    """1F1B: the first stage holds pp micro-batches of its layers/pp layers; the last one
    micro-batch of its layers plus the LM head + loss (the trace's non-layer rest) once."""
    A, R = 1000, 50_000  # saved bytes per layer, of the rest (logits), per sequence
    states = stage_state_bytes(_llama(layers=8), 2, bf16=True, zero1=True, pp=pp)
    mems = stage_memories(_lay(pp=pp), _traces(A, R), None, states, SHAPE, 1.0)
    per_stage = 8 // pp
    assert mems[0].activations == pp * A * per_stage + (R if pp == 1 else 0)
    assert mems[-1].activations == A * per_stage + R
    for mem, st in zip(mems, states):
        assert isinstance(mem, Memory) and mem.params == st.params
        assert mem.step_buffer >= st.grads  # ZeRO-1's flat gradient copy of the stage


def _job(nodes=1):
    from neuron_tp.plan.hardware import get_instance
    from neuron_tp.plan.search import Job

    return Job(get_instance("trn1.32xlarge"), nodes, 64, 64)


@pytest.mark.parametrize("pp, v", [(2, 1), (4, 1), (4, 2)])
def test_step_time_has_the_bubble_and_the_boundary_sends(pp, v):
    job = _job()
    sched = "interleaved" if v > 1 else "1f1b"
    lay = _lay(pp=pp, pp_schedule=sched, virtual_stages=v, grad_accum=8, dp=16 // pp)
    states = stage_state_bytes(_llama(layers=8), 2, bf16=True, zero1=True, pp=pp)
    traces = _traces(10, 10, flops=(10**12, 10**13), comm_bytes=10**6)
    t, _ = stage_timing(lay, traces, states, SHAPE, job, 1.0)
    busy = t.compute + t.tp_comm + t.pp_comm + t.cp_comm  # m micro-batches of the slowest
    assert t.bubble / (t.bubble + busy) == pytest.approx(pl.bubble_fraction(pp, 8, v))
    # the last stage is the slowest (the LM head): its layers' FLOPs and the head's
    rate = job.instance.peak_flops_per_core * job.efficiency
    assert t.compute == pytest.approx(8 * (10**12 * 8 // pp + 10**13) / rate)
    # boundary: b s h x 2 bytes / tp (SP) each way per micro-batch (and per chunk), NeuronLink
    sent = 1 * 64 * 32 * 2 // 2
    link = job.instance.link_bandwidth_per_core
    lat = job.instance.collective_latency
    assert t.pp_comm == pytest.approx(8 * 2 * v * (sent / link + lat))


def test_stage_boundary_and_ring_bytes_by_hand():
    assert pl.boundary_bytes(2, 4096, 8192, 2, tp=32, sp=True) == 2 * 4096 * 8192 * 2 // 32
    assert pl.boundary_bytes(2, 4096, 8192, 2, tp=32, sp=False) == 2 * 4096 * 8192 * 2
    assert pl.boundary_bytes(1, 4096, 8192, 2, tp=8, sp=True, cp=2) == 4096 * 8192 * 2 // 16
    # cp 4: K and V of 1/4 of the sequence, 3 hops
    assert pl.kv_ring_bytes(1, 1024, 1, 128, 2, cp=4) == 3 * 2 * 256 * 128 * 2
    assert pl.ring_passes("none") == 3 and pl.ring_passes("full") == 4


def test_attention_terms_by_hand():
    # Llama-3-8B at tp 8, s = 32k: 4 heads x 32k x 32k bf16 = 8 GiB per layer (issue 37)
    assert pl.sdpa_score_bytes(1, 4, 32768, 2) == 8 * 2**30
    assert pl.blockwise_tiles(1, 4, 512, 32768) == 3 * 4 * 512 * 32768 * 4  # 96 MiB
    assert pl.causal_fraction(4096, 512) == pytest.approx(9 / 16)
    assert pl.causal_fraction(512, 512) == 1


@pytest.mark.parametrize(
    "layers, pp, m, sched, v, message",
    [
        (80, 3, 8, "1f1b", 1, "does not divide the 80 layers"),
        (80, 8, 4, "1f1b", 1, "4 micro-batches per step < pp=8"),
        (80, 4, 8, "1f1b", 2, "needs --pp-schedule interleaved"),
        (80, 4, 8, "interleaved", 1, "needs --virtual-stages >= 2"),
        (80, 8, 8, "interleaved", 3, "x virtual stages 3 does not divide"),
    ],
)
def test_pipeline_refusals(layers, pp, m, sched, v, message):
    assert message in pl.pipeline_refusal(layers, pp, m, sched, v)
    assert pl.pipeline_refusal(80, 8, 8, "interleaved", 2) == ""


def test_layout_to_train_flags_and_back():
    """THE mapping: a layout's train flags, parsed by ``neuron-tp train``'s own parser, give
    a TrainConfig holding the same layout (pp, schedule, virtual stages, cp, attention too)."""
    for lay in (
        _lay(),
        _lay(pp=4, pp_schedule="interleaved", virtual_stages=2, dp=2),
        _lay(pp=2, cp=2, attention="blockwise", activation_checkpointing="full"),
        _lay(sequence_parallel=False, zero1=False, tp_mode="2d", tp=4, micro_batch=2),
    ):
        config = TrainConfig.from_args(train_parser().parse_args(lay.train_args()))
        values = {
            "tp": config.tp,
            "tp_mode": config.tp_mode,
            "micro_batch": config.micro_batch,
            "grad_accum": config.grad_accum,
            "activation_checkpointing": config.activation_checkpointing,
            "sequence_parallel": config.sequence_parallel,
            "zero1": config.zero1,
            "pp": config.pipeline.pp,
            "pp_schedule": config.pipeline.pp_schedule,
            "virtual_stages": config.pipeline.virtual_stages,
            "cp": config.context.cp,
            "attention": config.attention,
        }
        assert set(values) == set(TRAIN_OPTIONS)
        assert Layout(**values, dp=lay.dp) == lay
        assert lay.train_options() == values


def test_sdpa_scores_vs_blockwise_in_traced_steps():
    """Real traces of one tiny-Llama layer (tp 2, fp32): sdpa saves the [b, heads/tp, s, s]
    probabilities, blockwise attention saves O(s) per head; the difference is the
    hand-computed score bytes up to O(s d) terms, at two lengths. And
    blockwise's causal block skipping: a block of s/2 visits 3 of 4 tiles, a quarter of the
    score-tile FLOPs (``blockwise_dots`` products of 2 b h s s d) fewer than one s x s tile."""
    from neuron_tp.job.presets import model_config
    from neuron_tp.plan.trace import Spec, trace_in_subprocess

    config = model_config("tiny-llama", 257)
    heads, d = 4 // 2, 64 // 4
    specs = []
    for s in (128, 256):
        base = Spec(tp=2, seq_len=s, bf16=False, layers=1)
        specs += [base, Spec(**{**base.__dict__, "attn": "blockwise"})]
    specs.append(
        Spec(tp=2, seq_len=128, bf16=False, layers=1, attn="blockwise", attention_block=64)
    )
    sdpa1, block1, sdpa2, block2, halves = trace_in_subprocess(config, specs)
    for s, sdpa, block in ((128, sdpa1, block1), (256, sdpa2, block2)):
        # measured: the scores, plus one [heads, s, d] tensor sdpa keeps, minus blockwise's
        # log-sum-exp [heads, s] (fp32)
        scores = pl.sdpa_score_bytes(1, heads, s, 4)
        assert sdpa.saved_bytes - block.saved_bytes == scores + heads * s * (d - 1) * 4
    assert block2.saved_bytes < 2.2 * block1.saved_bytes  # linear in s
    skipped = (1 - pl.causal_fraction(128, 64)) * pl.blockwise_dots("none") * 2 * heads * d
    assert block1.flops - halves.flops == skipped * 128 * 128
