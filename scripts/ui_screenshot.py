"""Screenshots of the Prefect UI as a person sees it: the latest pipeline run, its artifacts, one artifact page.

    .venv/bin/python scripts/ui_screenshot.py [--api http://127.0.0.1:4200/api] [--out ui-shots] [--artifact KEY ...]

Needs a Chromium (Debian: `apt-get install chromium`; or set CHROMIUM=/path/to/chrome) and a
Prefect server that holds lmforge runs (`lmforge prefect start`, then `lmforge run`). Writes PNGs
of the flow-run page of the newest `lmforge-pipeline` run, of the artifacts list, and of each
artifact named with --artifact (default: pipeline-lineage-graph, pretrain-train-curves,
align-sft-curves, progress-pretrain-train), waiting for the single-page app to render.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_ARTIFACTS = ["pipeline-lineage-graph", "pretrain-train-curves", "align-sft-curves", "progress-pretrain-train"]


def chromium() -> str:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)  # type: ignore[return-value]
    sys.exit("no Chromium found: `apt-get install chromium` (Debian) or set CHROMIUM=/path/to/chrome")


def shoot(url: str, out: Path, width: int = 1500, height: int = 1400) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                "--virtual-time-budget=15000",
                f"--window-size={width},{height}",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    print(f"{out}  <- {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", default=os.environ.get("PREFECT_API_URL", "http://127.0.0.1:4200/api"))
    parser.add_argument("--out", default="ui-shots")
    parser.add_argument("--artifact", action="append", help="artifact key to screenshot (repeatable)")
    args = parser.parse_args()
    os.environ["PREFECT_API_URL"] = args.api
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import ArtifactSort, FlowRunSort

    ui = args.api.removesuffix("/api")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["lmforge-pipeline"])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )
        keys = args.artifact or DEFAULT_ARTIFACTS
        # each key's newest version: its own page shows the content (the key's page is a timeline of
        # versions with the content folded away)
        artifacts: dict = {}
        for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)), sort=ArtifactSort.CREATED_DESC
        ):
            artifacts.setdefault(a.key, a)
    if runs:
        shoot(f"{ui}/runs/flow-run/{runs[0].id}", out / "pipeline-run.png")
    shoot(f"{ui}/artifacts", out / "artifacts.png")
    for key in keys:
        if key in artifacts:
            shoot(f"{ui}/artifacts/artifact/{artifacts[key].id}", out / f"artifact-{key}.png")
        else:
            print(f"no artifact {key!r} on {args.api}", file=sys.stderr)


if __name__ == "__main__":
    main()
