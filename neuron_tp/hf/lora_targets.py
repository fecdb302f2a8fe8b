"""Which modules may carry LoRA under tensor parallelism: a column projection with a split
output (not the LM head) or a row one, as the model's plan says; LoRA on parameters (peft's
``target_parameters``, e.g. an MoE layer's fused 3-D experts) is refused. Errors name the
``target_modules`` the model supports (:func:`valid_targets`)."""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from .resolve import plan_model
from .styles import Style


def _lora_ok(name: str, style: Style | None, mp) -> bool:
    """Whether a module planned ``style`` can carry LoRA under tp: a column projection with a
    split output (not the LM head) or a row one."""
    from .resolve import column_role

    return style in (Style.ROW, Style.ROW_SPLIT_INPUT) or (
        style is not None
        and style.is_column
        and column_role(name, style, mp) in ("attention", "plain")
    )


def valid_targets(inner: nn.Module, plan: dict[str, str] | None) -> list[str]:
    """The ``target_modules`` names LoRA supports on ``inner`` under tp (e.g. the attention
    projections; an MoE block's experts and shared expert are sharded by the block, not here)."""
    mp = plan_model(inner, plan)
    return sorted({n.rpartition(".")[2] for n, s in mp.targets.items() if _lora_ok(n, s, mp)})


def check_targets(inner: nn.Module, names, plan: dict[str, str] | None) -> None:
    """Every LoRA target must be a column projection with a split output or a row one."""
    mp = plan_model(inner, plan)
    for name in names:
        style = mp.targets.get(name)
        if not _lora_ok(name, style, mp):
            what = "not sharded by the plan" if style is None else f"planned {style.value!r}"
            raise ValueError(
                f"{name}: LoRA target {what}; tensor parallelism supports LoRA on projections "
                "planned 'colwise' (split output, not the LM head) or 'rowwise' (of this "
                f"model: target_modules {valid_targets(inner, plan)}); remove it from "
                "target_modules"
            )


def refuse_target_parameters(model: nn.Module, plan: dict[str, str] | None) -> None:
    """ValueError for LoRA on parameters (peft's ``target_parameters``, e.g. an MoE layer's
    fused 3-D ``experts.gate_up_proj``): the experts are sharded by the MoE block."""
    peft_model = cast(Any, model)  # a peft PeftModel, read by its attribute names
    cfg = next(iter(peft_model.peft_config.values()))
    params = getattr(cfg, "target_parameters", None)
    if params:
        raise ValueError(
            f"LoraConfig target_parameters {list(params)}: LoRA on fused expert (3-D) or other "
            "parameters is not supported under tensor parallelism; LoRA targets this model "
            f"supports: target_modules {valid_targets(peft_model.base_model.model, plan)}"
        )
