"""Cancellation and termination reach the processes a flow launched.

- Prefect's `on_cancellation` / `on_crashed` hooks call `stop_launched`, which stops every
  command this process launched (training ranks, TRL, lm-eval, the quantizer) and returns
  only once they are gone. A SIGTERM to the flow process (SLURM, systemd, Kubernetes
  eviction) becomes a crash in Prefect's engine and takes the same path.
- A flow run started in-process (`lmforge run`) has no runner to watch for "Cancelling"
  from the UI or API; `watch_cancellation` polls its runs' states and, when one is being
  cancelled, stops the launched commands and hands the cancellation to Prefect's engine
  the way a runner does (the "cancel" intent, then SIGTERM), so the run ends Cancelled.
  Runs started by a worker or `flow.serve()` are watched by their runner already.
- Whatever happens to this process, `lmforge.processes.supervise` stops the launched commands when
  it is gone, and holds the step lock until they are.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import uuid
from typing import Any

from lmforge.processes import launcher

log = logging.getLogger("lmforge.cancel")
POLL_S = 2.0


def stop_launched(flow: Any = None, flow_run: Any = None, state: Any = None) -> None:
    """Prefect hook: stop every launched command and wait until they are gone."""
    stopped = launcher.stop_all()
    if stopped:
        log.warning(
            "stopped %d launched command(s) (%s); completed work and checkpoints are kept",
            stopped,
            getattr(state, "name", "terminated"),
        )


class _Watcher:
    def __init__(self) -> None:
        self.ids: set[uuid.UUID] = set()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.fired = False

    def add(self, flow_run_id: uuid.UUID) -> None:
        with self.lock:
            if not self.ids:
                self.fired = False
            self.ids.add(flow_run_id)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="lmforge-cancel-watch", daemon=True)
                self.thread.start()

    def remove(self, flow_run_id: uuid.UUID) -> None:
        with self.lock:
            self.ids.discard(flow_run_id)

    def _cancelling(self) -> list[uuid.UUID]:
        """The watched runs being cancelled."""
        with self.lock:
            ids = list(self.ids)
        return _being_cancelled(ids) if ids else []

    def _loop(self) -> None:
        stop = threading.Event()
        while not stop.wait(POLL_S):
            with self.lock:
                if not self.ids:
                    self.thread = None
                    return
            try:
                cancelling = self._cancelling()
            except Exception as exc:  # noqa: BLE001 - an API hiccup must not end the watch
                log.debug("cancellation watch: %s", exc)
                continue
            if cancelling and not self.fired:
                self.fired = True
                log.warning("flow run is being cancelled: stopping launched commands")
                launcher.stop_all()
                atexit.register(_settle_within, cancelling, 5.0)
                _hand_over_to_engine()
                return


_watcher = _Watcher()


def _being_cancelled(ids: list[uuid.UUID]) -> list[uuid.UUID]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    return [run.id for run in runs if run.state is not None and run.state.is_cancelling()]


def _settle_within(ids: list[uuid.UUID], seconds: float) -> None:
    """`_settle`, given at most `seconds` (a temporary API server may already be gone, and the client retries)."""
    thread = threading.Thread(target=_settle, args=(ids,), name="lmforge-cancel-settle", daemon=True)
    thread.start()
    thread.join(seconds)


def _settle(ids: list[uuid.UUID]) -> None:
    """At exit: a run the engine left "Cancelling" (it unwinds the innermost flow first, and the process can
    end before the state of the run the user cancelled is written) is marked Cancelled, as a runner marks
    the runs it killed."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    try:
        left = _being_cancelled(ids)
        with get_client(sync_client=True) as client:
            for run_id in left:
                client.set_flow_run_state(run_id, Cancelled(message="cancelled; launched processes were stopped"))
    except Exception as exc:  # noqa: BLE001 - the API may be gone with a temporary server; nothing to settle then
        log.debug("settling cancelled runs: %s", exc)


def _hand_over_to_engine() -> None:
    """Let Prefect's engine finish the cancellation as it does for runner-managed runs.

    The engine treats a SIGTERM with the "cancel" intent as a cancellation (state Cancelled,
    `on_cancellation` hooks). The intent setter is internal to Prefect 3.7 (pinned); without
    it, or without Prefect's SIGTERM bridge, the stopped commands still fail the run.
    """
    from prefect.utilities.engine import is_prefect_sigterm_handler_installed

    if not is_prefect_sigterm_handler_installed():
        return
    try:
        from prefect._internal import control_listener

        control_listener._set_intent("cancel")
    except (ImportError, AttributeError):
        pass
    launcher.mark_cancelling()  # this SIGTERM carries a cancellation, not a termination from outside
    os.kill(os.getpid(), signal.SIGTERM)


def watch_cancellation() -> None:
    """Watch the current flow run for cancellation, unless a runner does already."""
    from prefect.runtime import flow_run

    if os.environ.get("PREFECT__FLOW_RUN_ID"):  # started by a worker/runner: it watches and signals
        return
    run_id = flow_run.id
    if run_id:
        _watcher.add(uuid.UUID(str(run_id)))


def unwatch() -> None:
    from prefect.runtime import flow_run

    if flow_run.id:
        _watcher.remove(uuid.UUID(str(flow_run.id)))
