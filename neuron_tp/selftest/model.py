"""Check 3b: a tiny Llama patched by ``neuron_tp.parallelize``: a few training steps against the
same model trained on the host CPU (losses, grad norms), and greedy generation with the
library's generator against transformers' own ``generate`` on the host.

The dp ranks train on different batches (row blocks of one host batch); the host reference
trains on the whole batch, whose mean loss equals the mean of the dp ranks' losses.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..hf import parallelize
from ..infer.static_generator import Generator
from ..optim.grads import allreduce_data_parallel_grads, global_grad_norm
from ..parallel import comm
from ..parallel.sharding import move_to
from .context import Context
from .graphs import compile_counters, measure
from .report import Check

STEPS, LR, SEQ, ROWS = 3, 0.1, 16, 2  # rows per dp rank; --quick: 2 steps (1 + 1 to show
# that later steps compile nothing)
NEW_TOKENS, PROMPT = 6, 8


def tiny_llama(ctx: Context):
    """A Llama whose heads, kv heads and MLP tp divides, and a vocabulary it does not: 2
    layers on Neuron, 1 with --quick and off Neuron (half the compile time: XLA CPU device
    threads compiling one graph each on a busy machine drift apart, and XLA:CPU aborts a
    collective whose threads arrive more than 10 s apart)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tp = ctx.mesh.tp_size
    heads = max(4, tp)
    config = LlamaConfig(
        vocab_size=16 * tp + 5,
        hidden_size=16 * heads,
        intermediate_size=32 * heads,
        num_hidden_layers=2 if ctx.on_neuron and not ctx.options.quick else 1,
        num_attention_heads=heads,
        num_key_value_heads=max(2, heads // 2),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,  # greedy tokens never stop early (neither here nor in transformers)
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    with ctx.lock:  # the global RNG is shared by the ranks of a process
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def host_batch(ctx: Context, vocab: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (ROWS * ctx.mesh.dp_size, SEQ), generator=g)


def run_step(ctx: Context, what: str) -> None:
    """Run the step's pending graph. On XLA CPU devices the ranks first wait for each other:
    XLA:CPU aborts a collective whose threads arrive more than 10 s apart, and threads that
    trace a model under one GIL on a busy machine easily drift that far (the compile that
    follows still may: under heavy load an 8-device run can abort there)."""
    if ctx.on_xla and not ctx.on_neuron:
        ctx.barrier(f"traced {what}")
    ctx.sync()


def train(ctx: Context, base) -> dict:
    """``STEPS`` SGD steps on the device (tp x dp) and on the host; losses and grad norms."""
    mesh = ctx.mesh
    model = move_to(parallelize(copy.deepcopy(base), mesh, parallel_loss=True), ctx.device)
    ref = copy.deepcopy(base)
    model.train()
    ref.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    got, want = [], []
    counted = measure(ctx, "setup", compile_counters(ctx))
    for step in range(2 if ctx.options.quick else STEPS):
        batch = host_batch(ctx, base.config.vocab_size, step)
        mine = batch.chunk(mesh.dp_size)[mesh.dp_rank].to(ctx.device)
        with ctx.watchdog.doing(f"training step {step} of the tiny Llama (tp x dp collectives)"):
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            allreduce_data_parallel_grads(model, mesh)
            norm = global_grad_norm(model, mesh)
            mean = comm.all_reduce(loss.detach().reshape(1), mesh.dp) / mesh.dp_size
            opt.step()
            opt.zero_grad(set_to_none=True)
            run_step(ctx, f"train step {step}")
            got.append((float(mean.cpu()[0]), float(norm.cpu())))
        counted = measure(ctx, f"train step {step}", counted)
        ref_loss = ref(input_ids=batch, labels=batch).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        want.append((float(ref_loss.detach()), float(ref_norm)))
    return {"got": got, "want": want}


def greedy(ctx: Context, base) -> dict:
    """Greedy tokens of the library's generator (sharded, on the device) and transformers'."""
    model = move_to(parallelize(copy.deepcopy(base), ctx.mesh), ctx.device).eval()
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, base.config.vocab_size, (2, PROMPT), generator=g)
    gen = Generator(model, [PROMPT], NEW_TOKENS, batch_buckets=[2])
    counted = measure(ctx, "generation setup", compile_counters(ctx))
    with ctx.watchdog.doing("greedy generation (prefill + decode graphs)"), torch.no_grad():
        got = gen.generate(prompts.tolist(), NEW_TOKENS)
        counted = measure(ctx, "generate (first call)", counted)
        again = gen.generate(prompts.tolist(), NEW_TOKENS)
        measure(ctx, "generate (second call)", counted)
    shown: list[Any] = got
    if again != got:
        shown = [got, again]  # differs from the reference below: reported
    with torch.no_grad():
        full = base.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return {"got": shown, "want": full[:, PROMPT:].tolist(), "traces": gen.traces}


def tolerance(ctx: Context) -> float:
    """Relative difference of losses / grad norms allowed (Neuron: fp32 matmuls may run in
    bf16, ``--auto-cast``)."""
    return 2e-2 if ctx.on_neuron else 1e-4


def check_model(ctx: Context) -> Check:
    """Training steps and greedy generation against the host (see the module doc)."""
    c = Check("model")
    base = tiny_llama(ctx)
    t = train(ctx, base)
    tol = tolerance(ctx)
    for step, ((loss, norm), (rl, rn)) in enumerate(zip(t["got"], t["want"])):
        for what, a, b in (("loss", loss, rl), ("grad norm", norm, rn)):
            if not abs(a - b) <= tol * max(abs(b), 1e-6):
                c.fail(f"rank {ctx.rank}: step {step} {what} {a:.6g}, host reference {b:.6g}")
    gen = greedy(ctx, base)
    if gen["got"] != gen["want"]:
        c.fail(f"rank {ctx.rank}: greedy tokens {gen['got']}, transformers {gen['want']}")
    c.numbers = {"losses": t["got"], "reference": t["want"], "tokens": gen["got"]}
    last, ref = t["got"][-1], t["want"][-1]
    c.summary = (
        f"tiny Llama tp {ctx.mesh.tp_size} x dp {ctx.mesh.dp_size}: {len(t['got'])} steps, loss "
        f"{t['got'][0][0]:.4f} -> {last[0]:.4f} (host {ref[0]:.4f}), grad norm {last[1]:.4f} "
        f"(host {ref[1]:.4f}); {NEW_TOKENS} greedy tokens x 2 "
        + ("= transformers" if gen["got"] == gen["want"] else "!= transformers")
    )
    if not c.ok:
        c.hint = (
            "the sharded model disagrees with the same model on the host while the layers "
            "pass: attention / cache / optimizer path; report it with --json"
        )
    return c
