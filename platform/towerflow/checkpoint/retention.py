"""Which checkpoints to delete: tf.train.Saver's rule (max_to_keep, keep_checkpoint_every_n_hours)."""

from __future__ import annotations

from collections.abc import Collection


def checkpoints_to_delete(
    checkpoints: list[tuple[int, float]],
    max_to_keep: int,
    keep_every_n_hours: float | None,
    started_at: float,
    kept_for_good: Collection[int] = (),
) -> list[int]:
    """`checkpoints` are (step, written_at seconds). The newest `max_to_keep` stay. An older one is
    kept for good when `keep_every_n_hours` have passed since the last one kept for good (or since
    `started_at`), as tf.train.Saver does; the rest are deleted. `kept_for_good`: steps an earlier
    driver of the run kept so (a resumed run's), which stay, as a new Saver leaves those of the one
    before: judged again from this driver's start, they would all go."""
    ordered = sorted(c for c in checkpoints if c[0] not in kept_for_good)
    older = ordered[:-max_to_keep] if len(ordered) > max_to_keep else []
    doomed: list[int] = []
    last_preserved = started_at
    for step, written_at in older:
        if keep_every_n_hours is not None and written_at - last_preserved >= keep_every_n_hours * 3600:
            last_preserved = written_at
        else:
            doomed.append(step)
    return doomed
