"""A GPU preset's pretraining and alignment on one GPU, as one short script (or the same on a CPU, small).

    python benchmarks/gpu_check.py [--preset gpu-1node] [--steps 12] [--out DIR] [--sections ...]

Sections, each a child process with its own time limit, its log kept under --out:

  matmul     the card's measured bf16 matrix rate (8192^3 products), beside the data-sheet peak
             the MFU figures use;
  attention  one forward and backward of the preset's model in bf16 with each SDPA backend
             (cuDNN, flash, memory-efficient, math) forced in turn: the loss, the gradient norm
             and how many gradient tensors hold NaN/inf, so a broken attention kernel is named
             (`training.device_setup.safe_attention_kernels` switches cuDNN's off);
  plain      `benchmarks/pretrain.py --compare plain`: lmforge's DeepSpeed step vs a plain PyTorch
             loop, the preset's model (gpu-1node: 1.1B Llama, seq 2048, micro-batch 8), bf16;
  backends   `benchmarks/pretrain.py --compare backends --ranks 1`: FSDP2 vs DeepSpeed ZeRO-2 and
             ZeRO-0 on the same batches from the same weights;
  tp         `benchmarks/pretrain.py --compare mesh --ranks N` (N = the GPUs, at most 8): tensor +
             sequence parallel (DTensor, `training/parallel/dims/tensor.py`) over N GPUs vs FSDP2
             full shard over the same GPUs, in bf16 on NCCL: tokens/s and the loss gap per step.
             With one GPU it runs the DTensor plan on a mesh of one (the CUDA kernels of every
             style, no traffic): a check that the plan runs and learns, not a speed figure;
  align      the alignment stage's entry (`training.align.entry`, started by accelerate as the
             align step starts it) on a model of the preset's architecture: LoRA SFT, then LoRA DPO
             from the SFT model, with the preset's align values (LoRA r/alpha, lr, micro-batch,
             bf16, ZeRO stage) on the built-in chat and preference data of a tiny-cpu workspace
             (`--align-data`, its `align/data/<key>` folder) and its tokenizer (`--tokenizer`,
             a model folder); the global batch is cut to `--align-batch` sequences to fit the time;
  compile    `benchmarks/pretrain.py --compare compile`: torch.compile'd layers vs eager;
  float8     the preset's model trained --steps steps in bf16 and with float8 (`pretrain.float8`:
             torchao's Float8Linear, real float8 matmuls) on the same batches from the same
             weights, eager and with compiled layers: tokens/s of each, their ratio and the final
             losses. Only on a CUDA GPU of compute capability 8.9+ (Ada, Hopper); elsewhere it
             says why it is skipped.

It needs no Prefect (the training packages do not import it): on a machine that has torch,
transformers, accelerate and peft, add deepspeed, trl, datasets and pydantic (the README's
"Running on GPUs" says how this project measured its figures on a lent GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTIONS = ("matmul", "attention", "plain", "backends", "tp", "align", "compile", "float8")


def matmul() -> None:
    import torch

    from training.device import detect_device, peak_tflops

    device = detect_device()
    n = 8192 if torch.cuda.is_available() else 1024
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    if dev == "cuda":
        torch.cuda.synchronize()
    runs = 10
    start = time.perf_counter()
    for _ in range(runs):
        a @ b
    if dev == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / runs
    print(f"device {device.name} x{device.count}, torch {torch.__version__}")
    print(f"bf16 matmul {n}^3: {2 * n**3 / seconds / 1e12:.1f} TFLOP/s measured; "
          f"MFU peak used below: {peak_tflops(device, 'bf16'):.1f} TFLOP/s")  # fmt: skip


def attention(preset: str, overrides: list[str]) -> None:
    """Gradients of one bf16 step of the preset's model under each SDPA backend, side by side."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lmforge.config import load_config
    from training.model import build_model as build

    config = load_config(preset, [*LOADABLE, *overrides])
    p = config.pretrain
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = config.curate.tokenizer.vocab_size
    model = build(p.model, vocab, p.seq_len, {"bos_id": 0, "eos_id": 0, "pad_id": 1}, p.seed)
    model = model.to(device=dev, dtype=torch.bfloat16)
    seq = p.seq_len if dev == "cuda" else 64
    micro = p.distributed.micro_batch_size if dev == "cuda" else 2
    print(f"model {sum(x.numel() for x in model.parameters()) / 1e6:.0f}M parameters, bf16, sequences of {seq}, "
          f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")  # fmt: skip
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    rng = np.random.default_rng(0)
    data = {  # uniform ids, and the Zipf-distributed ids of benchmarks/pretrain.py's synthetic pack
        "uniform": rng.integers(2, vocab, (micro, seq + 1)),
        "zipf": np.minimum(rng.zipf(1.2, (micro, seq + 1)), vocab - 1),
    }
    # the pad id's embedding row is zero at initialisation (padding_idx): a window that starts with it
    # keeps an all-zero hidden state at position 0, where RMSNorm's backward multiplies by 1/sqrt(eps)
    data["zipf-no-pad"] = np.where(data["zipf"] == 1, 2, data["zipf"])
    print(f"zipf windows starting with the pad id: {int((data['zipf'][:, 0] == 1).sum())} of {micro}, "
          f"first ids per window {data['zipf'][:, 0].tolist()}")  # fmt: skip
    for kind, ids in data.items():
        for rows in (
            ([0], list(range(micro))) if kind == "uniform" else [[i] for i in range(micro)] + [list(range(micro))]
        ):
            batch = f"window {rows[0]}" if len(rows) == 1 else f"all {len(rows)}"
            tokens = torch.from_numpy(ids[rows].astype("int64")).to(dev)
            for name, backend in backends.items():
                model.zero_grad(set_to_none=True)
                try:
                    with sdpa_kernel([backend]):
                        logits = model(input_ids=tokens[:, :-1]).logits
                        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
                        loss.backward()
                except RuntimeError as error:  # a backend this card or shape does not support
                    print(f"{kind:11} {batch:9} sdpa {name:5}: not available ({str(error).splitlines()[0][:80]})")
                    continue
                named = [(n, x.grad) for n, x in model.named_parameters() if x.grad is not None]
                bad = [n for n, g in named if not torch.isfinite(g).all().item()]
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for _, g in named]))
                print(f"{kind:11} {batch:9} sdpa {name:5}: loss {loss.item():.4f}, grad norm {norm.item():.4f}, "
                      f"non-finite gradient tensors {len(bad)} of {len(named)} {bad[:3]}")  # fmt: skip
                del logits, loss


def float8(preset: str, overrides: list[str], steps: int) -> None:
    """bf16 vs float8 training of the preset's model (torchao, real float8), eager and compiled."""
    import numpy as np
    import torch

    from lmforge.config import load_config
    from training.device import detect_device
    from training.model import build_model as build
    from training.planner import describe_capability, float8_supported

    device = detect_device()
    if not float8_supported(device):
        print(f"float8: skipped: real float8 matmuls need a CUDA GPU of compute capability 8.9+ (Ada, Hopper); "
              f"{describe_capability(device)} (pretrain.float8=emulate checks the numerics anywhere)")  # fmt: skip
        return
    import torchao

    config = load_config(preset, [*LOADABLE, *overrides])
    p = config.pretrain
    vocab = config.curate.tokenizer.vocab_size
    base = build(p.model, vocab, p.seq_len, {"bos_id": 0, "eos_id": 0, "pad_id": 1}, p.seed)
    micro, seq = p.distributed.micro_batch_size, p.seq_len
    rng = np.random.default_rng(0)  # ids from 2: no pad id (see the attention section)
    batches = [torch.from_numpy(rng.integers(2, vocab, (micro, seq + 1))).cuda() for _ in range(steps)]
    print(f"model {sum(x.numel() for x in base.parameters()) / 1e6:.0f}M parameters, fp32 weights under bf16 "
          f"autocast, {micro} x {seq} tokens, {steps} steps each (tokens/s: median after 2 steps), "
          f"{describe_capability(device)}, torch {torch.__version__}, torchao {torchao.__version__}")  # fmt: skip
    for compiled in (False, True):
        runs = {mode: train_steps(base, batches, mode, compiled, p.optim) for mode in ("off", "on")}
        (bf16_tps, bf16_losses, bf16_first), (f8_tps, f8_losses, f8_first) = runs["off"], runs["on"]
        print(f"{'compiled' if compiled else 'eager':8}: bf16 {bf16_tps:,.0f} tokens/s, float8 {f8_tps:,.0f} tokens/s "
              f"(float8 / bf16 {f8_tps / bf16_tps:.3f}); final loss bf16 {bf16_losses[-1]:.4f}, float8 "
              f"{f8_losses[-1]:.4f} (first {bf16_losses[0]:.4f}); first step {bf16_first:.1f}s vs {f8_first:.1f}s",
              flush=True)  # fmt: skip


def train_steps(base, batches, mode: str, compiled: bool, optim, device: str = "cuda"):  # type: ignore[no-untyped-def]
    """(tokens/s, losses, first step's seconds) of training a copy of `base` on `batches` under bf16
    autocast, its linear layers converted to float8 by `training.float8` unless `mode` is off."""
    import copy

    import numpy as np
    import torch
    import torch.nn.functional as F

    from training import float8 as f8
    from training.parallel.engines.fsdp2 import decoder_layers

    model = copy.deepcopy(base).to(device)
    if mode != "off":
        f8.convert(model, mode)
    if compiled:  # as lmforge compiles (`pretrain.compile`): each decoder layer, after the conversion
        for layer in decoder_layers(model):
            layer.compile()
    opt = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), weight_decay=optim.weight_decay
    )
    seconds, losses = [], []
    for batch in batches:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    tokens = batches[0].shape[0] * (batches[0].shape[1] - 1)
    steady = float(np.median(seconds[2:] if len(seconds) > 3 else seconds))
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return tokens / steady, losses, seconds[0]


# the check trains on synthetic tokens and a workspace's chat data, not on the preset's corpus:
# its curate.inputs (gpu-1node: /data/raw/...) is pointed at a file that exists, so the preset loads anywhere
LOADABLE = ["curate.inputs=[README.md]"]


def build_model(preset: str, tokenizer_dir: Path, out: Path, overrides: list[str]) -> Path:
    """A randomly initialised model of the preset's architecture with the tokenizer of `tokenizer_dir`."""
    import shutil

    import torch

    from lmforge.config import load_config
    from training.model import build_model as build

    config = load_config(preset, [*LOADABLE, *overrides])
    hf_config = json.loads((tokenizer_dir / "config.json").read_text())
    special = {
        "bos_id": hf_config.get("bos_token_id") or 0,
        "eos_id": hf_config.get("eos_token_id") or 0,
        "pad_id": hf_config.get("pad_token_id") or 0,
    }
    p = config.pretrain
    model = build(p.model, hf_config["vocab_size"], p.seq_len, special, p.seed)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    print(f"model: {sum(x.numel() for x in model.parameters()) / 1e6:.0f}M parameters, {p.model.num_layers} layers")
    return out


def align_spec(
    preset: str, kind: str, base: Path, data: Path, out: Path, steps: int, batch: int, overrides: list[str]
) -> dict:
    from lmforge.config import load_config
    from training.align.steps import _plain, _training_fields
    from training.device import detect_device

    config = load_config(preset, [*LOADABLE, *overrides])
    a = config.align
    cfg = getattr(a, kind)
    settings = {f.rsplit(".", 1)[1]: _plain(getattr(cfg, f.rsplit(".", 1)[1])) for f in _training_fields(kind)}
    micro = min(settings["micro_batch_size"], batch)
    settings.update(max_steps=steps, save_steps=steps, global_batch_size=batch, micro_batch_size=micro, log_every=1)
    cuda = detect_device().kind == "cuda"
    lora = a.method in ("lora", "qlora") if kind == "sft" else cfg.lora
    context = json.loads((base / "config.json").read_text())["max_position_embeddings"]
    return {
        "kind": kind,
        "config": settings,
        "base_dir": str(base),
        "out_dir": str(out),
        "train": str(data / kind / "train.jsonl"),
        "heldout": str(data / ("heldout_sft.jsonl" if kind == "sft" else "heldout_preferences.jsonl")),
        "heldout_generation": [],
        "heldout_chats": [],
        "max_length": min(cfg.max_seq_len or context, context),
        "precision": ("bf16" if a.precision == "auto" else a.precision) if cuda else "fp32",
        "zero_stage": a.distributed.zero_stage,
        "backend": "deepspeed",
        "lora": a.lora.model_dump(mode="json") if lora else None,
        "quantized_base": False,
        "fault": config.debug.align.model_dump(mode="json"),
        "eval_every": 10**9,
        "attempt": 1,
        "attempt_dir": str(out / "logs" / "attempt-1"),
        "world_size": 1,
    }


def align(args: argparse.Namespace) -> None:
    from lmforge.processes.launch import Launch, build_command, free_port
    from lmforge.processes.launcher import QUIET_ENV

    work = Path(args.work)
    base = build_model(args.preset, Path(args.tokenizer).resolve(), work / "base", args.overrides)
    start = base
    for kind in args.align_kinds.split(","):
        out = work / kind
        out.mkdir(parents=True, exist_ok=True)
        spec = align_spec(
            args.preset,
            kind,
            start,
            Path(args.align_data).resolve(),
            out,
            args.align_steps,
            args.align_batch,
            args.overrides,
        )
        (out / "run_spec.json").write_text(json.dumps(spec))
        command = build_command("training.align.entry", out / "run_spec.json", Launch("accelerate", 1), free_port())
        began = time.time()
        done = subprocess.run(
            command, cwd=ROOT, env={**os.environ, **QUIET_ENV, "PYTHONPATH": os.pathsep.join(sys.path)}
        )
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if done.returncode == 0 else []
        speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
        lora = f"LoRA r={spec['lora']['r']}" if spec["lora"] else "full"
        print(
            f"align {kind}: {lora}, {spec['precision']}, ZeRO-{spec['zero_stage']}, batch {args.align_batch} x "
            f"max_length {spec['max_length']}, {args.align_steps} steps in {time.time() - began:.0f}s (rc {done.returncode}); "
            f"tokens/s {sum(speeds[1:]) / max(len(speeds[1:]), 1):,.0f} (from step 2); first/last loss "
            f"{rows[0].get('loss') if rows else None} / {rows[-1].get('loss') if rows else None}; "
            f"summary {'written' if summary else 'missing'}"
        )
        if done.returncode:
            return
        start = out / "hf"


def gpus_for_tp() -> int:
    """The GPUs the tp section spreads over: all of them up to 8 (a power of two), else 1."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return max(n for n in (1, 2, 4, 8) if n <= max(1, count))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpu-1node")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="gpu-check")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--align-data", help="a tiny-cpu workspace's align/data/<key> folder")
    parser.add_argument("--tokenizer", help="a model folder whose tokenizer (and chat template) to use")
    parser.add_argument("--align-kinds", default="sft,dpo", help="dpo alone starts from the base model")
    parser.add_argument("--align-steps", type=int, default=8)
    parser.add_argument("--align-batch", type=int, default=32)
    parser.add_argument("--work", default="/tmp/lmforge-gpu-check", help="where the align section writes its models")
    parser.add_argument("--limit", type=int, default=200, help="seconds per section")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    if args.section == "matmul":
        return matmul()
    if args.section == "align":
        return align(args)
    if args.section == "attention":
        return attention(args.preset, args.overrides)
    if args.section == "float8":
        return float8(args.preset, args.overrides, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = [
        sys.executable,
        str(ROOT / "benchmarks" / "pretrain.py"),
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
    ]
    for item in [*LOADABLE, *args.overrides]:
        bench += ["--set", item]
    commands = {
        "matmul": [sys.executable, __file__, "--section", "matmul"],
        "plain": [*bench, "--compare", "plain"],
        "backends": [*bench, "--compare", "backends", "--ranks", "1"],
        "tp": [*bench, "--compare", "mesh", "--ranks", str(gpus_for_tp())],
        "attention": [sys.executable, __file__, "--section", "attention", *sys.argv[1:]],
        "align": [sys.executable, __file__, "--section", "align", *sys.argv[1:]],
        "compile": [*bench, "--compare", "compile"],
        "float8": [sys.executable, __file__, "--section", "float8", *sys.argv[1:]],
    }
    table = []
    for name in args.sections.split(","):
        began = time.time()
        with open(out / f"{name}.log", "w") as log:
            # its own process group, so that a section past its limit is stopped with every rank it started
            child = subprocess.Popen(commands[name], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc: int | str = child.wait(timeout=args.limit)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                rc = "timeout"
        lines = (out / f"{name}.log").read_text().splitlines()
        keep = [x for x in lines if not x.startswith(("[", "W1", "I1")) and "Warning" not in x]
        table.append(f"== {name} (rc {rc}, {time.time() - began:.0f}s)\n" + "\n".join(keep[-12:]))
        print(table[-1], flush=True)


if __name__ == "__main__":
    main()
