"""Expert parallelism inside ``ntp.parallelize`` (a mesh with ``ep > 1``), ONE 4-rank gloo launch:
training steps of MoE families against the unsharded transformers model fed the whole global
batch (each rank's loss on its own rows, every gathered gradient, the global gradient norm
with clipping, the parameters after AdamW steps), at ep 2 x tp 2, ep 4, ep 2 of dp 4 (two
copies of each expert: their gradients summed over ``edp``), ep 2 x tp 2 with sequence
parallelism, ep 4 in capacity mode (a capacity that drops nothing), and with ZeRO-1;
checkpoints written at one ep degree load at another, a ZeRO-1 one resumes exactly at its own;
``neuron-tp train --ep 2`` equals ``--ep 1``; bad degrees refused before any collective.
(tp-only is proven against the same reference in tests/hf/test_moe.py.)"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

import gloo_dist
from moe_archs import V, build_moe
from moe_families import build_family
from neuron_tp import checkpoint
from neuron_tp.errors import UserError
from neuron_tp.hf import gather_hf_state_dict, parallelize
from neuron_tp.moe import TPExperts, TPInterfaceExperts, set_moe_mode
from neuron_tp.optim.grads import reduce_gradients
from neuron_tp.optim.zero1 import Zero1
from neuron_tp.parallel.mesh import Mesh, init_mesh

ROWS = 2  # sequences per rank
EXPERTS = (TPExperts, TPInterfaceExperts)
MAX_NORM = 0.05  # small enough to clip


@functools.cache
def _mesh(tp: int, ep: int) -> Mesh:
    return init_mesh(tp=tp, ep=ep)


def _close(a, b, what, atol=2e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def _build(name: str, **cfg):
    """A tiny model: ``family:<model_type>`` any MoE family (tests/helpers/moe_families.py),
    else one of tests/helpers/moe_archs.py."""
    fam = name.removeprefix("family:")
    return build_family(fam, **cfg) if fam != name else build_moe(name, **cfg)


def _moe_layers(model) -> int:
    """The number of routed-experts modules (fused 3-D weights) of a transformers model."""
    return sum(
        n.endswith(".experts") and any(p.dim() == 3 for p in m.parameters(recurse=False))
        for n, m in model.named_modules()
    )


def _batch(step: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(1, V, (dp * ROWS, 8), generator=g)


def _train(
    name: str, tp: int, ep: int, sp: bool = False, steps: int = 2, zero1=False, cf=None, **cfg
):
    """``steps`` AdamW steps (``zero1``: ZeRO-1's, experts cut over edp; ``cf``: capacity mode
    with that factor, large enough to drop nothing) of the ep-sharded model and of the
    reference; checks every step."""
    mesh = _mesh(tp, ep)
    tag = f"{name} tp={tp} ep={ep} sp={sp} zero1={zero1}"
    ref = _build(name, **cfg).train()
    m = parallelize(copy.deepcopy(ref), mesh, sequence_parallel=sp, parallel_loss=True)
    if cf is not None:
        assert set_moe_mode(m, "capacity", capacity_factor=cf) == _moe_layers(ref)
    local = {n: p.shape for n, p in m.named_parameters() if n.endswith("experts.down_proj")}
    full = ref.get_parameter(next(iter(local))).shape
    assert next(iter(local.values()))[0] == full[0] // ep, f"{tag}: experts not spread over ep"
    # families (random inits with near-zero gradients): an eps above the gradients' rounding
    # noise, or AdamW's first step (g / |g|) turns that noise into whole-step differences
    adam = dict(lr=1e-2, eps=1e-6 if name.startswith("family:") else 1e-8)
    opt_ref = torch.optim.AdamW(ref.parameters(), **adam)
    if zero1:
        opt = Zero1(m, mesh=mesh, **adam)
    else:
        opt = torch.optim.AdamW(m.parameters(), **adam)
    dp, d = mesh.dp_size, mesh.dp_rank
    for step in range(steps):
        ids = _batch(step, dp)
        rows = [ids[i * ROWS : (i + 1) * ROWS] for i in range(dp)]
        losses = [ref(r, labels=r).loss for r in rows]
        (sum(losses) / dp).backward()
        want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        out = m(rows[d], labels=rows[d])
        if cf is not None:  # capacity = every token: the all-to-all buffers drop nothing
            drops = [int(x.dropped) for x in m.modules() if isinstance(x, EXPERTS)]
            assert drops and not any(drops), f"{tag}: dropped {drops}"
        _close(out.loss, losses[d], f"{tag} step {step} loss")
        out.loss.backward()
        if not zero1:  # the averaged gradients (ZeRO-1 keeps them as shards)
            norm = reduce_gradients(m, opt, mesh, MAX_NORM, zero1=False)
            grads = gather_hf_state_dict(m, grads=True)
            for n, p in ref.named_parameters():
                _close(grads[n], p.grad, f"{tag} step {step} grad {n}")
        else:
            norm = reduce_gradients(m, opt, mesh, MAX_NORM, zero1=True)
        _close(norm, want_norm, f"{tag} step {step} grad norm")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    params = gather_hf_state_dict(m)
    for n, p in ref.named_parameters():
        _close(params[n], p.detach(), f"{tag} {n} after {steps} steps", atol=1e-4)
    return m, opt


def _checkpoint(tmp: str) -> None:
    """Saved at ep 2 x tp 2 (the files hold every expert), loaded at ep 1 and back at ep 2:
    parameters and AdamW moments equal the saving model's, gathered."""
    m, opt = _train("mixtral", 2, 2, steps=1)
    path = checkpoint.save(os.path.join(tmp, "ep"), m, opt, step=1, mesh=_mesh(2, 2))
    want = gather_hf_state_dict(m)
    for ep in (1, 2):
        other = parallelize(build_moe("mixtral", seed=7).train(), _mesh(2, ep), parallel_loss=True)
        o_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        checkpoint.load(path, other, o_opt, mesh=_mesh(2, ep))
        got = gather_hf_state_dict(other)
        for n, t in want.items():
            _close(got[n], t, f"load at ep={ep}: {n}", atol=0)
        pm = dict(m.named_parameters())
        for n, p in other.named_parameters():
            if n.endswith("experts.gate_up_proj") and ep == 2:
                _close(o_opt.state[p]["exp_avg"], opt.state[pm[n]]["exp_avg"], n, atol=0)


def _family_checkpoint(tmp: str) -> None:
    """Families behind transformers' experts interface: a checkpoint saved at tp 2 x ep 2
    after an AdamW step loads at tp 1 (dp 4), tp 4 and tp 2 x ep 2: the weights are the saved
    ones, and the eval logits equal transformers' model holding those weights."""
    for fam in ("gpt_oss", "llama4_text"):
        m, opt = _train(f"family:{fam}", 2, 2, steps=1)
        path = checkpoint.save(os.path.join(tmp, f"fam-{fam}"), m, opt, step=1, mesh=_mesh(2, 2))
        want = gather_hf_state_dict(m)
        ref = _build(f"family:{fam}", seed=7)
        ref.load_state_dict(want)
        ids = _batch(9, 1)
        for tp, ep in ((1, 1), (4, 1), (2, 2)):
            other = parallelize(_build(f"family:{fam}", seed=7), _mesh(tp, ep))
            checkpoint.load(path, other, mesh=_mesh(tp, ep))
            got = gather_hf_state_dict(other)
            for n, t in want.items():
                _close(got[n], t, f"{fam} at tp={tp} ep={ep}: {n}", atol=0)
            with torch.no_grad():
                logits, expect = other.eval()(ids).logits, ref.eval()(ids).logits
            _close(logits, expect, f"{fam} logits at tp={tp} ep={ep}")


def _zero1_resume(tmp: str) -> None:
    """ZeRO-1 at ep 2 x tp 2: a checkpoint after one step resumes to the uninterrupted run's
    weights after the second; at another ep its optimizer state is refused by name."""
    mesh = _mesh(2, 2)
    m, opt = _train("mixtral", 2, 2, steps=1, zero1=True)
    path = checkpoint.save(os.path.join(tmp, "z1"), m, opt, step=1, mesh=mesh)
    saved = gather_hf_state_dict(m)
    other = parallelize(build_moe("mixtral", seed=7).train(), mesh, parallel_loss=True)
    o_opt = Zero1(other, mesh=mesh, lr=1e-2)
    checkpoint.load(path, other, o_opt, mesh=mesh)
    ids = _batch(1, mesh.dp_size)[mesh.dp_rank * ROWS : (mesh.dp_rank + 1) * ROWS]
    for model, o in ((m, opt), (other, o_opt)):
        model(ids, labels=ids).loss.backward()
        reduce_gradients(model, o, mesh, MAX_NORM, zero1=True)
        o.step()
    want, got = gather_hf_state_dict(m), gather_hf_state_dict(other)
    for n, t in want.items():
        _close(got[n], t, f"zero1 resume {n}", atol=0)
    flat = parallelize(build_moe("mixtral").train(), _mesh(2, 1), parallel_loss=True)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"a ZeRO-1 state of an expert-parallel "
        r"run \(ep=2, tp=2, dp=2\) resumes with ZeRO-1 at the same tp, dp and ep",
    ):
        checkpoint.load(path, flat, Zero1(flat, mesh=_mesh(2, 1), lr=1e-2), mesh=_mesh(2, 1))
    checkpoint.load(path, flat, mesh=_mesh(2, 1))  # the weights alone: any layout
    for n, t in gather_hf_state_dict(flat).items():
        _close(t, saved[n], f"weights at ep 1: {n}", atol=0)


def _pretrained(tmp: str) -> None:
    """Under ep, from_pretrained reads only the rank's experts, from the fused tensors
    save_pretrained writes (gathered over ep) and from one tensor per expert as transformers
    writes them (Mixtral's w1/w3/w2 too): equal to parallelize of the full model."""
    import torch.distributed as dist

    from neuron_tp.hf import from_pretrained, save_pretrained
    from neuron_tp.hf.model_files import checkpoint_files

    for name, key, cfg in (
        ("mixtral", "block_sparse_moe.experts.7.w3", dict(num_local_experts=8)),
        ("qwen2_moe", "mlp.experts.7.up_proj", dict(num_experts=8)),
    ):
        ref = build_moe(name, **cfg)
        hf_dir, ours = os.path.join(tmp, f"hf-{name}"), os.path.join(tmp, f"ours-{name}")
        if dist.get_rank() == 0:
            copy.deepcopy(ref).save_pretrained(hf_dir)
        dist.barrier()
        assert f"model.layers.0.{key}.weight" in checkpoint_files(hf_dir)
        for tp, ep in ((1, 4), (2, 2)):
            mesh = _mesh(tp, ep)
            want = parallelize(copy.deepcopy(ref), mesh).state_dict()
            for path in (hf_dir, ours):
                if path == ours:
                    save_pretrained(parallelize(copy.deepcopy(ref), mesh), ours)
                got = from_pretrained(path, mesh=mesh).state_dict()
                for n, t in want.items():
                    assert torch.equal(got[n], t), f"{name} {path} tp={tp} ep={ep}: {n}"


def _bad() -> None:
    """Refusals name the degrees that work, before any collective."""
    with pytest.raises(
        UserError,
        match=r"ep=3 does not divide the data-parallel degree 4 .*"
        r"valid ep degrees: \[1, 2, 4\]",
    ):
        Mesh(4, 0, tp=1, ep=3)
    ref = build_moe("mixtral")  # 6 experts
    with pytest.raises(
        ValueError,
        match=r"6 experts cannot be spread over ep=4; ep degrees "
        r"that work with dp=4: \[1, 2\]",
    ):
        parallelize(copy.deepcopy(ref), _mesh(1, 4))
    m = parallelize(copy.deepcopy(ref), _mesh(2, 2))
    with pytest.raises(UserError, match=r"ZeRO-1 under expert parallelism \(ep=2\) needs the"):
        Zero1(list(m.parameters()), mesh=_mesh(2, 2))
    _train("qwen3_moe", 1, 2, steps=1)  # nobody communicated: the ranks are still in step


def _cli(tmp: str) -> None:
    """``neuron-tp train --ep 2`` (tp 2, dp 2) from a transformers-saved Mixtral directory:
    the same losses as ``--ep 1`` on the same data, and checkpoints that consolidate to the
    same weights; ``--ep`` with ZeRO-1 (``--bf16``) refused on every rank."""
    import torch.distributed as dist
    import transformers as tf

    from neuron_tp.checkpoint.merge import consolidate
    from neuron_tp.cli.args import train_parser
    from neuron_tp.train.loop import train

    model_dir = os.path.join(tmp, "mixtral")
    if dist.get_rank() == 0:
        build_moe("mixtral", vocab_size=257, max_position_embeddings=64).save_pretrained(model_dir)
    dist.barrier()

    def run(ep: int, *extra: str) -> list:
        out = os.path.join(tmp, f"run-ep{ep}{''.join(extra)}")
        args = train_parser().parse_args(
            ["--model", model_dir, "--tokenizer", "bytes", "--device", "cpu", "--tp", "2"]
            + ["--seq-len", "16", "--micro-batch", "2", "--steps", "3", "--lr", "1e-2"]
            + ["--warmup-steps", "1", "--log-every", "1", "--output-dir", out, "--ep", str(ep)]
            + list(extra)
        )
        log = train(args, _mesh(2, ep), printer=lambda *a, **k: None)["log"]
        return [r["loss"] for r in log if "loss" in r], out

    (got, out2), (want, out1) = run(2), run(1)
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)
    (bf_got, _), (bf_want, _) = run(2, "--bf16"), run(1, "--bf16")  # ZeRO-1's fp32 masters
    assert bf_got == pytest.approx(bf_want, rel=2e-2), (bf_got, bf_want)
    assert bf_got != pytest.approx(got, rel=1e-6), "--bf16 made no difference"
    failed = None
    if dist.get_rank() == 0:  # the other ranks wait at the barrier, whatever happens here
        try:
            a, b = (
                tf.AutoModelForCausalLM.from_pretrained(consolidate(o, o + "-cons")).state_dict()
                for o in (out2, out1)
            )
            for n, t in b.items():
                _close(a[n], t, f"consolidated {n}", atol=1e-4)
        except Exception as e:  # noqa: BLE001 - raised after the barrier
            failed = e
    dist.barrier()
    if failed is not None:
        raise failed


CASES = {
    "mixtral_aux_tp2_ep2": lambda tmp: _train(
        "mixtral", 2, 2, output_router_logits=True, router_aux_loss_coef=0.05
    ),
    "qwen2_moe_tp1_ep4": lambda tmp: _train("qwen2_moe", 1, 4, num_experts=8),
    "glm4_moe_ep2_of_dp4": lambda tmp: _train("glm4_moe", 1, 2),
    "qwen3_moe_tp2_ep2_sp": lambda tmp: _train("qwen3_moe", 2, 2, sp=True),
    "mixtral_capacity_ep4": lambda tmp: _train("mixtral", 1, 4, num_local_experts=8, cf=4.0),
    "checkpoint_across_ep": _checkpoint,
    "from_pretrained_reads_own_experts": _pretrained,
    "bad_degrees": lambda tmp: _bad(),
    "zero1_ep2_tp2": lambda tmp: _train("qwen2_moe", 2, 2, zero1=True),
    "zero1_ep2_of_dp4": lambda tmp: _train("glm4_moe", 1, 2, zero1=True),
    "zero1_resume_and_refusal": _zero1_resume,
    "cli_train_ep2_equals_ep1": _cli,
    # Families sharded behind transformers' experts interface (only the experts replaced):
    # softmax over the top-k logits with transposed, interleaved, biased experts (gpt-oss);
    # sigmoid scores and the dense [E*T, H] call (Llama-4); sigmoid with a correction bias
    # (MiniMax-M2); softmax or sigmoid selection (Cohere2-MoE, with SP); softmax top-k at one
    # expert per rank in capacity mode (Hunyuan).
    "gpt_oss_tp2_ep2": lambda tmp: _train("family:gpt_oss", 2, 2),
    "llama4_text_tp2_ep2": lambda tmp: _train("family:llama4_text", 2, 2),
    "minimax_m2_tp2_ep2": lambda tmp: _train("family:minimax_m2", 2, 2),
    "cohere2_moe_tp2_ep2_sp": lambda tmp: _train("family:cohere2_moe", 2, 2, sp=True),
    "hunyuan_capacity_ep4": lambda tmp: _train("family:hunyuan_v1_moe", 1, 4, cf=4.0),
    "zero1_gpt_oss_ep2_tp2": lambda tmp: _train("family:gpt_oss", 2, 2, zero1=True),
    "family_checkpoint_across_tp_and_ep": _family_checkpoint,
}


def _case(case: str, tmp: str) -> None:
    CASES[case](tmp)


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ep"))


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_model(case, shared_tmp):
    gloo_dist.run_case(_case, case, shared_tmp, cases=list(CASES), world_size=4, timeout=600)
