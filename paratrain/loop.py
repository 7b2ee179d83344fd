"""The one training loop of both faces: ``paratrain train`` (``paratrain.trainer``) and MindSpore's ``Model.train``
(``paratrain.train.model``).

A face gives the steps to take (an iterable of callables, each running one step through ``Engine.step`` and
returning its record: epochs, sinks and a resumed position are the face's) and a :class:`Face`, its part between
the steps. The loop runs them under a :class:`~paratrain.stopping.StopAgreement`, so a stop signal ends every
rank at the same step; after each step it runs the face's logging and evaluation, the agreement and the face's
periodic save, timed outside the step. At the end it brings the last records to the host, makes the last,
blocking agreement and lets the face save the last step. :func:`exit_code` turns how a run ended into the
process's exit code, the same for both faces: 3 diverged, 4 stopped on request, 5 fp16 loss-scale floor.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterable

from paratrain import progress
from paratrain.engine import Engine, TrainingDiverged
from paratrain.precision import LossScaleFloor
from paratrain.stopping import StopAgreement


class Face:
    """What a face does between and after the loop's steps (the defaults: nothing, and agree after every step).
    ``engine`` runs the steps; a face may make it during its first step (a user's net is placed on its first
    batch)."""

    engine: Engine | None = None

    def after_step(self, record: dict) -> bool:
        """Between steps, before the stop agreement (logging, evaluation, callbacks); returns whether the ranks may
        agree on a stop after this step (a MindSpore sink: only after its last step)."""
        return True

    def save(self) -> None:
        """Between steps, after the stop agreement: a periodic save."""

    def end(self, stopped: bool) -> int | None:
        """After the last step (``stopped``: on request): the last save; returns the step saved last, if any."""
        return None

    def close(self) -> None:
        """Always, last."""


@dataclass
class Outcome:
    """How a run ended: whether it stopped on request, and the step saved last (None: none)."""

    stopped: bool
    saved_step: int | None


def run(face: Face, steps: Iterable[Callable[[], dict]], world_size: int) -> Outcome:
    """Take ``steps`` until they end or every rank agrees to stop (SIGTERM/SIGINT on any rank; a stop during the
    last steps or the last save ends the run as stopped too). ``TrainingDiverged`` and ``LossScaleFloor`` pass."""
    stopping = False
    stop = StopAgreement(world_size)
    try:
        for step in steps:
            record = step()
            with face.engine.between_steps():
                if face.after_step(record):
                    stopping = stop.agreed()
                face.save()
            if stopping:
                break
        if face.engine is not None:
            face.engine.flush()
        stopping = stop.finish() or stopping
        return Outcome(stopping, face.end(stopping))
    finally:
        stop.close()
        face.close()


def exit_code(train: Callable[[], Outcome], rank: int, unsaved: str = "") -> int:
    """Run ``train`` (a face's run of the loop); returns the exit code of the process, with one line on stderr when
    it is not 0 (``unsaved``: why a stopped run saved nothing)."""
    try:
        outcome = train()
    except (TrainingDiverged, LossScaleFloor) as exc:
        print(f"paratrain: training stopped: {exc}", file=sys.stderr, flush=True)
        return exc.EXIT_CODE
    if not outcome.stopped:
        return 0
    if rank == 0:
        saved = f"saved at step {outcome.saved_step}" if outcome.saved_step else f"nothing saved ({unsaved})"
        print(f"paratrain: stopped on request, {saved}", file=sys.stderr, flush=True)
    return progress.stopped(outcome.saved_step)
