"""Sharding: the devices as a grid of named axes (`DeviceMesh`), the rules that lay a model's
variables over it (`LayoutMap`), and the plan made from both and a ZeRO stage (`ShardingPlan`:
each variable's splits, padding and bytes per device; `ShardingConfig`: a sharded strategy's
settings). It knows no strategy and no model: `lockstep.distribute`'s `ShardedStrategy` holds a
`ShardingConfig`, `lockstep.training` lays the state out by its plan. Public names are re-exported
from `lockstep`.
"""

from ._mesh import as_layout_map as as_layout_map
from ._mesh import as_mesh as as_mesh
from ._mesh import DeviceMesh as DeviceMesh
from ._mesh import LayoutMap as LayoutMap
from ._plan import fit_to as fit_to
from ._plan import shard_bytes as shard_bytes
from ._plan import SHARD_DIMS as SHARD_DIMS
from ._plan import ShardingConfig as ShardingConfig
from ._plan import ShardingPlan as ShardingPlan
from ._plan import VariableLayout as VariableLayout

__all__ = [
    "as_layout_map",
    "as_mesh",
    "DeviceMesh",
    "fit_to",
    "LayoutMap",
    "shard_bytes",
    "SHARD_DIMS",
    "ShardingConfig",
    "ShardingPlan",
    "VariableLayout",
]
