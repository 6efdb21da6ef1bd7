"""The command that starts alignment ranks: accelerate, torchrun, or DeepSpeed's launcher with a hostfile.

The same entry point (`training.align.entry`) runs under each; which one is how, not what,
so it is not in the cache key. On a CPU-only machine accelerate needs `--multi_gpu` to start
more than one process (`--cpu` starts one unless MPI is installed); the Trainer then runs on
the CPU because `use_cpu` is set, with gloo between the ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

ENTRY = "training.align.entry"


def build_command(launcher: str, num_ranks: int, spec_path: Path, master_port: int,
                  hostfile: str | None = None, num_nodes: int = 1, node_launcher: str = "pdsh") -> list[str]:
    module = [ENTRY, "--spec", str(spec_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={num_ranks}",
                f"--master_port={master_port}", "-m", *module]
    if launcher == "deepspeed":
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(master_port)]
        if hostfile:
            command += ["--hostfile", hostfile, "--num_nodes", str(num_nodes), "--launcher", node_launcher]
        return command + ["--num_gpus", str(num_ranks), "--module", *module]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_ranks),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(master_port)]
    if num_ranks > 1:
        command.append("--multi_gpu")
    return command + ["-m", *module]
