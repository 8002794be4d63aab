"""The `tf.distribute` face over the engine: `ReduceOp`, the strategies (`_strategy`), their
``extended`` (`_extended`, the engine itself), per-replica and mirrored values (`_values`),
distributed datasets (`_datasets`) and scopes (`_scope`). Public names are re-exported from
`lockstep`.
"""
