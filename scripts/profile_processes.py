"""Where a command's CPU goes, by kind of process and by the test folder a process worked in.

    .venv/bin/python scripts/profile_processes.py run --out procs.json -- bash scripts/test.sh
    .venv/bin/python scripts/profile_processes.py report procs.json

`run` samples every process on the machine twice a second (psutil: command line, parent, CPU
seconds so far) while the command runs, and writes the last sample of each process that started
after the command did. `report` sums them by kind (a training rank, its launcher, a vLLM server, a
Prefect server, lm-eval, a unit worker of the local process pool, ...) and by the pytest folder in
the command line (a test's tmp_path, or the shared lineage's stage), a child process counted where
its parent is. The test report in CI's log says which test files cost the most; this says what in
them does: on 2 cores the suite's time was a third process start-up (a 2-rank launch imports
torch, transformers and DeepSpeed twice, about 25 CPU-s before its first step).

Processes that live under half a second are missed, and each process's last half second; the
sampler itself costs about 2% of a core. By hand because nothing installed here attributes CPU to
process kinds over a whole run (`pytest --durations` and the CPU column see only waited-for
children, `acct` only the executable's name).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

KINDS = (  # the first pattern that matches the command line names its kind
    ("launcher", r"torch\.distributed\.run|torchrun|deepspeed\.launcher|accelerate(/commands)? launch|supervise"),
    ("rank", r"training\.train_entry|training\.align\.entry|training\.\w+_entry|LOCAL_RANK"),
    ("vllm", r"vllm|EngineCore"),
    ("parity", r"serving\.parity_entry"),
    ("lm-eval", r"lm_eval|evaluation\."),
    ("quantize", r"quantiz|llmcompressor"),
    ("llama.cpp", r"llama_cpp|llama-|gguf"),
    ("prefect server", r"prefect server start|prefect\.server\.api\.server"),
    ("prefect flow run", r"prefect\.engine"),
    ("prefect worker", r"prefect worker|worker start"),
    ("mlflow", r"mlflow|gunicorn"),
    ("s3 server", r"moto|s3server"),
    ("unit worker", r"multiprocessing\.spawn|multiprocessing-fork"),
    ("lmforge cli", r"lmforge\.cli|/lmforge "),
    ("pytest", r"pytest|execnet|sys\.stdin\.readline"),
    ("setup and lint", r"pip |pip/_vendor|mypy|ruff|mkdocs|cmake|cc1|c\+\+|\bld\b|ninja"),
)


def kind_of(command: str) -> str:
    for name, pattern in KINDS:
        if re.search(pattern, command):
            return name
    return "other"


def sample(out: Path, stop: threading.Event, since: float, every: float = 0.5) -> None:
    import psutil

    seen: dict[str, dict] = {}
    me = os.getpid()
    last_write = 0.0
    while True:
        for proc in psutil.process_iter(["pid", "ppid", "create_time", "cmdline", "name", "cpu_times"]):
            info = proc.info
            if info["pid"] == me or info["cpu_times"] is None or (info["create_time"] or 0) < since:
                continue
            key = f"{info['pid']}-{info['create_time']}"
            cpu = info["cpu_times"].user + info["cpu_times"].system
            record = seen.get(key)
            if record is None:
                command = " ".join(info["cmdline"] or [info["name"] or ""])[:500]
                seen[key] = {"pid": info["pid"], "ppid": info["ppid"], "start": info["create_time"], "cmd": command}
                record = seen[key]
            record["cpu"], record["last"] = cpu, time.time()
        if stop.is_set() or time.time() - last_write > 30:
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(list(seen.values())))
            tmp.replace(out)
            last_write = time.time()
            if stop.is_set():
                return
        stop.wait(every)


def run(out: Path, command: list[str]) -> int:
    stop = threading.Event()
    since = time.time() - 1
    thread = threading.Thread(target=sample, args=(out, stop, since), daemon=True)
    thread.start()
    child = subprocess.Popen(command)
    try:
        rc = child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        rc = child.wait()
    stop.set()
    thread.join()
    report(out)
    return rc


FOLDER = re.compile(r"/popen-gw\d+/([^/ ]+)|/(lineage/[^/ ]+)|/pytest-\d+/([^/ ]+)")


def _folder(record: dict, by_pid: dict[int, dict], depth: int = 0) -> str:
    """The pytest folder a process worked in: a test's tmp_path (`popen-gwN/NAME0`, or `pytest-N/NAME0`
    without xdist) or the shared lineage's stage (`lineage/STAGE`), from its command line, else its
    parent's; `-` for none."""
    match = FOLDER.search(record["cmd"])
    if match:
        return re.sub(r"\d+$", "", next(g for g in match.groups() if g))
    parent = by_pid.get(record["ppid"])
    if parent is not None and depth < 6 and kind_of(parent["cmd"]) != "pytest":
        return _folder(parent, by_pid, depth + 1)
    return "-"


def report(path: Path, top: int = 40) -> None:
    records = json.loads(path.read_text())
    by_pid = {r["pid"]: r for r in records}
    total = sum(r["cpu"] for r in records) or 1.0
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    folders: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in records:
        kind = kind_of(record["cmd"])
        kinds[kind][0] += 1
        kinds[kind][1] += record["cpu"]
        folders[_folder(record, by_pid)][kind] += record["cpu"]
    print(f"{'kind':18s} {'processes':>9s} {'CPU-s':>8s} {'per process':>11s} {'share':>6s}")
    for kind, (count, cpu) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:18s} {count:9d} {cpu:8.0f} {cpu / count:11.1f} {100 * cpu / total:5.1f}%")
    print(f"{'in all':18s} {len(records):9d} {total:8.0f}")
    print(f"\nCPU-s by test folder (a child process counted where its parent is), the {top} largest:")
    for folder, counter in sorted(folders.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        parts = ", ".join(f"{k} {v:.0f}" for k, v in counter.most_common(4))
        print(f"{sum(counter.values()):8.0f}  {folder[:48]:48s} {parts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    run_parser = sub.add_parser("run", help="run a command and sample every process while it runs")
    run_parser.add_argument("--out", type=Path, default=Path("procs.json"))
    run_parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    report_parser = sub.add_parser("report", help="the report of a sample file")
    report_parser.add_argument("file", type=Path)
    report_parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    if args.what == "report":
        report(args.file, args.top)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run: name the command after --")
    return run(args.out, command)


if __name__ == "__main__":
    sys.exit(main())
