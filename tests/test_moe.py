"""lmforge's own mixture of experts (`pretrain.model.experts`): trained on 2 ranks with its
load-balancing loss, router health as curves and a guardrail finding, exported as Mixtral (or
Qwen2-MoE with a shared expert) that transformers reloads exactly and vLLM serves; the planner
counts total parameters for memory and active ones for FLOPs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from lmforge.errors import ConfigError

MOE = [
    "pretrain.model.experts.num=4",
    "pretrain.model.experts.top_k=2",
    "pretrain.max_steps=100",
    "pretrain.optim.lr=3e-3",
    "pretrain.checkpoint.every_steps=50",
    "pretrain.eval_every=50",
]
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}


@pytest.fixture(scope="module")
def moe(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    from lmforge.engine.executor import run_pipeline_locally
    from tests.conftest import small_config

    workspace = tmp_path_factory.mktemp("moe") / "ws"
    shutil.copytree(curated[0], workspace, symlinks=True)
    return run_pipeline_locally(small_config(workspace, *MOE), ["pretrain"])["pretrain/train"]


def test_an_own_mixture_of_experts_trains_balanced_and_reloads_exactly(moe: dict) -> None:
    out = Path(moe["dir"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 101))
    first, last = sum(r["loss"] for r in rows[:10]) / 10, sum(r["loss"] for r in rows[-10:]) / 10
    assert last < first - 0.5, (first, last)
    # router health: the load-balancing loss and every expert's share of its layer's tokens, per step
    assert all(1.5 < r["router_aux_loss"] < 4.0 for r in rows)  # top-2 of 4, balanced: 2
    assert all(abs(sum(r[f"expert_share/layer{layer}/expert{e}"] for e in range(4)) - 1) < 1e-6
               for r in rows for layer in range(2))  # fmt: skip
    shares = moe["extra"]["expert_shares"]
    assert len(shares) == 2 and all(len(row) == 4 for row in shares)
    assert min(v for row in shares for v in row) > 0.05, shares  # every expert above 5% of the run's tokens
    assert abs(moe["metrics"]["expert_share_min"] - min(v for row in shares for v in row)) < 1e-4
    # the export: Mixtral, reloaded with identical logits (the stage's own parity check, max |diff|)
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert moe["metrics"]["parity_max_abs_logit_diff"] == 0.0
    # memory counts every expert, FLOPs and MFU the two a token is routed to
    budget = moe["extra"]["budget"]
    assert budget["params"] == moe["counts"]["params"]
    assert budget["active_params"] == budget["params"] - 2 * 2 * 3 * 64 * 192


def test_vllm_serves_the_mixture_of_experts_through_the_openai_client(moe: dict, tmp_path: Path) -> None:
    from openai import OpenAI

    from lmforge.inference.vllm_server import EngineConfig, TemporaryServer

    with TemporaryServer(Path(moe["dir"]) / "hf", EngineConfig(), tmp_path, "small-moe") as server:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key)
        reply = client.completions.create(model="small-moe", prompt="The", max_tokens=8, temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens > 0


def test_a_collapsed_router_is_found_once_and_a_rolled_back_step_is_not_counted() -> None:
    import torch

    from training.router import RouterStats

    stats = RouterStats(top_k=1, share=0.01, steps=3)
    alive = torch.tensor([[5.0, 0.0, 0.0]] * 2 + [[0.0, 5.0, 0.0]] * 2)  # expert 2 never chosen
    found = []
    for _ in range(5):
        stats.add((alive, alive), torch.tensor(1.0))
        values, collapsed = stats.close_step(lambda t: t * 2)  # two ranks that saw the same
        found += collapsed
    assert values["expert_share/layer0/expert2"] == 0.0 and values["expert_share_min"] == 0.0
    assert values["router_aux_loss"] == 1.0
    assert found == [{"layer": 0, "expert": 2, "share": 0.0}, {"layer": 1, "expert": 2, "share": 0.0}]
    stats.add((alive, alive), torch.tensor(9.0))
    stats.discard()
    assert stats.close_step(lambda t: t) == ({}, [])
    assert stats.shares()[0] == [0.5, 0.5, 0.0]


def test_the_shared_expert_exports_as_qwen2_moe_and_both_architectures_reload_exactly(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from training.config import ModelConfig
    from training.model import build_model, moe_config

    for shared, architecture in ((False, "MixtralForCausalLM"), (True, "Qwen2MoeForCausalLM")):
        model_cfg = ModelConfig(**SHAPE, experts={"num": 4, "top_k": 2, "shared_expert": shared})
        special = {"bos_id": 1, "eos_id": 1, "pad_id": 0}
        model = build_model(model_cfg, 256, 64, special, seed=0).eval()
        assert moe_config(model_cfg, 256, 64, special).architectures in (None, [architecture])
        model.save_pretrained(tmp_path / architecture)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / architecture).eval()
        assert type(loaded).__name__ == architecture
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_model_parallel_dimensions_are_refused_for_a_mixture_of_experts() -> None:
    from training.config import PretrainConfig
    from training.planner import mesh_candidates

    for field in ("tensor_parallel", "pipeline_parallel"):
        cfg = PretrainConfig.model_validate(
            {"model": {**SHAPE, "tie_embeddings": False, "experts": {"num": 4}}, "distributed": {field: 2}}
        )
        with pytest.raises(ConfigError, match=f"{field} 2 is for dense models") as caught:
            mesh_candidates(cfg, 2, 256)
        assert "\n" not in str(caught.value)
    auto = PretrainConfig.model_validate(
        {"model": {**SHAPE, "experts": {"num": 4}}, "distributed": {"tensor_parallel": "auto"}}
    )
    assert mesh_candidates(auto, 2, 256) == [{}]  # auto never chooses one
    with pytest.raises(ValueError, match="top_k 5 exceeds experts.num 4"):
        PretrainConfig.model_validate({"model": {**SHAPE, "experts": {"num": 4, "top_k": 5}}})


# -- a user's mixture of experts, through alignment, evaluation, quantization and serving ----------------------


@pytest.fixture(scope="module")
def moe_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.base_models import build_moe_base, demo_texts

    root, texts = tmp_path_factory.mktemp("moe-bases"), demo_texts()
    return {kind: build_moe_base(root / f"my-{kind}", texts, kind) for kind in ("mixtral", "qwen2_moe")}


@pytest.mark.parametrize(
    ("kind", "architecture", "recipe"),
    [("mixtral", "MixtralForCausalLM", "sft"), ("qwen2_moe", "Qwen2MoeForCausalLM", "sft -> dpo")],
)
def test_a_users_moe_base_is_aligned_evaluated_quantized_and_served(
    kind: str, architecture: str, recipe: str, moe_bases: dict[str, Path], curated: tuple[Path, dict], tmp_path: Path
) -> None:
    """Mixtral through SFT, Qwen2-MoE through SFT and DPO (the router's auxiliary loss rides along in
    both trainers): each export keeps its architecture, the card reads the lineage, vLLM answers."""
    from openai import OpenAI

    from lmforge.engine.executor import run_pipeline_locally
    from serving import release
    from tests.conftest import small_config
    from tests.test_cli_end_to_end import served

    base = moe_bases[kind]
    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace, symlinks=True)
    quick = [
        f"base_model.path={base}",
        "stages=[align,evaluate,quantize,serve]",
        f"align.dpo.enabled={'dpo' in recipe}",
        "align.dpo.max_steps=10",
        "align.sft.max_steps=60",  # the property is the MoE road, not the answers (120 took 70 s of 2 ranks)
        "evaluate.backends=[hf]",
        "evaluate.backend_models={}",
        "evaluate.tasks=[lmforge_chat_exact]",
        "quantize.schemes=[w8a8-int8]",
        "quantize.gate.enabled=false",
        "serve.slo.enabled=false",  # the SLO gate has its own tests; here: served, answering through openai
    ]
    stages = ["align", "evaluate", "quantize", "serve"]
    try:
        from serving.quantize.schemes import moe_serving_problem
        from serving.quantize.steps import serving_host

        if moe_serving_problem("w8a8-int8", serving_host(), architecture):  # a CPU: refused before any work
            with pytest.raises(ConfigError, match=f"quantize/w8a8-int8: {architecture} is a mixture of experts") as no:
                run_pipeline_locally(small_config(workspace, *quick), stages)
            assert "\n" not in str(no.value) and not list(workspace.glob("quantize/w8a8-int8/*/model"))
            quick.append("quantize.schemes=[]")  # then the model ships unquantized; align and evaluate are cached
        result = run_pipeline_locally(small_config(workspace, *quick), stages)
        sft = result["align/sft"]
        assert sft["metrics"]["heldout_loss_after"] < sft["metrics"]["heldout_loss_before"], sft["metrics"]
        if "dpo" in recipe:  # TRL's DPO adds the router's load-balancing loss, and it was logged
            logged = [json.loads(line) for line in (Path(result["align/dpo"]["dir"]) / "metrics.jsonl").open()]
            aux = [row["aux_loss"] for row in logged if "aux_loss" in row]
            assert aux and all(math.isfinite(a) and a > 0 for a in aux), logged
            assert any("rewards/margins" in row for row in logged), logged
        for step, folder in (("align/sft", "hf"), ("align/dpo", "hf"), ("quantize/w8a8-int8", "model")):
            if step in result:
                config = json.loads((Path(result[step]["dir"]) / folder / "config.json").read_text())
                assert config["architectures"] == [architecture], (step, config["architectures"])
        card = (Path(result["evaluate/report"]["dir"]) / "comparison.md").read_text()
        chain = ["base", *recipe.split(" -> ")]
        for before, after in zip(chain, chain[1:]):  # each step of the lineage against the one before
            assert f"| hf | lmforge_chat_exact | exact_match | {before} -> {after} |" in card, card
        record, key = served(workspace)
        client = OpenAI(base_url=f"{record['endpoint']}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model=record["served_name"], messages=[{"role": "user", "content": "What is 4 + 5?"}], max_tokens=16
        )
        assert reply.choices[0].message.content is not None and reply.usage.completion_tokens > 0
    finally:
        release.stop(workspace)


def test_a_users_moe_base_continues_pretraining_and_takes_lora_on_its_experts(
    moe_bases: dict[str, Path], curated: tuple[Path, dict], tmp_path: Path
) -> None:
    """Continued pretraining of the user's Mixtral (its experts read from its config.json: the router's
    loss and watch as for lmforge's own), then LoRA on attention and on its fused experts (PEFT's
    target_parameters): the adapter holds the experts' update, and the merged export reproduces the
    PEFT model (the stage's own parity check)."""
    from lmforge.engine.executor import run_pipeline_locally
    from tests.conftest import small_config

    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace, symlinks=True)
    lora = [
        f"base_model.path={moe_bases['mixtral']}",
        "stages=[pretrain, align]",
        "pretrain.max_steps=30",
        "pretrain.optim.lr=3e-3",
        "align.dpo.enabled=false",
        "align.method=lora",
        "align.sft.max_steps=20",
        "align.sft.lr=5e-3",
        "align.lora.dropout=0",
        "align.lora.target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]",
    ]
    result = run_pipeline_locally(small_config(workspace, *lora), ["pretrain", "align"])
    pretrained = result["pretrain/train"]
    assert pretrained["metrics"]["final_val_loss"] < pretrained["metrics"]["base_val_loss"], pretrained["metrics"]
    shares = pretrained["extra"]["expert_shares"]  # [layer][expert]: Mixtral's 4 experts in each layer, watched
    assert len(shares) == 2 and all(len(row) == 4 and abs(sum(row) - 1) < 1e-3 for row in shares), shares
    config = json.loads((Path(pretrained["dir"]) / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    sft = result["align/sft"]
    adapter = json.loads((Path(sft["dir"]) / "adapter" / "adapter_config.json").read_text())
    assert {"mlp.experts.down_proj", "mlp.experts.gate_up_proj"} <= set(adapter["target_parameters"])
    assert sft["metrics"]["merge_parity_max_abs_logit_diff"] <= 1e-3
    assert sft["metrics"]["heldout_loss_after"] < sft["metrics"]["heldout_loss_before"], sft["metrics"]
    with pytest.raises(ConfigError, match="align.lora: target_parameters needs dropout: 0"):
        small_config(workspace, *lora[:-2], "align.lora.target_parameters=[mlp.experts.down_proj]")
