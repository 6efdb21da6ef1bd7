"""Pretraining pieces that need no processes: planner, DeepSpeed config, guardrails,
checkpoint verification, launcher commands and exit classification, retry policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.errors import (
    ConfigError,
    DeterministicError,
    ParityError,
    RetryableError,
    TrainingDiverged,
    TrainingInterrupted,
    is_retryable,
)
from lmforge.processes.launch import RANKS, SINGLE, Launch, build_command, classify, run_entry
from training import checkpoint
from training.config import GuardrailConfig, PretrainConfig
from training.device import DeviceInfo
from training.guardrails import SpikeDetector
from training.parallel.engines.deepspeed import build_ds_config
from training.planner import count_parameters, plan_parallelism

GIB = 1024**3


def gpu(memory_gib: float, count: int = 8) -> DeviceInfo:
    return DeviceInfo("cuda", "H100", count, int(memory_gib * GIB), True, 64)


def test_parameter_count_matches_the_built_model() -> None:
    from training.model import build_model

    cfg = PretrainConfig()
    model = build_model(cfg.model, 4096, cfg.seq_len, {"bos_id": 0, "eos_id": 0, "pad_id": 1}, seed=0)
    assert count_parameters(cfg.model, 4096) == sum(p.numel() for p in model.parameters())


def test_planner_picks_the_least_sharded_strategy_that_fits() -> None:
    """For each rung of the ladder, a GPU just big enough for it (and too small for the one before)."""
    from training.parallel.engines.deepspeed import LADDER as STRATEGIES
    from training.planner import memory_per_rank

    cfg = load_config(
        "gpu-1node",
        [
            "pretrain.distributed.num_ranks=8",
            "pretrain.distributed.memory_headroom=0",
            "pretrain.distributed.activation_checkpointing=true",
            "pretrain.distributed.micro_batch_size=1",
        ],
        check_paths=False,
    ).pretrain
    params = count_parameters(cfg.model, 50304)
    totals = [sum(memory_per_rank(params, cfg, "bf16", 8, st, off, 50304)[0].values()) for st, off in STRATEGIES]
    assert totals == sorted(totals, reverse=True)
    for (stage, offload), total in zip(STRATEGIES, totals):
        plan = plan_parallelism(cfg, 50304, gpu(total * 1.001))
        assert (plan.zero_stage, plan.offload) == (stage, offload)
        assert plan.reasoning[-1].startswith(f"chosen: ZeRO-{stage}")
        assert sum(plan.per_rank_gib.values()) <= plan.capacity_gib


def test_planner_memory_follows_deepspeeds_layout() -> None:
    """bf16: 2 B weights + 2 B gradients + 16 B for the optimizer step (fp32 master copy, the fp32
    gradient buffer DeepSpeed keeps, Adam m and v) per parameter; ZeRO-1 shards the 16 B, ZeRO-2
    also the gradients, ZeRO-3 also the weights; ZeRO-1/2/3 add their communication buckets."""
    from training.planner import ALLGATHER_BUCKET, REDUCE_BUCKET, memory_per_rank

    cfg = load_config("gpu-1node", ["pretrain.distributed.micro_batch_size=1"], check_paths=False).pretrain
    n, world = count_parameters(cfg.model, 50304), 8
    expected = {
        0: (2, 2, 16),
        1: (2, 2, 16 / world),
        2: (2, 2 / world, 16 / world),
        3: (2 / world, 2 / world, 16 / world),
    }
    for stage, (w, g, o) in expected.items():
        parts, host = memory_per_rank(n, cfg, "bf16", world, stage, "none", 50304)
        assert parts["weights"] * GIB == pytest.approx(w * n)
        assert parts["gradients"] * GIB == pytest.approx(g * n)
        assert parts["optimizer"] * GIB == pytest.approx(o * n) and host == 0
        assert parts["buckets"] > 0  # ZeRO-0: the flattened fp32 all-reduce buffer; ZeRO-1/2/3: the buckets
        assert parts["optimizer_step"] * GIB == pytest.approx(4 * n / (world if stage else 1))
    parts, _ = memory_per_rank(n, cfg, "bf16", world, 2, "none", 50304)
    assert parts["buckets"] * GIB == pytest.approx(2 * (min(REDUCE_BUCKET, n) + min(ALLGATHER_BUCKET, n)))
    assert "fp32_build_copy" not in parts and memory_per_rank(n, cfg, "bf16", world, 2, "none", 50304, cpu=True)[0][
        "fp32_build_copy"
    ] * GIB == pytest.approx(4 * n)
    parts, host = memory_per_rank(n, cfg, "bf16", world, 2, "optimizer", 50304)
    assert parts["optimizer"] == 0 and host * GIB == pytest.approx(16 * n / world)
    # activations: 34*s*b*h bytes per layer (16-bit, no stored attention scores) plus fp32 logits and their grads
    m, s = cfg.model, cfg.seq_len
    assert parts["activations"] * GIB == pytest.approx(34 * s * m.hidden_size * m.num_layers)
    assert parts["logits"] * GIB == pytest.approx(8 * s * 50304)
    fp32, _ = memory_per_rank(n, cfg, "fp32", world, 0, "none", 50304)
    assert (fp32["weights"] + fp32["gradients"] + fp32["optimizer"]) * GIB == pytest.approx(16 * n)


def test_planner_agrees_with_deepspeeds_own_estimates() -> None:
    """DeepSpeed's estimate_zero2/zero3_model_states_mem_needs for the 1.1B preset on 8 GPUs."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from training.planner import layer_parameters, memory_per_rank

    cfg = load_config("gpu-1node", ["pretrain.distributed.micro_batch_size=1"], check_paths=False).pretrain
    n, world = count_parameters(cfg.model, 50304), 8

    def states(stage: int) -> float:
        parts, _ = memory_per_rank(n, cfg, "bf16", world, stage, "none", 50304)
        return (parts["weights"] + parts["gradients"] + parts["optimizer"]) * GIB

    _, zero2 = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=world, cpu_offload=False)
    assert states(2) == pytest.approx(zero2, rel=0.001)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(
        n, layer_parameters(cfg.model), num_gpus_per_node=world, cpu_offload=False, cpu_offload_params=False
    )
    assert states(3) == pytest.approx(zero3, rel=0.15)  # DeepSpeed counts 18 B/N plus a gathered layer


def test_planner_checks_offloaded_states_against_host_ram() -> None:
    from dataclasses import replace

    from training.parallel.engines.deepspeed import LADDER as STRATEGIES
    from training.planner import memory_per_rank

    cfg = load_config(
        "gpu-1node",
        [
            "pretrain.distributed.num_ranks=8",
            "pretrain.distributed.memory_headroom=0",
            "pretrain.distributed.activation_checkpointing=true",
            "pretrain.distributed.micro_batch_size=1",
        ],
        check_paths=False,
    ).pretrain
    params = count_parameters(cfg.model, 50304)
    stage, offload = STRATEGIES[-2]  # optimizer offload: the device fits it, the host must hold the Adam states
    parts, host = memory_per_rank(params, cfg, "bf16", 8, stage, offload, 50304)
    device = gpu(sum(parts.values()) * 1.001)
    assert plan_parallelism(cfg, 50304, device).offload == offload  # host RAM unknown: not judged
    roomy = replace(device, host_memory_bytes=int(host * 8 * 1.01 * GIB))
    assert plan_parallelism(cfg, 50304, roomy).offload == offload
    cramped = replace(device, host_memory_bytes=int(host * 8 * 0.5 * GIB))
    with pytest.raises(ConfigError, match="host RAM too small"):
        plan_parallelism(cfg, 50304, cramped)


def test_planner_reports_the_compute_budget() -> None:
    cfg = load_config("gpu-1node", ["pretrain.distributed.num_ranks=8"], check_paths=False).pretrain
    plan = plan_parallelism(cfg, 50304, gpu(80), peak_tflops=989)
    tied = plan_parallelism(
        cfg.model_copy(update={"model": cfg.model.model_copy(update={"tie_embeddings": True})}),
        50304,
        gpu(80),
        peak_tflops=989,
    )
    assert tied.budget["flops_6nd"] == 6 * tied.params * cfg.max_steps * cfg.global_batch_size * cfg.seq_len
    n, d = plan.params, cfg.max_steps * cfg.global_batch_size * cfg.seq_len
    untied_embedding = 50304 * cfg.model.hidden_size  # gpu-1node unties embeddings: the input one is a lookup
    assert not cfg.model.tie_embeddings and plan.budget["flops_6nd"] == 6 * (n - untied_embedding) * d
    assert plan.budget["chinchilla_optimal_tokens"] == 20 * n
    hours = plan.budget["flops_with_attention"] / (989e12 * 8 * 0.4) / 3600
    assert plan.budget["estimated_hours"] == pytest.approx(hours, rel=1e-3)


def test_planner_override_and_errors() -> None:
    cfg = load_config(
        "gpu-1node", ["pretrain.distributed.num_ranks=8", "pretrain.distributed.zero_stage=3"], check_paths=False
    ).pretrain
    assert plan_parallelism(cfg, 50304, gpu(80)).zero_stage == 3
    tight = load_config("gpu-1node", ["pretrain.distributed.num_ranks=8"], check_paths=False).pretrain
    with pytest.raises(ConfigError, match="no strategy fits"):
        plan_parallelism(tight, 50304, gpu(4))
    with pytest.raises(
        ConfigError, match="pretrain: global_batch_size 10 is not a multiple of micro_batch_size x ranks"
    ):
        load_config("tiny-cpu", ["pretrain.global_batch_size=10"])  # fixed rank count: caught when the config loads
    odd = load_config("tiny-cpu", ["pretrain.global_batch_size=24", "pretrain.distributed.num_ranks=auto"]).pretrain
    with pytest.raises(
        ConfigError, match="not a multiple of micro_batch_size x data-parallel ranks"
    ):  # auto: once devices are known
        plan_parallelism(odd, 4096, DeviceInfo("cuda", "H100", 4, 80 * GIB, True, 64))


def test_deepspeed_config_follows_the_plan() -> None:
    cfg = load_config("gpu-1node", ["pretrain.distributed.num_ranks=8"], check_paths=False).pretrain
    plan = plan_parallelism(
        cfg.model_copy(
            update={"distributed": cfg.distributed.model_copy(update={"zero_stage": 3, "offload": "optimizer"})}
        ),
        50304,
        gpu(80),
    )
    ds = build_ds_config(cfg, plan)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["bf16"] == {"enabled": True}
    assert ds["train_batch_size"] == cfg.global_batch_size == 8 * 8 * ds["gradient_accumulation_steps"]
    assert ds["scheduler"]["params"]["warmup_num_steps"] == cfg.optim.warmup_steps
    assert ds["gradient_clipping"] == cfg.optim.grad_clip
    small = plan_parallelism(cfg, 50304, gpu(80))
    assert build_ds_config(cfg, small)["optimizer"]["params"]["torch_adam"] is True


def test_spike_detector() -> None:
    detector = SpikeDetector(GuardrailConfig(min_history=5, window=10, spike_zscore=4))
    for loss in [3.0, 3.1, 2.9, 3.0, 3.05]:
        assert detector.judge(loss) is None
        detector.accept(loss)
    assert detector.judge(float("nan")) == "non_finite"
    assert detector.judge(float("inf")) == "non_finite"
    assert detector.judge(3.2) is None
    assert detector.judge(6.0) == "spike"
    ratio = SpikeDetector(GuardrailConfig(spike_mode="ratio", spike_ratio=1.5, min_history=2))
    ratio.accept(2.0), ratio.accept(2.0)
    assert ratio.judge(2.9) is None and ratio.judge(3.1) == "spike"
    assert [detector.record_anomaly(s) for s in (10, 11, 12, 100)] == [1, 2, 3, 1]
    restored = SpikeDetector(detector.cfg)
    restored.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert list(restored.history) == list(detector.history) and restored.consecutive == 1


def _fake_checkpoint(root: Path, step: int) -> Path:
    directory = checkpoint.step_dir(root, step)
    (directory / "engine").mkdir(parents=True)
    (directory / "engine" / "w.pt").write_bytes(bytes([step % 256]) * 100)
    (directory / "trainer.json").write_text(json.dumps({"step": step}))
    from lmforge.hashing import file_sha256

    files = ["engine/w.pt", "trainer.json"]
    (directory / checkpoint.CHECKSUMS).write_text(json.dumps({f: file_sha256(directory / f) for f in files}))
    return directory


def test_corrupted_latest_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 10)
    latest = _fake_checkpoint(tmp_path, 20)
    (latest / "engine" / "w.pt").write_bytes(b"\xff" * 100)
    assert checkpoint.verify(latest) == "checksum mismatch in engine/w.pt"
    assert checkpoint.latest_verified(tmp_path).name == "step-00000010"
    assert list(tmp_path.glob(".corrupt-step-00000020-*"))  # set aside for inspection, never loaded


def test_rng_state_round_trips_through_json() -> None:
    import random

    import numpy as np
    import torch

    state = json.loads(json.dumps(checkpoint.rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_one_node_starts_deepspeed_ranks_with_torchrun_and_several_with_deepspeeds_runner() -> None:
    from training.config import DistributedConfig
    from training.steps import launcher_for

    assert launcher_for(DistributedConfig(), "deepspeed") == "torchrun"  # launcher: auto
    assert launcher_for(DistributedConfig(hostfile="/etc/hosts.ds"), "deepspeed") == "deepspeed"
    assert launcher_for(DistributedConfig(hostfile="/h", num_nodes=2), "deepspeed") == "deepspeed"
    assert launcher_for(DistributedConfig(launcher="deepspeed"), "deepspeed") == "deepspeed"
    assert launcher_for(DistributedConfig(launcher="deepspeed"), "fsdp2") == "torchrun"  # FSDP2: torchrun on one node
    assert launcher_for(DistributedConfig(hostfile="/h", num_nodes=2, backend="fsdp2"), "fsdp2") == "deepspeed"


def test_launch_commands() -> None:
    entry = "training.train_entry"
    command = build_command(entry, Path("/w/spec.json"), Launch("deepspeed", 2), 29555)
    assert command[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert "--num_gpus" in command and command[command.index("--num_gpus") + 1] == "2"
    assert command[-4:] == ["--module", "training.train_entry", "--spec", "/w/spec.json"]
    multi = build_command(entry, Path("s"), Launch("deepspeed", 8, num_nodes=4, hostfile="/etc/hosts.ds"), 1)
    assert multi[multi.index("--hostfile") + 1] == "/etc/hosts.ds" and multi[multi.index("--num_nodes") + 1] == "4"
    assert "--nproc_per_node=2" in build_command(entry, Path("s"), Launch("torchrun", 2), 1)
    accelerate = build_command("training.align.entry", Path("s"), Launch("accelerate", 2), 7)
    assert "--multi_gpu" in accelerate and accelerate[-4:] == ["-m", "training.align.entry", "--spec", "s"]
    assert "--multi_gpu" not in build_command("training.align.entry", Path("s"), Launch("accelerate", 1), 7)
    plain = build_command("evaluation.lmeval_entry", Path("s"), Launch(python="/q/bin/python"), 7)
    assert plain == ["/q/bin/python", "-m", "evaluation.lmeval_entry", "--spec", "s"]
    with pytest.raises(ConfigError, match="starts one process"):
        build_command("x", Path("s"), Launch("python", 2), 7)


def test_exit_classification_separates_retryable_from_deterministic() -> None:
    ok = [{"rank": 0, "status": "ok"}, {"rank": 1, "status": "ok"}]
    classify(RANKS, 0, ok, 2)
    classify(RANKS, 250, ok, 2)  # a crash in interpreter teardown after every rank recorded success
    with pytest.raises(TrainingInterrupted, match="1 rank\\(s\\) died without a record"):
        classify(RANKS, 247, [{"rank": 0, "status": "crash", "message": "gloo: Connection reset by peer"}], 2)
    with pytest.raises(TrainingDiverged):
        classify(
            RANKS,
            3,
            [
                {"rank": 0, "status": "diverged", "message": "4 anomalies"},
                {"rank": 1, "status": "diverged", "message": ""},
            ],
            2,
        )
    with pytest.raises(ParityError):
        classify(RANKS, 4, [{"rank": 0, "status": "parity_failed", "message": "gap"}], 2)
    with pytest.raises(ConfigError):
        classify(RANKS, 2, [{"rank": 0, "status": "config_error", "message": "bad"}], 2)
    # every rank alive and recorded, one crashed with a code error (not a dead peer): not retried
    with pytest.raises(DeterministicError, match="rank 1 crashed with IndexError: index 9"):
        classify(
            RANKS,
            1,
            [
                {"rank": 0, "status": "crash", "message": "gloo: Connection closed by peer"},
                {"rank": 1, "status": "crash", "message": "IndexError: index 9 is out of bounds"},
            ],
            2,
        )
    with pytest.raises(TrainingInterrupted):  # communication or I/O failures on every rank: worth a retry
        classify(
            RANKS,
            1,
            [
                {"rank": 0, "status": "crash", "message": "RuntimeError: [gloo] Connection reset by peer"},
                {"rank": 1, "status": "crash", "message": "OSError: [Errno 28] No space left on device"},
            ],
            2,
        )
    # the launcher failed before any rank started (busy port, unreachable node, bad hostfile): a retry
    # costs seconds, and the message quotes the launcher's own last words
    with pytest.raises(TrainingInterrupted, match="before any process started; its last output: ssh: no route"):
        classify(RANKS, 1, [], 2, started=0, output_tail="ssh: no route")


def test_a_rank_that_dies_of_a_fatal_signal_is_named_with_where_it_was(tmp_path: Path) -> None:
    """Before: a rank killed by SIGABRT (a C++ library's std::terminate) left only the launcher's "Signal 6
    received by PID ..." and no trace of where it was; faulthandler's record is now in the error."""
    with pytest.raises(TrainingInterrupted) as info:
        run_entry("tests.fault_entry", {"abort_rank": 1}, tmp_path, launch=Launch("torchrun", 2), policy=RANKS)
    message = str(info.value)
    assert (
        "1 rank(s) died without a record (rank 1: Fatal Python error: Aborted in tear_down_badly at "
        "tests/fault_entry.py:18, see logs/attempt-1/fault-rank1.txt), others reported ['ok']"
    ) in message
    attempt = tmp_path / "logs" / "attempt-1"
    assert "tear_down_badly" in (attempt / "fault-rank1.txt").read_text()
    assert not (attempt / "fault-rank0.txt").exists()  # a rank that ended normally leaves no fault record


def test_single_process_policy() -> None:
    """One process (lm-eval, the quantizer): killed by a signal or an outside error is worth a retry, a
    programming error or a config error is not, and the message names the process, not a rank."""
    classify(SINGLE, 0, [{"rank": 0, "status": "ok"}], 1)
    with pytest.raises(RetryableError, match="lm-eval ended with exit code -9") as killed:
        classify(SINGLE, -9, [], 1, started=1, what="lm-eval")
    assert not isinstance(killed.value, TrainingInterrupted)
    with pytest.raises(RetryableError, match="crashed with ConnectionError"):
        classify(SINGLE, 1, [{"rank": 0, "status": "crash", "message": "ConnectionError: refused"}], 1)
    with pytest.raises(DeterministicError, match="^the quantizer crashed with KeyError"):
        classify(SINGLE, 1, [{"rank": 0, "status": "crash", "message": "KeyError: 'x'"}], 1, what="the quantizer")
    with pytest.raises(ConfigError, match="^quantize.group_size 128 does not divide"):
        classify(
            SINGLE,
            2,
            [
                {
                    "rank": 0,
                    "status": "config_error",
                    "message": "quantize.group_size 128 does not divide q_proj's 96 input columns",
                }
            ],
            1,
        )


def test_entry_main_records_outcomes(tmp_path: Path) -> None:
    """Every entry module's shared `main` writes one exit record per process, whatever `work` did."""
    from lmforge.processes.entry import EXIT_CODES, main
    from lmforge.processes.launch import exit_records, processes_started

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out_dir": str(tmp_path), "attempt": 1, "attempt_dir": str(tmp_path / "a1")}))

    def broken(spec: dict, rank: int) -> None:
        raise ConfigError("align.sft.lr: must be positive")

    assert main(broken, ["--spec", str(spec), "--local-rank", "0"]) == EXIT_CODES["config_error"]
    assert processes_started(tmp_path / "a1") == 1
    assert exit_records(tmp_path / "a1")[0]["message"] == "align.sft.lr: must be positive"
    assert main(lambda s, r: None, ["--spec", str(spec)]) == 0
    assert exit_records(tmp_path / "a1")[0]["status"] == "ok"


def test_multinode_settings_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match="need launcher: deepspeed"):
        load_config("tiny-cpu", ["pretrain.distributed.launcher=torchrun", "pretrain.distributed.num_nodes=2"])
    with pytest.raises(ConfigError, match="num_nodes > 1 needs a hostfile"):
        load_config("tiny-cpu", ["pretrain.distributed.num_nodes=2"])


def test_retry_policy() -> None:
    assert is_retryable(TrainingInterrupted("killed")) and is_retryable(OSError("disk"))
    assert not is_retryable(ConfigError("x")) and not is_retryable(TrainingDiverged("x"))
    assert not is_retryable(ParityError("x")) and not is_retryable(ValueError("x"))
    assert not is_retryable(AssertionError("x")) and not is_retryable(IndexError("x"))  # bugs repeat
    from concurrent.futures.process import BrokenProcessPool

    assert is_retryable(BrokenProcessPool("a worker died")) and is_retryable(TimeoutError("slow disk"))
    from lmforge.errors import RunStopped, StepTimeout

    assert not is_retryable(RunStopped("cancelled")) and not is_retryable(StepTimeout("over its limit"))
    prefect_timeout = type("TaskRunTimeoutError", (TimeoutError,), {})
    assert not is_retryable(prefect_timeout("step ran past timeout_seconds"))


def test_known_gpu_peaks_tell_pcie_from_sxm() -> None:
    from training.device import peak_tflops

    def peak(name: str) -> float:
        return peak_tflops(DeviceInfo("cuda", name, 8, 80 * GIB, True, 64), "bf16")

    assert peak("NVIDIA H100 80GB HBM3") == 989.0 and peak("NVIDIA H100 PCIe") == 756.0
    assert peak("NVIDIA H100 NVL") == 835.0 and peak("NVIDIA H100 PCIe") != peak("NVIDIA H100 80GB HBM3")


def test_mfu_flops_leave_out_an_untied_input_embedding() -> None:
    from training.metrics import flops_per_token

    tied = PretrainConfig().model
    untied = tied.model_copy(update={"tie_embeddings": False})
    n_tied, n_untied = count_parameters(tied, 4096), count_parameters(untied, 4096)
    assert flops_per_token(n_untied, untied, 256, 4096) == flops_per_token(n_tied, tied, 256, 4096)


@pytest.mark.parametrize(
    ("preset", "overrides", "device", "chosen", "why"),
    [
        (
            "tiny-cpu",
            [],
            DeviceInfo("cpu", "AMD EPYC", 1, 24 * GIB, True, 2, 24 * GIB),
            "ZeRO-0 offload=none",
            "tie with FSDP2 grad_op offload=none broken by prefer_backend=deepspeed",
        ),
        (
            "tiny-cpu",
            ["pretrain.distributed.prefer_backend=fsdp2"],
            DeviceInfo("cpu", "AMD EPYC", 1, 24 * GIB, True, 2, 24 * GIB),
            "FSDP2 grad_op offload=none",
            "tie with ZeRO-0 offload=none broken by prefer_backend=fsdp2",
        ),
        (  # a mixture of experts: FSDP2 on the tie (prefer_backend auto; measured in benchmarks/pretrain.py)
            "tiny-cpu",
            ["pretrain.model.experts.num=4"],
            DeviceInfo("cpu", "AMD EPYC", 1, 24 * GIB, True, 2, 24 * GIB),
            "FSDP2 grad_op offload=none",
            "tie with ZeRO-0 offload=none broken by prefer_backend=fsdp2",
        ),
        ("gpu-1node", [], gpu(80), "ZeRO-0 offload=none", "no offload, the least traffic that fits)"),
        ("gpu-multinode", [], gpu(80), "FSDP2 hybrid offload=none", "the least traffic that fits across nodes"),
    ],
)
def test_the_planner_chooses_between_deepspeed_and_fsdp2(
    preset: str, overrides: list[str], device: DeviceInfo, chosen: str, why: str
) -> None:
    """Both families are costed for every preset; the choice and its reason are pinned here."""
    cfg = load_config(preset, overrides, check_paths=False).pretrain
    plan = plan_parallelism(cfg, 50304 if preset != "tiny-cpu" else 8192, device)
    assert plan.label == chosen and plan.reasoning[-1].startswith(f"chosen: {chosen} (") and why in plan.reasoning[-1]
    listed = " ".join(plan.reasoning)
    assert "ZeRO-3 offload=none" in listed and "FSDP2 full offload=none" in listed
    assert ("FSDP2 hybrid" in listed) == (cfg.distributed.num_nodes > 1)


def test_a_memory_bound_run_takes_fsdp2_full_shard_over_zero3_only_when_preferred() -> None:
    """Equal traffic (3 GA) for ZeRO-3 and FSDP2 full shard: prefer_backend decides; FSDP2's smaller
    gathered working set lets it fit a device ZeRO-3 does not."""
    from training.planner import memory_fsdp2, memory_per_rank

    base = ["pretrain.distributed.num_ranks=8", "pretrain.distributed.memory_headroom=0"]
    cfg = load_config("gpu-1node", base, check_paths=False).pretrain
    n = count_parameters(cfg.model, 50304)
    zero3 = sum(memory_per_rank(n, cfg, "bf16", 8, 3, "none", 50304)[0].values())
    full = sum(memory_fsdp2(n, cfg, "bf16", 8, 1, "full", "none", 50304)[0].values())
    assert full < zero3
    assert plan_parallelism(cfg, 50304, gpu(zero3 * 1.001)).label == "ZeRO-3 offload=none"
    fsdp_first = load_config("gpu-1node", [*base, "pretrain.distributed.prefer_backend=fsdp2"], check_paths=False)
    assert plan_parallelism(fsdp_first.pretrain, 50304, gpu(zero3 * 1.001)).label == "FSDP2 full offload=none"
    assert plan_parallelism(cfg, 50304, gpu((full + zero3) / 2)).label == "FSDP2 full offload=none"
    only_ds = load_config("gpu-1node", [*base, "pretrain.distributed.backend=deepspeed"], check_paths=False)
    assert plan_parallelism(only_ds.pretrain, 50304, gpu(zero3 * 1.001)).backend == "deepspeed"


def test_a_resume_from_the_final_checkpoint_trains_no_further_step(tmp_path: Path) -> None:
    """transformers' loop takes a step before it checks max_steps: a retry resumed from the last
    checkpoint (a rank that died in the export) trained step max_steps+1 (CI saw `assert 41 == 40`)."""
    import torch
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from training.align.entry import logged_train_loss, stop_at_max_steps

    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6]] * 32, "labels": [[1, 2, 3, 4, 5, 6]] * 32})
    steps: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            steps.append(state.global_step)

    def trainer(guarded: bool) -> Trainer:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=16, n_positions=8))
        args = TrainingArguments(
            output_dir=str(tmp_path / "checkpoints"), max_steps=4, save_steps=2, logging_steps=1, use_cpu=True,
            report_to=[], per_device_train_batch_size=2, save_total_limit=2, disable_tqdm=True,
        )  # fmt: skip
        made = Trainer(model=model, args=args, train_dataset=data, callbacks=[Steps()])
        if guarded:
            stop_at_max_steps(made)
        return made

    trainer(guarded=True).train()
    assert steps == [1, 2, 3, 4]
    final = tmp_path / "checkpoints" / "checkpoint-4"
    unguarded = trainer(guarded=False)
    unguarded.train(resume_from_checkpoint=str(final))
    assert unguarded.state.global_step == 5  # the library's behaviour this guards against
    steps.clear()
    resumed = trainer(guarded=True)
    resumed.train(resume_from_checkpoint=str(final))
    assert steps == [] and resumed.state.global_step == 4
    from safetensors.torch import load_file

    saved = load_file(str(final / "model.safetensors"))
    for name, tensor in resumed.model.state_dict().items():  # the checkpoint's weights, not a fresh model's
        if name in saved:
            assert torch.equal(tensor, saved[name]), name

    rows = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 2.0}, {"step": 2, "heldout_exact_match": 0.5},
            {"step": 3, "loss": 9.0}, {"step": 2, "loss": 3.0}, {"step": 3, "loss": 1.0}]  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert logged_train_loss(metrics, 3, 0.0) == pytest.approx((4.0 + 3.0 + 1.0) / 3)
    assert logged_train_loss(tmp_path / "none.jsonl", 3, 0.5) == 0.5


# -- the device mesh ------------------------------------------------------------------------------


def _llama(size: str, nodes: int, micro: int, tp: object = "auto", pp: object = 1, **extra: object) -> PretrainConfig:
    shapes = {  # Llama 3.1 8B, 70B and 405B
        "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8},
        "70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8},
        "405B": {"hidden_size": 16384, "intermediate_size": 53248, "num_layers": 126, "num_heads": 128,
                 "num_kv_heads": 8},
    }  # fmt: skip
    multi = {"hostfile": "/etc/hosts.ds", "launcher": "deepspeed"} if nodes > 1 else {}
    return PretrainConfig.model_validate(
        {
            "model": {**shapes[size], "tie_embeddings": False},
            "seq_len": 8192,
            "precision": "bf16",
            "global_batch_size": micro * 8 * nodes,
            "distributed": {
                "num_ranks": 8,
                "num_nodes": nodes,
                "micro_batch_size": micro,
                "activation_checkpointing": True,
                "tensor_parallel": tp,
                "pipeline_parallel": pp,
                **multi,
                **extra,
            },
        }
    )


def test_the_planner_splits_layers_only_when_sharding_alone_does_not_fit() -> None:
    h100 = DeviceInfo("cuda", "H100", 8, 80 * GIB, True, 64, host_memory_bytes=2048 * GIB, capability=(9, 0))
    small = plan_parallelism(_llama("8B", 1, 1), 128256, h100)
    assert small.degrees == {} and small.offload == "none"
    big = plan_parallelism(_llama("70B", 8, 8), 128256, h100)  # torchtitan's 70B: FSDP x TP 8
    assert big.degrees == {"tp": 8} and big.backend == "fsdp2" and big.offload == "none"
    assert big.data_parallel == 8 and big.grad_accum == 8  # 512 sequences = 8 data ranks x 8 x 8 micro-batches
    assert big.reasoning[-1].endswith("device mesh: dp_shard 8 x tp 8")
    # a TP candidate's memory divides the split parts by its degree, and leaves the fp32 build copy whole
    line = next(r for r in big.reasoning if r.startswith("tp 8 + FSDP2 full offload=none"))
    assert "all-gathers" in line and "fits" in line
    with pytest.raises(ConfigError, match="no strategy fits .* tp 2 \\+ FSDP2"):  # a fixed degree is not overridden
        plan_parallelism(_llama("70B", 8, 8, tp=2), 128256, h100)


def test_the_planner_adds_pipeline_stages_across_nodes_where_fsdp_and_tp_alone_would_offload() -> None:
    h100 = DeviceInfo("cuda", "H100", 8, 80 * GIB, True, 64, host_memory_bytes=2048 * GIB, capability=(9, 0))
    without = plan_parallelism(_llama("405B", 8, 2), 128256, h100)  # stages not planned: offloaded
    assert "pp" not in without.degrees and without.offload != "none"
    staged = plan_parallelism(_llama("405B", 8, 2, pp="auto"), 128256, h100)
    assert staged.degrees == {"pp": 4, "tp": 8} and staged.offload == "none" and staged.grad_accum == 32
    assert staged.reasoning[-1].endswith("device mesh: pp 4 x dp_shard 2 x tp 8")
    # 1F1B's first stage holds min(stages, micro-batches) micro-batches of its quarter of the layers
    line = next(r for r in staged.reasoning if r.startswith("pp 4 x tp 8 + FSDP2 full offload=none"))
    assert "fits" in line
    from training.parallel.dims.pipeline import memory_factors

    assert memory_factors(4, 32, _llama("405B", 8, 2, pp=4)) == {"activations": 1.0}  # 4 of 32 in flight, 1/4 each
    assert memory_factors(4, 32, _llama("405B", 8, 2, pp=4, pipeline_schedule="gpipe")) == {"activations": 8.0}
    one_node = plan_parallelism(_llama("70B", 1, 8, pp="auto"), 128256, h100)  # a stage is whole nodes
    assert "pp" not in one_node.degrees and one_node.offload != "none"
    with pytest.raises(ConfigError, match="1F1B needs at least 4 micro-batches per step"):
        cfg = _llama("8B", 4, 1, tp=1, pp=4)
        plan_parallelism(cfg.model_copy(update={"global_batch_size": 8}), 128256, h100)


def test_tensor_parallel_settings_are_refused_in_one_line() -> None:
    cpu = DeviceInfo("cpu", "test", 1, 64 * GIB, False, 2)
    base = {"distributed": {"num_ranks": 2, "backend": "fsdp2", "micro_batch_size": 4}, "global_batch_size": 8}
    for extra, message in (
        ({"tensor_parallel": 4}, "tensor_parallel 4 does not divide the 2 rank"),
        ({"tensor_parallel": 2, "model": {"num_kv_heads": 1, "num_heads": 4}}, "does not divide num_kv_heads 1"),
        ({"tensor_parallel": 2, "float8": "emulate"}, "float8 with tp 2 is not supported"),
    ):
        settings = {
            **base,
            "distributed": {**base["distributed"], "tensor_parallel": extra["tensor_parallel"]},
            **{k: v for k, v in extra.items() if k != "tensor_parallel"},
        }
        with pytest.raises(ConfigError, match=message):
            plan_parallelism(PretrainConfig.model_validate(settings), 512, cpu)


def test_mesh_coordinates_put_tensor_parallel_ranks_side_by_side() -> None:
    from training.parallel import mesh
    from training.planner import Plan

    plan = Plan(3, "none", 8, 2, 16, 1, "bf16", 1, {}, 0.0, 80.0, sharding="hybrid", degrees={"tp": 4})
    assert mesh.shape(plan) == {"dp_replicate": 2, "dp_shard": 2, "tp": 4}
    assert [mesh.coordinates(plan, r)["tp"] for r in range(5)] == [0, 1, 2, 3, 0]  # consecutive: one node
    assert [mesh.data_rank(plan, r) for r in (0, 3, 4, 8, 15)] == [0, 0, 1, 2, 3]
    assert mesh.describe(plan) == "dp_replicate 2 x dp_shard 2 x tp 4"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_every_projection_of_a_family_has_a_tensor_parallel_style(model_type: str) -> None:
    """The plan is a table of patterns: each must match the family's module names, and every linear
    layer of the decoder must fall under a split style (a layer left whole would hold full weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from training.parallel.dims.tensor import matches, plan_for

    config = AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = [n for n, _ in model.named_modules()]
    styled = dict(matches(plan_for(model_type), names))  # raises where a pattern matches nothing
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(styled.get(n) in ("colwise", "rowwise_to_sequence", "head") for n in linears)
    assert styled["model.embed_tokens"] == "embedding" and styled["model.norm"] == "sequence_out"
    with pytest.raises(ValueError, match="no plan for model type 'gpt_neox'"):
        plan_for("gpt_neox")


def test_pipeline_stages_keep_the_whole_models_names_and_split_layers_evenly() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.parallel.dims.pipeline import bounds, stage_module

    assert [bounds(5, s, 2) for s in range(2)] == [(0, 3), (3, 5)]
    assert [bounds(4, s, 4) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    whole = set(model.state_dict())
    parts = [set(stage_module(model, s, 2).state_dict()) for s in range(2)]
    assert parts[0] | parts[1] == whole and not parts[0] & parts[1]  # the stages' slices are the model
    assert "model.embed_tokens.weight" in parts[0] and {"lm_head.weight", "model.norm.weight"} <= parts[1]
    assert "model.layers.2.mlp.down_proj.weight" in parts[1]


def test_pipeline_settings_are_refused_by_the_planner_in_one_line_and_compose_with_tensor_parallel() -> None:
    from training.parallel import mesh

    cpu = DeviceInfo("cpu", "test", 1, 64 * GIB, False, 2)
    base = {"backend": "fsdp2", "num_ranks": 2, "micro_batch_size": 4}
    for settings, message in (
        ({"distributed": {**base, "pipeline_parallel": 2}}, "needs tie_embeddings false"),
        (
            {"model": {"tie_embeddings": False, "num_layers": 1}, "distributed": {**base, "pipeline_parallel": 2}},
            "exceeds num_layers 1",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            plan_parallelism(PretrainConfig.model_validate({**settings, "global_batch_size": 8}), 512, cpu)
    both = {
        "model": {"tie_embeddings": False, "num_kv_heads": 2},
        "distributed": {**base, "num_ranks": 4, "pipeline_parallel": 2, "tensor_parallel": 2},
    }
    plan = plan_parallelism(PretrainConfig.model_validate({**both, "global_batch_size": 8}), 512, cpu)
    assert plan.degrees == {"pp": 2, "tp": 2} and mesh.shape(plan) == {
        "pp": 2,
        "dp_replicate": 1,
        "dp_shard": 1,
        "tp": 2,
    }
    assert mesh.coordinates(plan, 3) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 1}
