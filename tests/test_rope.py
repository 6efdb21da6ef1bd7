"""RoPE scaling (lmforge/rope.py): every type lmforge's Llama takes gives transformers' own inverse
frequencies and attention factor, vLLM serves the same rotary table, config.json carries both of
transformers' shapes, and a setting that cannot apply is refused in one line."""

from __future__ import annotations

import json

import pytest

from lmforge.errors import ConfigError
from lmforge.rope import extension, gguf_refusal, rope_parameters_of, with_both_shapes
from training.config import PretrainConfig, RopeScalingConfig

TRAINED, LONG = 64, 256


def _base_config() -> dict:
    """A config.json of lmforge's tiny Llama trained at 64 tokens (as transformers 5 writes it)."""
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": TRAINED,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    }


def _llama(rope: dict, context: int):
    from transformers import LlamaConfig

    from lmforge.rope import apply

    config = LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TRAINED,
    )  # fmt: skip
    return apply(config, rope, context)


def _rope(kind: str) -> dict:
    if kind == "dynamic":  # not a training-time extension (refused there): a base that ships it
        return {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 4.0}
    rope = extension(RopeScalingConfig(type=kind), _base_config(), LONG)
    assert rope is not None
    return rope


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "llama3"])
def test_every_scaling_type_gives_transformers_frequencies_and_vllms_rotary_table(kind: str) -> None:
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    config = _llama(_rope(kind), TRAINED if kind == "dynamic" else LONG)
    rotary = LlamaForCausalLM(config).model.rotary_emb  # what lmforge's Llama trains with
    expected, factor = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    assert torch.allclose(rotary.inv_freq, expected, rtol=0, atol=1e-6)
    assert abs(rotary.attention_scaling - factor) <= 1e-6
    if kind == "yarn":
        assert factor > 1.0  # YaRN's attention temperature is really applied
    unscaled = 1.0 / 10_000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert not torch.allclose(rotary.inv_freq, unscaled) or kind == "dynamic"  # dynamic: scaled past 64 only

    # vLLM's rotary table for the same config.json (what the served model computes)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = rope_parameters_of(json.loads(config.to_json_string()))
    # dynamic: vLLM keeps one unscaled table of the trained length (its scaled rows come only from a
    # larger max_position), transformers rescales past it per input: they agree within the trained
    # context only, which is why lmforge/rope.py refuses dynamic as a training-time extension
    positions = config.max_position_embeddings
    with set_current_vllm_config(VllmConfig()):
        served = get_rope(16, config.max_position_embeddings, True, params, torch.float32)
    cos_sin = served.cos_sin_cache[:positions]
    ids = torch.arange(positions)[None]
    cos, sin = rotary(torch.zeros(1, positions, 16), ids)
    assert torch.allclose(cos_sin[:, :8], cos[0, :, :8], atol=1e-5), kind
    assert torch.allclose(cos_sin[:, 8:], sin[0, :, :8], atol=1e-5), kind


def test_the_extension_is_chosen_from_the_ratio_and_records_the_trained_context() -> None:
    auto = extension(RopeScalingConfig(), _base_config(), LONG)
    assert auto == {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "original_max_position_embeddings": TRAINED,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    assert extension(RopeScalingConfig(), _base_config(), TRAINED) is None  # within the context: the model's own
    assert extension(RopeScalingConfig(type="none"), _base_config(), LONG) == {
        "rope_type": "default",
        "rope_theta": 10_000.0,
    }
    assert extension(RopeScalingConfig(type="linear", factor=8), _base_config(), LONG)["factor"] == 8.0


@pytest.mark.parametrize(
    ("scaling", "config", "seq_len", "message"),
    [
        ({"type": "yarn"}, None, TRAINED, "applies only when pretrain.seq_len (64) exceeds"),
        ({"type": "linear", "factor": 2}, None, LONG, "factor 2 stretches the trained context of 64 tokens to 128"),
        ({"type": "dynamic"}, None, LONG, "type=dynamic is not a training-time extension"),
        ({}, {"rope_scaling": {"type": "yarn", "factor": 4.0}}, 512, "already reaches with yarn RoPE scaling"),
    ],
)
def test_a_setting_that_cannot_apply_is_refused_in_one_line(scaling, config, seq_len, message) -> None:
    base = _base_config() | (config or {})
    with pytest.raises(ConfigError) as caught:
        extension(RopeScalingConfig(**scaling), base, seq_len)
    assert "\n" not in str(caught.value)
    assert all(part in str(caught.value) for part in message.split(" with ")) or message in str(caught.value)


def test_both_config_shapes_are_read_and_written() -> None:
    legacy = {"rope_theta": 500_000.0, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}
    params = rope_parameters_of(legacy)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500_000.0 and params["factor"] == 8.0
    assert rope_parameters_of({})["rope_theta"] == 10_000.0  # neither shape: transformers' default
    written = with_both_shapes({"rope_parameters": _rope("yarn"), "max_position_embeddings": LONG})
    assert written["rope_theta"] == 10_000.0
    assert written["rope_scaling"]["type"] == written["rope_scaling"]["rope_type"] == "yarn"
    assert written["rope_scaling"]["original_max_position_embeddings"] == TRAINED
    assert "rope_scaling" not in with_both_shapes(_base_config())
    from training.model import decoder_shape

    assert (
        decoder_shape({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, **legacy})["rope_theta"]
        == 500_000.0
    )


def test_transformers_and_llama_cpp_read_the_written_shapes_alike(tmp_path) -> None:
    from transformers import AutoConfig

    config = _llama(_rope("yarn"), LONG)
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(with_both_shapes(json.loads(path.read_text()))))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert rope_parameters_of(loaded.to_dict()) | {"type": "yarn"} == {**_rope("yarn"), "type": "yarn"}
    assert loaded.max_position_embeddings == LONG


def test_gguf_refuses_a_scaling_llama_cpp_would_drop() -> None:
    dynamic = _base_config() | {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}}
    assert "no dynamic-NTK RoPE for llama" in gguf_refusal(dynamic)
    assert gguf_refusal(_base_config() | {"rope_parameters": _rope("yarn")}) is None


def test_a_model_from_scratch_refuses_a_scaling_type(tmp_path) -> None:
    from lmforge.config import load_config

    with pytest.raises(ConfigError, match="needs base_model.path"):
        load_config("tiny-cpu", ["pretrain.rope_scaling.type=yarn"], str(tmp_path))
    assert PretrainConfig().rope_scaling.type == "auto"
