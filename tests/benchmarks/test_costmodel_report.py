"""The cost model's constants from costmodel.py's measurements: what the near-empty model's runs
say about the platform's own time and CPU, with the object store's objects counted apart."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from costmodel_report import costs_from  # noqa: E402

from towerflow.runtime.cost_model import predict_step  # noqa: E402

MLP = {
    "params": 397_510,
    "bytes": 4 * 397_510,
    "compute": {str(b): {"wall_s": 1e-3 + b * 1e-5, "cpu_s": 1e-3 + b * 1e-5} for b in (16, 32, 64)},
    "gradients_out_s": 1.8e-3,
    "parameters_in_s": 0.9e-3,
    "push_s": 0.7e-3,
    "apply_s": 0.4e-3,
    "publish_s": 1.7e-3,
    "call_s": 0.7e-3,
}


def _found(with_store_object: bool) -> dict:
    def tiny(seconds: float, other_ms: float) -> dict:
        cpu = {"workers": 6e-3, "shards": 4e-3, "other": other_ms / 1000}
        return {"workers": 2, "params": 7850, "seconds_per_batch": seconds, "cpu_per_batch": cpu}

    found = {"mlp": MLP, "overhead": {"sync": tiny(10e-3, 3.0), "async": tiny(7e-3, 2.0)}}
    if with_store_object:
        found["store_object"] = {"inline_bytes": 102_400, "object_s": 1e-3, "object_cpu_s": 0.8e-3}
    return found


def test_the_near_empty_models_one_stored_object_a_sync_step_is_counted_apart_from_its_own_time_and_cpu():
    plain, stored = costs_from(_found(False), "mlp"), costs_from(_found(True), "mlp")
    assert (stored.store_object_s, stored.store_object_cpu_s) == (1e-3, 0.8e-3)
    # 31 KB travels inline: an async step of that model stores nothing; a sync one stores its version.
    assert stored.overhead_async_s == pytest.approx(plain.overhead_async_s)
    assert stored.overhead_sync_s == pytest.approx(plain.overhead_sync_s - 1e-3)
    assert stored.other_cpu_s == pytest.approx(plain.other_cpu_s - 0.8e-3 / 2)  # the mean of both modes'
    # The MLP's 1.6 MB goes through the store: its steps now carry its objects' latency and CPU.
    shape = {"workers": 2, "shards": 1, "params": MLP["params"], "batch_per_worker": 32, "cores": 2}
    for mode, more_s in (("sync", 1e-3), ("async", 2e-3)):
        base, now = predict_step(plain, mode=mode, **shape), predict_step(stored, mode=mode, **shape)
        assert now.worker_s == pytest.approx(base.worker_s + more_s)
