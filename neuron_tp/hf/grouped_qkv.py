"""CodeGen's fused qkv projection: its output is ``groups`` (its ``mp_num``, 4) blocks, each
``[q | v | k]`` of ``heads / groups`` consecutive heads, and the forward reshapes whatever it
gets into ``groups`` blocks again. A rank holding query heads ``[r * q/tp, (r+1) * q/tp)``
therefore holds the rows of those heads laid out as the same ``groups`` blocks of
``[q | v | k]``, so its forward reads them as its own heads in order (which needs
``q / tp`` divisible by ``groups``)."""

from __future__ import annotations

from ..errors import UserError
from ..parallel.mesh import valid_tp_degrees
from .attention import Heads

GROUPS = 4  # CodeGen's mp_num
PARTS = 3  # q, v, k


def grouped_qkv_rows(heads: Heads, tp: int, world_size: int, name: str) -> list[list[int]]:
    """For each tp rank, the rows of the fused projection it holds (UserError when its query
    heads do not fill the blocks evenly)."""
    local = heads.q // tp
    if heads.q % GROUPS or local % GROUPS:
        ok = [t for t in valid_tp_degrees(world_size, heads.q) if (heads.q // t) % GROUPS == 0]
        raise UserError(
            f"{name}: a fused qkv of {GROUPS} blocks of [q | v | k] needs the query heads per "
            f"rank ({heads.q}/{tp}) to be a multiple of {GROUPS}; tp degrees that work with "
            f"world size {world_size}: {ok}"
        )
    per_block, d = heads.q // GROUPS, heads.dim
    block_rows = PARTS * per_block * d
    out = []
    for r in range(tp):
        rows: list[int] = []
        for g in range(GROUPS):
            mine = [r * local + g * (local // GROUPS) + j for j in range(local // GROUPS)]
            for part in range(PARTS):
                for h in mine:
                    block, i = divmod(h, per_block)
                    start = block * block_rows + part * per_block * d + i * d
                    rows += range(start, start + d)
        out.append(rows)
    return out
