"""`cluster.ps: auto`: the shard count the cost model (cost_model.py) picks for a job.

The model is built once here to count its parameters. A worker's compute is taken at its lower
bound, 6 FLOPs per parameter per example (forward and backward through a dense layer; convolutions
cost more), at `WORKER_FLOPS`: the less a worker computes, the sooner the shards are the bottleneck,
so the estimate errs towards more shards. Workers and shards are taken to sit on machines of their
own, on a 25 Gbit/s network.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from towerflow.errors import SpecError
from towerflow.runtime.cost_model import DEFAULT_COSTS, shards_for

log = logging.getLogger(__name__)

# A worker's sustained FLOP rate: per CPU, the 784-500-10 MLP's dense layers at one thread on the
# machine DEFAULT_COSTS came from (1.1e11; benchmarks/costmodel.py), the fast end of what a CPU
# core does; per GPU, a fraction of a data-centre GPU's FP32 rate.
CPU_FLOPS = 1.0e11
GPU_FLOPS = 1.0e13
NETWORK_GBIT = 25.0


def count_parameters(model_spec: Any) -> tuple[int, int]:
    """(trainable parameters, trainable variables) of the spec's model, built here."""
    from towerflow.imports import import_user_code

    try:
        model = import_user_code(model_spec.ref)(**model_spec.params)
    except Exception as exc:
        raise SpecError(
            f"cluster.ps: auto counts the model's parameters, but {model_spec.ref} could not be built here: "
            f"{exc}. Set cluster.ps to a number."
        ) from exc
    variables = model.trainable_variables
    return int(sum(int(v.shape.num_elements() or 0) for v in variables)), len(variables)


def auto_shards(spec: Any) -> int:
    """The shards for this job: the fewest whose part of a step stays small beside a worker's."""
    cluster = spec.cluster
    params, variables = count_parameters(spec.model)
    flops = (
        GPU_FLOPS * cluster.gpus_per_worker
        if cluster.gpus_per_worker
        else CPU_FLOPS * cluster.cpus_per_worker
    )
    costs = replace(DEFAULT_COSTS, compute_s_per_example=6 * params / flops, compute_fixed_s=0.0)
    # Never more shards than pieces: variables, and row slices of big ones where they may be cut.
    pieces = variables + (0 if cluster.min_slice_bytes is None else 4 * params // cluster.min_slice_bytes)
    return shards_for(
        costs.on_network(NETWORK_GBIT),
        workers=cluster.workers,
        params=params,
        batch_per_worker=spec.data.batch_size,
        mode=spec.training.mode,
        most=max(1, min(64, pieces)),
    )


def resolve_shards(spec: Any) -> Any:
    """The spec with `cluster.ps: auto` replaced by the count the cost model picks."""
    if spec.cluster.ps != "auto":
        return spec
    shards = auto_shards(spec)
    log.info(
        "cluster.ps: auto -> %d shard(s) for %d workers (the cost model, towerflow/runtime/cost_model.py)",
        shards,
        spec.cluster.workers,
    )
    return spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"ps": shards})})
