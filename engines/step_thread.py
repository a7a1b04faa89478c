"""The one thread that does every in-process engine's PyTorch work: loading, warm-up and every step.

Why one thread for the process: PyTorch's CPU ops and our kernels (`engines/cpu_kernels.c`) run their
parallel regions on OpenMP (libgomp), which keeps a pool of worker threads for each thread that enters a
parallel region. Once libgomp manages more threads than the machine has CPUs, its workers stop spinning
between regions and sleep at once ("throttled" spinning), and every region of every step then pays a
futex wake-up. A model loaded on one thread and stepped on another is enough to cross that line on a
small machine: decode steps ran markedly slower that way (`make bench-step-thread`). So engines
are built here (`call`) and step here, taking turns a step at a time when several have work: on a
machine whose cores the engines share, interleaved steps are what concurrent ones would amount to,
without the oversubscription. On a machine with cores enough for each tier, serve tiers as separate
engine servers (`sluice engine --tier <name>`), each with its own step thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Stepper(Protocol):
    """An engine loop the step thread drives. Both methods are called on the step thread;
    `has_work` with `STEP_THREAD.condition` held (it must be quick), `run_once` without."""

    interactive_queued: int  # interactive requests queued for it and not yet taken

    def has_work(self) -> bool: ...

    def run_once(self) -> None: ...


class StepThread:
    def __init__(self) -> None:
        # Guards the attached steppers, the pending calls and whatever state steppers read in `has_work`;
        # notified whenever one of them may have work.
        self.condition = threading.Condition()
        self._steppers: list[Stepper] = []
        self._calls: list[tuple[Callable[[], object], Future[object]]] = []
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the step thread, between steps, and return its result (or raise its exception)."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future[object] = Future()
        with self.condition:
            self._calls.append((fn, future))
            self._start()
            self.condition.notify()
        return future.result()  # type: ignore[return-value]

    def interactive_waiting(self) -> bool:
        """Whether an interactive request is queued for any engine here and not yet taken: a step of batch
        work alone, of any engine, is given up for it (it would otherwise wait for that step on this thread).
        Asked between layers, without the lock."""
        return any(stepper.interactive_queued for stepper in self._steppers)

    def attach(self, stepper: Stepper) -> None:
        with self.condition:
            self._steppers.append(stepper)
            self._start()
            self.condition.notify()

    def detach(self, stepper: Stepper) -> None:
        """Stop driving `stepper`; once this returns, no step of it is running or will run."""

        def remove() -> None:
            with self.condition:
                self._steppers.remove(stepper)

        self.call(remove)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sluice-engine-step", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self.condition:
                while not (self._calls or any(stepper.has_work() for stepper in self._steppers)):
                    self.condition.wait()
                calls, self._calls = self._calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller, who raises it
                    future.set_exception(exc)
            with self.condition:  # after the calls: a stepper detached by one of them is not stepped
                ready = [stepper for stepper in self._steppers if stepper.has_work()]
            for stepper in ready:
                try:
                    stepper.run_once()
                except Exception:  # a bug in one engine's loop must not stop the others
                    logger.exception("an engine loop failed")


STEP_THREAD = StepThread()
# A forked child has no step thread (threads do not survive fork) and must not inherit the parent's engines.
os.register_at_fork(after_in_child=STEP_THREAD.__init__)
