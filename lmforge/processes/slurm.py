"""SLURM: an `sbatch` script that runs one stage across the job's nodes with lmforge's cache and resume rules.

Prefect has no SLURM worker; a stage run through `sbatch` is still an lmforge run: the script
builds DeepSpeed's hostfile from `SLURM_JOB_NODELIST` (`scontrol show hostnames`), starts
`lmforge stage STAGE` on the first node with the job's nodes and `--launcher slurm` (DeepSpeed
starts the other nodes' ranks with `srun`), and `exec`s it, so SLURM's SIGTERM before the time
limit or on preemption reaches lmforge, which stops the ranks and keeps the last verified
checkpoint. With `--requeue`, the requeued job runs the same command and resumes from it. The
flow run is tagged `slurm-job-<id>` and every manifest it writes records the job id.

What the config puts into the script is checked here, where it is written, not only where the
config loads (a workspace comes from `--workspace` too, and a config object can be changed in
code): a newline in a `#SBATCH` value would start a shell line, and sbatch stops reading options
at the first line that is not one, so a value with a control character is refused in one line
naming its field. `#SBATCH` values are escaped the way sbatch reads them (a backslash before
whitespace, quotes, `#` and backslashes); shell lines quote with `shlex.quote`.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.engine.remote import is_remote, local_workspace
from lmforge.errors import ConfigError

if TYPE_CHECKING:
    from lmforge.pipelinebase import PipelineBase

REPO_ROOT = Path(__file__).resolve().parents[2]
# the stages that run across nodes, and the config section holding their hostfile and node count
MULTINODE = {"pretrain": "pretrain.distributed", "align": "align.distributed"}


def hostfile_function() -> str:
    """Shell: print one `host slots=N` line per node of the job (DeepSpeed's hostfile format)."""
    return (
        "lmforge_hostfile() {  # $1: slots (GPUs) per node\n"
        '  scontrol show hostnames "$SLURM_JOB_NODELIST" | awk -v slots="$1" \'NF { print $1 " slots=" slots }\'\n'
        "}\n"
    )


def checked(field: str, value: str) -> str:
    """`value` if it holds no newline or other control character; else a ConfigError naming `field`."""
    bad = next((ch for ch in value if ord(ch) < 32 or ord(ch) == 127), None)
    if bad is not None:
        raise ConfigError(
            f"slurm: {field}: {value!r} holds the control character {bad!r}; it would inject a line into the job script"
        )
    return value


def sbatch_word(field: str, value: str) -> str:
    """`value` as one word of a `#SBATCH` line: sbatch splits on whitespace, takes quotes and drops what
    follows a `#`, unless a backslash escapes the character."""
    return "".join("\\" + ch if ch.isspace() or ch in "\\\"'#" else ch for ch in checked(field, value))


def render(config: PipelineBase, stage: str, preset: str, overrides: list[str], workspace: str | None) -> str:
    """The sbatch script for `stage` under the `cluster` section of `config`."""
    c = config.cluster
    if stage not in _stage_names():
        raise ConfigError(f"slurm: no stage named {stage!r} (stages: {', '.join(_stage_names())})")
    if c.nodes > 1 and stage not in MULTINODE:
        raise ConfigError(f"slurm: {stage} runs on one node; cluster.nodes={c.nodes} is for {' and '.join(MULTINODE)}")
    given = checked("workspace", workspace or config.workspace)
    # an object-store workspace is passed on as its URL; the job's logs go to the working copy's folder
    ws = given if is_remote(given) else str(Path(given).resolve())
    logs = f"{local_workspace(config.model_copy(update={'workspace': given})).resolve()}/slurm"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={sbatch_word('name', f'lmforge-{stage}-{config.name}')}",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={c.cpus_per_task}",
        f"#SBATCH --time={sbatch_word('cluster.time', c.time)}",
        f"#SBATCH --output={sbatch_word('workspace', logs)}/%x-%j.out",
        "#SBATCH --signal=B:TERM@180",
    ]
    if c.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={c.gpus_per_node}")
    if c.partition:
        lines.append(f"#SBATCH --partition={sbatch_word('cluster.partition', c.partition)}")
    if c.account:
        lines.append(f"#SBATCH --account={sbatch_word('cluster.account', c.account)}")
    lines.append("#SBATCH --requeue" if c.requeue else "#SBATCH --no-requeue")
    # whole options the user writes as sbatch reads them (their own quoting): only their lines are checked
    lines += [f"#SBATCH {checked('cluster.extra_sbatch', option)}" for option in c.extra_sbatch]
    lines += [
        "",
        "# Rendered by `lmforge slurm render`. SIGTERM (3 minutes before the time limit, or on preemption)",
        "# reaches lmforge through exec: it stops the ranks; a requeued job resumes from the last checkpoint.",
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(logs)}",
        f"cd {shlex.quote(str(REPO_ROOT))}",
        *c.setup,
        "",
        hostfile_function(),
    ]
    command = [str(REPO_ROOT / ".venv" / "bin" / "lmforge"), "stage", stage, "--config", preset, "--workspace", ws]
    for override in overrides:
        command += ["--set", override]
    if stage in MULTINODE:
        section = MULTINODE[stage]
        lines += [
            f'HOSTFILE={shlex.quote(logs)}/hostfile-"$SLURM_JOB_ID"',
            f'lmforge_hostfile {c.gpus_per_node or 1} > "$HOSTFILE"',
            "echo \"nodes: $(tr '\\n' ' ' < \"$HOSTFILE\")\"",
        ]
        tail = (
            f' --set {section}.hostfile="$HOSTFILE" --set {section}.num_nodes="$SLURM_JOB_NUM_NODES"'
            f" --set {section}.node_launcher=slurm --set {section}.launcher=deepspeed"
        )
        if c.gpus_per_node:
            tail += f" --set {section}.num_ranks={c.gpus_per_node}"
    else:
        tail = ""
    lines += ["exec " + " ".join(shlex.quote(p) for p in command) + tail, ""]
    return "\n".join(lines)


def _stage_names() -> list[str]:
    from lmforge.engine.registry import stage_names

    return stage_names()


def submit(script: str, directory: Path) -> tuple[Path, str]:
    """Write the script under `directory` and `sbatch` it; (script path, sbatch's answer)."""
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "slurm submit: `sbatch` is not on PATH (run it on a SLURM login node, or use "
            "`lmforge slurm render` and submit the script yourself)"
        )
    import time

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"lmforge-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(script)
    done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(f"sbatch {path} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return path, done.stdout.strip()


def main_tags() -> list[str]:
    """Prefect tags linking a flow run to the SLURM job it runs in (none outside SLURM)."""
    import os

    job = os.environ.get("SLURM_JOB_ID")
    return [f"slurm-job-{job}"] if job else []
