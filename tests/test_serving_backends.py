"""Serving backends behind one interface (serving/backends/): the release and the step name none."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_built_in_backends_and_what_each_supports() -> None:
    from serving.backends import backend, backends, default

    assert list(backends()) == ["vllm", "llamacpp"] and default() == "vllm"
    assert backend("vllm").supports == {"adapters", "speculative"} and backend("llamacpp").supports == set()
    assert [backend(n).section for n in backends()] == ["engine", "llamacpp"]


def test_an_unknown_or_unsupported_choice_is_one_line_naming_the_field() -> None:
    from lmforge.config import load_config
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"serve.backend.*no serving backend 'tgi' \(registered: vllm, llamacpp\)"):
        load_config("tiny-cpu", ["serve.backend=tgi"], "/tmp/lmforge-backends-test", check_paths=False)
    with pytest.raises(ConfigError, match=r"serve.backend: llamacpp does not support serve.adapters"):
        load_config(
            "tiny-cpu",
            ["serve.backend=llamacpp", "serve.adapters.enabled=true", "align.method=lora"],
            "/tmp/lmforge-backends-test",
            check_paths=False,
        )


class _GgufContext:
    """What LlamaCppBackend.choose reads of its step context: the GGUF output's folder and manifest."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory, self.key = directory, key

    def path(self, product: object) -> Path:
        return self.directory

    def manifest(self, product: object) -> dict:
        return {"step": "quantize/gguf", "key": self.key, "digest": "d", "dir": str(self.directory)}


def test_a_gguf_output_made_on_another_machine_is_served_with_its_own_tokenizer_copy(tmp_path: Path) -> None:
    """Issue 51: the llama.cpp backend took its tokenizer from the model folder the verdict recorded, a path
    on the machine that made the GGUF output (absent on one that fetched it from a shared workspace)."""
    import json

    from serving.backends.llamacpp import LlamaCpp

    key = "0123abcd"
    here = tmp_path / "ws" / "quantize" / "gguf" / key
    here.mkdir(parents=True)
    there = f"/elsewhere/ws/quantize/gguf/{key}"
    verdict = {
        "model": "dpo",
        "model_dir": "/elsewhere/ws/align/dpo/feedbeef/hf",
        "chosen": "Q8_0",
        "decision": "GGUF gate: Q8_0 ships",
        "file": f"{there}/model-Q8_0.gguf",
        "tokenizer_dir": f"{there}/tokenizer",
    }
    (here / "verdict.json").write_text(json.dumps(verdict))
    ctx = _GgufContext(here, key)
    name, model, source = LlamaCpp().choose(ctx)  # type: ignore[arg-type]
    assert model == here / "model-Q8_0.gguf" and source["tokenizer_dir"] == str(here / "tokenizer")
    # an output made before it kept a tokenizer: the recorded model folder, as before
    (here / "verdict.json").write_text(json.dumps({k: v for k, v in verdict.items() if k != "tokenizer_dir"}))
    assert LlamaCpp().choose(ctx)[2]["tokenizer_dir"] == verdict["model_dir"]  # type: ignore[arg-type]


def test_the_release_and_the_step_name_no_backend() -> None:
    """Backend names live in serving/backends/ only: the rest of the project reaches them by `serve.backend`."""
    names = ("vllm", "llamacpp", "llama.cpp")
    for path in (ROOT / "serving" / "release.py", ROOT / "serving" / "steps.py", ROOT / "serving" / "config.py"):
        code = "\n".join(
            line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
        )  # what runs, not prose: docstrings and comments may say vLLM
        literals = re.findall(r"""["']([^"'\n]*)["']""", code)
        assert not [s for s in literals if s.lower() in names], path


ECHO_PACKAGE = """
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from lmforge.configbase import StrictModel
from serving.backends.base import ServingBackend


class EchoSettings(StrictModel):
    workers: int = Field(1, ge=1, description="Worker processes.")


class Echo(ServingBackend):
    name = "echo"
    label = "Echo"
    description = "a test package's server"
    section = "echo"
    config = EchoSettings
    code = ("echo_backend",)

    def command(self, model: Path, cfg: Any, **kw: Any) -> list[str]:
        # a real process that writes down what it was started with, then serves nothing for a minute
        script = ("import os, sys, time; "
                  "open(sys.argv[1], 'w').write(os.environ['ECHO_MODE'] + ' ' + ' '.join(sys.argv[2:])); time.sleep(60)")
        return [sys.executable, "-c", script, str(kw["directory"] / "seen"), str(model), "--workers", str(cfg.echo.workers)]

    def environment(self) -> dict[str, str]:
        return {"ECHO_MODE": "on"}
"""

CHECK = """
import json, sys, time
from pathlib import Path

from lmforge.config import load_config
from lmforge.engine.executor import graph
from serving import release
from serving.backends import backends
from serving.config import ServeConfig

ws = Path(sys.argv[1])
print("registered", list(backends()))
config = load_config("tiny-cpu", ["serve.backend=echo", "serve.echo.workers=3"], str(ws))
step = next(s for s in graph().steps if s.name == "serve/release")
reads = step.declared_reads(config)
other = load_config("tiny-cpu", ["serve.backend=echo", "serve.echo.workers=4"], str(ws))
vllm = [load_config("tiny-cpu", [f"serve.echo.workers={n}"], str(ws)) for n in (3, 4)]
print("reads", "serve.echo" in reads, "serve.llamacpp" in reads)
print("keyed", step.identity(config) != step.identity(other), step.identity(vllm[0]) != step.identity(vllm[1]))
print("code", "echo_backend" in str(step.code))

release.wait_ready = lambda *a, **k: 0.1  # readiness and the smoke test: the real servers' own tests
cfg = ServeConfig.model_validate({"backend": "echo", "front": False, "echo": {"workers": 2}})
record = release.start(ws / "model", "m", cfg, ws)
seen = Path(record["pid_file"]).parent / "seen"
deadline = time.monotonic() + 30
while not seen.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
print("seen", seen.read_text())
print("settings", json.dumps(record["settings"]["backend"]))
from lmforge.processes.launcher import stop_detached
print("stopped", stop_detached(Path(record["pid_file"]), wait_s=20))
"""


def test_a_backend_a_package_registers_needs_no_edit_to_the_project(tmp_path: Path) -> None:
    """A package on the path with a `lmforge.serving_backends` entry point (a real dist-info, as pip
    installs it) is all it takes: `serve.backend: echo` validates, `serve.echo` is its section and keys
    serve/release only when echo is chosen, and the release starts echo's command with echo's
    environment as a supervised process, stopped by pid."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    (site / "echo_backend-0.1.dist-info").mkdir(parents=True)
    (site / "echo_backend.py").write_text(ECHO_PACKAGE)
    (site / "echo_backend-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: echo-backend\nVersion: 0.1\n"
    )
    (site / "echo_backend-0.1.dist-info" / "entry_points.txt").write_text(
        "[lmforge.serving_backends]\necho = echo_backend:Echo\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path / "ws")], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["registered"] == "['vllm', 'llamacpp', 'echo']"
    assert lines["reads"] == "True False"
    assert lines["keyed"] == "True False"  # its section keys the release only when it is the backend
    assert lines["code"] == "True"
    assert lines["seen"] == f"on {tmp_path / 'ws' / 'model'} --workers 2"
    assert lines["settings"] == '"echo"' and lines["stopped"] == "True"
