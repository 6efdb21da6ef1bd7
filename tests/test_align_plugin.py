"""The seam is real: an alignment method another package registers goes through align -> evaluate ->
serve with no edit to lmforge. The package here is a real dist-info on the path, as pip installs it,
with one entry point in the `lmforge.align_methods` group; everything runs in a fresh process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

IPO_PACKAGE = '''
"""IPO (Azar et al. 2023): DPO's data and frozen reference with a squared loss on the log-ratio margin."""

from typing import Any, ClassVar

from pydantic import Field

from lmforge.engine.stage import Product
from training.align.methods import PreferenceMethod
from training.align.methods.sft import SFT_MODEL
from training.align.sections import TrainConfig


class IpoConfig(TrainConfig):
    beta: float = Field(0.1, gt=0, description="IPO's tau: the margin aimed at is 1/(2 tau).")
    lr: float = Field(5e-7, gt=0)
    max_steps: int = Field(100, ge=1)


class IPO(PreferenceMethod):
    name = "ipo"
    config = IpoConfig
    description = "Identity preference optimisation with TRL's DPOTrainer (loss_type ipo)"
    starts: ClassVar[tuple[Product, ...]] = (SFT_MODEL,)

    def trainer(self, spec: dict[str, Any], model: Any, tokenizer: Any, callbacks: list[Any]) -> Any:
        from trl import DPOConfig, DPOTrainer

        from training.align.kit import dataset, load_model, peft_config, training_args

        args = training_args(spec, DPOConfig, beta=spec["config"]["beta"], loss_type=["ipo"])
        return DPOTrainer(
            model=model,
            ref_model=load_model(spec["base_dir"], spec["precision"]),
            args=args,
            train_dataset=dataset(spec["train"], ["prompt", "chosen", "rejected"]),
            processing_class=tokenizer,
            peft_config=peft_config(spec),
            callbacks=callbacks,
        )
'''

RUN = """
import json, sys
from pathlib import Path

from openai import OpenAI

from lmforge.engine.executor import run_pipeline_locally
from lmforge.engine.registry import role_names
from serving import release
from tests.conftest import small_config
from tests.preference_methods import small

ws, port = Path(sys.argv[1]), sys.argv[2]
# lr 1e-4, not the other methods' 1e-3: IPO's squared loss aims at a margin of 1/(2 beta) = 5, and at
# 1e-3 its 12 steps sometimes left a model that answers nothing (the release's smoke test then refuses it)
ipo = small("ipo", "align.ipo.lr=1e-4")
config = small_config(ws, *ipo, "evaluate.models=[sft, ipo]", "evaluate.backends=[hf]", "serve.model=ipo",
                      "serve.front=false", f"serve.port={port}", "serve.slo.concurrency=[1]")
try:
    manifests = run_pipeline_locally(config, ["align", "evaluate", "serve"])
    report = json.loads((Path(manifests["evaluate/report"]["dir"]) / "report.json").read_text())
    extra = manifests["serve/release"]["extra"]
    record = release.current(ws)
    key, _ = release.api_key(ws)
    client = OpenAI(base_url=f"{record['endpoint']}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model=extra["served_name"], messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                           max_tokens=16, temperature=0)
    print(json.dumps({
        "roles": role_names(),
        "ipo": {k: manifests["align/ipo"][k] for k in ("counts", "metrics")},
        "world_size": manifests["align/ipo"]["extra"]["world_size"],
        "evaluated": report["models"],
        "card": (Path(manifests["evaluate/report"]["dir"]) / "comparison.md").read_text(),
        "served_name": extra["served_name"],
        "lineage_role": extra.get("lineage", {}).get("model", {}).get("role"),
        "reply": reply.choices[0].finish_reason,
    }))
finally:
    release.stop(ws)
"""


@pytest.mark.slow
def test_a_method_a_package_registers_is_aligned_evaluated_and_served(evaluated: dict, tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "ipo_method-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "ipo_method.py").write_text(IPO_PACKAGE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ipo-method\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lmforge.align_methods]\nipo = ipo_method:IPO\n")
    workspace = tmp_path / "ws"
    shutil.copytree(Path(evaluated["evaluate/report"]["dir"]).parents[2], workspace)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(workspace), str(port)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "ipo" in seen["roles"]  # a lineage role from the registry, as the built-ins'
    assert seen["world_size"] == 2 and seen["ipo"]["counts"]["steps"] == 12  # on 2 ranks, from the cached SFT
    m = seen["ipo"]["metrics"]
    low, high = m["preference_accuracy_delta_ci"]  # measured like DPO: the paired change and its interval
    assert low <= m["preference_accuracy_delta"] <= high
    assert "ipo" in seen["evaluated"] and "ipo" in seen["card"]  # evaluated and on the card
    assert "-ipo" in seen["served_name"] and seen["lineage_role"] == "ipo"  # served under its role's name
    assert seen["reply"] in ("stop", "length")  # the official client through the guard
