"""What a person sees in the terminal: one line per step, a live progress line, warnings -- and
the launched processes' output only with -v, though always in the step's logs/step.log."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge import console
from lmforge.console import Terminal, step_line
from lmforge.engine.executor import execute_step
from lmforge.engine.graph import Graph, Step, StepContext
from lmforge.engine.store import StageStore
from lmforge.processes import launcher

CHATTER = [
    "[lm-eval] WARNING Overwriting default num_fewshot of lmforge_continuation from None to 0",
    "Running loglikelihood requests: 100%|##########| 40/40",
    "[deepspeed] Setting ds_accelerator to cpu (auto detect)",
]


def _chatty(ctx: StepContext, results: dict) -> dict:
    """A step that launches a talkative process, as training, lm-eval and the quantizer do."""
    script = "; ".join(f"print({line!r})" for line in CHATTER)
    code, _ = launcher.run([sys.executable, "-c", script], logging.getLogger("evaluation.lmeval"), what="chatter")
    assert code == 0
    logging.getLogger("evaluation.report").warning("task lmforge_humaneval has 3 items only")
    (ctx.out_dir / "result.txt").write_text("ok")
    return {"counts": {"lines": len(CHATTER)}}


def _broken(ctx: StepContext, results: dict) -> dict:
    raise ValueError("no such metric: acc_norm_stderr\nsecond line of detail")


def _run(
    step: Step, workspace: Path, verbose: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict | None, BaseException | None]:
    """Run `step` (this module's own, not a registered one) the way both run paths do, under a terminal."""
    from lmforge.config import load_config
    from lmforge.engine import executor

    monkeypatch.setattr(executor, "graph", lambda: Graph([step]))
    config = load_config("tiny-cpu", [], str(workspace))
    store = StageStore(str(workspace), "checksum")
    out, manifest, error = io.StringIO(), None, None
    with console.terminal(verbose, level="INFO", stream=out):  # INFO: as runtime.log_level, what the CLI sets
        try:
            manifest, _ = execute_step(step, config, store, {}, lambda ctx, todo: {})
        except ValueError as exc:
            error = exc
    return out.getvalue(), manifest, error


def test_the_terminal_shows_one_line_per_step_and_warnings_but_no_process_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = Step("evaluate/chatty", 1, "talks a lot", finalize=_chatty)
    shown, manifest, _ = _run(step, tmp_path, False, monkeypatch)
    lines = shown.splitlines()
    assert [ln.split()[:2] for ln in lines if ln.startswith(("computed", "cached", "FAILED"))] == [
        ["computed", "evaluate/chatty"]
    ]
    assert manifest is not None and lines[-1].split()[-1] == console.where(manifest["dir"])
    assert "warning: evaluate/chatty: task lmforge_humaneval has 3 items only" in lines
    assert not [line for line in lines if any(c in line for c in CHATTER) or "launching:" in line]
    assert len(lines) == 2, shown
    # nothing is lost: the step's own log file has every line the process printed
    log = (Path(manifest["dir"]) / "logs" / "step.log").read_text()
    assert all(c in log for c in CHATTER) and "launching:" in log and "3 items only" in log

    again, _, _ = _run(step, tmp_path, False, monkeypatch)
    assert [line.split()[:2] for line in again.splitlines()] == [["cached", "evaluate/chatty"]]


def test_verbose_brings_the_process_output_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shown, _, _ = _run(Step("evaluate/chatty", 1, "talks a lot", finalize=_chatty), tmp_path, True, monkeypatch)
    for line in CHATTER:
        assert line in shown
    assert "launching:" in shown and "3 items only" in shown
    assert sum(line.startswith("computed  evaluate/chatty") for line in shown.splitlines()) == 1


def test_a_failed_step_is_one_line_with_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shown, _, error = _run(Step("evaluate/broken", 1, "fails", finalize=_broken), tmp_path, False, monkeypatch)
    assert error is not None
    (line,) = shown.splitlines()
    assert line.startswith("FAILED    evaluate/broken") and line.endswith("ValueError: no such metric: acc_norm_stderr")


def _record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_prefect_run_state_lines_stay_off_the_terminal_but_the_run_link_is_shown() -> None:
    terminal = Terminal(io.StringIO(), verbose=False, tty=False)
    assert terminal.brief(_record("prefect.task_runs", logging.INFO, "Finished in state Completed()")) is None
    assert terminal.brief(_record("prefect.flow_runs", logging.ERROR, "Finished in state Failed('boom')")) is None
    assert (
        terminal.brief(_record("prefect", logging.INFO, "Starting temporary server on http://127.0.0.1:8190")) is None
    )
    link = "View at http://127.0.0.1:4200/runs/flow-run/0b6e"
    assert (
        terminal.brief(_record("prefect.flow_runs", logging.INFO, link))
        == "Prefect run: http://127.0.0.1:4200/runs/flow-run/0b6e"
    )
    assert terminal.brief(_record("prefect.flow_runs", logging.INFO, link + "-subflow")) is None  # only the top run's
    assert terminal.brief(_record("prefect.client", logging.WARNING, "API slow")) == "warning: API slow"
    assert terminal.brief(_record("training.launcher", logging.INFO, CHATTER[2])) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_in_a_pipe_is_a_plain_line_at_most_every_interval(tmp_path: Path) -> None:
    out, clock = io.StringIO(), _Clock()
    terminal = Terminal(out, tty=False, pipe_every_s=30, clock=clock)
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 10, "loss": 4.5}\n{"step": 20, "loss": 3.25}\n{"step": 20, "val_loss": 3.9}\n'
    )
    terminal.step_computing("pretrain/train", tmp_path, lambda: (20, 200))
    for second in range(0, 95, 1):
        clock.now = float(second)
        terminal.tick()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == [f"running: pretrain/train 20/200 loss 3.25 {t}" for t in ("30s", "1m00s", "1m30s")]
    terminal.step_ended("pretrain/train", "computed", 95.0, "ws/pretrain/train/abc")
    assert out.getvalue().splitlines()[-1] == step_line("pretrain/train", "computed", 95.0, "ws/pretrain/train/abc")
    assert out.getvalue().splitlines()[-1].split()[:3] == ["computed", "pretrain/train", "1m35s"]


def test_progress_on_a_terminal_is_redrawn_in_place_and_cleared_before_other_lines() -> None:
    out, clock = io.StringIO(), _Clock()
    terminal = Terminal(out, tty=True, clock=clock)
    terminal.step_computing("curate/minhash", None, None)
    terminal.step_progress("curate/minhash", 3, 6, "units")
    clock.now = 1.0
    terminal.tick()
    assert out.getvalue().endswith("\rrunning: curate/minhash 3/6 units 1s")
    terminal.line("warning: something")
    # the live line was wiped (carriage return, blanks, carriage return) before the warning, then redrawn
    assert "\r" + " " * len("running: curate/minhash 3/6 units 1s") + "\rwarning: something\n" in out.getvalue()
    assert out.getvalue().endswith("running: curate/minhash 3/6 units 1s")


@pytest.fixture
def small_curate() -> list[str]:
    from tests.conftest import SMALL_CURATE

    return [a for o in SMALL_CURATE for a in ("--set", o)]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.cli", *args], capture_output=True, text=True, timeout=600)


def test_the_cli_prints_one_line_per_step_and_the_chatter_only_with_verbose(
    curated_copy: Path, curated: tuple[Path, dict], small_curate: list[str]
) -> None:
    steps = [name for name in curated[1] if name.startswith("curate/")]
    # a changed split reruns the split and packing only; units' progress lines are INFO: off the terminal
    quiet = _cli(
        "stage", "curate", "--local", "-w", str(curated_copy), *small_curate, "--set", "curate.pack.val_fraction=0.2"
    )
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    lines = quiet.stderr.splitlines()
    assert [line.split()[1] for line in lines] == steps, quiet.stderr
    rows = {line.split()[1]: line.split() for line in lines}  # status, step, time, output folder
    computed = {step for step, row in rows.items() if row[0] == "computed"}
    assert computed == {"curate/split", "curate/pack"} and {r[0] for r in rows.values()} == {"cached", "computed"}
    assert "units done" in (Path(rows["curate/pack"][3]) / "logs" / "step.log").read_text()
    assert f"{len(steps)} steps, {len(steps) - 2} cache hits, 2 computed" in quiet.stdout  # the summary is unchanged

    loud = _cli(
        "stage",
        "curate",
        "--local",
        "-v",
        "-w",
        str(curated_copy),
        *small_curate,
        "--set",
        "curate.pack.val_fraction=0.3",
    )
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert re.search(r"curate/pack: \d+/\d+ units done", loud.stderr) and "cache hit" in loud.stderr
    assert sum(line.startswith(("computed ", "cached ")) for line in loud.stderr.splitlines()) == len(steps)
