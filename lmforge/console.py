"""What a person sees in the terminal while lmforge runs steps.

A run's full story is in its logs: the Prefect run logs and each computed step's `logs/step.log`
(`lmforge.engine.steplog`) get every record of lmforge's loggers, every output line of every launched
process included. Inside `terminal()` (the CLI's `run` and `stage`) the terminal shows a digest:

- one line per step as it ends: cached, computed, FAILED or stopped, its time, and its output
  folder (or the error);
- a live line naming the steps being computed, with their progress: units done, or what the step's
  own `progress` reads off its output folder (training steps, evaluation tasks), and the latest
  loss in its `metrics.jsonl`. On a terminal it is redrawn in place; in a pipe (CI, a file) it is
  a plain line at most every PIPE_EVERY_S;
- log records at WARNING and above, one line each (tracebacks stay in the logs unless
  LMFORGE_DEBUG is set). Launched processes' output is logged at INFO, so it stays off. Prefect's
  flow- and task-run state lines are left to the step lines, the CLI's one-line failure and the
  UI; only the link to the run is shown.

`verbose` (`-v`) brings every record back as before, beside the step lines. Outside `terminal()`
(tests, unit worker processes, deployment runs on workers) the step events do nothing and
`ConsoleHandler` writes every record as a plain stream handler would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from lmforge.engine import steplog

PIPE_EVERY_S = 30.0  # a plain progress line at most this often when the terminal is not a TTY
TICK_S = 0.5  # the live line's redraw
POLL_S = 2.0  # how often a running step's progress is read off its output folder
NAME_WIDTH = 24
RUN_STATE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
PLAIN_FORMAT = "%(asctime)s %(name)s %(message)s"
VERBOSE_HELP = (
    "show every log line on the terminal, launched processes' output included (it always goes to "
    "the Prefect run logs and to each computed step's logs/step.log)"
)

Progress = Callable[[], "tuple[float, float] | None"]


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)


@dataclass
class _Running:
    started: float
    out_dir: Path | None = None
    progress: Progress | None = None
    done: float | None = None
    total: float | None = None
    what: str = ""
    loss: float | None = None
    polled: float = float("-inf")

    def describe(self, name: str, now: float) -> str:
        text = name
        if self.total:
            text += f" {_count(self.done or 0)}/{_count(self.total)}" + (f" {self.what}" if self.what else "")
        if self.loss is not None:
            text += f" loss {self.loss:.4g}"
        return f"{text} {elapsed(now - self.started)}"


class Terminal:
    """The terminal of one run: step lines, the live line, and the log records a person needs."""

    def __init__(
        self,
        stream: TextIO,
        verbose: bool = False,
        tty: bool | None = None,
        pipe_every_s: float = PIPE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.verbose = verbose
        self.tty = _isatty(stream) if tty is None else tty
        self.pipe_every_s = pipe_every_s
        self.clock = clock
        self.lock = threading.RLock()
        self.running: dict[str, _Running] = {}
        self.drawn = ""  # the live line as it is on the screen now
        self.last_plain = clock()
        self.run_link_shown = False
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    # -- step events ----------------------------------------------------------------------------------

    def step_computing(self, step: str, out_dir: Path | None, progress: Progress | None) -> None:
        with self.lock:
            self.running[step] = _Running(self.clock(), out_dir, progress)
            self._draw()

    def step_progress(self, step: str, done: float, total: float, what: str = "") -> None:
        with self.lock:
            running = self.running.get(step)
            if running is not None:
                running.done, running.total, running.what = done, total, what

    def step_ended(self, step: str, status: str, seconds: float, detail: str) -> None:
        with self.lock:
            self.running.pop(step, None)
            self.line(step_line(step, status, seconds, detail))

    # -- output ---------------------------------------------------------------------------------------

    def line(self, text: str) -> None:
        """A line above the live line."""
        with self.lock:
            self._erase()
            self.stream.write(text + "\n")
            self._draw()
            self.stream.flush()

    def handle(self, record: logging.LogRecord, inner: logging.Handler) -> None:
        """A log record that reached a console handler: shown whole (verbose), in brief, or not at all."""
        if self.verbose:  # as `inner` would write it (Prefect's colours aside), on this terminal's stream
            if record.levelno >= inner.level and inner.filter(record):
                self.line(inner.format(record))
            return
        text = self.brief(record)
        if text is not None:
            self.line(text)

    def brief(self, record: logging.LogRecord) -> str | None:
        message = record.getMessage()
        if record.name in RUN_STATE_LOGGERS or record.name.startswith(tuple(n + "." for n in RUN_STATE_LOGGERS)):
            if message.startswith("View at ") and not self.run_link_shown:  # the first is the top-level run
                self.run_link_shown = True
                return f"Prefect run: {message.removeprefix('View at ').strip()}"
            return None
        if record.levelno < logging.WARNING:
            return None
        step = steplog.current_step()
        if step and not message.startswith(step):
            message = f"{step}: {message}"
        if record.exc_info and record.exc_info[1] is not None:
            if os.environ.get("LMFORGE_DEBUG"):
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            else:
                message += f" ({one_line(record.exc_info[1])})"
        return f"{record.levelname.lower()}: {message}"

    def status(self, now: float) -> str:
        return "running: " + " | ".join(r.describe(name, now) for name, r in self.running.items())

    def _erase(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * len(self.drawn) + "\r")
            self.drawn = ""

    def _draw(self) -> None:
        if not self.tty or not self.running:
            return
        text = self.status(self.clock())[: _columns(self.stream) - 1]  # a wrapped line could not be redrawn
        if text != self.drawn.rstrip():
            text = text.ljust(len(self.drawn))  # over the old line, no blank flash in between
            self.stream.write("\r" + text)
            self.drawn = text
            self.stream.flush()

    # -- the ticker: progress polling, redraws, plain lines in a pipe ---------------------------------

    def tick(self) -> None:
        self._poll()
        with self.lock:
            now = self.clock()
            if self.tty:
                self._draw()
            elif self.running and now - self.last_plain >= self.pipe_every_s:
                self.last_plain = now
                self.line(self.status(now))

    def _poll(self) -> None:
        now = self.clock()
        with self.lock:
            due = [r for r in self.running.values() if now - r.polled >= POLL_S]
            for running in due:
                running.polled = now
        for running in due:  # file reads, outside the lock
            found = None
            if running.progress is not None:
                try:
                    found = running.progress()
                except Exception:  # noqa: BLE001 - a half-written file, or anything else: progress is cosmetic
                    found = None
            loss = last_loss(running.out_dir) if running.out_dir is not None else None
            with self.lock:
                if found:
                    running.done, running.total, running.what = found[0], found[1], ""
                if loss is not None:
                    running.loss = loss

    def start(self) -> None:
        def loop() -> None:
            while not self.stop_event.wait(TICK_S):
                self.tick()

        self.thread = threading.Thread(target=loop, name="lmforge-terminal", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        with self.lock:
            self.running.clear()
            self._erase()
            self.stream.flush()


_terminal: Terminal | None = None


def active() -> Terminal | None:
    return _terminal


class ConsoleHandler(logging.Handler):
    """A console handler that gives way to `terminal()` while it shows a run (which decides what is
    shown and keeps the live line whole); otherwise `inner` writes every record."""

    def __init__(
        self, inner: logging.Handler | None = None, fmt: str = PLAIN_FORMAT, datefmt: str | None = None
    ) -> None:
        super().__init__()
        if inner is None:
            inner = logging.StreamHandler(sys.stderr)
            inner.setFormatter(logging.Formatter(fmt, datefmt))
        self.inner = inner

    def emit(self, record: logging.LogRecord) -> None:
        terminal = _terminal
        if terminal is None:
            self.inner.handle(record)
        else:
            terminal.handle(record, self.inner)


def _is_console(handler: logging.Handler) -> bool:
    return (
        isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and getattr(handler, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    )


@contextlib.contextmanager
def terminal(
    verbose: bool = False, level: str | None = None, stream: TextIO | None = None, until_exit: bool = False
) -> Iterator[Terminal]:
    """Show the steps run inside this block as the module docstring says.

    The root logger's console handlers (Prefect's, when it configured logging) are wrapped, or a
    plain one is added; `level` sets the root logger's level (the `--local` run, where lmforge's
    loggers propagate to it). Everything is restored on the way out, unless `until_exit`: then
    what is logged later in this process (Prefect stopping its temporary server at exit) is
    still shown by the same rules.
    """
    global _terminal
    screen = Terminal(stream or sys.stderr, verbose)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    handlers = [ConsoleHandler(h) if _is_console(h) else h for h in root.handlers]
    if not any(isinstance(h, ConsoleHandler) for h in handlers):
        handlers.append(ConsoleHandler())
    root.handlers = handlers
    if level is not None:
        root.setLevel(level)
    _terminal = screen
    screen.start()
    try:
        yield screen
    finally:
        screen.stop()
        if not until_exit:
            _terminal = None
            root.handlers, root.level = saved[0], saved[1]


# -- what the executor tells the terminal --------------------------------------------------------------


class StepOnScreen:
    """One step as the terminal shows it: `computing` while it runs, one line when it ends."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.started = time.monotonic()

    def computing(self, out_dir: Path, progress: Progress | None) -> None:
        if _terminal is not None:
            _terminal.step_computing(self.step, out_dir, progress)

    def ended(self, status: str, out_dir: str | Path) -> None:
        self._end(status, where(out_dir))

    def _end(self, status: str, detail: str) -> None:
        if _terminal is not None:
            _terminal.step_ended(self.step, status, time.monotonic() - self.started, detail)


@contextlib.contextmanager
def step_on_screen(step: str) -> Iterator[StepOnScreen]:
    """Report `step` to the terminal, if one is shown; a step that raises is reported failed (or stopped)."""
    shown = StepOnScreen(step)
    try:
        yield shown
    except BaseException as exc:
        stopped = isinstance(exc, KeyboardInterrupt) or type(exc).__name__ in ("RunStopped", "TerminationSignal")
        shown._end("stopped" if stopped else "FAILED", one_line(exc))
        raise


def step_progress(step: str, done: float, total: float, what: str = "units") -> None:
    """Units of `step` done so far (a no-op without a terminal)."""
    if _terminal is not None:
        _terminal.step_progress(step, done, total, what)


# -- formatting ----------------------------------------------------------------------------------------


def step_line(step: str, status: str, seconds: float, detail: str) -> str:
    return f"{status:<8}  {step:<{NAME_WIDTH}}  {duration(seconds):>6}  {detail}"


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def elapsed(seconds: float) -> str:
    """A running step's time, in whole seconds (a live line that changes every tick only flickers)."""
    return f"{int(seconds)}s" if seconds < 60 else duration(seconds)


def where(path: str | Path) -> str:
    """A folder as a person would type it from here: relative when it is below the current directory."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."


def last_loss(out_dir: Path) -> float | None:
    """The loss in the last complete row of `out_dir/metrics.jsonl` (training steps write one), if any."""
    try:
        with open(Path(out_dir) / "metrics.jsonl", "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 8192))
            lines = handle.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        try:
            row = json.loads(raw)
        except ValueError:  # the line being written, or a cut first line
            continue
        loss = row.get("loss") if isinstance(row, dict) else None
        if isinstance(loss, (int, float)):  # rows of evaluations may carry no training loss
            return float(loss)
    return None


def _count(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _columns(stream: TextIO) -> int:
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        columns = 0
    return columns if columns > 0 else shutil.get_terminal_size((100, 24)).columns  # 0: a pty with no size set


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
