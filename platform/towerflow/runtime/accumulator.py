"""A bucket's gradient accumulator: the running sum of the gradients its next update will average.

As TensorFlow's ConditionalAccumulator under SyncReplicasOptimizer, gradients are added as they
arrive instead of being held and averaged at the end: the early arrivals are summed while the shard
still waits for the last one (less work left on the sync barrier), and the shard keeps one sum per
piece instead of one copy per replica.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class GradientAccumulator:
    def __init__(self, tf: Any, like: list[Any]) -> None:
        """`like`: the bucket's variables, whose shapes and dtypes the sums take."""
        self._tf = tf
        self._like = like
        self._sums: list[Any] | None = None  # made on first use: async shards and lone replicas never sum
        self.count = 0
        # The first gradient replaces the sum (no zeroing pass); later ones add into it in place.
        self._start = tf.function(lambda grads: [s.assign(g) for s, g in zip(self._sums, grads, strict=True)])
        self._add = tf.function(
            lambda grads: [s.assign_add(g) for s, g in zip(self._sums, grads, strict=True)]
        )

    def add(self, gradients: list[np.ndarray]) -> None:
        if self._sums is None:
            tf = self._tf
            self._sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in self._like]
        (self._add if self.count else self._start)(list(gradients))
        self.count += 1

    def take(self) -> tuple[list[Any], int]:
        """The sums and how many gradients they hold; the accumulator starts over."""
        count, self.count = self.count, 0
        return self._sums, count
