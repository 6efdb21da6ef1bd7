"""`pretrain.float8`: torchao's float8 training against bf16 on a tiny model (emulated: no GPU
here), which layers it converts, the export of a converted model, and how the planner resolves
the setting on each kind of hardware."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from lmforge.errors import ConfigError
from training.config import ModelConfig, PretrainConfig
from training.device import DeviceInfo
from training.planner import plan_parallelism

GIB = 1024**3
CPU = DeviceInfo("cpu", "Test CPU", 1, 16 * GIB, True, 2, 16 * GIB)
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 8, 80 * GIB, True, 64, 512 * GIB, capability=(9, 0))
A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", 8, 80 * GIB, True, 64, 512 * GIB, capability=(8, 0))

# the tiny model of the tests' pipeline (tests/conftest.py SMALL_PRETRAIN) on a small vocabulary
TINY = ModelConfig(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2, num_kv_heads=1)
SPECIAL = {"bos_id": 0, "eos_id": 0, "pad_id": 1}
VOCAB, SEQ, STEPS = 512, 64, 30
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tiny_model(model: ModelConfig = TINY) -> Any:
    from training.model import build_model

    return build_model(model, VOCAB, SEQ, SPECIAL, seed=1234)


def train(float8: str) -> dict[str, Any]:
    """STEPS AdamW steps on 8 fixed random sequences under CPU bf16 autocast, from the same weights."""
    import torch
    import torch.nn.functional as F

    from training import float8 as f8

    model = tiny_model()
    swapped = f8.convert(model, float8) if float8 != "off" else []
    tokens = torch.randint(2, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    began = time.perf_counter()
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"model": model, "swapped": swapped, "losses": losses, "seconds": time.perf_counter() - began}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return {"bf16": train("off"), "float8": train("emulate")}


def test_float8_training_follows_bf16(runs: dict[str, dict[str, Any]]) -> None:
    plain, fp8 = runs["bf16"]["losses"], runs["float8"]["losses"]
    gap = abs(fp8[-1] - plain[-1]) / plain[-1]
    print(
        f"\nfloat8 (emulated) vs bf16 after {STEPS} steps: final loss {fp8[-1]:.4f} vs {plain[-1]:.4f} "
        f"(relative difference {gap:.2%}; first {fp8[0]:.4f} vs {plain[0]:.4f}); "
        f"{runs['float8']['seconds']:.1f}s vs {runs['bf16']['seconds']:.1f}s"
    )
    assert plain[-1] < 0.5 * plain[0] and fp8[-1] < 0.5 * fp8[0], "the loss did not fall"
    assert gap < 0.05


def test_every_attention_and_mlp_projection_is_converted_and_nothing_else(runs: dict[str, dict[str, Any]]) -> None:
    import torch
    from torchao.float8.float8_linear import Float8Linear

    model, swapped = runs["float8"]["model"], runs["float8"]["swapped"]
    print(f"\nconverted: {swapped}")
    assert swapped == [f"model.layers.{i}.{p}" for i in range(TINY.num_layers) for p in PROJECTIONS]
    assert type(model.lm_head) is torch.nn.Linear  # the output projection stays in high precision
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in swapped)
    assert not any(isinstance(m, Float8Linear) for m in runs["bf16"]["model"].modules())


def test_a_layer_whose_dimensions_do_not_divide_by_16_stays_in_high_precision() -> None:
    from training.float8 import eligible

    converted, uneven = eligible(tiny_model(TINY.model_copy(update={"intermediate_size": 200})))
    assert uneven == [
        f"model.layers.{i}.mlp.{p}" for i in range(TINY.num_layers) for p in ("gate_proj", "up_proj", "down_proj")
    ]
    assert converted == [f"model.layers.{i}.{p}" for i in range(TINY.num_layers) for p in PROJECTIONS[:4]]


def test_a_converted_model_exports_as_a_plain_hf_model_and_passes_the_parity_check(tmp_path: Path) -> None:
    """Same state-dict keys and tensors as an unconverted model; `save_hf` writes a normal safetensors
    model; and with its float8 layers run as nn.Linear (what the parity check does) the converted
    model gives the exported model's logits exactly, while its float8 forward does not."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM

    from training import float8
    from training.export import save_hf

    plain, converted = tiny_model(), tiny_model()
    float8.convert(converted, "emulate")
    state = converted.state_dict()
    assert list(state) == list(plain.state_dict())
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({}))
    cfg = PretrainConfig(model=TINY, seq_len=SEQ)
    state = {k: v.detach().clone() for k, v in state.items()}
    save_hf(state, cfg, VOCAB, SPECIAL, tokenizer_dir, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists()
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    batch = torch.randint(2, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    converted.eval()
    with torch.no_grad():
        reference = exported(input_ids=batch).logits
        with float8.high_precision(converted):
            assert torch.equal(converted(input_ids=batch).logits, reference)
        emulated = converted(input_ids=batch).logits  # outside the block: float8 again
    assert not torch.equal(emulated, reference)
    assert float((emulated - reference).abs().max()) < 0.5


# -- the planner ------------------------------------------------------------------------------


def plan_for(float8: str, device: DeviceInfo) -> Any:
    micro = 2 if device.kind == "cuda" else 8  # 8 GPUs x 2 or 2 CPU ranks x 8 = the global batch of 16
    cfg = PretrainConfig.model_validate({"float8": float8, "distributed": {"micro_batch_size": micro}})
    return plan_parallelism(cfg, 4096, device)


@pytest.mark.parametrize("device", [CPU, A100], ids=["cpu", "a100"])
def test_float8_on_is_refused_in_one_line_without_a_gpu_of_capability_8_9(device: DeviceInfo) -> None:
    with pytest.raises(ConfigError) as refused:
        plan_for("on", device)
    message = str(refused.value)
    assert "\n" not in message
    assert "pretrain.float8" in message and "8.9" in message and "emulate" in message
    assert ("8.0" in message) == (device is A100)


def test_float8_auto_is_off_on_cpu_and_says_why() -> None:
    plan = plan_for("auto", CPU)
    assert plan.float8 == "off"
    assert any(r.startswith("float8: off (auto:") and "8.9" in r for r in plan.reasoning)


def test_float8_auto_is_on_on_a_gpu_of_capability_9_0() -> None:
    plan = plan_for("auto", H100)
    assert plan.float8 == "on"
    assert "bf16 + float8" in plan.reasoning[0]
    assert any(r.startswith("float8: float8 matmuls") and "9.0" in r for r in plan.reasoning)
    assert plan_for("on", H100).float8 == "on"
    assert plan_for("auto", A100).float8 == "off"


def test_float8_emulate_and_off_resolve_to_themselves_anywhere() -> None:
    assert plan_for("emulate", CPU).float8 == "emulate"
    assert plan_for("emulate", H100).float8 == "emulate"
    off = plan_for("off", CPU)
    assert off.float8 == "off" and not any(r.startswith("float8") for r in off.reasoning)


def test_float8_is_in_the_pretrain_steps_key_and_auto_keys_its_resolution() -> None:
    from lmforge.config import load_config
    from training.steps import PRETRAIN_STEPS

    step = PRETRAIN_STEPS[0]

    def key(*overrides: str) -> dict[str, Any]:
        return step.identity(load_config("tiny-cpu", list(overrides), check_paths=False))["pretrain"]

    assert key()["float8"] == "off"
    assert key("pretrain.float8=emulate")["float8"] == "emulate"
    # YAML reads a bare on/off as a boolean: `float8: on` in a preset or --set still means "on"
    assert key("pretrain.float8=on")["float8"] == "on" and key("pretrain.float8=off")["float8"] == "off"
    assert key("pretrain.float8=auto")["float8"] in ("auto:off", "auto:on")  # resolved on this machine
