"""Everything that touches `jax.distributed`: the strategies whose workers join a job,
`MultiWorkerMirroredStrategy` and its cluster watchdog (`_multi_worker`) and `ShardedStrategy`
(`_sharded`: a model laid out over a mesh that may span workers), the cluster resolvers (environment, TF_CONFIG, SLURM: `_resolvers`), what the workers agree
on (`_agreement`), who is present (`_roll_call`) and the coordination service's entries
(`_coordination`). Public names are re-exported from `lockstep`.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

#: what other packages use of this one, by the module that defines it (imported when first asked
#: for: `import lockstep` stays free of JAX)
_EXPORTS = {
    "agree_on": "_multi_worker",
    "any_worker": "_multi_worker",
    "backups_take_sigterm": "_signals",
}

if TYPE_CHECKING:
    from ._multi_worker import agree_on as agree_on
    from ._multi_worker import any_worker as any_worker
    from ._signals import backups_take_sigterm as backups_take_sigterm


__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
