"""Zero-downtime promotion under load: requests sent and failed, and latency p50/p99, before a switch
(the baseline) and during it, for a promotion of a new model on the same endpoint, the rollback of a
candidate that fails to start, and a promotion back.

    .venv/bin/python benchmarks/promotion.py --model DIR [--users 16] [--skip-smoke]

DIR is a Hugging Face model folder (an aligned model of a lineage, e.g.
`<workspace>/align/dpo/<key>/hf`); the script serves it from a scratch workspace through the real
release code (front, drain, readiness, smoke test) and promotes copies of it while `users` clients
(`serving.loadgen`: chat and completions, streamed and not, no retries) ask for the stable alias.
`--skip-smoke --completions-only`: for a model that was never taught to chat (no chat smoke test,
no chat requests).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--pause-s", type=float, default=2.0, help="each user's think time between requests")
    parser.add_argument("--baseline-s", type=float, default=20.0)
    parser.add_argument("--skip-smoke", action="store_true")
    parser.add_argument("--completions-only", action="store_true", help="for a model without a chat template")
    args = parser.parse_args()

    from serving import release
    from serving.config import ServeConfig
    from serving.loadgen import KINDS, SteadyLoad, summary

    if args.skip_smoke:
        release.smoke_each = lambda record, cfg, workspace: {}  # type: ignore[assignment]
    cfg = ServeConfig.model_validate({"slo": {"enabled": False}})
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        models = {name: work / name for name in ("first", "second", "broken")}
        for folder in models.values():
            shutil.copytree(args.model, folder)
        weights = next(models["broken"].glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:4096])  # torn: the server cannot load it
        workspace = work / "workspace"
        first = release.start_and_promote(models["first"], "first", cfg, workspace)
        key, _ = release.api_key(workspace)
        kinds = ("completion", "completion-stream") if args.completions_only else KINDS
        load = SteadyLoad(
            first["endpoint"], key, str(cfg.alias), users=args.users, pause_s=args.pause_s, kinds=kinds
        ).start()
        marks = [time.time()]
        try:
            time.sleep(args.baseline_s)
            marks.append(time.time())
            release.start_and_promote(models["second"], "second", cfg, workspace)
            marks.append(time.time())
            try:
                release.start_and_promote(models["broken"], "broken", cfg, workspace)
            except Exception as exc:  # noqa: BLE001 - the rollback is the point
                print(f"rollback: {str(exc)[:160]}")
            marks.append(time.time())
            release.start_and_promote(models["first"], "first", cfg, workspace)
            marks.append(time.time())
            time.sleep(5)
        finally:
            records = load.stop()
            release.stop(workspace)
        marks.append(time.time())
    phases = ("before (baseline)", "promotion", "rollback", "promotion back", "after")
    rows = {name: summary(records, start, end) for name, (start, end) in zip(phases, zip(marks, marks[1:]))}
    base = rows["before (baseline)"]["p99_ms"]
    print(f"{'phase':<18} {'seconds':>8} {'sent':>6} {'failed':>7} {'p50 ms':>8} {'p99 ms':>8} {'p99 / baseline':>15}")
    for (name, row), (start, end) in zip(rows.items(), zip(marks, marks[1:])):
        print(
            f"{name:<18} {end - start:8.1f} {row['sent']:6d} {row['failed']:7d} {row['p50_ms']:8.1f} "
            f"{row['p99_ms']:8.1f} {row['p99_ms'] / base:14.2f}x"
        )
    print(json.dumps({name: {k: v for k, v in row.items() if k != "errors" or v} for name, row in rows.items()}))


if __name__ == "__main__":
    main()
