"""The driver's side of its run taken over by another driver (runtime/run_keeper.py): whether the
run is still its own, asked before it acts, and the error it stops with where it is not. Its
actors refuse a driver of an older term (runtime/fencing.py); this is how the driver hears so."""

from __future__ import annotations

import ray

from towerflow.errors import FencedOut, RunTakenOver
from towerflow.runtime.actors import first_line
from towerflow.runtime.fencing import fenced_out, held_terms

# A kept run's failure: how long its actors get to say whether another driver has them now.
TERMS_AT_THE_END_S = 5.0


class RunOwnership:
    """Whether the run is still this driver's (a mixin of the Driver, whose control point, actors
    and term it reads)."""

    def _confirm_the_run_is_ours(self) -> None:
        """Raise RunTakenOver where its control point says another driver took the run over
        (runtime/run_control.py); the workers' poll says so itself (runtime/fencing.py)."""
        if self.control is not None:
            self.control.confirm()

    def _taken_over(self, exc: BaseException) -> RunTakenOver | None:
        """Why the run is no longer this driver's, where `exc` (its run's failure) came of it or
        the run was taken over meanwhile; else None."""
        seen: BaseException | None = exc
        for _ in range(8):  # a hook's error over an actor's refusal, say (a chain may loop)
            if seen is None:
                break
            if isinstance(seen, RunTakenOver):
                return self._naming_the_run(seen)
            seen = seen.__cause__ or seen.__context__
        try:
            self._confirm_the_run_is_ours()
        except RunTakenOver as taken:
            return self._naming_the_run(taken)
        if self._kept_beyond_the_driver():  # unheard, perhaps: asked before its end kills them
            newer = [
                t for t in held_terms([*self.shards, *self.workers], TERMS_AT_THE_END_S) if t > self.term
            ]
            if newer:
                return self._naming_the_run(fenced_out("its actors", max(newer), self.term))
        return None

    def _naming_the_run(self, exc: RunTakenOver) -> RunTakenOver:
        """The error this driver stops with: the control point's as it is; an actor's refusal
        (`FencedOut`, perhaps in Ray's wrapper) with the run named."""
        if not isinstance(exc, FencedOut):
            return exc
        why = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
        job = self.control.taken_by if self.control is not None else None
        by = f" (Ray job {job})" if job else ""
        return RunTakenOver(
            f"run {self.session.tags.get('run_id')} was taken over by another driver{by} while this one "
            f"was paused or cut off from the cluster; {first_line(why)}. This driver stops and leaves "
            "the run to it"
        )
