"""What ``--pp`` accepts of MoE models (and of windowed attention), in-process, before any
collective: the MoE families whose decoder layers it cuts (Mixtral, Qwen2-MoE, Qwen3-MoE) pass
the layout rules (``job_refusals``), with or without their router load-balancing loss
(``output_router_logits``), and with ``--ep`` (the mesh's ep groups are dp ranks of one stage).
The numerics of a cut MoE model (with its router loss, with ep) are
tests/pipeline/test_pipeline_gloo.py's ``pp2_moe`` / ``_aux`` / ``_ep`` cases."""

from __future__ import annotations

import pytest

from moe_archs import MOE_ARCHS, build_moe
from neuron_tp.cli.args import train_parser
from neuron_tp.errors import UserError
from neuron_tp.job.config import TrainConfig
from neuron_tp.job.layout_rules import job_refusals
from neuron_tp.parallel.mesh import Mesh
from neuron_tp.pipeline.stages import plan_stages, split_model


def check_options(config: TrainConfig, model) -> None:
    """What train refuses of this layout for ``model`` (UserError), at its smallest world."""
    why = job_refusals(config, model_config=model)
    if why:
        raise UserError("; ".join(why))


def _config(*argv: str) -> TrainConfig:
    base = ["--model", "tiny-llama", "--pp", "2", "--grad-accum", "4"]
    return TrainConfig.from_args(train_parser().parse_args([*base, *argv]))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_families_are_cut_at_pp(family):
    check_options(_config(), MOE_ARCHS[family]())
    check_options(_config(), MOE_ARCHS[family](output_router_logits=True))


def test_ep_at_pp_is_accepted_inside_a_stage():
    check_options(_config("--ep", "2"), MOE_ARCHS["mixtral"]())
    mesh = Mesh.virtual(8, 0, 1, pp=2, ep=2)  # pp 2 x dp 4: ep groups of one stage's dp ranks
    for group in mesh.group("ep").all_groups:
        assert len({r // 4 for r in group}) == 1, group


def test_other_moe_families_are_refused_at_pp():
    with pytest.raises(UserError, match="OlmoeForCausalLM is not one of them"):
        split_model(build_moe("olmoe"), Mesh.virtual(1, 0, 1), plan_stages(2, 1))


def test_a_sliding_window_shorter_than_the_sequence_is_refused_at_pp():
    """Stages build a plain causal mask: a window shorter than --seq-len would be ignored."""
    from transformers import MistralConfig

    windowed = MistralConfig(num_hidden_layers=2, sliding_window=16)
    with pytest.raises(UserError, match="sliding window of 16 tokens, shorter than --seq-len 32"):
        check_options(_config("--seq-len", "32"), windowed)
    check_options(_config("--seq-len", "16"), windowed)  # the window covers it
    check_options(_config("--seq-len", "32"), MistralConfig(num_hidden_layers=2))
