"""Each computed step's own log file: `<step output>/logs/step.log`.

Everything lmforge's loggers record while a step computes is appended there: the step's own
lines, what its units logged in worker processes (replayed by the executor), and every output
line of the processes it launched (`lmforge.processes.launcher` streams them into loggers). The file is
written whatever the terminal shows (`lmforge.console`) and whether or not Prefect runs the step
(its run logs get the same records). `logs/` is never part of an output's digest.

A record belongs to the step whose computation set the context variable of the thread that
logged it; Prefect's task threads and lmforge's progress threads inherit it, so steps that run
side by side in one process keep separate files.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

FILE = "step.log"
FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("lmforge_computing_step", default=None)


def current_step() -> str | None:
    """The step this thread is computing for, if any."""
    return _current.get()


class _StepFiles(logging.Handler):
    """One handler on lmforge's loggers, writing each record to the file of the step it belongs to."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, TextIO] = {}
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        step = _current.get()
        stream = self.files.get(step) if step is not None else None
        if stream is None:
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise into the caller
            self.handleError(record)


_handler = _StepFiles()


def _attach() -> None:
    from lmforge.engine.registry import domain_packages

    names = domain_packages()
    # the outermost loggers only: a record propagating from `serving.quantize` to `serving` is written once
    for name in names:
        if any(name.startswith(other + ".") for other in names):
            continue
        logger = logging.getLogger(name)
        if _handler not in logger.handlers:
            logger.addHandler(_handler)


@contextlib.contextmanager
def recording(step: str, out_dir: Path) -> Iterator[Path]:
    """Append what is logged for `step` inside this block (and in threads started from it) to its step.log."""
    path = Path(out_dir) / "logs" / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _attach()
    stream = open(path, "a", encoding="utf-8", errors="replace")
    stream.write(f"--- {step}: computing, {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()} ---\n")
    stream.flush()
    with _lock():
        _handler.files[step] = stream
    token = _current.set(step)
    try:
        yield path
    finally:
        _current.reset(token)
        with _lock():  # no record is being written to it once it is out of the table
            _handler.files.pop(step, None)
        stream.close()


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    _handler.acquire()
    try:
        yield
    finally:
        _handler.release()
