"""The slot KV cache split over tp by sequence (``--kv-split sequence``, issue 37): with fewer
kv heads than tp, the ranks sharing a kv head each cache 1/r of the positions, and attention
combines their partial softmaxes by log-sum-exp.

Against independent references: the split attention against plain softmax attention over all
positions (scores large enough that a combine without the max shift overflows); a long prompt
(1.5k tokens, 1 kv head, tp 2) and a random schedule of shorter greedy and sampled requests give
transformers' tokens per request, at tp 2 (one kv head: the whole tp group splits) and tp 4
(two kv heads: two groups of 2), gloo ranks; the KV bytes per rank measured against the
by-heads layout. The 2 XLA CPU devices case runs in test_slots.py's launch."""

from __future__ import annotations

import pytest
import torch

import gloo_dist
from hf_sampling import peaked
from neuron_tp.errors import UserError
from neuron_tp.infer import kv_split
from slot_trace import (
    eos_ids,
    kv1_llama,
    long_request,
    make_requests,
    reference,
    run_long,
    run_schedule,
)

LONG = 640  # prompt tokens of the long request (3 prefill chunks, the last partial)
MAX_LEN = LONG + 16


def _preset(name: str = "tiny-llama"):
    from neuron_tp.job.presets import build_model

    return peaked(build_model(name, 257, 4)).eval()


# tp, model builder, slot positions, schedule requests (seed, n, max prompt, max new)
CASES = {
    "tp2_kv1": (2, kv1_llama, MAX_LEN, (11, 5, 40, 6)),
    "tp4_kv2": (4, _preset, 64, (12, 5, 40, 6)),
}


def _wants() -> dict:
    out = {}
    for case, (_, build, _, sched) in CASES.items():
        full = build()
        reqs = make_requests(*sched)
        out[case] = (
            reference(full, long_request(LONG)) if case == "tp2_kv1" else None,
            [reference(full, r) for r in reqs],
            eos_ids(full),
        )
    return out


def _math_case() -> None:
    """split_attention == softmax attention over all positions (gloo group of 2)."""
    group = gloo_dist.shared_mesh(2).tp
    g = torch.Generator().manual_seed(0)
    b, h, nq, d, length = 2, 4, 3, 8, 10  # every rank: the same full tensors
    q = torch.randn(b, h, nq, d, generator=g) * 100  # scores: exp() overflows fp32 unshifted
    k, v = torch.randn(b, 1, length, d, generator=g), torch.randn(b, 1, length, d, generator=g)
    qpos = torch.tensor([[0, 4, 9], [1, 2, 7]])
    seen = torch.arange(length)[None, None, :] <= qpos[:, :, None]  # [b, nq, length]
    want = (
        torch.softmax((q @ k.transpose(-1, -2) * 0.5).masked_fill(~seen[:, None], -torch.inf), -1)
        @ v
    )
    mine = torch.arange(group.rank, length, group.size)  # this rank's positions (p % r)
    local = h // group.size
    heads = slice(group.rank * local, (group.rank + 1) * local)
    allowed = seen[:, None][..., mine]
    out = kv_split.split_attention(
        q[:, heads], k[:, :, mine], v[:, :, mine], allowed, group=group, scale=0.5
    )
    torch.testing.assert_close(out, want[:, heads], rtol=1e-5, atol=1e-5)


def _cli_case(tmp: str) -> None:
    """``neuron-tp generate --kv-split sequence`` (tp 2 x dp 2) on a saved one-kv-head model
    prints transformers' greedy continuations."""
    from neuron_tp.cli.args import generate_parser
    from neuron_tp.infer.generate_command import run_cli

    full = kv1_llama(256)
    if torch.distributed.get_rank() == 0:
        full.save_pretrained(f"{tmp}/kv1")
    torch.distributed.barrier()
    prompts = ["The old", "A long way"]
    argv = ["--device", "cpu", "--tp", "2", "--model", f"{tmp}/kv1", "--tokenizer", "bytes"]
    argv += ["--max-new-tokens", "6", "--buckets", "8,16", "--kv-split", "sequence"]
    texts = run_cli(
        generate_parser().parse_args(argv + [a for p in prompts for a in ("--prompt", p)])
    )
    want = []
    for p in prompts:
        ids = torch.tensor([list(p.encode())])
        out = full.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[
            0, ids.shape[1] :
        ]
        want.append(bytes(t for t in out.tolist() if t < 256).decode("utf-8", "replace"))
    assert texts == want


def _serve_case(case: str, wants: dict) -> None:
    from neuron_tp import hf
    from neuron_tp.infer.slot_generator import SlotGenerator

    if case == "math":
        return _math_case()
    if case == "cli":
        return _cli_case(wants["tmp"])
    tp, build, max_len, sched = CASES[case]
    long_want, want, eos = wants[case]
    model = hf.parallelize(build(), gloo_dist.shared_mesh(tp)).eval()
    gen = SlotGenerator(model, 3, max_len, chunk=256, decode_buckets=[1, 3], kv_split="auto")
    assert gen.kv_split == "sequence"
    if long_want is not None:
        assert run_long(gen, long_request(LONG), 256) == long_want
    got = run_schedule(gen, make_requests(*sched), sched[0], eos)
    bad = [(i, a, w) for i, (a, w) in enumerate(zip(got, want)) if a != w]
    assert not bad, f"requests differ (index, got, want): {bad[:3]}"
    heads = SlotGenerator(model, 3, max_len, chunk=256, kv_split="heads").kv_bytes
    r = gen.split.r
    print(
        f"{case} rank {gen.split.group.rank}: KV bytes per rank {gen.kv_bytes} (sequence) "
        f"vs {heads} (heads, replicated), r={r}"
    )
    per_position = heads // (max_len + 1)
    assert gen.kv_bytes == per_position * (max_len // r + 1)  # 1/r of the positions + scratch


@pytest.fixture(scope="module")
def wants(tmp_path_factory) -> dict:
    return {**_wants(), "tmp": str(tmp_path_factory.mktemp("kv_split"))}


GLOO = ["math", *CASES, "cli"]


@pytest.mark.parametrize("case", GLOO)
def test_sequence_split_gloo(case, wants):
    """4 gloo ranks: tp 2 x dp 2 (one kv head, the long prompt) and tp 4 (two kv heads)."""
    gloo_dist.run_case(_serve_case, case, wants, cases=GLOO, world_size=4, timeout=900)


def test_resolve_and_refusals():
    cfg = kv1_llama().config
    assert kv_split.resolve("auto", cfg, 2) == "sequence"
    assert kv_split.resolve("auto", cfg, 1) == "heads"
    assert kv_split.resolve("auto", _preset().config, 2) == "heads"  # tp divides 2 kv heads
    with pytest.raises(UserError, match="tp=2 divides the model's kv heads"):
        kv_split.resolve("sequence", _preset().config, 2)
    with pytest.raises(UserError, match="one of auto, heads, sequence"):
        kv_split.resolve("rows", cfg, 2)
