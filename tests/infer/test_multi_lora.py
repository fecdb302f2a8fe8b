"""Many LoRA adapters behind one engine (:mod:`neuron_tp.hf.lora_bank`,
:mod:`neuron_tp.infer.lora_slots`): a random trace of requests naming three PEFT adapters
(different ranks, alphas, rsLoRA and target subsets) or the base model, mixed in the same
decode batches over a bank of two slots, with an adapter loaded while others run and one
unloaded and loaded again. Every request's tokens (greedy and seeded sampling) equal
transformers' own generation on peft's merged model of its adapter, at tp 1 in this process,
tp 2 on gloo ranks and tp 2 on two XLA CPU devices (where writing adapters into the bank
compiles no graph)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import engine_cases as ec  # noqa: E402
import lora_cases as lc  # noqa: E402

import gloo_dist  # noqa: E402
from lora_serving import write_adapter  # noqa: E402


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("adapters"))
    return {name: write_adapter(root, name, seed=i + 1) for i, name in enumerate(lc.NAMES)}


def _engine(mesh, paths: dict[str, str], device=None):
    from neuron_tp import hf
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.parallel.sharding import move_to

    model = hf.parallelize(lc.base_copy(), mesh).eval()
    if device is not None:
        move_to(model, device)
    group = mesh.group("world") if mesh.tp_size > 1 else None
    engine = Engine(group, lease_steps=3)
    lc.attach(engine, SlotGenerator(model, **ec.SHAPES), paths)
    return engine


def _serve(engine, items, paths) -> list:
    engine.start()
    try:
        return lc.drive(engine, items, paths)
    finally:
        engine.shutdown(60)


def test_adapters_change_the_tokens(paths):
    """The reference itself: each adapter's merged model answers differently from the base
    and from the others (a bank that ignored an adapter, or used another's, would fail)."""
    items = [it for it in lc.make_trace(2, 12) if it["sampling"] is None][:4]
    outs = {}
    for name in [None, *lc.NAMES]:
        outs[name] = lc.references([{**it, "adapter": name} for it in items], paths)
    for name in lc.NAMES:
        assert outs[name] != outs[None], name
    assert len({str(v) for v in outs.values()}) == len(outs)


def test_mixed_adapters_equal_peft_merged_per_request_tp1(paths):
    from neuron_tp import init_mesh

    engine = _engine(init_mesh(tp=1), paths)
    engine.warmup()
    items = lc.make_trace(1, 36)
    results = _serve(engine, items, paths)
    lc.check(results, items, lc.references(items, paths))
    assert engine.rows.lora.loads > lc.BANK, "no adapter ever waited for a slot"


def test_an_adapter_waits_for_a_slot_no_running_request_uses(paths):
    """Two requests decode with alpha and beta (both bank slots) when a gamma request
    arrives (drive loads it just before): it waits until one ends (evicting a running
    request's adapter would change that request's next tokens), then runs; all three equal
    peft's merged models."""
    from neuron_tp import init_mesh
    from neuron_tp.hf.lora_bank import LoraBank
    from neuron_tp.infer.lora_slots import BankSlots, HostAdapters

    engine = _engine(init_mesh(tp=1), paths)
    engine.warmup()
    prompt = list(range(40, 52))
    items = [
        {"gap": 0.0, "prompt": prompt, "max_tokens": n, "sampling": None, "adapter": a}
        for a, n in (("alpha", ec.MAX_NEW), ("beta", ec.MAX_NEW), ("gamma", 4))
    ]
    results = _serve(engine, items, paths)
    lc.check(results, items, lc.references(items, paths))
    model = engine.gen.model
    slots = BankSlots(LoraBank(model, 2, 8), HostAdapters(1))
    assert [slots.place(7, set()), slots.place(8, {0}), slots.place(9, {0, 1})] == [0, 1, None]
    assert slots.place(9, {1}) == 0 and slots.place(8, {0}) == 1 and slots.place(9, set()) == 0


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_verifies_with_the_adapters_the_draft_without(paths, method):
    """Speculative decoding under adapters: the draft (a model of its own, no bank) or the
    n-gram proposer proposes, the target verifies with each row's adapter; greedy tokens equal
    peft's merged models (a verification without the adapters would give the base's)."""
    from neuron_tp import hf, init_mesh
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.ngram import NgramGenerator
    from neuron_tp.infer.speculative import SpeculativeGenerator

    mesh = init_mesh(tp=1)
    model = hf.parallelize(lc.base_copy(), mesh).eval()
    if method == "draft":
        from neuron_tp.job.presets import build_model

        draft = hf.parallelize(build_model("tiny-llama", 257, 9).eval(), mesh).eval()
        gen = SpeculativeGenerator(model, draft, k=3, **ec.SHAPES)
    else:
        gen = NgramGenerator(model, k=3, **ec.SHAPES)
    engine = Engine(lease_steps=3)
    lc.attach(engine, gen, paths)
    engine.warmup()
    items = [it for it in lc.make_trace(6, 30) if it["sampling"] is None]
    results = _serve(engine, items, paths)
    lc.check(results, items, lc.references(items, paths))
    assert gen.stats.steps > 0


def _tp2_trace(case: str, paths: dict[str, str]) -> None:
    from neuron_tp import init_mesh

    mesh = init_mesh(tp=2)
    engine = _engine(mesh, paths)
    engine.warmup()
    if mesh.rank != 0:
        engine.follow()
        return
    items = lc.make_trace(3, 24)
    results = _serve(engine, items, paths)
    lc.check(results, items, lc.references(items, paths))


def test_mixed_adapters_equal_peft_merged_per_request_tp2_gloo(paths):
    gloo_dist.run_case(_tp2_trace, "trace", paths, cases=["trace"], world_size=2)


def test_bank_refuses_what_it_cannot_hold(paths, tmp_path):
    """rank over --max-lora-rank, targets the model lacks, a directory that is not an
    adapter, a name in use: UserError naming the problem, and the registry unchanged."""
    from neuron_tp import hf, init_mesh
    from neuron_tp.errors import UserError
    from neuron_tp.hf.lora_bank import LoraBank
    from neuron_tp.infer.lora_slots import Adapters, HostAdapters

    model = hf.parallelize(lc.base_copy(), init_mesh(tp=1)).eval()
    adapters = Adapters("base", LoraBank(model, 1, 4), HostAdapters(1))
    with pytest.raises(UserError, match="rank 8 exceeds --max-lora-rank 4"):
        adapters.load("a", paths["alpha"])
    with pytest.raises(UserError, match="no adapter_config.json"):
        adapters.load("a", str(tmp_path))
    adapters.load("b", paths["beta"])
    with pytest.raises(UserError, match="already loaded"):
        adapters.load("b", paths["gamma"])
    with pytest.raises(UserError, match="other than the base"):
        adapters.load("base", paths["gamma"])
    assert [r.name for r in adapters.all()] == ["b"]
    from lora_serving import foreign_adapter

    with pytest.raises(UserError, match="not a LoRA-capable projection"):
        adapters.load("c", foreign_adapter(str(tmp_path)))


def test_mixed_adapters_on_two_xla_devices_compile_nothing_after_warmup(paths):
    """tp 2 on two XLA CPU devices, replayed graphs: the trace's requests equal peft's merged
    models, and loading adapters into the bank while serving compiled no graph."""
    import multi_lora_xla_cases

    import xla_dist

    r0, r1 = xla_dist.run(multi_lora_xla_cases.job, paths, 24, devices=2)
    for r in (r0, r1):
        assert r["traces"][0] == r["traces"][1] > 0, r
        assert r["loads"] > lc.BANK, r
    assert r0["compiles"][0] == r0["compiles"][1], r0
    items = lc.make_trace(5, 24)
    lc.check(r0["results"], items, lc.references(items, paths))
    print(f"adapter writes into the bank: {r0['load_ms']:.1f} ms each (mean, rank 0)")


def test_lora_bank_delta_is_the_merged_product():
    """One projection, every mix: the bank's output for rows naming slot 0, 1 or none equals
    x (W + s B A)^T of that row's adapter."""
    from neuron_tp import hf, init_mesh
    from neuron_tp.hf.lora_bank import AdapterWeights, LoraBank

    model = hf.parallelize(lc.base_copy(), init_mesh(tp=1)).eval()
    bank = LoraBank(model, 2, 4)
    name = "model.layers.0.self_attn.o_proj"
    layer = model.get_submodule(name)
    g = torch.Generator().manual_seed(0)
    pairs = [
        (
            torch.randn(r, layer.in_features, generator=g),
            torch.randn(layer.out_features, r, generator=g),
        )
        for r in (4, 2)
    ]
    for slot, (a, b) in enumerate(pairs):
        bank.write(slot, AdapterWeights(f"x{slot}", a.shape[0], {name: (a, b)}))
    wider = AdapterWeights("w", 4, {name: (pairs[0][0][:, :-2], pairs[0][1])})  # another model's
    assert bank.problems(wider) == [
        f"{name}: lora_A (4, {layer.in_features - 2}) / lora_B ({layer.out_features}, 4) do not "
        f"fit the base projection [{layer.out_features}, {layer.in_features}]"
    ]
    x = torch.randn(3, 5, layer.in_features, generator=g)
    index = torch.tensor([1, -1, 0])
    with torch.no_grad(), bank.bound(bank.tensors), bank.select(index):
        got = layer(x)
    with torch.no_grad():
        base = layer(x)
    for row, slot in enumerate(index.tolist()):
        want = base[row] + (x[row] @ (pairs[slot][1] @ pairs[slot][0]).T if slot >= 0 else 0)
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
