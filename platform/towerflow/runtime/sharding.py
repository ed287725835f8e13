"""Sharding strategies: which parameter-server shard owns which trainable variable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class VariableInfo:
    """A trainable variable as the driver sees it: position in the model, name, shape, size."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


class ShardingStrategy(Protocol):
    def assign(self, variables: list[VariableInfo], num_shards: int) -> list[list[int]]:
        """Return, per shard, the indices of the variables it owns (each variable exactly once)."""
        ...


class RoundRobin:
    """Variable i goes to shard i mod S, as TensorFlow's replica_device_setter placed them."""

    def assign(self, variables: list[VariableInfo], num_shards: int) -> list[list[int]]:
        shards: list[list[int]] = [[] for _ in range(num_shards)]
        for position, var in enumerate(variables):
            shards[position % num_shards].append(var.index)
        return shards


class GreedyBytes:
    """Largest variable first, each to the shard holding the fewest bytes so far (balances PS load)."""

    def assign(self, variables: list[VariableInfo], num_shards: int) -> list[list[int]]:
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


def shard_variables(strategy: ShardingStrategy, variables: list[VariableInfo], num_shards: int) -> list[list[int]]:
    """Apply a strategy and check its answer: every variable placed once, no shard left empty."""
    if num_shards > len(variables):
        raise ValueError(
            f"cluster.ps is {num_shards} but the model has only {len(variables)} trainable variables; "
            f"use at most {len(variables)} parameter servers"
        )
    shards = strategy.assign(variables, num_shards)
    placed = sorted(i for shard in shards for i in shard)
    if placed != sorted(v.index for v in variables):
        raise AssertionError(f"{type(strategy).__name__} did not place every variable exactly once")
    if any(not shard for shard in shards):
        raise AssertionError(f"{type(strategy).__name__} left a shard empty")
    return shards
