"""Everything that touches `jax.distributed`: `MultiWorkerMirroredStrategy` and its cluster
resolvers (environment, TF_CONFIG, SLURM) and watchdog (`_multi_worker`), what the workers agree
on (`_agreement`), who is present (`_roll_call`) and the coordination service's entries
(`_coordination`). Public names are re-exported from `lockstep`.
"""
