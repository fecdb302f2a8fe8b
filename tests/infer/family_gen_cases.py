"""Greedy generation of one family's tiny model through the slot generator vs transformers'
``generate`` on the unsharded model: the body of tests/infer/test_family_generation.py on gloo
ranks (:func:`outcome`) and on XLA CPU devices (:func:`xla_sample`, via xla_dist.run)."""

from __future__ import annotations

import copy
import traceback

import torch

from hf_sampling import peaked
from neuron_tp.infer.sampling import Sampling
from slot_trace import Req, eos_ids, reference

PROMPTS = ([5, 17, 33, 2, 41, 9, 28, 11, 3, 50, 7], [12, 4, 60])
NEW = 6
LARGE = dict(max_position_embeddings=128, sliding_window=64, window_size=64)  # all in windows


def build(mt: str):
    from dense_families import build_dense
    from moe_families import build_family, moe_families

    if mt in moe_families():
        return peaked(build_family(mt, seed=1, **LARGE))
    return peaked(build_dense(mt, seed=1, **LARGE))


def outcome(mt: str, mesh, full=None, device=None) -> dict:
    """The outcome of family ``mt`` on this rank: equal, differs (with both token lists),
    refused (the generator's message) or crashed. ``device``: move the sharded model there
    (an XLA device); ``full``: the unsharded model, if already built."""
    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.infer.slot_generator import SlotGenerator

    full = build(mt) if full is None else full
    reqs = [Req(list(p), NEW, Sampling()) for p in PROMPTS]
    stops = eos_ids(full)
    want = [_cut(reference(full, r), stops) for r in reqs]
    try:
        model = hf.parallelize(copy.deepcopy(full), mesh).eval()
        if device is not None:
            model = ntp.move_to(model, device)
        gen = SlotGenerator(model, 2, max_len=32, chunk=8)
    except (ValueError, NotImplementedError) as e:
        return {"kind": "refused", "detail": str(e)}
    try:
        got = _serve(gen, reqs, stops)
    except Exception as e:  # noqa: BLE001 - an accepted family that crashes is the finding
        where = [f"{f.filename}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)[-4:]]
        return {"kind": "crashed", "detail": f"{type(e).__name__}: {e} at {where}"[:900]}
    return {"kind": "equal" if got == want else "differs", "got": got, "want": want}


def _cut(tokens: list[int], stops: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def _serve(gen, reqs: list[Req], stops: list[int]) -> list[list[int]]:
    """Both requests in a slot each: the long prompt in two chunks, then decode together."""
    out: list[list[int]] = [[] for _ in reqs]
    slots = [gen.acquire() for _ in reqs]
    with torch.no_grad():
        for slot, r, o in zip(slots, reqs, out):
            cut = min(len(r.prompt) - 1, gen.chunk) if len(r.prompt) > 4 else 0
            if cut:
                gen.prefill(slot, r.prompt[:cut], 0, None)
            o.append(gen.prefill(slot, r.prompt[cut:], cut, r.sampling))
        live = dict(zip(slots, range(len(reqs))))
        for slot, o in zip(slots, out):
            if o[-1] in stops:
                gen.release(slot)
                del live[slot]
        while live:
            for slot, new in gen.decode().items():
                i = live[slot]
                out[i] += new
                if len(out[i]) >= NEW or out[i][-1] in stops:
                    out[i] = _cut(out[i][:NEW], stops)
                    gen.release(slot)
                    del live[slot]
    return out


def xla_sample(names: list[str], tp: int) -> dict:
    """One XLA rank of ``tp``: every family of ``names`` built (one rank at a
    time), sharded, moved to this rank's device and served."""
    import neuron_tp as ntp
    from xla_dist import serial

    mesh = ntp.init_mesh(tp=tp)
    out = {}
    for mt in names:
        with serial():
            full = build(mt)
        out[mt] = outcome(mt, mesh, full=full, device=ntp.xla_device())
    return out
