"""A shard's state as a checkpoint sees it: the snapshot it takes at one version, the part of a
stored checkpoint it reads itself, and the part it writes (from its own node, or relayed to the
chief where that node cannot reach the store)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import ray


@dataclass
class ShardSnapshot:
    """A shard's whole state at one version: values and optimizer slots of its pieces."""

    shard_id: int
    version: int
    names: list[str]
    values: list[np.ndarray]
    slots: dict[str, list[np.ndarray]]  # slot name -> one array per piece


@dataclass
class PartSource:
    """A shard's pieces to read itself: one part of a stored checkpoint (checkpoint/stores.py)."""

    checkpoint: Any  # StoredCheckpoint: its meta and a reader, picklable
    part: str
    with_slots: bool  # False when the optimizer changed: its slots start afresh
    own_copy_ok: bool = False  # a rollback: a shard that wrote this part may use its own copy of it


@dataclass(frozen=True)
class OwnCopy:
    """A shard's pieces at a version of which it kept a copy itself (a memory checkpoint's part)."""

    version: int


@dataclass(frozen=True)
class LiveState:
    """A shard's pieces as it holds them now: a new driver takes the live shards of a run whose
    driver was lost over (runtime/run_keeper.py)."""


@dataclass
class PartReport:
    """What a shard tells the chief of the checkpoint part it was asked for."""

    version: int  # the version it holds; not the checkpoint's step: nothing was written
    written: bool = False
    finite: bool = True  # False: the state holds NaN/inf, nothing was written
    slot_names: list[str] | None = None  # the order of the slots in the part
    relayed: Any = None  # ObjectRef of {relative path: bytes} where this node could not write the part
    relay_reason: str = ""


def write_shard_part(kept: ShardSnapshot, slot_names: list[str], writer: Any, part: str) -> PartReport:
    """Write `kept` as checkpoint part `part` through `writer`; where this node cannot, the files go
    back in the report for the chief to write."""
    import tempfile
    from pathlib import Path

    from towerflow.checkpoint.files import write_part

    report = PartReport(kept.version, written=True, slot_names=slot_names)
    with tempfile.TemporaryDirectory(prefix="towerflow-part-") as scratch:
        write_part(scratch, kept.values, [kept.slots[name] for name in slot_names])
        if writer.reachable():
            try:
                writer.write_part(part, scratch)
                return report
            except Exception as exc:  # no credentials or no route from this node: the chief writes it
                report.relay_reason = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        else:
            report.relay_reason = "the checkpoint store is on another machine's disk"
        files = {str(p.relative_to(scratch)): p.read_bytes() for p in Path(scratch).rglob("*") if p.is_file()}
    report.relayed = ray.put(files)
    return report
