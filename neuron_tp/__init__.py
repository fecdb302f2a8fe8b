"""neuron_tp: tensor parallelism for AWS Trainium and Inferentia on torch-xla collectives.

Public API::

    import neuron_tp as ntp
    mesh = ntp.init_mesh(tp=2)                 # world = dp x tp, becomes the default mesh
    vmesh = ntp.Mesh.virtual(world_size=32, rank=5, tp=8)   # trace-only
    from neuron_tp.layers import ColumnParallelLinear, RowParallelLinear, ...
    model = ntp.parallelize(hf_model)          # shard a transformers model in place
    mesh2d = ntp.init_mesh(tp=16, tp_mode="2d")   # 2D/3D layers: neuron_tp.layers.Linear2D, ...
    job = ntp.plan.Job(ntp.plan.get_instance("trn1.32xlarge"), nodes=4, seq_len=4096,
                       global_batch=1024)
    ntp.plan.make_plan(hf_config, job).recommended   # will it fit, which layout is fastest
    stage = ntp.pipeline.stages_of_blocks(blocks, mesh, plan, embedding=emb, head=head)
"""

from . import blocks, checkpoint, layers, moe, pipeline, plan
from .backend.xla import cpu_devices_env as xla_cpu_devices_env
from .backend.xla import device as xla_device
from .blocks import block_nd as blocks_nd
from .hf import from_pretrained, parallelize, save_pretrained
from .hf.attention import use_blockwise_attention
from .hf.context_parallel import context_parallel
from .hf.int8_model import quantize
from .hf.recompute import Recompute, apply_activation_checkpointing
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_cross_entropy,
)
from .moe import set_moe_mode
from .optim.grads import (
    allreduce_data_parallel_grads,
    clip_grad_norm_,
    global_grad_norm,
    sync_sequence_parallel_grads,
)
from .optim.zero1 import Zero1, gather_full_state
from .parallel import comm, regions
from .parallel.mesh import Group, Mesh, get_mesh, init_mesh, set_default_mesh
from .parallel.sharding import (
    gather_full,
    gather_params,
    get_param_meta,
    get_sharding,
    mark_sequence_parallel,
    move_to,
)

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "Group",
    "init_mesh",
    "get_mesh",
    "set_default_mesh",
    "set_moe_mode",
    "xla_device",
    "xla_cpu_devices_env",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "parallel_cross_entropy",
    "allreduce_data_parallel_grads",
    "sync_sequence_parallel_grads",
    "clip_grad_norm_",
    "global_grad_norm",
    "Zero1",
    "gather_full_state",
    "gather_full",
    "gather_params",
    "get_sharding",
    "get_param_meta",
    "move_to",
    "mark_sequence_parallel",
    "parallelize",
    "quantize",
    "from_pretrained",
    "save_pretrained",
    "Recompute",
    "apply_activation_checkpointing",
    "use_blockwise_attention",
    "context_parallel",
    "blocks",
    "blocks_nd",
    "checkpoint",
    "comm",
    "layers",
    "moe",
    "pipeline",
    "plan",
    "regions",
]
