"""Alignment: data (built in and the user's, malformed records quarantined), SFT and DPO with TRL on
2 CPU ranks, exports that load and stop at <|im_end|>, LoRA merge parity. A killed alignment rank's resume
(`training/align/entry.py`, one code path for every method) is tested on KTO (test_kto.py: the same key and
held-out figures as the uninterrupted run) and on QLoRA under Prefect (test_base_model.py)."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from lmforge.engine.executor import execute_step, graph, make_pool, pool_unit_runner, run_pipeline_locally
from lmforge.engine.store import StageStore
from tests.conftest import SMALL_ALIGN, small_config

SFT_STEPS = int(next(o.split("=")[1] for o in SMALL_ALIGN if o.startswith("align.sft.max_steps=")))


def _run_data_step(workspace: Path, *extra: str) -> dict:
    config = small_config(workspace, *extra)
    store = StageStore(workspace)
    with make_pool(1) as pool:
        manifest, _ = execute_step(graph().get("align/data"), config, store, {}, pool_unit_runner(pool, store))
    return manifest


def test_builtin_data_is_verifiable_split_by_id_and_written_for_evaluation(tmp_path: Path) -> None:
    from training.align.data import GENERATORS

    manifest = _run_data_step(tmp_path)
    out = Path(manifest["dir"])
    sft = [json.loads(line) for line in (out / "sft" / "train.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (out / "heldout_sft.jsonl").read_text().splitlines()]
    prefs = [json.loads(line) for line in (out / "heldout_preferences.jsonl").read_text().splitlines()]
    assert {r["task"] for r in sft} == set(GENERATORS) | {"dialogue"}
    assert not {r["id"] for r in sft} & {r["id"] for r in heldout}
    add = next(r for r in heldout + sft if r["task"] == "add")
    a, b = [int(x) for x in add["messages"][-2]["content"].replace("?", " ").replace(".", " ").split() if x.isdigit()]
    assert add["answer"] == str(a + b) == add["messages"][-1]["content"]
    assert prefs and all(p["chosen"] != p["rejected"] and p["chosen"][0]["content"] == p["answer"] for p in prefs)
    counts = manifest["counts"]["sft"]
    assert counts["input"] == counts["train"] + counts["heldout"] + counts["quarantined"] + counts["duplicates"]
    again = _run_data_step(tmp_path / "other")  # the split follows ids, not order or machine
    assert (Path(again["dir"]) / "heldout_sft.jsonl").read_text() == (out / "heldout_sft.jsonl").read_text()


def test_malformed_user_records_are_quarantined_and_counted(tmp_path: Path) -> None:
    sft = tmp_path / "chat.jsonl"
    good = [
        {"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    ]
    sft.write_text(
        "\n".join(
            [json.dumps(g) for g in good]
            + [
                '{"messages": [{"role": "user", "content": "broken',
                json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
                json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}),
                json.dumps({"prompt": "2+2?", "completion": "4"}),
            ]
        )
        + "\n"
    )
    dpo = tmp_path / "prefs.jsonl"
    dpo.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}),
                json.dumps({"prompt": "3+3?", "rejected": "7"}),
                json.dumps({"prompt": "4+4?", "chosen": "8", "rejected": "8"}),
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": "1+1?"}],
                        "chosen": [{"role": "assistant", "content": "2"}],
                        "rejected": [{"role": "assistant", "content": "3"}],
                    }
                ),
            ]
        )
        + "\n"
    )
    manifest = _run_data_step(tmp_path / "ws", f"align.sft.inputs=[{sft}]", f"align.dpo.inputs=[{dpo}]")
    counts = manifest["counts"]
    assert counts["sft"]["input"] == 14 and counts["sft"]["quarantined"] == 3
    assert counts["sft"]["train"] + counts["sft"]["heldout"] == 11
    assert counts["dpo"]["input"] == 4 and counts["dpo"]["quarantined"] == 2
    quarantine = [json.loads(line) for line in (Path(manifest["dir"]) / "quarantine.jsonl").read_text().splitlines()]
    reasons = sorted((q["dataset"], q["reason"].split(" ")[0], q["line"]) for q in quarantine)
    assert reasons == [
        ("dpo", "identical_pair", 3),
        ("dpo", "missing_chosen", 2),
        ("sft", "empty_assistant_turn", 13),
        ("sft", "invalid_json", 11),
        ("sft", "unknown_role", 12),
    ]
    assert all(q["file"].endswith(("chat.jsonl", "prefs.jsonl")) for q in quarantine)


@pytest.mark.slow
def test_sft_and_dpo_train_on_two_ranks_and_export_models_that_stop_at_end_of_turn(aligned: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    for step in ("align/sft", "align/dpo"):
        manifest = aligned[step]
        assert manifest["extra"]["world_size"] == 2
        hf = Path(manifest["dir"]) / "hf"
        assert not (hf / "training_args.bin").exists() and (hf / "model.safetensors").exists()
        tokenizer = AutoTokenizer.from_pretrained(str(hf))
        model = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert im_end in model.generation_config.eos_token_id
        assert tokenizer.model_max_length == model.config.max_position_embeddings
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )

        stops = list(model.generation_config.eos_token_id)

        class EndAt(LogitsProcessor):  # the model says <|im_end|> as its 4th token: generation must stop there
            def __call__(self, input_ids, scores):  # type: ignore[no-untyped-def]
                made = input_ids.shape[1] - prompt["input_ids"].shape[1]  # noqa: B023 - used within this iteration
                if made < 3:  # no stop token before (a tiny model may say one at any point)
                    scores[:, stops] = -float("inf")  # noqa: B023
                elif made == 3:
                    scores[:] = -float("inf")
                    scores[:, im_end] = 0  # noqa: B023
                return scores

        with torch.no_grad():
            out = model.generate(
                **prompt, max_new_tokens=20, do_sample=False, logits_processor=LogitsProcessorList([EndAt()])
            )
        new = out[0, prompt["input_ids"].shape[1] :].tolist()
        assert len(new) == 4 and new[-1] == im_end
    metrics = [
        json.loads(line) for line in (Path(aligned["align/dpo"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    logged = set().union(*metrics)
    assert {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "kl_chosen",
        "tokens_per_s",
        "heldout_exact_match",
    } <= logged
    assert list((Path(aligned["align/sft"]["dir"]) / "tensorboard").rglob("events.out.tfevents.*"))


@pytest.mark.slow
def test_sft_lowers_held_out_assistant_loss_below_the_pretrained_models(aligned: dict) -> None:
    m = aligned["align/sft"]["metrics"]
    assert m["heldout_loss_after_ci"][1] < m["heldout_loss_before_ci"][0], m  # the intervals do not even touch
    assert m["tokens_per_s"] > 0 and aligned["align/sft"]["counts"]["steps"] == SFT_STEPS


@pytest.mark.slow
def test_changing_dpo_beta_reruns_only_dpo(aligned: dict) -> None:
    from lmforge.engine.explain import explain

    workspace = Path(aligned["align/sft"]["dir"]).parents[2]
    lines = {e.step: e for e in explain(small_config(workspace, "align.dpo.beta=0.35"), ["align"])}
    assert lines["align/sft"].reuse and lines["align/data"].reuse and lines["pretrain/train"].reuse
    assert not lines["align/dpo"].reuse and "align.dpo.beta changed 0.1 -> 0.35" in lines["align/dpo"].reasons


@pytest.mark.slow
def test_lora_merge_is_checked_against_the_peft_model_and_a_bad_merge_is_caught(aligned: dict, tmp_path: Path) -> None:
    from lmforge.errors import ParityError, is_retryable

    workspace = tmp_path / "ws"
    shutil.copytree(Path(aligned["align/sft"]["dir"]).parents[2], workspace)
    lora = ["align.method=lora", "align.dpo.enabled=false", "align.sft.max_steps=20", "align.sft.lr=5e-3"]
    manifest = run_pipeline_locally(small_config(workspace, *lora), ["align"])["align/sft"]
    out = Path(manifest["dir"])
    assert (out / "adapter" / "adapter_model.safetensors").exists() and (out / "hf" / "model.safetensors").exists()
    assert manifest["metrics"]["merge_parity_max_abs_logit_diff"] < 1e-3 and manifest["extra"]["lora"]
    assert manifest["metrics"]["heldout_loss_after"] < manifest["metrics"]["heldout_loss_before"]
    # a merge that went wrong (`debug.align.corrupt_merge`), through the same check on this run's adapter: in
    # this process, not a second 2-rank training (a rank's ParityError becomes the step's by its exit record,
    # test_training_units.py::test_exit_classification_separates_retryable_from_deterministic)
    from training.align.kit import merge_lora

    spec = {**json.loads((out / "run_spec.json").read_text()), "fault": {"corrupt_merge": True}}
    with pytest.raises(ParityError, match="merged LoRA model's logits differ") as info:
        merge_lora(spec, out / "adapter", tmp_path / "bad-merge")
    assert not is_retryable(info.value)


def _kill_rank_when(workspace: Path, rank: int, step: int, done: threading.Event, name: str = "sft") -> None:
    """SIGKILL one alignment rank once align/<name> (SFT by default) has logged `step`."""
    while not done.is_set():
        for metrics in workspace.glob(f"align/{name}/*/metrics.jsonl"):
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            if any(r.get("step", 0) >= step and "loss" in r for r in rows):
                for proc in psutil.process_iter(["cmdline"]):
                    cmd = " ".join(proc.info["cmdline"] or [])
                    if "training.align.entry" in cmd and str(workspace) in cmd and "supervise" not in cmd:
                        try:
                            if proc.environ().get("LOCAL_RANK") == str(rank):
                                proc.send_signal(signal.SIGKILL)
                                return
                        except psutil.Error:
                            continue
        time.sleep(0.05)


def test_a_checkpoint_with_a_truncated_rank_file_or_no_seal_is_set_aside_and_the_previous_one_resumed(
    tmp_path: Path,
) -> None:
    """Before: a checkpoint counted as complete when trainer_state.json existed, although the other ranks'
    files were written without a barrier or checksums."""
    from training.align.entry import newest_checkpoint
    from training.checkpoint import seal

    root = tmp_path / "checkpoints"
    for step in (10, 20):
        directory = root / f"checkpoint-{step}"
        directory.mkdir(parents=True)
        (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        for rank in (0, 1):
            (directory / f"rng_state_{rank}.pth").write_bytes(bytes(range(256)) * 4)
        seal(directory)
    assert newest_checkpoint(root) == root / "checkpoint-20"
    with open(root / "checkpoint-20" / "rng_state_1.pth", "r+b") as handle:  # a rank killed mid-write
        handle.truncate(100)
    assert newest_checkpoint(root) == root / "checkpoint-10"
    aside = [p.name for p in root.iterdir() if p.name.startswith(".corrupt-checkpoint-20-")]
    assert len(aside) == 1 and not (root / "checkpoint-20").exists()
    # a checkpoint the Trainer wrote but nobody sealed (killed before every rank was done): incomplete
    unsealed = root / "checkpoint-30"
    unsealed.mkdir()
    (unsealed / "trainer_state.json").write_text('{"global_step": 30}')
    assert newest_checkpoint(root) == root / "checkpoint-10"
    assert not unsealed.exists() and len([p for p in root.iterdir() if p.name.startswith(".corrupt-")]) == 2


def test_fsdp2_alignment_builds_accelerates_fsdp2_plugin_and_is_refused_on_cpu(trained: dict, tmp_path: Path) -> None:
    """align.distributed.backend=fsdp2 hands TRL's trainer accelerate's FSDP plugin (version 2, full shard,
    a full state dict for the export); accelerate shards only GPU ranks, so on CPU it is a one-line error."""
    from trl import SFTConfig

    from lmforge.errors import ConfigError
    from training.align.kit import training_args as _training_args

    config = {"micro_batch_size": 4, "global_batch_size": 8, "lr": 1e-3, "lr_scheduler": "cosine"}
    config.update({"warmup_ratio": 0.1, "weight_decay": 0.0, "max_steps": 4, "save_steps": 2, "seed": 0})
    spec = {"config": config, "out_dir": str(tmp_path), "max_length": 64, "precision": "fp32", "zero_stage": 0}
    args = _training_args({**spec, "backend": "fsdp2"}, SFTConfig)
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is True
    assert plugin["state_dict_type"] == "FULL_STATE_DICT" and args.deepspeed is None
    assert _training_args({**spec, "backend": "deepspeed"}, SFTConfig).fsdp_plugin_args is None
    workspace = tmp_path / "ws"
    shutil.copytree(Path(trained["dir"]).parents[2], workspace)
    with pytest.raises(ConfigError, match="align.distributed.backend: fsdp2 needs GPUs"):
        run_pipeline_locally(small_config(workspace, "align.distributed.backend=fsdp2"), ["align"])
    with pytest.raises(ConfigError, match="zero_stage is DeepSpeed's"):
        small_config(workspace, "align.distributed.backend=fsdp2", "align.distributed.zero_stage=2")
