"""Sharding: cut large variables into row slices, then a strategy places the pieces on shards.

Cutting follows TensorFlow's min_max_variable_partitioner: a variable is split along its first
axis into as many slices as there are shards, as long as each slice keeps at least
`min_slice_bytes`. A big dense kernel then spreads over every shard, so its optimizer update and
its publication run in parallel instead of on one shard while the others idle.
"""

from __future__ import annotations

from typing import Protocol

from towerflow.shared_types import Piece, VariableInfo


def cut_variables(variables: list[VariableInfo], num_shards: int, min_slice_bytes: int | None) -> list[Piece]:
    """Pieces of every variable, in model order; a variable is cut only when it is worth it."""
    pieces: list[Piece] = []
    for var in variables:
        rows = var.shape[0] if var.shape else 1
        parts = 1
        if min_slice_bytes and var.shape and rows > 1:
            parts = max(1, min(num_shards, rows, var.nbytes // min_slice_bytes))
        bounds = [round(i * rows / parts) for i in range(parts + 1)]
        row_bytes = var.nbytes // rows
        for part, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            name = var.name if parts == 1 else f"{var.name}/part_{part}"
            shape = (stop - start, *var.shape[1:]) if var.shape else ()
            pieces.append(Piece(len(pieces), var.index, start, stop, shape, (stop - start) * row_bytes, name))
    return pieces


def gradient_buckets(variables: list[VariableInfo], bucket_bytes: int | None) -> list[list[int]]:
    """Variable indices grouped into push buckets, in the order backprop produces their gradients.

    Backprop reaches the layers nearest the loss first, so walking the model's variables from the
    last to the first approximates the order gradients become ready (PyTorch DDP buckets the same
    way). A bucket closes once it holds `bucket_bytes`; the rest of the model forms the last one.
    With no size, everything is one bucket, pushed after the whole backward pass.
    """
    if not bucket_bytes:
        return [[v.index for v in variables]]
    buckets: list[list[int]] = [[]]
    size = 0
    for var in reversed(variables):
        if size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(var.index)
        size += var.nbytes
    return buckets


class ShardingStrategy(Protocol):
    def assign(self, variables: list[Piece], num_shards: int) -> list[list[int]]:
        """Return, per shard, the indices of the pieces it owns (each piece exactly once)."""
        ...


class RoundRobin:
    """Variable i goes to shard i mod S, as TensorFlow's replica_device_setter placed them."""

    def assign(self, variables: list[Piece], num_shards: int) -> list[list[int]]:
        shards: list[list[int]] = [[] for _ in range(num_shards)]
        for position, var in enumerate(variables):
            shards[position % num_shards].append(var.index)
        return shards


class GreedyBytes:
    """Largest variable first, each to the shard holding the fewest bytes so far (balances PS load)."""

    def assign(self, variables: list[Piece], num_shards: int) -> list[list[int]]:
        shards: list[list[int]] = [[] for _ in range(num_shards)]
        load = [0] * num_shards
        for var in sorted(variables, key=lambda v: (-v.nbytes, v.index)):
            target = min(range(num_shards), key=lambda s: (load[s], s))
            shards[target].append(var.index)
            load[target] += var.nbytes
        return [sorted(indices) for indices in shards]


STRATEGIES: dict[str, type] = {"round_robin": RoundRobin, "greedy_bytes": GreedyBytes}


def make_sharding(name: str) -> ShardingStrategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown sharding {name!r}; choose one of {', '.join(STRATEGIES)}") from None


def shard_variables(strategy: ShardingStrategy, pieces: list, num_shards: int) -> list[list[int]]:
    """Apply a strategy and check its answer: every piece placed once, no shard left empty."""
    if num_shards > len(pieces):
        raise ValueError(
            f"cluster.ps is {num_shards} but the model has only {len(pieces)} trainable variables (or slices "
            f"of them); use at most {len(pieces)} parameter servers"
        )
    shards = strategy.assign(pieces, num_shards)
    placed = sorted(i for shard in shards for i in shard)
    if placed != sorted(v.index for v in pieces):
        raise AssertionError(f"{type(strategy).__name__} did not place every piece exactly once")
    if any(not shard for shard in shards):
        raise AssertionError(f"{type(strategy).__name__} left a shard empty")
    return shards
