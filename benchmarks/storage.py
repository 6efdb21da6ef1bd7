"""Object-storage workspace: lmforge's publish and fetch of a step output against fsspec's own
`put`/`get` of the same files, and a cached rerun on an S3 workspace against the same rerun on a
local one.

    .venv/bin/python benchmarks/storage.py [--mb 256] [--files 24] [--repeats 3] [--endpoint URL]

The store is moto's S3 server on 127.0.0.1, started here (or any S3 endpoint given with
`--endpoint`, credentials from the environment). Both paths move the same output: one large
weights file and `--files` small ones (a model folder's shape), `--mb` MB in all.

- transfer: lmforge publishes (a manifest check, the files through fsspec's batched `put`, the
  manifest last with a conditional create) and fetches into an empty working copy (fsspec's
  batched `get`, then every file's SHA-256 checked against the manifest, the manifest written
  last); the baseline is `fs.put` / `fs.get` of the same files, nothing checked. Runs alternate
  and the best of `--repeats` is kept for each.
- cached rerun: the small test preset's curation stage (9 steps) computed once into a local
  workspace and once into `s3://`, then rerun with every output reused: on the local workspace,
  on the S3 workspace from the machine that made it (its working copy warm), and from a fresh
  machine (an empty working copy: every output downloaded and verified).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RERUN = """
import sys, time
from lmforge.config import load_config
from lmforge.engine.executor import run_pipeline_locally
from tests.conftest import SMALL_CURATE
workspace, local, endpoint = sys.argv[1:4]
extra = [f"runtime.storage.options={{endpoint_url: {endpoint}}}", f"runtime.storage.local_copy={local}"]
config = load_config("tiny-cpu", [*SMALL_CURATE, *(extra if "://" in workspace else [])], workspace)
started = time.perf_counter()
manifests = run_pipeline_locally(config, ["curate"])
print("SECONDS", time.perf_counter() - started, len(manifests))
"""


def start_moto() -> tuple[object, str]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def make_output(directory: Path, mb: int, files: int) -> None:
    directory.mkdir(parents=True)
    small = 64 * 1024
    with open(directory / "model.safetensors", "wb") as handle:
        remaining = mb * 2**20 - files * small
        while remaining > 0:
            chunk = min(remaining, 16 * 2**20)
            handle.write(os.urandom(chunk))
            remaining -= chunk
    for i in range(files):
        (directory / f"part-{i:03d}.json").write_bytes(os.urandom(small))


def transfer(endpoint: str, mb: int, files: int, repeats: int, scratch: Path) -> dict[str, float]:
    import s3fs

    from lmforge.engine.remote import FsspecStore
    from lmforge.engine.store import StageStore

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    source = scratch / "source"
    out = source / "demo" / "step" / "k0"
    make_output(out, mb, files)
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    manifest = StageStore(source).finish(out, {"step": "demo/step", "key": "k0"})
    names = list(manifest["outputs"])
    best = {"publish": 1e9, "put": 1e9, "fetch": 1e9, "get": 1e9}
    for r in range(repeats):
        remote = FsspecStore(f"s3://{bucket}/lm{r}", {"endpoint_url": endpoint})
        started = time.perf_counter()
        remote.publish("demo/step", "k0", out, manifest)
        best["publish"] = min(best["publish"], time.perf_counter() - started)

        started = time.perf_counter()
        fs.put([str(out / n) for n in names], [f"{bucket}/plain{r}/{n}" for n in names])
        best["put"] = min(best["put"], time.perf_counter() - started)

        target = scratch / f"fetch{r}" / "demo" / "step" / "k0"
        started = time.perf_counter()
        problem = remote.fetch("demo/step", "k0", target, manifest)
        best["fetch"] = min(best["fetch"], time.perf_counter() - started)
        assert problem is None, problem

        plain = scratch / f"get{r}"
        plain.mkdir()
        started = time.perf_counter()
        fs.get([f"{bucket}/plain{r}/{n}" for n in names], [str(plain / n) for n in names])
        best["get"] = min(best["get"], time.perf_counter() - started)
        shutil.rmtree(target.parents[2])
        shutil.rmtree(plain)
    return {"mb": size, **{k: size / v for k, v in best.items()}}


def rerun(endpoint: str, scratch: Path, repeats: int) -> dict[str, float]:
    import s3fs

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(bucket)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    scratch.mkdir(parents=True, exist_ok=True)

    def run(workspace: str, local: Path) -> float:
        done = subprocess.run([sys.executable, "-c", RERUN, workspace, str(local), endpoint], env=env, cwd=scratch,
                              capture_output=True, text=True, timeout=1800)  # fmt: skip
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        return float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("SECONDS")))

    local_ws, s3_ws = scratch / "local-ws", f"s3://{bucket}/ws"
    first = {"local": run(str(local_ws), local_ws), "s3": run(s3_ws, scratch / "copy-a")}
    best = {"local": 1e9, "s3_warm": 1e9, "s3_fresh": 1e9}
    for r in range(repeats):
        best["local"] = min(best["local"], run(str(local_ws), local_ws))
        best["s3_warm"] = min(best["s3_warm"], run(s3_ws, scratch / "copy-a"))
        best["s3_fresh"] = min(best["s3_fresh"], run(s3_ws, scratch / f"fresh-{r}"))
    return {"first_local": first["local"], "first_s3": first["s3"], **best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--endpoint", help="an S3 endpoint; default: moto's server started here")
    parser.add_argument("--skip-rerun", action="store_true")
    args = parser.parse_args()
    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        os.environ.setdefault(name, value)
    server, endpoint = (None, args.endpoint) if args.endpoint else start_moto()
    scratch = Path(tempfile.mkdtemp(prefix="lmforge-storage-bench-"))
    try:
        t = transfer(endpoint, args.mb, args.files, args.repeats, scratch / "transfer")
        print(f"output: {t['mb']:.0f} MB in {args.files + 1} files, best of {args.repeats}")
        print(f"upload:   lmforge publish {t['publish']:.0f} MB/s | fsspec put {t['put']:.0f} MB/s | "
              f"ratio {t['publish'] / t['put']:.2f}x")  # fmt: skip
        print(f"download: lmforge fetch (SHA-256 verified) {t['fetch']:.0f} MB/s | fsspec get {t['get']:.0f} MB/s | "
              f"ratio {t['fetch'] / t['get']:.2f}x")  # fmt: skip
        if not args.skip_rerun:
            r = rerun(endpoint, scratch / "rerun", args.repeats)
            print(f"curation (9 steps) computed: local {r['first_local']:.1f} s | s3 {r['first_s3']:.1f} s")
            print(f"cached rerun: s3, warm working copy {r['s3_warm']:.2f} s | local workspace {r['local']:.2f} s | "
                  f"ratio {r['s3_warm'] / r['local']:.2f}x")  # fmt: skip
            print(f"cached rerun: s3, fresh machine (downloads, verifies) {r['s3_fresh']:.2f} s | "
                  f"local workspace {r['local']:.2f} s | ratio {r['s3_fresh'] / r['local']:.2f}x")  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if server is not None:
            server.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
