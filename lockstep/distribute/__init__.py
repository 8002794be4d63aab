"""The `tf.distribute` face over the engine: `ReduceOp`, the strategies (`_strategy`), their
``extended`` (`_extended`, the engine itself), per-replica and mirrored values (`_values`),
distributed datasets (`_datasets`) and scopes (`_scope`). Public names are re-exported from
`lockstep`.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

#: what other packages use of this one, by the module that defines it (imported when first asked
#: for: `import lockstep` stays free of JAX)
_EXPORTS = {
    "Mirrored": "_values",
    "PerReplica": "_values",
    "Strategy": "_strategy",
    "checked_communication_options": "_cross_device_ops",
    "engine_of": "_values",
    "active": "_scope",
    "get_strategy": "_strategy",
    "recent": "_scope",
    "remember_scope": "_scope",
    "strategy_of_model": "_scope",
    "unwrap": "_values",
}

if TYPE_CHECKING:
    from ._values import Mirrored as Mirrored
    from ._values import PerReplica as PerReplica
    from ._strategy import Strategy as Strategy
    from ._cross_device_ops import checked_communication_options as checked_communication_options
    from ._values import engine_of as engine_of
    from ._strategy import get_strategy as get_strategy
    from ._scope import active as active
    from ._scope import recent as recent
    from ._scope import remember_scope as remember_scope
    from ._scope import strategy_of_model as strategy_of_model
    from ._values import unwrap as unwrap


__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
