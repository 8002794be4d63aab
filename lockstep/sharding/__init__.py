"""Sharding: the devices as a grid of named axes (`DeviceMesh`), the rules that lay a model's
variables over it (`LayoutMap`), the plan made from both and a ZeRO stage (`ShardingPlan`: each
variable's splits, padding and bytes per device; `ShardingConfig`: a sharded strategy's settings),
and the layout of a trainer's state made from it (`state_layout`: `Replicated`, every variable
whole, or `Sharded` by a plan; where each array lies, how each gradient is reduced, padding, the
bytes each device holds). It knows no strategy and no model: `lockstep.distribute`'s
`ShardedStrategy` holds a `ShardingConfig`, `lockstep.training` makes its one training program from
a step and a state layout. Public names are re-exported from `lockstep`.
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
from ._state_layout import Replicated as Replicated
from ._state_layout import Slots as Slots
from ._state_layout import state_layout as state_layout

__all__ = [
    "as_layout_map",
    "as_mesh",
    "DeviceMesh",
    "fit_to",
    "LayoutMap",
    "Replicated",
    "shard_bytes",
    "SHARD_DIMS",
    "ShardingConfig",
    "ShardingPlan",
    "Slots",
    "state_layout",
    "VariableLayout",
]
