"""Everything that touches `jax.distributed`: `MultiWorkerMirroredStrategy` and its cluster
watchdog (`_multi_worker`), the cluster resolvers (environment, TF_CONFIG, SLURM: `_resolvers`), what the workers agree
on (`_agreement`), who is present (`_roll_call`) and the coordination service's entries
(`_coordination`). Public names are re-exported from `lockstep`.
"""
