"""`accumulation_groups`: distributed batches grouped for gradient accumulation, with the group's count."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple


class AccumulationGroup(NamedTuple):
    """Consecutive distributed batches whose gradients make one optimizer update."""

    batches: list[Any]  # DistributedBatch, in order; the epoch's last group may hold fewer
    num_samples: int    # real samples in all of them together (padding not counted)


def accumulation_groups(batches: Iterable[Any], k: int) -> Iterator[AccumulationGroup]:
    """Groups of `k` consecutive distributed batches, each with its real sample count.

    For gradient accumulation in a custom loop: divide each batch's summed loss by the *group's*
    count (``ls.compute_average_loss(per_example, global_batch_size=group.num_samples)`` inside
    `strategy.run`), add the gradients of the group's batches, and apply them once. The update is
    then one device's step on all the group's samples — an epoch's short last group included,
    with its own count (``optax.MultiSteps`` and Keras average the batches' mean gradients
    instead, which over-weighs a short batch). `Trainer(gradient_accumulation_steps=k)` does this
    for `fit`.

    Args:
      batches: distributed batches (`strategy.experimental_distribute_dataset(...)`).
      k: batches per group, at least 1.

    Raises:
      ValueError: `k` is not a positive integer.

    >>> import numpy as np, lockstep as ls
    >>> strategy = ls.MirroredStrategy(2)
    >>> dist = strategy.experimental_distribute_dataset(ls.data.batches(np.arange(10.0), 3))
    >>> [(len(g.batches), g.num_samples) for g in ls.data.accumulation_groups(dist, 2)]
    [(2, 6), (2, 4)]
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"`k` must be a positive integer, got k={k!r}.")
    it = iter(batches)
    while group := list(itertools.islice(it, k)):
        yield AccumulationGroup(group, sum(b.step.num_real for b in group))
