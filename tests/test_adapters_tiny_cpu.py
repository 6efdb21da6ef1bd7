"""The README's adapter command on the preset users run, not only on the small test lineage.

`lmforge run --set align.method=lora --set align.dpo.lora=true --set serve.adapters.enabled=true` on
tiny-cpu (the 256-wide, 4M-parameter Llama) through the release: its SLO gate with the preset's own
targets, and both fine-tunes answering by name through the `openai` client. On vLLM's own CPU LoRA
ops this release missed its SLO on 2 cores (issue 44: TTFT p90 4.6 s against 2.5 s); lmforge's
grouped ops (`lmforge.inference.vllm_cpu_lora`) are what it runs here.

The test shortens what does not change how the model is served: fewer training steps, and no
evaluation or quantization stage (`serve.require_evaluation=false`). The served model's shape, the
adapters' rank, the engine settings and the SLO are the preset's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
README_COMMAND = ["align.method=lora", "align.dpo.lora=true", "serve.adapters.enabled=true"]
SHORTER = [
    "stages=[curate, pretrain, align, serve]",
    "serve.require_evaluation=false",
    "pretrain.max_steps=100",
    "align.sft.max_steps=150",
    "align.dpo.max_steps=40",
]


def lmforge(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory):
    workspace = tmp_path_factory.mktemp("tiny-cpu-adapters")
    sets = [a for s in (*README_COMMAND, *SHORTER) for a in ("--set", s)]
    try:
        yield workspace, lmforge("run", "--config", "tiny-cpu", "--local", "--workspace", str(workspace), *sets)
    finally:
        lmforge("serve", "stop", "--workspace", str(workspace), timeout=120)


def test_the_readme_adapter_command_passes_the_presets_slo_on_tiny_cpu(released) -> None:
    workspace, run = released
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    release = json.loads(next(workspace.glob("serve/release/*/release.json")).read_text())
    adapters = release["lineage"]["adapters"]
    assert set(adapters) == {"sft", "dpo"} and adapters["dpo"]["stacked"] == 2 and adapters["dpo"]["rank"] == 32
    # the tiny-cpu model, not the small test lineage's 64-wide one
    base = json.loads((Path(release["model_dir"]) / "config.json").read_text())
    preset = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml").read_text())
    assert base["hidden_size"] == preset["pretrain"]["model"]["hidden_size"] == 256
    slo = json.loads(next(workspace.glob("serve/release/*/slo.json")).read_text())
    target = preset["serve"]["slo"]
    assert {(r["workload"], r["clients"]) for r in slo} == {
        (w, c) for w in ("shared-prefix", "distinct") for c in (1, 8)
    }, slo
    for row in slo:  # the gate passed; the figures say by how much
        assert row["errors"] == 0 and row["ttft_ms_p90"] <= target["ttft_p90_ms"], row
        assert row["tpot_ms_p90"] <= target["tpot_p90_ms"], row


def test_both_fine_tunes_answer_by_name_through_openai(released) -> None:
    from openai import OpenAI

    from serving import release

    workspace, run = released
    assert run.returncode == 0, run.stderr[-2000:]
    record = release.current(workspace)
    assert record is not None
    key, _ = release.api_key(workspace)
    client = OpenAI(base_url=f"{record['endpoint']}/v1", api_key=key, max_retries=0)
    names = json.loads(next(workspace.glob("serve/release/*/release.json")).read_text())["adapters"]
    assert set(names) == {"sft", "dpo"} and set(record["smoke"]) == set(names.values()), names
    for name in names.values():
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=24, temperature=0
        )
        assert reply.model == name and reply.choices[0].finish_reason == "stop", reply
