"""Column- and row-parallel linear layers (1D, Megatron-style), with optional sequence parallelism.

The communication is :mod:`neuron_tp.parallel.regions`' pairs, named for what they do (Megatron's
``copy_to_tensor_model_parallel_region`` is ``identity_fwd_all_reduce_bwd``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import gathered_linears, regions
from ..parallel.mesh import Mesh, get_mesh
from ..parallel.sharding import mark_sequence_parallel
from .activation_layout import REPLICATED, SHARDED_FEATURES, SHARDED_SEQUENCE
from .common import FromLinear, check_input, make_linear_parameters, require_divisible


class ColumnParallelLinear(FromLinear, nn.Module):
    """``Y = X A^T + b`` with ``A`` split by output rows over tp.

    Input: replicated ``[..., in]`` (or sequence-sharded when ``sequence_parallel``).
    Output: ``[..., out/tp]`` sharded on the last dim, or the full ``[..., out]`` when
    ``gather_output`` (``input_layout`` / ``output_layout`` say which). ``segments`` packs
    several projections in one (fused QKV: sizes ``(q, k, v)``; gate_up: ``(ffn, ffn)``): each
    piece is split over tp separately, so a rank holds its heads of q, k and v, not a block of
    rows. ``pad_output`` allows an ``out_features`` that tp does not divide (a vocabulary): the
    weight is zero-padded to a multiple of tp and a gathered output is trimmed back to
    ``out_features``.

    With ``sequence_parallel`` the all-gathered input is not saved for backward: the layer
    saves its sequence shard and all-gathers it again in backward for the weight gradient
    (:func:`neuron_tp.parallel.gathered_linears.gathered_linear`; Megatron's choice,
    activation memory / tp).
    ``sequence_parallel_regather=False`` keeps the gathered input instead (tp times the
    memory of that activation, one all-gather fewer in backward).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        skip_bias_add: bool = False,
        pad_output: bool = False,
        segments: tuple[int, ...] | None = None,
        mesh: Mesh | None = None,
        device=None,
        dtype=None,
        init_method=None,
        sequence_parallel_regather: bool = True,
    ):
        super().__init__()
        self.mesh = get_mesh(mesh)
        tp = self.mesh.tp
        if segments is not None:
            if sum(segments) != out_features or pad_output:
                raise ValueError(
                    f"segments {segments} must sum to out_features={out_features} "
                    "and cannot be combined with pad_output"
                )
            for size in segments:
                require_divisible(size, tp, "ColumnParallelLinear segment", self.mesh.world_size)
        elif not pad_output:
            require_divisible(
                out_features, tp, "ColumnParallelLinear out_features", self.mesh.world_size
            )
        if gather_output and segments is not None:
            raise ValueError("gather_output is not supported for a packed (segments) projection")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.sequence_dim, self.skip_bias_add = sequence_dim, skip_bias_add
        self.sequence_parallel_regather = sequence_parallel_regather
        self.weight, self.bias = make_linear_parameters(
            self,
            in_features,
            out_features,
            bias,
            weight_splits=(("tp", 0),),
            bias_splits=(("tp", 0),),
            mesh=self.mesh,
            init_method=init_method,
            device=device,
            dtype=dtype,
            segments=segments,
        )

    @property
    def input_layout(self) -> str:
        return SHARDED_SEQUENCE if self.sequence_parallel else REPLICATED

    @property
    def output_layout(self) -> str:
        return REPLICATED if self.gather_output else SHARDED_FEATURES

    def forward(self, x: torch.Tensor):
        check_input(x, self.weight, self.in_features, -1, self._label(), self.mesh)
        weight, bias = self._local_weight_and_bias(x.device)
        y = self._linear(x, weight, None if self.skip_bias_add else bias)
        if self.gather_output:
            y = regions.all_gather_fwd_split_bwd(y, self.mesh.tp, -1)
            if y.shape[-1] != self.out_features:
                y = y[..., : self.out_features]
        return (y, self.bias) if self.skip_bias_add else y

    # The steps of forward a subclass may change (neuron_tp.hf.modules.HFColumnLinear).
    def _label(self) -> str:
        """The layer's name in error messages."""
        return type(self).__name__

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The input region and the matmul; fused (saving the sequence shard) under sequence
        parallelism with ``sequence_parallel_regather``."""
        if self.sequence_parallel and self.sequence_parallel_regather:
            tp, dim = self.mesh.tp, self.sequence_dim
            return gathered_linears.gathered_linear(x, weight, tp, dim, bias)
        return F.linear(self._input_region(x), weight, bias)

    def _input_region(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated input: copy (backward all-reduce); sequence-sharded: all-gather the
        sequence (backward reduce-scatter)."""
        if self.sequence_parallel:
            return regions.all_gather_fwd_reduce_scatter_bwd(x, self.mesh.tp, self.sequence_dim)
        return regions.identity_fwd_all_reduce_bwd(x, self.mesh.tp)

    def _local_weight_and_bias(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the matmul uses."""
        return self.weight, self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.mesh.tp_size}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
            + ("" if self.sequence_parallel_regather else ", sequence_parallel_regather=False")
        )


class RowParallelLinear(FromLinear, nn.Module):
    """``Y = X A^T + b`` with ``A`` split by input columns over tp; partial sums are reduced.

    Input: ``[..., in/tp]`` sharded on the last dim (``input_is_parallel``) or the full
    ``[..., in]``, which is then split. Output: replicated ``[..., out]``, or sequence-sharded
    (reduce-scatter along ``sequence_dim``) when ``sequence_parallel`` (``input_layout`` /
    ``output_layout`` say which). The bias is added after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        skip_bias_add: bool = False,
        mesh: Mesh | None = None,
        device=None,
        dtype=None,
        init_method=None,
    ):
        super().__init__()
        self.mesh = get_mesh(mesh)
        require_divisible(
            in_features, self.mesh.tp, "RowParallelLinear in_features", self.mesh.world_size
        )
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.sequence_dim, self.skip_bias_add = sequence_dim, skip_bias_add
        self.weight, self.bias = make_linear_parameters(
            self,
            in_features,
            out_features,
            bias,
            weight_splits=(("tp", 1),),
            bias_splits=(),
            mesh=self.mesh,
            init_method=init_method,
            device=device,
            dtype=dtype,
        )
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self, "bias")

    @property
    def input_layout(self) -> str:
        return SHARDED_FEATURES if self.input_is_parallel else REPLICATED

    @property
    def output_layout(self) -> str:
        return SHARDED_SEQUENCE if self.sequence_parallel else REPLICATED

    def forward(self, x: torch.Tensor, partial_addend=None):
        """``partial_addend(x_local)``, if given, is added to this rank's partial product before
        the reduction (a LoRA branch on the local input: one reduction for both)."""
        tp = self.mesh.tp
        local_in = self.in_features // tp.size if self.input_is_parallel else self.in_features
        check_input(x, self.weight, local_in, -1, type(self).__name__, self.mesh)
        if self.sequence_parallel and x.shape[self.sequence_dim] % tp.size:
            raise ValueError(
                f"RowParallelLinear: sequence length {x.shape[self.sequence_dim]} (dim "
                f"{self.sequence_dim}) is not divisible by tp={tp.size} under sequence "
                f"parallelism; pad the sequence to a multiple of {tp.size}"
            )
        if not self.input_is_parallel:
            x = regions.split_fwd_all_gather_bwd(x, tp, -1)
        y = F.linear(x, self.weight)
        if partial_addend is not None:
            y = y + partial_addend(x)
        if self.sequence_parallel:
            y = regions.reduce_scatter_fwd_all_gather_bwd(y, tp, self.sequence_dim)
        else:
            y = regions.all_reduce_fwd_identity_bwd(y, tp)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp={self.mesh.tp_size}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
