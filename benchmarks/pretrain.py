"""Tokens/s of lmforge's training step against a baseline, side by side in one command.

Three comparisons (`--compare`):
  plain     lmforge's DeepSpeed step vs a plain PyTorch loop, one process (the default);
  backends  FSDP2 vs DeepSpeed ZeRO-2 (and ZeRO-0) on 2 ranks (torchrun; `--ranks N`): the engines live in every rank and step
            in turn on the same batches from the same initial weights, so tokens/s and the loss
            trajectories (largest relative gap per step) are compared under the same conditions;
  compile   torch.compile (per decoder layer, inductor) vs eager, one process: the first step's
            compile time apart from steady-state tokens/s;
  mesh      tensor + sequence parallel over all ranks (FSDP2 on a (dp 1 x tp N) mesh) and, for
            an untied model, N pipeline stages, vs FSDP2 full shard over the same ranks, as
            `backends` does: same batches, same weights.
            On CPU ranks over gloo TP moves activations every layer, so expect it slower; on
            one GPU (`--ranks 1`) it runs the DTensor path on a mesh of one, as a check.

Both train the same model (same config, seed and initial weights) on the same batches,
with the same dtype, thread count, AdamW settings, gradient clipping and LR schedule.
The lmforge side is the real `training.loop.Trainer.train_step` on a DeepSpeed engine
(world size 1, ZeRO-0 as the planner picks for this size), including its per-step loss
all-reduce, spike detection and gradient-norm bookkeeping.

With `--base DIR` (a Hugging Face model directory, or `neox` / `qwen2` for a small one built
here with transformers, the tests' base-model builders) `plain` compares continued pretraining
of that model: both sides start from its weights, in its own architecture (target >= 0.95).
With `--set pretrain.model.experts.num=N` it compares lmforge's mixture of experts (its router
statistics and their all-reduce included) with the plain loop adding transformers' load-balancing
loss (target >= 0.95).

    .venv/bin/python benchmarks/pretrain.py [--compare plain|backends|compile|mesh] [--steps 30]
        [--preset tiny-cpu] [--set KEY=VALUE ...] [--base DIR|neox|qwen2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def synthetic_pack(directory: Path, vocab_size: int, tokens: int, seed: int = 0) -> Path:
    """A pack output with Zipf-distributed random tokens (the content does not matter for speed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    (directory / "tokens").mkdir(parents=True)
    for split, n in (("train", tokens), ("val", tokens // 10)):
        # ids 0 and 1 are the eos and pad ids below, and never drawn: the pad id's embedding row is
        # zero at initialisation (padding_idx), so a window starting with it keeps an all-zero hidden
        # state whose RMSNorm backward (x 1/sqrt(eps) per norm) overflowed bf16 gradients on the
        # 22-layer gpu-1node model (one window in eight; docs/how-to/gpus.md)
        stream = np.minimum(rng.zipf(1.2, n) + 1, vocab_size - 1).astype("<u2")
        stream.tofile(directory / "tokens" / f"s.{split}.bin")
        pq.write_table(
            pa.table({"id": ["synthetic"], "domain": ["x"], "start": [0], "length": [n]}),
            directory / "tokens" / f"s.{split}.docs.parquet",
        )
    index = {
        "dtype": "uint16",
        "vocab_size": vocab_size,
        "eos_id": 0,
        "pad_id": 1,
        "splits": {
            s: [{"shard": "s", "file": f"tokens/s.{s}.bin", "docs": f"tokens/s.{s}.docs.parquet", "num_tokens": n}]
            for s, n in (("train", tokens), ("val", tokens // 10))
        },
    }
    (directory / "index.json").write_text(json.dumps(index))
    return directory


class PlainLoop:
    """The same training, written as the textbook PyTorch loop."""

    def __init__(self, cfg, plan, trainer) -> None:  # type: ignore[no-untyped-def]
        import torch

        from training.model import build_model, load_base
        from training.reader import BatchSchedule

        self.cfg, self.plan, self.trainer = cfg, plan, trainer
        dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float32
        model = (
            load_base(trainer.base_dir)
            if trainer.base_dir is not None
            else build_model(cfg.model, trainer.vocab_size, cfg.seq_len, trainer.special, cfg.seed)
        )
        self.model = model.to(device=trainer.device, dtype=dtype)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            eps=cfg.optim.eps,
        )
        self.schedule = BatchSchedule(len(trainer.train_data), cfg.distributed.micro_batch_size, 1, 0, cfg.seed)
        self.step_index = 0
        self.non_finite_grads = 0  # steps whose gradient norm was NaN/inf (applied anyway, as a plain loop does)

    def train_step(self) -> float:
        import torch
        import torch.nn.functional as F

        cfg, plan = self.cfg, self.plan
        for _ in range(plan.grad_accum):
            _, windows = self.schedule.next()
            batch = torch.from_numpy(self.trainer.train_data.batch(windows)).to(self.trainer.device)
            experts = cfg.model.experts  # a mixture of experts: transformers' load-balancing loss, as its Trainer adds
            out = self.model(input_ids=batch[:, :-1], **({"output_router_logits": True} if experts.enabled else {}))
            logits = out.logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            if experts.enabled:
                loss = loss + experts.router_aux_loss_coef * out.aux_loss
            (loss / plan.grad_accum).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
        self.non_finite_grads += int(not torch.isfinite(norm).item())
        self.step_index += 1
        for group in self.opt.param_groups:
            group["lr"] = cfg.optim.lr * min(1.0, self.step_index / max(cfg.optim.warmup_steps, 1))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def _loss(outcome: object, name: str, anomalies: list[str]) -> float:
    """A step's loss; a step the guardrails flagged (spike, non-finite) is reported, not hidden."""
    from training.loop import Anomaly

    if isinstance(outcome, Anomaly):
        anomalies.append(f"{name}: {outcome.kind} at step {outcome.step} (loss {outcome.loss:.4f})")
        return outcome.loss
    return float(outcome)  # type: ignore[arg-type]


def _steady(timings: list[float]) -> float:
    """Median step time after the first few (allocator and kernel warm-up)."""
    return float(np.median(timings[3:] if len(timings) > 6 else timings))


def _setup(args: argparse.Namespace, ranks: int) -> tuple:  # type: ignore[type-arg]
    from dataclasses import replace

    from lmforge.config import load_config
    from training.device import detect_device, peak_tflops
    from training.planner import plan_parallelism

    overrides = [f"pretrain.distributed.num_ranks={ranks}", *args.overrides]
    config = load_config(args.preset, overrides)
    per_step = config.pretrain.distributed.micro_batch_size * ranks
    cfg = config.pretrain.model_copy(update={"global_batch_size": per_step})
    vocab = config.curate.tokenizer.vocab_size
    device = detect_device()
    plan = plan_parallelism(cfg, vocab, device)
    peak = cfg.peak_tflops or peak_tflops(device, plan.precision)
    return cfg, vocab, device, plan, peak, replace


def _header(cfg, plan, trainer, threads: int, peak: float, device, steps: int, what: str) -> None:  # type: ignore[no-untyped-def]
    print(
        f"model {trainer.params / 1e6:.2f}M params, {plan.precision}, seq {cfg.seq_len}, batch {cfg.global_batch_size}, "
        f"{threads} threads/rank, {what}, {steps} steps each, interleaved (median after warm-up)"
    )
    source = "configured" if cfg.peak_tflops else "data sheet" if device.kind == "cuda" else "measured matmul"
    print(f"device peak {peak:.3f} TFLOP/s ({device.name}, {plan.precision}, {source})")


def backends_worker(args: argparse.Namespace) -> None:
    """One rank of `--compare backends` (started by torchrun)."""
    import torch
    import torch.distributed as dist

    from training.loop import Trainer
    from training.metrics import flops_per_token
    from training.train_entry import init_distributed

    world = int(os.environ["WORLD_SIZE"])
    cfg, vocab, device, plan, peak, replace = _setup(args, world)
    rank, world = init_distributed("deepspeed")
    threads = torch.get_num_threads()
    if args.compare == "mesh":  # the same global batch: TP's (and PP's) one data-parallel rank accumulates
        plans = {
            "fsdp2": replace(plan, backend="fsdp2", zero_stage=3, sharding="full", degrees={}),
            "tp": replace(
                plan, backend="fsdp2", zero_stage=3, sharding="full", degrees={"tp": world}, grad_accum=world
            ),
        }
        if world > 1 and not cfg.model.tie_embeddings:  # stages need the embedding and head apart
            plans["pp"] = replace(
                plan, backend="fsdp2", zero_stage=3, sharding="full", degrees={"pp": world}, grad_accum=world
            )
    else:
        plans = {
            "deepspeed": replace(plan, backend="deepspeed", zero_stage=2, sharding=""),
            "fsdp2": replace(plan, backend="fsdp2", zero_stage=2, sharding="grad_op"),
            "zero0": replace(plan, backend="deepspeed", zero_stage=0, sharding=""),
        }
    special = {"bos_id": 0, "eos_id": 0, "pad_id": 1}
    root = Path(args.workdir)
    pack = root / "pack"
    if rank == 0:
        synthetic_pack(pack, vocab, 4_000_000)
    dist.barrier()
    trainers = {
        name: Trainer(
            cfg, p, pack, root / f"out-{name}", special, rank, world, peak * (world if device.kind == "cuda" else 1)
        )
        for name, p in plans.items()
    }
    timings: dict[str, list[float]] = {n: [] for n in trainers}
    losses: dict[str, list[float]] = {n: [] for n in trainers}
    anomalies: list[str] = []
    for _ in range(args.steps):
        for name, trainer in trainers.items():
            dist.barrier()
            start = time.perf_counter()
            losses[name].append(_loss(trainer.train_step(), name, anomalies))
            timings[name].append(time.perf_counter() - start)
    if rank:
        return
    if args.compare == "mesh":
        return _report_mesh(cfg, plan, trainers, timings, losses, anomalies, threads, peak, device, args.steps, world)
    trainer = trainers["deepspeed"]
    _header(
        cfg,
        plan,
        trainer,
        threads,
        peak,
        device,
        args.steps,
        f"{world} ranks (gloo)" if device.kind == "cpu" else f"{world} GPUs",
    )
    fpt = flops_per_token(trainer.params, cfg.model, cfg.seq_len, trainer.vocab_size)
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    tps = {n: tokens_per_step / _steady(t) for n, t in timings.items()}
    peak_all = peak * 1e12 * (world if device.kind == "cuda" else 1)
    print(f"{'path':28} {'tokens/s':>10} {'MFU':>7} {'first loss':>11} {'last loss':>10}")
    for name, label in (
        ("deepspeed", "DeepSpeed ZeRO-2"),
        ("fsdp2", "FSDP2 (grad_op, per layer)"),
        ("zero0", "DeepSpeed ZeRO-0 (DDP)"),
    ):
        print(
            f"{label:28} {tps[name]:10.0f} {fpt * tps[name] / peak_all:7.1%} "
            f"{losses[name][0]:11.4f} {losses[name][-1]:10.4f}"
        )
    for line in anomalies:
        print(line)
    for other, label in (("fsdp2", "FSDP2"), ("zero0", "ZeRO-0 (DeepSpeed's own spread, for scale)")):
        gaps = [abs(a - b) / abs(b) for a, b in zip(losses[other], losses["deepspeed"])]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        print(
            f"loss vs ZeRO-2, {label}: largest relative gap {gaps[worst]:.3%} at step {worst + 1}, "
            f"mean {sum(gaps) / len(gaps):.3%}"
        )
    print(f"ratio (FSDP2 / DeepSpeed ZeRO-2): {tps['fsdp2'] / tps['deepspeed']:.3f}  (target >= 0.95)")
    # DDP moves 2x the model per step and gathers nothing; sharded layouts (ZeRO-2, FSDP2) also
    # all-gather weights: on 2 CPU ranks over gloo that shows, which is why the planner keeps ZeRO-0 there
    print(f"ratio (FSDP2 / DeepSpeed ZeRO-0, the planner's choice here): {tps['fsdp2'] / tps['zero0']:.3f}")


def _report_mesh(cfg, plan, trainers, timings, losses, anomalies, threads, peak, device, steps, world) -> None:  # type: ignore[no-untyped-def]
    where = f"{world} ranks (gloo)" if device.kind == "cpu" else f"{world} GPU(s)"
    _header(cfg, plan, trainers["fsdp2"], threads, peak, device, steps, where)
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    tps = {n: tokens_per_step / _steady(t) for n, t in timings.items()}
    print(f"{'path':34} {'tokens/s':>10} {'first loss':>11} {'last loss':>10}")
    labels = {
        "fsdp2": f"FSDP2 full shard (dp {world})",
        "tp": f"TP + SP (tp {world}) on FSDP2",
        "pp": f"PP ({world} stages, 1F1B) on FSDP2",
    }
    for name in trainers:
        print(f"{labels[name]:34} {tps[name]:10.0f} {losses[name][0]:11.4f} {losses[name][-1]:10.4f}")
    for line in anomalies:
        print(line)
    for name in [n for n in trainers if n != "fsdp2"]:
        gaps = [abs(a - b) / abs(b) for a, b in zip(losses[name], losses["fsdp2"])]
        what = name.upper()
        print(f"loss, {what} vs FSDP2: largest relative gap {max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e}")
        print(f"ratio ({what} / FSDP2 tokens/s): {tps[name] / tps['fsdp2']:.3f}")
    if "pp" not in trainers:
        print("PP not compared: it needs untied embeddings (--set pretrain.model.tie_embeddings=false) and 2+ ranks")


def compare_backends(args: argparse.Namespace) -> None:
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
            f"--master_port={os.environ.get('MASTER_PORT', '29614')}",
            __file__, "--worker", "--compare", args.compare, "--workdir", tmp,
            "--steps", str(args.steps), "--preset", args.preset,
        ]  # fmt: skip
        for item in args.overrides:
            command += ["--set", item]
        env = {**os.environ, "LOCAL_SIZE": str(args.ranks)}
        sys.exit(subprocess.run(command, env=env).returncode)


def _single_process() -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29613"),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_SIZE": "1",
        }
    )


def compare_compile(args: argparse.Namespace) -> None:
    """Eager vs torch.compile'd decoder layers, same engine, same batches."""
    _single_process()
    import torch

    from training.loop import Trainer
    from training.metrics import flops_per_token
    from training.train_entry import init_distributed

    cfg, vocab, device, plan, peak, replace = _setup(args, 1)
    rank, world = init_distributed(plan.backend)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        pack = synthetic_pack(Path(tmp) / "pack", vocab, 4_000_000)
        special = {"bos_id": 0, "eos_id": 0, "pad_id": 1}
        trainers = {
            name: Trainer(
                cfg, replace(plan, compile=name == "compiled"), pack, Path(tmp) / name, special, rank, world, peak
            )
            for name in ("eager", "compiled")
        }
        timings: dict[str, list[float]] = {n: [] for n in trainers}
        losses: dict[str, list[float]] = {n: [] for n in trainers}
        for _ in range(args.steps):
            for name, trainer in trainers.items():
                start = time.perf_counter()
                losses[name].append(trainer.train_step())  # type: ignore[arg-type]
                timings[name].append(time.perf_counter() - start)
    trainer = trainers["eager"]
    _header(cfg, plan, trainer, threads, peak, device, args.steps, f"{plan.label}, 1 rank")
    fpt = flops_per_token(trainer.params, cfg.model, cfg.seq_len, trainer.vocab_size)
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    print(f"{'path':28} {'tokens/s':>10} {'MFU':>7} {'first step s':>13} {'last loss':>10}")
    tps = {}
    for name in trainers:
        tps[name] = tokens_per_step / _steady(timings[name])
        print(
            f"{name:28} {tps[name]:10.0f} {fpt * tps[name] / (peak * 1e12):7.1%} "
            f"{timings[name][0]:13.2f} {losses[name][-1]:10.4f}"
        )
    compile_s = timings["compiled"][0] - _steady(timings["compiled"])
    print(f"compile time (first step beyond a steady one): {compile_s:.1f} s")
    print(f"ratio (compiled / eager): {tps['compiled'] / tps['eager']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=("plain", "backends", "compile", "mesh"), default="plain")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--ranks", type=int, default=2, help="backends: ranks (GPUs) to start")
    parser.add_argument("--base", help="plain: continued pretraining of this model (a directory, or neox / qwen2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare in ("backends", "mesh"):
        return backends_worker(args) if args.worker else compare_backends(args)
    if args.compare == "compile":
        return compare_compile(args)
    plain(args)


def plain(args: argparse.Namespace) -> None:
    _single_process()
    import torch

    from lmforge.config import load_config
    from training.device import detect_device, peak_tflops
    from training.loop import Trainer
    from training.metrics import flops_per_token
    from training.planner import plan_parallelism
    from training.train_entry import init_distributed

    config = load_config(args.preset, ["pretrain.distributed.num_ranks=1", *args.overrides])
    cfg = config.pretrain.model_copy(update={"global_batch_size": config.pretrain.distributed.micro_batch_size})
    vocab = config.curate.tokenizer.vocab_size
    rank, world = init_distributed("deepspeed")  # one rank: the engine only joins the group
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        base = _base_dir(args.base, Path(tmp)) if args.base else None
        params = None
        if base is not None:  # its architecture and embedding rows, as pretrain/train takes them
            from training.model import count_weights, model_config_of

            hf_config = json.loads((base / "config.json").read_text())
            cfg, vocab, params = (
                cfg.model_copy(update={"model": model_config_of(hf_config)}),
                hf_config["vocab_size"],
                count_weights(base),
            )
        device = detect_device()
        plan = plan_parallelism(cfg, vocab, device, params=params)
        peak = cfg.peak_tflops or peak_tflops(device, plan.precision)
        pack = synthetic_pack(Path(tmp) / "pack", vocab, 4_000_000)
        special = {"bos_id": 0, "eos_id": 0, "pad_id": 1}
        trainer = Trainer(cfg, plan, pack, Path(tmp) / "out", special, rank, world, peak, base_dir=base)
        plain = PlainLoop(cfg, plan, trainer)
        # interleaved step by step, so both paths see the same machine conditions (other load,
        # thermal state); each path's figure is the median of its own step times
        timings: dict[str, list[float]] = {"ds": [], "plain": []}
        losses: dict[str, list[float]] = {"ds": [], "plain": []}
        anomalies: list[str] = []
        for _ in range(args.steps):
            for name, path in (("ds", trainer), ("plain", plain)):
                start = time.perf_counter()
                losses[name].append(_loss(path.train_step(), name, anomalies))
                timings[name].append(time.perf_counter() - start)
        ds_step, plain_step = _steady(timings["ds"]), _steady(timings["plain"])
        ds_losses, plain_losses = losses["ds"], losses["plain"]
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    fpt = flops_per_token(trainer.params, cfg.model, cfg.seq_len, trainer.vocab_size)
    ds_tps, plain_tps = tokens_per_step / ds_step, tokens_per_step / plain_step
    what = f"continued pretraining of {args.base}" if args.base else "from scratch"
    print(
        f"model {trainer.params / 1e6:.2f}M params ({what}), {plan.precision}, seq {cfg.seq_len}, "
        f"batch {cfg.global_batch_size}, {threads} threads, ZeRO-{plan.zero_stage}, {args.steps} steps each, "
        "interleaved (median after warm-up)"
    )
    source = "configured" if cfg.peak_tflops else "data sheet" if device.kind == "cuda" else "measured matmul"
    print(f"device peak {peak:.3f} TFLOP/s ({device.name}, {plan.precision}, {source})")
    print(f"{'path':28} {'tokens/s':>10} {'MFU':>7} {'first loss':>11} {'last loss':>10}")
    print(
        f"{'plain PyTorch loop':28} {plain_tps:10.0f} {fpt * plain_tps / (peak * 1e12):7.1%} "
        f"{plain_losses[0]:11.4f} {plain_losses[-1]:10.4f}"
    )
    print(
        f"{'lmforge DeepSpeed path':28} {ds_tps:10.0f} {fpt * ds_tps / (peak * 1e12):7.1%} "
        f"{ds_losses[0]:11.4f} {ds_losses[-1]:10.4f}"
    )
    for line in anomalies:
        print(f"guardrail finding: {line}")
    print(f"plain loop steps with non-finite gradient norm: {plain.non_finite_grads} of {args.steps}")
    ratio = ds_tps / plain_tps
    target = 0.95 if args.base or cfg.model.experts.enabled else 0.85
    print(f"ratio (lmforge / plain): {ratio:.3f}  (target >= {target})")
    sys.exit(0 if ratio >= target else 1)


def _base_dir(base: str, tmp: Path) -> Path:
    """A model directory: the one given, or a small NeoX / Qwen2 built with the tests' builders."""
    if base not in ("neox", "qwen2"):
        return Path(base)
    from tests.base_models import build_neox_base, build_qwen2_base, demo_texts

    build = build_neox_base if base == "neox" else build_qwen2_base
    # 4 layers of width 256: big enough that the step, not Python, dominates on a CPU
    return build(tmp / base, demo_texts(), steps=20, hidden_size=256, intermediate_size=768, num_hidden_layers=4)


if __name__ == "__main__":
    main()
