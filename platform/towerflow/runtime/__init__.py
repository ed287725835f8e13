"""Runtime: parameter-server shards, tower workers, sync and async protocols, the driver.

It knows nothing of the CLI or MLflow: it reports events to the hooks it is given.
"""

from towerflow.runtime.hooks import Hook, RunContext, RunOutcome, SessionInfo, StepEvent

__all__ = ["Hook", "RunContext", "RunOutcome", "SessionInfo", "StepEvent"]
