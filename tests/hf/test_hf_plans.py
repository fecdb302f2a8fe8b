"""Explicit architecture plans: their paths resolve on every tiny model, they describe the
same structure the name-based fallback finds, an architecture without one still works through
the fallback, and a plan naming a module that does not exist is refused before anything is
modified. (Numerics of every architecture vs the unsharded model: test_hf_parallelize.py.)"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import neuron_tp as ntp  # noqa: E402
from hf_archs import ARCHS, build  # noqa: E402
from neuron_tp.hf import ARCH_PLANS, STYLES, Style, parallelize, resolve_plan  # noqa: E402
from neuron_tp.hf.fallback import guess_structure, shipped_styles  # noqa: E402
from neuron_tp.hf.plans import arch_plan  # noqa: E402
from neuron_tp.hf.resolve import match_modules, plan_model  # noqa: E402
from neuron_tp.hf.slice_map import get_slice_map  # noqa: E402
from neuron_tp.parallel.sharding import get_sharding  # noqa: E402
from neuron_tp.parallel.state import is_parallel  # noqa: E402

EXPLICIT = [n for n, (config, _, _) in ARCHS.items() if config().model_type in ARCH_PLANS]
FALLBACK = [n for n in ARCHS if n not in EXPLICIT]
MESH2 = ntp.Mesh(world_size=2, rank=0, tp=2)  # rank 0 of 2: building needs no collective


def test_styles_are_an_enum_named_like_plan_entries():
    assert STYLES == tuple(s.value for s in Style)
    assert Style("colwise") is Style.COLUMN and Style.COLUMN == "colwise"
    assert FALLBACK == ["gpt_neox"]  # keep at least one architecture on the fallback


@pytest.mark.parametrize("name", EXPLICIT)
def test_explicit_plan_paths_resolve(name):
    model = build(name)
    arch = arch_plan(model.config)
    s = plan_model(model).structure
    assert "ARCH_PLANS" in s.source
    layers = model.get_submodule(s.layers)
    assert isinstance(layers, nn.ModuleList) and len(layers) == 2  # the tiny configs' depth
    assert model.get_submodule(s.lm_head) is model.get_output_embeddings()
    if arch.final_norm is None:
        assert s.final_norm is None
    else:
        assert isinstance(model.get_submodule(s.final_norm), nn.Module)
    for i in range(len(layers)):
        for rel in (arch.attention, arch.mlp, *arch.prepares_input, *arch.layer_styles):
            if rel is not None:
                model.get_submodule(f"{s.layers}.{i}.{rel}")
    targets = plan_model(model).targets
    assert len(targets) == 1 + len(layers) * len(arch.layer_styles) + 1  # embedding, head
    assert targets[s.lm_head] is Style.COLUMN_GATHER_OUTPUT
    emb = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    assert targets[emb] is Style.VOCAB_EMBEDDING


@pytest.mark.parametrize("name", EXPLICIT)
def test_explicit_plan_states_what_the_fallback_guessed(name):
    """Behaviour unchanged: for the modules the plan shards, the explicit structure answers
    every question (layers, final norm, head, attention, input preparation) the way the
    name-based guesses did before the plans were explicit."""
    model = build(name)
    mp, guessed = plan_model(model), guess_structure(model)
    s = mp.structure
    assert (s.layers, s.final_norm, s.lm_head) == (
        guessed.layers,
        guessed.final_norm,
        guessed.lm_head,
    )
    for target, style in mp.targets.items():
        parent = target.rpartition(".")[0]
        if style.is_column and target != s.lm_head:
            assert (parent in s.attention) == (parent in guessed.attention), target
            assert (parent in s.prepares_input) == (parent in guessed.prepares_input), target


@pytest.mark.parametrize(
    "name", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "starcoder2"]
)
def test_explicit_plan_matches_the_plan_transformers_ships(name):
    model = build(name)
    assert plan_model(model).targets == match_modules(model, shipped_styles(model))


def _digest(model: nn.Module) -> dict:
    """Everything parallelize decides, per module: class, flags, hooks, parameter shards."""
    out = {}
    for name, mod in model.named_modules():
        rec = [type(mod).__name__, len(mod._forward_pre_hooks), len(mod._forward_hooks)]
        rec += [
            getattr(mod, a, None)
            for a in ("shared_region", "gather_output", "sequence_parallel", "num_key_value_heads")
        ]
        for pn, p in mod.named_parameters(recurse=False):
            rec += [pn, p.detach().clone(), get_sharding(mod, pn), get_slice_map(mod, pn)]
        out[name] = rec
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name


@pytest.mark.parametrize("sp", [False, True])
def test_architecture_without_plan_uses_the_fallback(sp):
    """A Llama whose model_type has no explicit plan is sharded from the plan transformers
    ships with the guessed structure, exactly like the explicit Llama plan shards it."""
    torch.manual_seed(0)
    ref = build("llama")
    unknown = copy.deepcopy(ref)
    unknown.config.model_type = "my_llama"
    assert arch_plan(unknown.config) is None
    assert "guessed" in plan_model(unknown).structure.source
    for rank in (0, 1):
        mesh = ntp.Mesh(world_size=2, rank=rank, tp=2)
        explicit = parallelize(copy.deepcopy(ref), mesh=mesh, sequence_parallel=sp)
        fallback = parallelize(copy.deepcopy(unknown), mesh=mesh, sequence_parallel=sp)
        _assert_same(_digest(explicit), _digest(fallback))


def test_user_plan_replaces_styles_and_keeps_the_explicit_structure():
    model = build("llama")
    styles = {k: v.value for k, v in resolve_plan(model).items()}
    strings = parallelize(copy.deepcopy(model), mesh=MESH2, plan=styles)
    members = parallelize(copy.deepcopy(model), mesh=MESH2, plan=resolve_plan(model))
    default = parallelize(copy.deepcopy(model), mesh=MESH2)
    _assert_same(_digest(strings), _digest(default))
    _assert_same(_digest(members), _digest(default))


def _refused(model: nn.Module, arch, match: str, monkeypatch) -> None:
    monkeypatch.setitem(ARCH_PLANS, model.config.model_type, arch)
    before = {
        n: (type(m), [id(p) for p in m.parameters(recurse=False)]) for n, m in model.named_modules()
    }
    with pytest.raises(ValueError, match=match):
        parallelize(model, mesh=MESH2)
    after = {
        n: (type(m), [id(p) for p in m.parameters(recurse=False)]) for n, m in model.named_modules()
    }
    assert after == before, "model modified on refusal"
    assert not is_parallel(model)


def test_plan_naming_a_missing_module_is_refused_before_anything_changes(monkeypatch):
    llama = ARCH_PLANS["llama"]
    _refused(
        build("llama"),
        dataclasses.replace(llama, mlp="feed_forward"),
        r"plan for model_type 'llama'.*mlp 'model\.layers\.0\.feed_forward' does not "
        r"exist in LlamaForCausalLM; model\.layers\.0 has \['self_attn', 'mlp'",
        monkeypatch,
    )
    _refused(
        build("llama"),
        llama.with_styles({"mlp.fc9": Style.COLUMN}),
        r"layer_styles 'model\.layers\.0\.mlp\.fc9' does not exist",
        monkeypatch,
    )
    _refused(
        build("llama"),
        dataclasses.replace(llama, layers="norm"),
        r"layers 'model\.norm' is a LlamaRMSNorm, not the ModuleList",
        monkeypatch,
    )
    _refused(
        build("llama"),
        dataclasses.replace(llama, final_norm="final_norm"),
        r"final_norm 'model\.final_norm' does not exist.*model has \['embed_tokens'",
        monkeypatch,
    )
    _refused(
        build("llama"),
        dataclasses.replace(llama, lm_head="output"),
        r"lm_head 'output' is not the output embedding of LlamaForCausalLM \('lm_head'\)",
        monkeypatch,
    )
    _refused(
        build("gpt2"),
        dataclasses.replace(ARCH_PLANS["gpt2"], embedding="tok_emb"),
        r"embedding 'transformer\.tok_emb' does not exist in GPT2LMHeadModel; "
        r"transformer has \['wte', 'wpe'",
        monkeypatch,
    )
