"""Every MoE causal-LM family of the installed transformers (found from its auto mappings,
:mod:`moe_families`) at tp 2 on gloo ranks, in ONE launch: a tiny random model parallelized
with the plan neuron_tp picks, compared with the unsharded transformers model in logits, loss,
and every weight after one optimizer step (SGD; eval mode, so training jitter and dropout
stay out) — or refused, before anything is changed, with a message naming what is missing.

When the whole model is refused for something outside its MoE layers (e.g. an attention kind),
the same family is tried again with only its experts sharded (``plan={'...experts':
'moe_tp_experts'}``), which proves the MoE layers on their own.

The outcome table is printed; the test fails when a family of :data:`EXPECTED_PASS` (or
:data:`EXPECTED_EXPERTS_ONLY`) does not pass, when a family is accepted and then crashes or
differs ("fail"), or when a refusal changed the model."""

from __future__ import annotations

import copy
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import gloo_dist  # noqa: E402
from doc_tables import check_docs_table  # noqa: E402
from moe_families import (  # noqa: E402
    V,
    build_family,
    docs_table,
    family_table,
    moe_families,
)

TP = 2
ATOL = 1e-4

# Families whose whole model passes at tp 2 (committed: one that stops passing fails the test).
EXPECTED_PASS: list[str] = [
    "afmoe",
    "aria_text",
    "axk1",
    "bailing_hybrid",
    "beam",
    "cohere2_moe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "ernie4_5_moe",
    "exaone_moe",
    "flex_olmo",
    "flint",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "granitemoe_swa",
    "gpt_oss",
    "granitemoe",
    "granitemoehybrid",
    "granitemoeshared",
    "hunyuan_v1_moe",
    "hy_v3",
    "jamba",
    "kimi_linear",
    "kolibri1",
    "laguna",
    "lfm2_moe",
    "llama4",
    "llama4_text",
    "mellum",
    "minimax",
    "minimax_m2",
    "minimax_m3_vl_text",
    "mixtral",
    "nemotron_h",
    "olmoe",
    "phimoe",
    "qwen2_moe",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_moe",
    "qwen3_next",
    "solar_open",
    "zaya",
]
# Families refused as a whole whose experts-only plan passes.
EXPECTED_EXPERTS_ONLY: list[str] = [
    "axk2",
    "hy_v4",
    "inkling2_text",
    "inkling_text",
    "mimo_v2_flash",
    "qwen4_exp",
    "qwen4_exp_text",
]


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-3, msg=lambda m: f"{what}: {m}")


def _experts_plan(model) -> dict[str, str]:
    names = {
        re.sub(r"\.\d+\.", ".*.", n)
        for n, m in model.named_modules()
        if n.endswith(".experts") and any(p.dim() == 3 for p in m.parameters(recurse=False))
    }
    return {n: "moe_tp_experts" for n in sorted(names)}


def _compare(ref, m) -> None:
    """``m`` (parallelized from a copy of ref) vs ref: logits, loss, weights after one SGD
    step, logits after it (AdamW's first step divides each gradient by its own size: it
    would turn the rounding of the near-zero gradients of tiny random models into visible
    differences)."""
    import neuron_tp as ntp
    from neuron_tp.hf import gather_hf_state_dict

    ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(3))
    out, want = m(ids, labels=ids), ref(ids, labels=ids)
    _close(out.logits, want.logits, "logits")
    _close(out.loss, want.loss, "loss")
    out.loss.backward()
    want.loss.backward()
    ntp.sync_sequence_parallel_grads(m)
    for model in (m, ref):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    after = gather_hf_state_dict(m)
    for n, t in ref.state_dict().items():
        if n in after:
            _close(after[n], t, f"{n} after a step")
    with torch.no_grad():
        _close(m(ids).logits, ref(ids).logits, "logits after a step")


def _compare_ep(ref, plan, mesh) -> tuple[str, str]:
    """Expert parallelism over the launch's 2 ranks (tp 1, ep 2: 2 of the 4 experts each),
    each rank its own rows: its logits and loss vs the unsharded model's on those rows, every
    gradient after the data-parallel reduction vs the unsharded model's on both ranks' rows."""
    import neuron_tp as ntp
    from neuron_tp.hf import gather_hf_state_dict, parallelize

    try:
        ids = torch.randint(1, V, (2 * mesh.dp_size, 8), generator=torch.Generator().manual_seed(4))
        mine = ids.chunk(mesh.dp_size)[mesh.dp_rank]
        m = parallelize(copy.deepcopy(ref), mesh, plan=plan)
        local = [p for n, p in m.named_parameters() if n.endswith("experts.down_proj")]
        full = ref.get_parameter(
            next(n for n, _ in ref.named_parameters() if n.endswith("experts.down_proj"))
        )
        assert local and local[0].shape[0] * mesh.ep_size == full.shape[0], "not spread over ep"
        out = m(mine, labels=mine)
        want = [ref(r, labels=r) for r in ids.chunk(mesh.dp_size)]
        _close(out.logits, want[mesh.dp_rank].logits, "ep logits")
        _close(out.loss, want[mesh.dp_rank].loss, "ep loss")
        out.loss.backward()
        (sum(w.loss for w in want) / mesh.dp_size).backward()
        ntp.allreduce_data_parallel_grads(m, mesh)
        grads = gather_hf_state_dict(m, grads=True)
        for n, p in ref.named_parameters():
            if p.grad is not None:
                _close(grads[n], p.grad, f"ep grad {n}")
    except Exception as e:  # noqa: BLE001
        return "fail", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return "pass", ""


def _shards_experts(model) -> bool:
    from neuron_tp.hf.resolve import plan_model
    from neuron_tp.hf.styles import Style

    return Style.MOE_EXPERTS in plan_model(model).targets.values()


def _try(ref, plan) -> tuple[str, str]:
    """``(outcome, detail)``: pass / refused / fail; ``ref`` is not changed."""
    before = {n: t.clone() for n, t in ref.state_dict().items()}
    probe = copy.deepcopy(ref)
    from neuron_tp.hf import parallelize

    try:
        parallelize(probe, plan=plan)
    except ValueError as e:  # UserError is a ValueError too
        after = probe.state_dict()
        same = set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
        if not same or getattr(probe, "_ntp_parallel", False):
            return "fail", f"refused after changing the model: {e}"
        return "refused", str(e).splitlines()[0][:300]
    except Exception as e:  # noqa: BLE001 - accepted then crashed while sharding
        return "fail", f"{type(e).__name__} while sharding: {str(e)[:300]}"
    try:
        _compare(copy.deepcopy(ref), probe)
    except Exception as e:  # noqa: BLE001
        return "fail", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return "pass", ""


# Families whose experts layouts differ (transposed + interleaved + biases, Llama-4's dense
# call, a shared-expert gate, a plain one): checkpoint round trips at tp 2.
CHECKPOINT_FAMILIES = ("gpt_oss", "llama4_text", "qwen3_next", "cohere2_moe")


def _checkpoints(tmp: str) -> dict[str, str]:
    """save_pretrained of the sharded model loads in plain transformers equal to the
    original; from_pretrained (each rank reads its slices of the fused experts) equals
    parallelize of the full model, and its logits transformers'."""
    import transformers as tf

    from neuron_tp.hf import from_pretrained, parallelize, save_pretrained

    out = {}
    for mt in CHECKPOINT_FAMILIES:
        try:
            ref = build_family(mt)
            path = os.path.join(tmp, mt)
            save_pretrained(parallelize(copy.deepcopy(ref)), path)
            back = tf.AutoModelForCausalLM.from_pretrained(path).eval()
            for n, t in ref.state_dict().items():
                assert torch.equal(back.state_dict()[n], t), f"saved {n}"
            loaded = from_pretrained(path)
            expected = parallelize(copy.deepcopy(ref))
            got, want = loaded.state_dict(), expected.state_dict()
            assert list(got) == list(want), "parameter names"
            for n in want:
                assert torch.equal(got[n], want[n]), f"loaded {n}"
            ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                _close(loaded(ids).logits, ref(ids).logits, "loaded logits")
            out[mt] = "pass"
        except Exception as e:  # noqa: BLE001
            out[mt] = f"fail: {type(e).__name__}: {str(e)[:300]}"
    for mt in TF_SAVED_FAMILIES:
        out[f"transformers-saved {mt}"] = _tf_saved(mt, os.path.join(tmp, f"tf-{mt}"))
    return out


# transformers' own save_pretrained writes these one tensor per expert (Hunyuan, Cohere2-MoE:
# gate/up/down_proj; MiniMax-M2: block_sparse_moe w1/w3/w2; Jamba: feed_forward) or fused
# with biases (gpt-oss).
TF_SAVED_FAMILIES = ("hunyuan_v1_moe", "cohere2_moe", "minimax_m2", "jamba", "gpt_oss")


def _tf_saved(mt: str, path: str) -> str:
    """from_pretrained of transformers' own files (each rank reads its experts' slices):
    the logits of transformers' model."""
    import torch.distributed as dist

    from neuron_tp.hf import from_pretrained

    try:
        ref = build_family(mt)
        if dist.get_rank() == 0:
            copy.deepcopy(ref).save_pretrained(path)
        dist.barrier()
        ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            _close(from_pretrained(path)(ids).logits, ref(ids).logits, "logits")
        return "pass"
    except Exception as e:  # noqa: BLE001
        return f"fail: {type(e).__name__}: {str(e)[:300]}"


# Families sharded behind the experts interface whose model returns a load-balancing loss.
AUX_FAMILIES = ("qwen3_next", "jamba", "granitemoe", "flex_olmo", "ernie4_5_moe")


def _aux() -> dict[str, str]:
    """The router auxiliary loss (``output_router_logits``), in the parallel loss too: equal
    to transformers', with a plain and a packed (4-D, one sample per row) attention mask."""
    from neuron_tp.hf import parallelize
    from neuron_tp.hf.packing import block_causal_mask

    out = {}
    for mt in AUX_FAMILIES:
        try:
            ref = build_family(mt, output_router_logits=True, router_aux_loss_coef=0.05)
            m = parallelize(copy.deepcopy(ref), parallel_loss=True)
            ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(9))
            want = ref(ids, labels=ids)
            assert want.aux_loss is not None, "no aux loss"
            for mask in (None, block_causal_mask(torch.ones_like(ids))):
                got = m(ids, labels=ids, attention_mask=mask)
                _close(got.aux_loss, want.aux_loss, "aux loss")
                _close(got.loss, want.loss, "loss with aux")
            out[mt] = "pass"
        except Exception as e:  # noqa: BLE001
            out[mt] = f"fail: {type(e).__name__}: {str(e)[:300]}"
    return out


def _sweep(out_path: str) -> None:
    import neuron_tp as ntp

    ep_mesh = ntp.init_mesh(tp=1, ep=TP)
    mesh = gloo_dist.shared_mesh(TP)  # the default
    results = {}
    for mt in moe_families():
        try:
            ref = build_family(mt)
            ids = torch.randint(1, V, (2, 8))
            ref(ids, labels=ids).loss.backward()  # the unsharded model itself runs
            ref.zero_grad(set_to_none=True)
        except Exception as e:  # noqa: BLE001 - the tiny config does not build: not neuron_tp's
            results[mt] = {"whole": ("no tiny model", f"{type(e).__name__}: {str(e)[:200]}")}
            continue
        entry = {"whole": _try(ref, None)}
        if entry["whole"][0] == "pass" and not _shards_experts(ref):
            entry["whole"] = ("pass (experts replicated)", "")
        plan = None
        if entry["whole"][0] != "pass":
            plan = _experts_plan(ref)
            entry["experts_only"] = _try(ref, plan) if plan else ("refused", "no experts module")
        if "pass" in (entry["whole"][0], entry.get("experts_only", ("",))[0]):
            entry["ep"] = _compare_ep(ref, plan, ep_mesh)  # ref's last use
        ntp.set_default_mesh(mesh)
        results[mt] = entry
        if torch.distributed.get_rank() == 0:
            print(f"[moe families] {mt}: {entry}", flush=True)
    ckpt = _checkpoints(os.path.dirname(out_path))
    ckpt.update({f"aux {k}": v for k, v in _aux().items()})
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"families": results, "checkpoints": ckpt}, f, indent=1)


def test_every_moe_family(tmp_path):
    out = str(tmp_path / "families.json")
    gloo_dist.run(_sweep, out, world_size=TP, timeout=1500)
    with open(out) as f:
        both = json.load(f)
    results, ckpt = both["families"], both["checkpoints"]
    print(f"checkpoint round trips, aux losses: {ckpt}")
    whole = sorted(mt for mt, r in results.items() if r["whole"][0] == "pass")
    only = sorted(mt for mt, r in results.items() if r.get("experts_only", ("",))[0] == "pass")
    print(f"\n{len(results)} MoE families; whole model passes at tp {TP}: {len(whole)} {whole}")
    print(f"experts-only plan passes (model refused as a whole): {len(only)} {only}")
    ep = sorted(mt for mt, r in results.items() if r.get("ep", ("",))[0] == "pass")
    print(f"expert parallelism (tp 1 x ep 2) passes: {len(ep)} {ep}")
    for mt, r in sorted(results.items()):
        line = f"  {mt:24s} {r['whole'][0]:14s} {r['whole'][1]}"
        if "experts_only" in r:
            line += f"\n  {'':24s} experts only: {r['experts_only'][0]} {r['experts_only'][1]}"
        if "ep" in r:
            line += f"\n  {'':24s} ep 2: {r['ep'][0]} {r['ep'][1]}"
        print(line)
    failing = {mt: r for mt, r in results.items() if "fail" in (v[0] for v in r.values())}
    lost = sorted(set(EXPECTED_PASS) - set(whole)) + sorted(set(EXPECTED_EXPERTS_ONLY) - set(only))
    assert not lost, f"families that no longer pass: {lost}"
    assert ep == sorted(whole + only), f"passing at tp, not under ep: {set(whole + only) - set(ep)}"
    assert not failing, f"accepted then failed: {json.dumps(failing, indent=1)}"
    assert all(v == "pass" for v in ckpt.values()), ckpt
    _check_docs_table(results)


DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "moe.md")


def _check_docs_table(results: dict) -> None:
    """docs/moe.md's family table is what this sweep finds (``NTP_WRITE_MOE_TABLE=1``
    rewrites it)."""
    with open(DOCS) as f:
        have = docs_table(f.read())
    check_docs_table(
        DOCS, family_table(results), have, "NTP_WRITE_MOE_TABLE", "tests/hf/test_moe_families.py"
    )
