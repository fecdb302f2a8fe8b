"""Every dense causal-LM family of the installed transformers (:mod:`dense_families`) at tp 2 on
gloo ranks, in ONE launch: a tiny random model parallelized with ``parallel_loss=True`` (the plan
neuron_tp picks) and compared with the unsharded transformers model in logits, parallel loss,
every gradient and the logits after one SGD step (eval mode), and, for a family with dropout,
in training mode from the same RNG state (logits, loss, every gradient: each dropout mask must
be the unsharded model's), also with sequence parallelism where the family takes it — or
refused, before anything is changed.

Each rank computes every difference before any comparison decides (a rank that stopped early
would leave the other one alone in a collective), and the outcome of a family is the worst of
its ranks' (a gradient wrong on one rank only is wrong). A family accepted and then different
or crashing fails the test, and so does a docs/hf.md family table that differs from what the
sweep finds."""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import gloo_dist  # noqa: E402
from dense_families import (  # noqa: E402
    NO_TINY,
    SP_FAMILIES,
    V,
    build_dense,
    dense_families,
    docs_table,
    drops,
    family_row,
    family_table,
)
from doc_tables import check_docs_table  # noqa: E402

TP = int(os.environ.get("NTP_DENSE_TP", "2"))  # the table records tp 2; 4: a developer's check
ATOL, RTOL = 1e-4, 1e-3


def _diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """How far ``a`` is outside the tolerance around ``b`` (None: within it)."""
    if a.shape != b.shape:
        return float("inf")
    over = (a.detach() - b.detach()).abs() - (ATOL + RTOL * b.detach().abs())
    worst = float(over.max()) if over.numel() else 0.0
    return None if worst <= 0 and torch.isfinite(a).all() else float((a - b).abs().max())


def _compare(ref, m) -> list[str]:
    """What differs between ``m`` (parallelized from a copy of ``ref``) and ``ref``: logits,
    parallel loss, every gradient, logits after one SGD step (eval mode: no dropout). Nothing
    raises between the collectives, so both ranks run the same ones."""
    import neuron_tp as ntp
    from neuron_tp.hf import full_logits, gather_hf_state_dict

    ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(3))
    bad: list[str] = []

    def check(a, b, what):
        d = _diff(a, b)
        if d is not None:
            bad.append(f"{what} off by {d:.1e}")

    want = ref(ids, labels=ids)
    with full_logits(m), torch.no_grad():
        check(m(ids).logits, want.logits, "logits")
    loss = m(ids, labels=ids).loss
    check(loss, want.loss, "loss")
    loss.backward()
    want.loss.backward()
    ntp.sync_sequence_parallel_grads(m)
    grads = gather_hf_state_dict(m, grads=True)
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    missing = sorted(set(expected) - set(grads))
    if missing:
        bad.append(f"no gradient for {missing[:3]}")
    for n, g in expected.items():
        if n in grads:
            check(grads[n], g, f"grad {n}")
    for model in (m, ref):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    with full_logits(m), torch.no_grad():
        check(m(ids).logits, ref(ids).logits, "logits after a step")
    return bad


def _compare_training(ref, m, tag: str = "", ids: torch.Tensor | None = None) -> list[str]:
    """In training mode, with the same RNG state before every forward (so each dropout mask
    must be the unsharded model's): logits, parallel loss, every gradient."""
    import neuron_tp as ntp
    from neuron_tp.hf import full_logits, gather_hf_state_dict

    ref.train()
    m.train()
    if ids is None:
        ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(4))
    bad: list[str] = []

    def check(a, b, what):
        d = _diff(a, b)
        if d is not None:
            bad.append(f"{tag}training {what} off by {d:.1e}")

    torch.manual_seed(7)
    want = ref(ids, labels=ids)
    torch.manual_seed(7)
    with full_logits(m), torch.no_grad():
        check(m(ids).logits, want.logits, "logits")
    torch.manual_seed(7)
    loss = m(ids, labels=ids).loss
    check(loss, want.loss, "loss")
    loss.backward()
    want.loss.backward()
    ntp.sync_sequence_parallel_grads(m)
    grads = gather_hf_state_dict(m, grads=True)
    for n, p in ref.named_parameters():
        if p.grad is not None and n in grads:
            check(grads[n], p.grad, f"grad {n}")
    return bad


def _try(ref, sp_too: bool = False) -> tuple[str, str]:
    """``(outcome, detail)``: exact / refused / wrong / fail; ``ref`` is not changed.
    ``sp_too``: also in eval mode with sequence parallelism (when the family takes it)."""
    from neuron_tp.hf import parallelize

    opts = dict(parallel_loss=True)
    before = {n: t.clone() for n, t in ref.state_dict().items()}
    probe = copy.deepcopy(ref)
    try:
        parallelize(probe, **opts)
    except ValueError as e:  # UserError is a ValueError too
        after = probe.state_dict()
        same = set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
        if not same or getattr(probe, "_ntp_parallel", False):
            return "fail", f"refused after changing the model: {e}"
        return "refused", str(e).splitlines()[0][:300]
    except Exception as e:  # noqa: BLE001 - accepted then crashed while sharding
        return "fail", f"{type(e).__name__} while sharding: {str(e)[:300]}"
    try:
        bad = _compare(copy.deepcopy(ref), probe)
        if not bad and sp_too:
            bad = [f"sp {b}" for b in _compare_sp(ref, opts)]
        if not bad and drops(ref):
            bad = _compare_training(copy.deepcopy(ref), parallelize(copy.deepcopy(ref), **opts))
            try:
                sp = parallelize(copy.deepcopy(ref), **opts, sequence_parallel=True)
            except ValueError:
                sp = None  # sequence parallelism refused for this family
            if not bad and sp is not None:
                bad = _compare_training(copy.deepcopy(ref), sp, "sp ")
    except Exception as e:  # noqa: BLE001
        return "fail", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return ("wrong", "; ".join(bad[:4])) if bad else ("exact", "")


def _compare_sp(ref, opts: dict) -> list[str]:
    """:func:`_compare` with sequence parallelism (nothing when the family refuses it)."""
    from neuron_tp.hf import parallelize

    try:
        sp = parallelize(copy.deepcopy(ref), **opts, sequence_parallel=True)
    except ValueError:
        return []
    return _compare(copy.deepcopy(ref), sp)


def _lora_dropout() -> dict[str, str]:
    """GPT-2 with LoRA adapters on its column and row projections, lora_dropout 0.2 and the
    model's own dropout, in training from the same RNG state, with and without sequence
    parallelism: loss and every gradient equal peft's unsharded model's."""
    from lora_models import peft_model, sample_ids
    from neuron_tp.hf import parallelize

    out = {}
    for sp in (False, True):
        ref = peft_model("tiny-gpt2", lora_dropout=0.2)
        m = parallelize(copy.deepcopy(ref), parallel_loss=True, sequence_parallel=sp)
        bad = _compare_training(ref, m, ids=sample_ids(8))
        out[f"lora dropout sp={sp}"] = "; ".join(bad[:3]) or "pass"
    return out


_RANK = {"exact": 0, "refused": 1, "no tiny model": 1, "wrong": 2, "fail": 3}


def _sweep(out_path: str) -> None:
    import torch.distributed as dist

    gloo_dist.shared_mesh(TP)  # the default mesh
    results = {}
    for mt in dense_families():
        if ONLY and mt not in ONLY:
            continue
        if mt in NO_TINY:
            results[mt] = ("no tiny model", NO_TINY[mt])
            continue
        try:
            ref = build_dense(mt)
            ids = torch.randint(1, V, (2, 8))
            # the unsharded model itself runs (a copy: RecurrentGemma keeps its states)
            copy.deepcopy(ref)(ids, labels=ids).loss.backward()
            outcome = None
        except Exception as e:  # noqa: BLE001 - the tiny config does not build: not neuron_tp's
            outcome = ("no tiny model", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        if outcome is None:
            outcome = _try(ref, sp_too=mt in SP_FAMILIES)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, outcome)
        results[mt] = max(every, key=lambda o: _RANK[o[0]])
        if dist.get_rank() == 0:
            print(f"[dense families] {mt}: {results[mt]}", flush=True)
    extra = _lora_dropout()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, extra)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"families": results, "extra": every}, f, indent=1)


def test_every_dense_family(tmp_path):
    out = str(tmp_path / "families.json")
    gloo_dist.run(_sweep, out, world_size=TP, timeout=900)
    with open(out) as f:
        both = json.load(f)
    results = {k: tuple(v) for k, v in both["families"].items()}
    counts: dict[str, int] = {}
    for mt, (kind, detail) in sorted(results.items()):
        counts[kind] = counts.get(kind, 0) + 1
        print(f"  {mt:28s} {kind:14s} {detail}")
    print(f"{len(results)} dense families at tp {TP}: {counts}")
    print(f"LoRA with dropout, per rank: {both['extra']}")
    bad = {mt: r for mt, r in results.items() if r[0] in ("wrong", "fail")}
    assert not bad, f"accepted and wrong (or crashed): {json.dumps(bad, indent=1)}"
    assert all(v == "pass" for e in both["extra"] for v in e.values()), both["extra"]
    if TP != 2:  # the table is tp 2's: a tp 4 sweep only finds nothing wrong
        return
    if ONLY:  # a developer's partial sweep: the table's rows of those families
        with open(DOCS) as f:
            table = docs_table(f.read()) or ""
        stale = [mt for mt in results if family_row(mt, results[mt]) not in table]
        assert not stale, (
            f"docs/hf.md differs for {stale}: rerun the whole sweep with NTP_WRITE_DENSE_TABLE=1"
        )

    else:
        _check_docs_table(results)


DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "hf.md")
# NTP_DENSE_FAMILIES=opt,mpt: sweep only these families (while working on them).
ONLY = {f for f in os.environ.get("NTP_DENSE_FAMILIES", "").split(",") if f}


def _check_docs_table(results: dict) -> None:
    """docs/hf.md's family table is what this sweep finds (``NTP_WRITE_DENSE_TABLE=1``
    rewrites it)."""
    with open(DOCS) as f:
        have = docs_table(f.read())
    check_docs_table(
        DOCS,
        family_table(results),
        have,
        "NTP_WRITE_DENSE_TABLE",
        "tests/hf/test_dense_families.py",
    )
