"""What ``--pp`` accepts of MoE models (and of windowed attention), in-process, before any
collective: the MoE families
whose decoder layers it cuts (Mixtral, Qwen2-MoE, Qwen3-MoE) pass ``check_options``, with or
without their router load-balancing loss (``output_router_logits``); ``--ep`` at ``--pp`` is
refused with what would work. The numerics of a cut MoE model (and of its router loss) are
tests/pipeline/test_pipeline_gloo.py's ``pp2_moe`` and ``_aux`` cases."""

from __future__ import annotations

import pytest

from moe_archs import MOE_ARCHS, build_moe
from neuron_tp.cli.args import train_parser
from neuron_tp.errors import UserError
from neuron_tp.job.config import TrainConfig
from neuron_tp.parallel.mesh import Mesh
from neuron_tp.pipeline.stages import plan_stages, split_model
from neuron_tp.train import pipelined


def _config(*argv: str) -> TrainConfig:
    base = ["--model", "tiny-llama", "--pp", "2", "--grad-accum", "4"]
    return TrainConfig.from_args(train_parser().parse_args([*base, *argv]))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_families_are_cut_at_pp(family):
    pipelined.check_options(_config(), MOE_ARCHS[family]())
    pipelined.check_options(_config(), MOE_ARCHS[family](output_router_logits=True))


def test_ep_at_pp_is_refused_naming_what_works():
    with pytest.raises(UserError, match=r"--pp 2 does not run with --ep yet; use --ep 1"):
        pipelined.check_options(_config("--ep", "2"), MOE_ARCHS["mixtral"]())


def test_other_moe_families_are_refused_at_pp():
    with pytest.raises(UserError, match="OlmoeForCausalLM is not one of them"):
        split_model(build_moe("olmoe"), Mesh.virtual(1, 0, 1), plan_stages(2, 1))


def test_a_sliding_window_shorter_than_the_sequence_is_refused_at_pp():
    """Stages build a plain causal mask: a window shorter than --seq-len would be ignored."""
    from transformers import MistralConfig

    windowed = MistralConfig(num_hidden_layers=2, sliding_window=16)
    with pytest.raises(UserError, match="sliding window of 16 tokens, shorter than --seq-len 32"):
        pipelined.check_options(_config("--seq-len", "32"), windowed)
    pipelined.check_options(_config("--seq-len", "16"), windowed)  # the window covers it
    pipelined.check_options(_config("--seq-len", "32"), MistralConfig(num_hidden_layers=2))
