"""User-facing errors: the CLI prints their message as one paragraph and exits non-zero."""


class TowerflowError(Exception):
    """An error the user can fix (bad spec, bad data, too small a cluster); no traceback is shown."""

    exit_code = 2


class SpecError(TowerflowError):
    """The job spec is invalid: the message names the key and the allowed values."""


class DataError(TowerflowError):
    """Input data is missing or malformed: the message names the file (and record where known)."""


class ClusterError(TowerflowError):
    """The Ray cluster cannot run the job as specified (too few CPUs or GPUs, unreachable address)."""


class RunTakenOver(ClusterError):
    """Another driver took this driver's run over while this one did not renew its lease (paused,
    or cut off from the cluster): this one stops and leaves the run, its actors and its MLflow
    run to the other."""


class RunEndedWhileAway(RunTakenOver):
    """The run's control point ended while this driver did not renew its lease (paused, or cut off
    from the cluster, for longer than training.failure.driver_grace_s): its shards were ended, or
    another driver ended the run. The driver stops; its MLflow run ends FAILED where no other
    driver has reopened it (tracking/mlflow_tracker.py), so that it is not left RUNNING."""


class FencedOut(RunTakenOver):
    """A call of this driver's refused by an actor of its run, which a newer driver has fenced
    (runtime/fencing.py); the driver stops with a RunTakenOver that names the run. `term`: the
    newer driver's, where the refusing actor told it."""

    def __init__(self, message: str, term: int | None = None) -> None:
        super().__init__(message)
        self.term = term  # kept through pickling (in the instance's __dict__), as Ray ships it


class TrainingError(TowerflowError):
    """Training stopped abnormally (an actor died, a NaN loss, a hook failed)."""

    exit_code = 1
