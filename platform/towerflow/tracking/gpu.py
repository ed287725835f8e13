"""NVIDIA GPUs through NVML (nvidia-ml-py): the fields nvidia-smi shows, each read on its own.

A field a GPU does not support (fan on a passively cooled card, ECC on a consumer card) is left
out; a machine without NVML (no driver, no library, no GPU) simply has no GPUs. Nothing here raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from towerflow.tracking.host_metrics import Monitor

MB = 1024 * 1024  # nvidia-smi's MiB


@dataclass
class GpuProcess:
    pid: int
    name: str
    used_memory_mb: float | None


@dataclass
class GpuReading:
    index: int
    name: str
    uuid: str
    fields: dict[str, float] = field(default_factory=dict)  # metric name -> value (supported fields only)
    processes: list[GpuProcess] = field(default_factory=list)


def nvml() -> Any | None:
    """The initialised pynvml module, or None where NVML cannot be used here."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return None
    return pynvml


def read_gpus() -> list[GpuReading]:
    """One reading per GPU of this machine (empty without NVML)."""
    lib = nvml()
    if lib is None:
        return []
    try:
        count = lib.nvmlDeviceGetCount()
        readings = []
        for index in range(count):
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            reading = GpuReading(
                index=index,
                name=_read(lambda h=handle: _text(lib.nvmlDeviceGetName(h))) or "GPU",
                uuid=_read(lambda h=handle: _text(lib.nvmlDeviceGetUUID(h))) or "",
                fields=gpu_fields(lib, handle),
            )
            reading.processes = _processes(lib, handle)
            readings.append(reading)
        return readings
    except lib.NVMLError:
        return []
    finally:
        with contextlib.suppress(Exception):
            lib.nvmlShutdown()


def gpu_fields(lib: Any, handle: Any) -> dict[str, float]:
    """The nvidia-smi fields of one GPU that it supports, as `{metric name: value}`."""
    out: dict[str, float] = {}

    def put(name: str, read: Callable[[], float]) -> None:
        value = _read(read)
        if value is not None:
            out[name] = float(value)

    put("utilization_percentage", lambda: lib.nvmlDeviceGetUtilizationRates(handle).gpu)
    memory = _read(lambda: lib.nvmlDeviceGetMemoryInfo(handle))
    if memory is not None:
        out["memory_used_megabytes"] = memory.used / MB
        out["memory_total_megabytes"] = memory.total / MB
        out["memory_usage_percentage"] = 100.0 * memory.used / memory.total if memory.total else 0.0
    put("temperature_celsius", lambda: lib.nvmlDeviceGetTemperature(handle, lib.NVML_TEMPERATURE_GPU))
    put("power_usage_watts", lambda: lib.nvmlDeviceGetPowerUsage(handle) / 1000.0)
    put("power_limit_watts", lambda: lib.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0)
    put("sm_clock_mhz", lambda: lib.nvmlDeviceGetClockInfo(handle, lib.NVML_CLOCK_SM))
    put("fan_speed_percentage", lambda: lib.nvmlDeviceGetFanSpeed(handle))
    put(
        "ecc_errors_uncorrected",
        lambda: lib.nvmlDeviceGetTotalEccErrors(
            handle, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
        ),
    )
    put(
        "ecc_errors_corrected",
        lambda: lib.nvmlDeviceGetTotalEccErrors(
            handle, lib.NVML_MEMORY_ERROR_TYPE_CORRECTED, lib.NVML_VOLATILE_ECC
        ),
    )
    return out


class NVMLMonitor(Monitor):
    """A system-metrics monitor for every NVIDIA GPU of the machine: `gpu_<i>_<field>`, averaged
    over the samples of a logging period. Construct it only where `nvml()` is not None."""

    def __init__(self) -> None:
        super().__init__()
        self._lib = nvml()
        if self._lib is None:
            raise RuntimeError("NVML is not available on this machine")
        self._handles = [
            self._lib.nvmlDeviceGetHandleByIndex(i) for i in range(self._lib.nvmlDeviceGetCount())
        ]

    def collect_metrics(self) -> None:
        for index, handle in enumerate(self._handles):
            for name, value in gpu_fields(self._lib, handle).items():
                self._metrics[f"gpu_{index}_{name}"].append(value)

    def aggregate_metrics(self) -> dict[str, float]:
        return {k: round(sum(v) / len(v), 2) for k, v in self._metrics.items() if v}


def _processes(lib: Any, handle: Any) -> list[GpuProcess]:
    found: dict[int, GpuProcess] = {}
    for query in (lib.nvmlDeviceGetComputeRunningProcesses, lib.nvmlDeviceGetGraphicsRunningProcesses):
        for proc in _read(lambda q=query: q(handle)) or []:
            used = getattr(proc, "usedGpuMemory", None)
            found[proc.pid] = GpuProcess(
                pid=proc.pid,
                name=_read(lambda p=proc: psutil.Process(p.pid).name()) or "?",
                used_memory_mb=used / MB if isinstance(used, int) else None,  # None: not reported (e.g. MIG)
            )
    return sorted(found.values(), key=lambda p: p.pid)


def _read(read: Callable[[], Any]) -> Any:
    """`read()`, or None when NVML says the field is not supported here (or the process vanished)."""
    try:
        return read()
    except Exception:  # pynvml.NVMLError_NotSupported and kin, psutil.NoSuchProcess
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
