"""towerflow: parameter-server TensorFlow training on Ray.

Public API: ``train`` runs a job spec end to end; ``load_spec`` reads and validates one;
``Hook`` (with ``SessionInfo``, ``RunContext``, ``StepEvent``, ``RunOutcome``) is the base of user hooks;
``keep_ray_local`` (called before Ray is imported) keeps a Ray that ``train`` starts on 127.0.0.1,
with token authentication, as the CLI does; ``release_kept_actors`` ends now the actors a finished
run keeps for the next run in this process (``cluster.keep_actors_s``).
"""

import os

from towerflow.errors import TowerflowError

# Every towerflow process (driver, shards, workers, Ray Data tasks) imports this before TensorFlow.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"

__all__ = [
    "Hook",
    "RunContext",
    "RunOutcome",
    "SessionInfo",
    "StepEvent",
    "TowerflowError",
    "__version__",
    "keep_ray_local",
    "load_spec",
    "release_kept_actors",
    "train",
]
_HOOK_API = {"Hook", "RunContext", "RunOutcome", "SessionInfo", "StepEvent"}


def __getattr__(name: str):
    # Lazy so that `import towerflow` (CLI start-up, `--help`) does not pay for Ray or TensorFlow.
    if name == "train":
        from towerflow.launch import train

        return train
    if name == "keep_ray_local":
        from towerflow.runtime.cluster import keep_embedded_ray_local

        return keep_embedded_ray_local
    if name == "load_spec":
        from towerflow.spec import load_spec

        return load_spec
    if name == "release_kept_actors":
        from towerflow.runtime.actor_pool import release_kept_actors

        return release_kept_actors
    if name in _HOOK_API:
        from towerflow.runtime import hooks

        return getattr(hooks, name)
    raise AttributeError(name)
