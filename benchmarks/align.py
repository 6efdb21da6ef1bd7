"""Alignment throughput: SFT, DPO, RL, KTO, ORPO and SimPO tokens/s through lmforge against TRL called directly.

    .venv/bin/python benchmarks/align.py --workspace WS [--kinds sft,dpo,rl,kto,orpo,simpo] [--steps 30] [--repeats 2]

WS is a workspace where `lmforge stage align` ran (it reads the pretrained, SFT and DPO models
and the alignment data from it; RL needs a run with `rl` in `align.recipe`, e.g. the
`tiny-cpu-rl` preset). Both paths train the same model on the same data with the same
settings (tiny-cpu's batch sizes, learning rates, sequence length, fp32 on CPU), on 2 ranks
started by `accelerate launch`:

- lmforge: `training.align.entry` with the spec the align step writes (its callbacks log
  metrics and checkpoint every `save_steps`; held-out generation is switched off here, since it
  is evaluation, not training);
- plain TRL: a short script a user would write, `SFTTrainer` / `DPOTrainer` / `GRPOTrainer` /
  `KTOTrainer` / `ORPOTrainer` / `CPOTrainer` (SimPO) with the same arguments (GRPO with the same
  verifiable reward function, KTO on the same unpaired rows), no callbacks, no checkpoints.

tokens/s is measured the same way for both: TRL's `num_tokens` counter between consecutive
logged steps over the wall time between them, averaged from the second step on. TRL's
experimental ORPO and CPO trainers keep no `num_tokens`; for them both paths count the same
thing, the non-padding tokens of each pair's chosen and rejected sequences summed over ranks
(lmforge's entry does it for its curves, `AlignMethod.token_keys`; the plain script's trainer
subclass does it only for this measurement). The runs alternate (lmforge, TRL,
lmforge, TRL...), and the best of `--repeats` is kept for each, so a slow moment of the machine
does not decide the ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PLAIN = r"""
import json, sys, time
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
import trl

spec = json.load(open(sys.argv[1]))
cfg = spec["config"]
tokenizer = AutoTokenizer.from_pretrained(spec["base_dir"])
# the precision lmforge trains in (transformers 5 would otherwise load a bf16 export as bf16 weights)
dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
model = AutoModelForCausalLM.from_pretrained(spec["base_dir"], dtype=dtype)
if spec["kind"] == "rl":  # the same prompts, the same reward function (lmforge.text.verify's check)
    from training.align.methods.rl import prompt_records, verifier_reward
    from datasets import Dataset
    data = Dataset.from_list(prompt_records(spec["train"], cfg["prompts"]))
else:
    columns = ["messages"] if spec["kind"] == "sft" else ["prompt", "chosen", "rejected"]
    data = load_dataset("json", data_files=spec["train"], split="train").select_columns(columns)

class Times(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "num_tokens" in logs:
            with open(spec["out_dir"] + "/plain_metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, "num_tokens": logs["num_tokens"], "time": time.time()}) + "\n")

# TRL's configs default to bf16 autocast and gradient checkpointing; lmforge trains in the spec's
# precision (fp32 on CPU) without checkpointed layers (a 4M model's activations are small): set both alike
common = dict(output_dir=spec["out_dir"] + "/plain", use_cpu=True, report_to=[], bf16=spec["precision"] == "bf16",
              gradient_checkpointing=False,
              per_device_train_batch_size=cfg["micro_batch_size"],
              gradient_accumulation_steps=cfg["global_batch_size"] // (cfg["micro_batch_size"] * 2),
              learning_rate=cfg["lr"], lr_scheduler_type=cfg["lr_scheduler"], max_steps=cfg["max_steps"],
              warmup_steps=int(cfg["warmup_ratio"] * cfg["max_steps"]), logging_steps=1, save_strategy="no",
              seed=cfg["seed"], data_seed=cfg["seed"], dataloader_num_workers=0, ddp_find_unused_parameters=False)
if spec["kind"] != "rl":
    common["max_length"] = spec["max_length"]
if spec["kind"] == "rl":
    args = trl.GRPOConfig(**common, num_generations=cfg["num_generations"], max_completion_length=cfg["max_completion_length"],
                          temperature=cfg["temperature"], beta=cfg["beta"], epsilon=cfg["epsilon"],
                          num_iterations=cfg["num_iterations"], loss_type=cfg["loss_type"], scale_rewards=cfg["scale_rewards"])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[verifier_reward], args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Times()])
elif spec["kind"] == "sft":
    args = trl.SFTConfig(**common, assistant_only_loss=cfg["assistant_only_loss"], packing=cfg["packing"])
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[Times()])
elif spec["kind"] in ("orpo", "simpo"):
    import os
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    def counting(base):  # the measurement's instrument: the same count lmforge's entry keeps
        class Counting(base):
            tokens = 0.0

            def training_step(self, model, inputs, *a, **k):
                masks = [inputs[key] for key in ("chosen_attention_mask", "rejected_attention_mask") if key in inputs]
                self.tokens += float(sum(mask.sum().item() for mask in masks))
                return super().training_step(model, inputs, *a, **k)

            def log(self, logs, *a, **k):
                if "train_runtime" not in logs:
                    local = torch.tensor([self.tokens], dtype=torch.float64)
                    logs["num_tokens"] = float(self.accelerator.reduce(local, reduction="sum").item())
                return super().log(logs, *a, **k)
        return Counting

    common["max_length"] = spec["max_length"]
    if spec["kind"] == "orpo":
        args = ORPOConfig(**common, beta=cfg["beta"])
        trainer = counting(ORPOTrainer)(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                        callbacks=[Times()])
    else:
        args = CPOConfig(**common, loss_type="simpo", beta=cfg["beta"], simpo_gamma=cfg["gamma"],
                         cpo_alpha=cfg["sft_weight"])
        trainer = counting(CPOTrainer)(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                                       callbacks=[Times()])
elif spec["kind"] == "kto":
    from training.align.methods.kto import unpaired  # the same unpaired rows lmforge trains on
    args = trl.KTOConfig(**common, beta=cfg["beta"], desirable_weight=cfg["desirable_weight"],
                         undesirable_weight=cfg["undesirable_weight"])
    rows = data.map(unpaired, batched=True, remove_columns=["prompt", "chosen", "rejected"])
    reference = AutoModelForCausalLM.from_pretrained(spec["base_dir"], dtype=dtype)
    trainer = trl.KTOTrainer(model=model, ref_model=reference, args=args, train_dataset=rows, processing_class=tokenizer,
                             callbacks=[Times()])
else:
    weight = cfg.get("sft_weight", 0.0)
    losses = {"loss_type": [cfg["loss_type"]]}
    if weight:
        losses = {"loss_type": [cfg["loss_type"], "sft"], "loss_weights": [1.0, weight]}
    args = trl.DPOConfig(**common, beta=cfg["beta"], **losses)
    reference = AutoModelForCausalLM.from_pretrained(spec["base_dir"], dtype=dtype)
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer,
                             callbacks=[Times()])
trainer.train()
"""


def accelerate(module_or_script: list[str], port: int) -> list[str]:
    """The exact command lmforge's launch helper builds for 2 ranks, with the module or script swapped in."""
    from lmforge.processes.launch import Launch, build_command

    command = build_command("training.align.entry", Path("spec.json"), Launch("accelerate", 2), port)
    return command[: command.index("-m", 3)] + module_or_script


def spec_for(kind: str, workspace: Path, steps: int, out: Path) -> dict:
    manifest = json.loads(next(workspace.glob(f"align/{kind}/*/manifest.json")).read_text())
    spec = json.loads((Path(manifest["dir"]) / "run_spec.json").read_text())
    spec["config"]["max_steps"] = steps
    spec["config"]["save_steps"] = max(steps // 2, 1)  # lmforge checkpoints as it always does
    if "prompt_filter" in spec["config"]:  # both paths train on every prompt: this measures the training loop
        spec["config"]["prompt_filter"]["samples"] = 0
    spec.update(
        out_dir=str(out),
        eval_every=10**9,
        heldout_generation=[],
        heldout_chats=[],
        attempt=1,
        attempt_dir=str(out / "logs" / "attempt-1"),
    )
    return spec


def run_lmforge(spec: dict, port: int) -> float:
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_spec.json").write_text(json.dumps(spec))
    subprocess.run(
        accelerate(["-m", "training.align.entry", "--spec", str(out / "run_spec.json")], port),
        check=True,
        cwd=ROOT,
        capture_output=True,
        env=_env(),
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the entry logs tokens/s between consecutive logged steps (from TRL's num_tokens), as the plain run is measured
    speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    return sum(speeds[1:]) / len(speeds[1:])


def run_plain(spec: dict, port: int, script: Path) -> float:
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        accelerate([str(script), str(out / "spec.json")], port), cwd=ROOT, capture_output=True, text=True, env=_env()
    )
    if done.returncode:
        raise SystemExit(f"plain TRL {spec['kind']} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "plain_metrics.jsonl").read_text().splitlines()]
    speeds = [
        (b["num_tokens"] - a["num_tokens"]) / (b["time"] - a["time"])
        for a, b in zip(rows[1:], rows[2:])
        if b["time"] > a["time"]
    ]
    return sum(speeds) / len(speeds)


def _env() -> dict:
    import os

    from lmforge.processes.launcher import QUIET_ENV

    return {**os.environ, **QUIET_ENV, "PYTHONPATH": str(ROOT)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--steps", type=int, default=30, help="steps of every other method")
    parser.add_argument(
        "--kinds",
        default="sft,dpo,rl",
        help="comma-separated: sft, dpo, rl, kto, orpo, simpo (each needs its align/<kind> run in WS)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    workspace = Path(args.workspace)
    from lmforge.processes.launch import free_port

    results = {}
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "plain_trl.py"
        script.write_text(PLAIN)
        for kind in args.kinds.split(","):
            steps = args.sft_steps if kind == "sft" else args.steps
            if not any(workspace.glob(f"align/{kind}/*/run_spec.json")):
                print(f"skipping {kind}: no align/{kind} run in {workspace} (see align.recipe)", file=sys.stderr)
                continue
            mine, plain = [], []
            for repeat in range(args.repeats):
                started = time.time()
                mine.append(
                    run_lmforge(spec_for(kind, workspace, steps, Path(work) / f"{kind}-lmforge-{repeat}"), free_port())
                )
                plain.append(
                    run_plain(
                        spec_for(kind, workspace, steps, Path(work) / f"{kind}-plain-{repeat}"), free_port(), script
                    )
                )
                print(
                    f"{kind} repeat {repeat + 1}: lmforge {mine[-1]:,.0f} tok/s, plain TRL {plain[-1]:,.0f} tok/s "
                    f"({time.time() - started:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
            results[kind] = (max(mine), max(plain))
    print("| step | lmforge tokens/s | plain TRL tokens/s | ratio |\n|---|---|---|---|")
    for kind, (mine, plain) in results.items():
        print(
            f"| {kind.upper()} (2 CPU ranks, best of {args.repeats}) | {mine:,.0f} | {plain:,.0f} | **{mine / plain:.2f}x** |"
        )


if __name__ == "__main__":
    main()
