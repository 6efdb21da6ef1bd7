"""A cached rerun of the whole pipeline: `lmforge run` (Prefect) side by side with `lmforge run --local`.

    .venv/bin/python benchmarks/cached_rerun.py                       # workspace-bench/, 5 repetitions
    .venv/bin/python benchmarks/cached_rerun.py --workspace WS --repeats 7 --set quantize.enabled=false
    .venv/bin/python benchmarks/cached_rerun.py --with-server         # also with `lmforge prefect start` running

Every step of a cached rerun is a cache hit: what is left is lmforge's own overhead (imports,
keys and code identities, verifying outputs, the serving stage's check of the running server).
`--local` does the same planning and verification without Prefect, so it is the floor the
plain run is compared with. With no Prefect server running, a plain `lmforge run` whose every
step is reusable starts no temporary server (it would record runs nobody can browse); with
`--with-server`, the same rerun is also measured as a recorded Prefect run (flows, task runs,
artifacts) on a managed server.

The workspace is populated first when it holds no complete run (one full `lmforge run`: about
15-25 minutes on 2 cores; the served model stays running afterwards, as after `lmforge run`). Each
mode then runs once untimed (warm page cache; a served model that was not running is started
again) and `--repeats` times timed, alternating, each as a fresh `lmforge` process. A timed run
that computed anything is an error: then it was not a cached rerun. Prints every wall time,
the median of each mode and the ratio. `--stop-serving` stops the served model at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^(\d+) steps, (\d+) cache hits, (\d+) computed", re.MULTILINE)


def lmforge(*args: str) -> list[str]:
    """The lmforge command line of this environment (the console script beside this Python)."""
    script = Path(sys.executable).with_name("lmforge")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "lmforge.cli", *args]


def run(mode: str, args: argparse.Namespace, env: dict[str, str]) -> tuple[float, str]:
    command = lmforge("run", "--workspace", args.workspace, *[f"--set={s}" for s in args.set])
    if mode == "local":
        command.append("--local")
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return seconds, done.stdout


def computed_steps(stdout: str) -> tuple[int, int]:
    found = SUMMARY.search(stdout)
    if found is None:
        sys.exit(f"no run summary in the output:\n{stdout[-2000:]}")
    return int(found.group(1)), int(found.group(3))


def populate(args: argparse.Namespace, env: dict[str, str]) -> None:
    print(
        f"populating {args.workspace}: one full `lmforge run` computes every step "
        "(about 15-25 minutes on 2 cores; its log streams below) ...",
        flush=True,
    )
    started = time.perf_counter()
    command = lmforge("run", "--workspace", args.workspace, *[f"--set={s}" for s in args.set])
    if subprocess.run(command, cwd=ROOT, env=env).returncode != 0:
        sys.exit("populating the workspace failed (see the log above)")
    print(f"populated in {(time.perf_counter() - started) / 60:.1f} min\n", flush=True)


def populated(workspace: Path) -> bool:
    """A complete run left the served model's record and a manifest under every step folder it used."""
    return (workspace / "serve" / "release" / ".latest.json").exists()


def measure(modes: list[str], args: argparse.Namespace, env: dict[str, str]) -> dict[str, list[float]]:
    for mode in modes:  # untimed: page cache, and a served model that is not running is started again
        print(f"warm-up: {mode} ...", flush=True)
        run(mode, args, env)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for repeat in range(1, args.repeats + 1):
        for mode in modes:
            seconds, stdout = run(mode, args, env)
            steps, computed = computed_steps(stdout)
            if computed:
                sys.exit(
                    f"{mode}: {computed} of {steps} steps were computed: not a cached rerun (did the "
                    "workspace, the config or the code change during the benchmark?)"
                )
            if mode == "prefect" and "no Prefect run was needed" not in stdout and not args.with_server_now:
                sys.exit("a plain `lmforge run` went through Prefect although every step was a cache hit")
            times[mode].append(seconds)
            print(f"  {repeat}/{args.repeats}  {mode:8} {seconds:6.2f} s  ({steps} steps, all cache hits)", flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace", default=str(ROOT / "workspace-bench"), help="default: workspace-bench/")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument(
        "--with-server",
        action="store_true",
        help="also measure with a managed Prefect server running (`lmforge prefect start`)",
    )
    parser.add_argument("--stop-serving", action="store_true", help="stop the served model at the end")
    args = parser.parse_args()
    args.workspace = str(Path(args.workspace).resolve())
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # each run finds its own API
    running = subprocess.run(lmforge("prefect", "status"), cwd=ROOT, env=env, capture_output=True, text=True).stdout
    if running.startswith("running"):
        sys.exit(
            "a managed Prefect server is running (`lmforge prefect stop` first): `lmforge run` would use it, "
            "and the figures would not be those of a plain `lmforge run` (see --with-server)"
        )
    if not populated(Path(args.workspace)):
        populate(args, env)

    args.with_server_now = False
    times = measure(["prefect", "local"], args, env)
    if args.with_server:
        args.with_server_now = True
        print("starting a managed Prefect server (lmforge prefect start) ...", flush=True)
        subprocess.run(lmforge("prefect", "start"), cwd=ROOT, env=env, check=True, capture_output=True)
        try:
            times["server"] = measure(["prefect"], args, env)["prefect"]
        finally:
            subprocess.run(lmforge("prefect", "stop"), cwd=ROOT, env=env, capture_output=True)

    print(f"\ncached rerun of {args.workspace} ({os.cpu_count()} CPUs), median of {args.repeats}:")
    labels = {
        "prefect": "lmforge run",
        "local": "lmforge run --local",
        "server": "lmforge run, server running",
    }
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    for mode, median in medians.items():
        print(f"  {labels[mode]:30} {median:6.2f} s   (min {min(times[mode]):.2f}, max {max(times[mode]):.2f})")
    print(f"  ratio lmforge run / --local      {medians['prefect'] / medians['local']:6.2f}x")
    if "server" in medians:
        print(f"  ratio server running / --local   {medians['server'] / medians['local']:6.2f}x")
    if args.stop_serving:
        subprocess.run(
            lmforge("serve", "stop", "--workspace", args.workspace, *[f"--set={s}" for s in args.set]),
            cwd=ROOT,
            env=env,
        )


if __name__ == "__main__":
    main()
