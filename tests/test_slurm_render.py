"""The sbatch script refuses values that would inject lines into it, and escapes the ones it writes.

A newline in anything written into a `#SBATCH` line starts a shell line of its own (and sbatch stops
reading options there); the script is rendered where the config cannot have checked every value
(`--workspace` on the command line, a config object changed in code), so `render` checks them itself.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.errors import ConfigError
from lmforge.processes.slurm import render

REPO = Path(__file__).resolve().parent.parent
INJECTED = "x\nrm -rf ~"


def test_a_workspace_with_a_newline_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "slurm", "render", "evaluate", "--workspace", str(tmp_path / INJECTED)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stdout
    err = done.stderr.strip()
    assert "\n" not in err and "workspace" in err and "control character" in err, err
    assert "rm -rf" not in done.stdout


@pytest.mark.parametrize(
    ("field", "section", "name"),
    [
        ("workspace", None, "workspace"),
        ("name", None, "name"),
        ("cluster.time", "cluster", "time"),
        ("cluster.partition", "cluster", "partition"),
        ("cluster.account", "cluster", "account"),
        ("cluster.extra_sbatch", "cluster", "extra_sbatch"),
    ],
)
def test_render_refuses_a_control_character_in_every_value_it_writes(
    field: str, section: str | None, name: str
) -> None:
    config = load_config("tiny-cpu", [], "/tmp/lmforge-slurm-test")
    owner = getattr(config, section) if section else config
    value = [INJECTED] if name == "extra_sbatch" else INJECTED
    object.__setattr__(owner, name, value)  # past the config's own check: what code could hand render
    with pytest.raises(ConfigError, match=rf"^slurm: {field}: .*control character") as raised:
        render(config, "evaluate", "tiny-cpu", [], None)
    assert "\n" not in str(raised.value)


def test_a_workspace_with_spaces_and_a_hash_stays_one_word_in_sbatch_lines_and_shell_lines(tmp_path: Path) -> None:
    workspace = tmp_path / "my runs #2 'a\"b'"
    config = load_config("tiny-cpu", ["cluster.partition=gpu big"], str(workspace))
    script = render(config, "evaluate", "tiny-cpu", [], None)
    lines = script.splitlines()
    escaped = str(workspace).replace(" ", "\\ ").replace("#", "\\#").replace("'", "\\'").replace('"', '\\"')
    assert f"#SBATCH --output={escaped}/slurm/%x-%j.out" in lines
    assert "#SBATCH --partition=gpu\\ big" in lines
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    exec_line = next(line for line in lines if line.startswith("exec "))
    words = shlex.split(exec_line)
    assert words[words.index("--workspace") + 1] == str(workspace)
    mkdir = next(line for line in lines if line.startswith("mkdir -p "))
    assert shlex.split(mkdir) == ["mkdir", "-p", f"{workspace}/slurm"]
