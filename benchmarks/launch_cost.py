"""What starting a process costs on CPU, lmforge's way against the earlier one, in one command:

    .venv/bin/python benchmarks/launch_cost.py [--model DIR] [--rounds 2]

DIR is a Hugging Face model folder vLLM can serve (e.g. `<workspace>/align/sft/<key>/hf` of the
test lineage). On a 2-core host almost every second a launch costs is CPU, so CPU seconds are the
figure (wall time follows them when the host is busy):

- a vLLM server on CPU (`lmforge.inference.vllm_server.TemporaryServer`, lmforge's own command and
  environment): `serve.engine.cpu_executor: uni` (the model in the engine process) against `mp`
  (vLLM's CPU default, a worker process of its own). CPU of every process of the server until it
  answers, for 20 completions, and over 10 s idle;
- starting training ranks: the launcher's imports (`torch.distributed.run`, what
  `pretrain.distributed.launcher: auto` starts on one node, against DeepSpeed's runner and its
  `launch.py`), and a rank's library imports (`training.device_setup.preload_libraries`, without
  mlflow and scikit-learn, against a plain import of the same libraries), and an alignment rank's
  that is not QLoRA's (the same, without bitsandbytes, against preloaded).

Each figure is the median of `--rounds` runs, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RANK_IMPORTS = "import deepspeed, transformers.models.llama.modeling_llama, trl, peft, accelerate"


def _tree_cpu(pid: int) -> float:
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def vllm_server(model: Path, executor: str) -> dict[str, float]:
    from lmforge.inference.vllm_server import EngineConfig, TemporaryServer

    cfg = EngineConfig.model_validate({"cpu_executor": executor, "max_model_len": 64})
    with tempfile.TemporaryDirectory() as work:
        started = time.time()
        server = TemporaryServer(model, cfg, Path(work))
        try:
            pid = server.service.process.pid
            ready_s, ready_cpu = time.time() - started, _tree_cpu(pid)
            body = json.dumps({"model": "model", "prompt": "the", "max_tokens": 16, "temperature": 0}).encode()
            for _ in range(20):
                request = urllib.request.Request(
                    f"{server.base_url}/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.api_key}"},
                )
                urllib.request.urlopen(request, timeout=60).read()
            served_cpu = _tree_cpu(pid)
            time.sleep(10)
            idle_cpu = _tree_cpu(pid)
        finally:
            server.stop()
    return {
        "ready_s": ready_s,
        "cpu_to_ready_s": ready_cpu,
        "cpu_20_requests_s": served_cpu - ready_cpu,
        "cpu_idle_10s": idle_cpu - served_cpu,
    }


def child_cpu(code: str) -> float:
    """CPU seconds of `python -c code` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model folder vLLM can serve; without it, no vLLM figures")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    if args.model is not None:
        print("vLLM server on CPU (CPU seconds of all its processes)")
        servers = {e: median([vllm_server(args.model, e) for _ in range(args.rounds)]) for e in ("uni", "mp")}
        for field in servers["uni"]:
            uni, mp = servers["uni"][field], servers["mp"][field]
            print(f"  {field:18} uni {uni:7.1f}   mp {mp:7.1f}   uni/mp {uni / mp:5.2f}")

    print("starting training ranks (CPU seconds, fresh processes)")
    launchers = {
        "torchrun": [child_cpu("import torch.distributed.run") for _ in range(args.rounds)],
        "deepspeed runner + launch.py": [
            child_cpu("import deepspeed.launcher.runner") + child_cpu("import deepspeed.launcher.launch")
            for _ in range(args.rounds)
        ],
    }
    torchrun, runner = (statistics.median(v) for v in launchers.values())
    print(f"  launcher           torchrun {torchrun:6.1f}   deepspeed {runner:6.1f}   ratio {torchrun / runner:5.2f}")
    preload = "from training.device_setup import preload_libraries; preload_libraries(); " + RANK_IMPORTS
    lean = statistics.median(child_cpu(preload) for _ in range(args.rounds))
    plain = statistics.median(child_cpu(RANK_IMPORTS) for _ in range(args.rounds))
    print(f"  rank imports       preloaded {lean:5.1f}   plain {plain:6.1f}   ratio {lean / plain:5.2f}  (per rank)")
    # an alignment rank that is not QLoRA's imports its libraries without bitsandbytes (training/align/entry.py)
    no_bnb = (
        "from training.device_setup import imports_without, preload_libraries; preload_libraries()\n"
        f"with imports_without('bitsandbytes'):\n    {RANK_IMPORTS}"
    )
    lean_align = statistics.median(child_cpu(no_bnb) for _ in range(args.rounds))
    print(f"  align rank imports without bitsandbytes {lean_align:5.1f}   preloaded {lean:5.1f}   "
          f"ratio {lean_align / lean:5.2f}  (per rank, not QLoRA)")  # fmt: skip


if __name__ == "__main__":
    main()
