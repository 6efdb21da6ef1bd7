"""RoPE scaling (lmforge/rope.py): every type lmforge's Llama takes gives transformers' own inverse
frequencies and attention factor, vLLM serves the same rotary table, config.json carries both of
transformers' shapes, and a setting that cannot apply is refused in one line."""

from __future__ import annotations

import json
import shutil

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


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "llama3"])
def test_vllm_serves_each_scaling_at_the_context_the_model_was_trained_at(kind: str, tmp_path, tokenizer_dir) -> None:
    """vLLM multiplies max_position_embeddings by the factor for linear and dynamic (not for yarn and
    llama3): lmforge's command holds it to the trained context, and vLLM's own reading agrees."""
    from vllm.config import ModelConfig

    from lmforge.inference.vllm_server import EngineConfig, NotServable, server_command

    context = TRAINED if kind == "dynamic" else LONG  # dynamic: a base that ships it; the rest: an extension
    config = _llama(_rope(kind), context)
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(with_both_shapes(json.loads(path.read_text()))))
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    command = server_command(tmp_path, EngineConfig(), port=8000)
    held = int(command[command.index("--max-model-len") + 1]) if "--max-model-len" in command else None
    assert held == (context if kind in ("linear", "dynamic") else None), command
    served = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), dtype="float32", max_model_len=held)
    assert served.max_model_len == context
    if kind in ("linear", "dynamic"):  # what vLLM would have served without it
        assert ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), dtype="float32").max_model_len == 4 * context
    if kind == "dynamic":  # its one rotary table has `context` rows: a longer serve is refused in one line
        with pytest.raises(
            NotServable, match=f"exceeds this dynamic-NTK model's max_position_embeddings .{context}."
        ) as no:
            server_command(tmp_path, EngineConfig(max_model_len=4 * context), port=8000)
        assert "\n" not in str(no.value)


def test_gguf_refuses_a_scaling_llama_cpp_would_drop() -> None:
    dynamic = _base_config() | {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}}
    assert "no dynamic-NTK RoPE for llama" in gguf_refusal(dynamic)
    assert gguf_refusal(_base_config() | {"rope_parameters": _rope("yarn")}) is None


def test_a_model_from_scratch_refuses_a_scaling_type(tmp_path) -> None:
    from lmforge.config import load_config

    with pytest.raises(ConfigError, match="needs base_model.path"):
        load_config("tiny-cpu", ["pretrain.rope_scaling.type=yarn"], str(tmp_path))
    assert PretrainConfig().rope_scaling.type == "auto"


# -- evaluation at length (evaluation/build.py, evaluation/stats.py) -----------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from evaluation.build import PASSKEY_FILLER, PASSKEY_HEAD, PASSKEY_QUESTION

    corpus = [PASSKEY_HEAD, PASSKEY_QUESTION, *PASSKEY_FILLER, "The pass key is 12345. Remember it."] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    out = tmp_path_factory.mktemp("tok")
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def test_passkey_items_hide_the_key_at_each_depth_within_each_length(tokenizer_dir) -> None:
    from evaluation.build import PASSKEY_FILLER, passkey_items

    items = passkey_items(tokenizer_dir, [64, 256], [0.0, 0.5, 1.0], 2, seed=0)
    assert len(items) == 2 * 3 * 2 and len({i["id"] for i in items}) == len(items)
    for item in items:
        assert item["id"].startswith(f"L{item['length']}-")
        assert item["length"] - 24 <= item["tokens"] <= item["length"] - 4  # about the length, room for the answer
        assert item["context"].count(item["answer"]) == 1 and item["context"].endswith("The pass key is")
        at = item["context"].index(item["answer"])
        before, after = (
            sum(part.count(f) for f in PASSKEY_FILLER) for part in item["context"].partition(item["answer"])[::2]
        )
        assert before == round(item["depth"] * (before + after)), (item["depth"], before, after)
        assert at > 0
    assert passkey_items(tokenizer_dir, [64], [0.5], 1, seed=0) == passkey_items(tokenizer_dir, [64], [0.5], 1, seed=0)
    with pytest.raises(ValueError, match="cannot hold the pass key"):
        passkey_items(tokenizer_dir, [16], [0.5], 1, seed=0)


def test_the_passkey_and_perplexity_scorers_and_the_by_length_table(tokenizer_dir, tmp_path) -> None:
    import importlib.util
    import math

    from evaluation import report, stats
    from evaluation.build import ppl_by_length_items

    docs = [{"id": f"d{i}", "text": " ".join(["The sky is blue and the grass is green."] * 40)} for i in range(3)]
    items = ppl_by_length_items(docs, tokenizer_dir, [64, 128], limit=2)
    assert [i["id"] for i in items] == ["L64-d0", "L128-d0", "L64-d1", "L128-d1"]
    assert all(12 <= i["tokens"] <= 20 and i["continuation"] for i in items)
    # every length scores the same tokens; only the context before them grows
    assert items[0]["continuation"] == items[1]["continuation"] and items[1]["context"].endswith(items[0]["context"])
    assert len(items[1]["context"]) > len(items[0]["context"])

    from evaluation.build import SANDBOX, TEMPLATES, VERIFY

    for source in (TEMPLATES / "utils.py", SANDBOX, VERIFY):  # as build() lays the task folder out
        shutil.copy2(source, tmp_path / source.name)
    spec = importlib.util.spec_from_file_location("task_utils", tmp_path / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    assert utils.passkey_process({"answer": "48213"}, [" 48213"])["acc"] == 1.0
    assert utils.passkey_process({"answer": "48213"}, [" 4821"])["acc"] == 0.0
    pair = utils.ppl_process({"tokens": 16}, [(-16 * math.log(5.0), False)])["token_perplexity"]
    assert abs(utils.token_perplexity([pair, pair]) - 5.0) < 1e-9
    values = {"L64-a": 1.0, "L64-b": 0.0, "L256-a": 1.0}
    assert stats.by_length("acc", values) == [[64, 0.5], [256, 1.0]]
    assert stats.by_length("acc", {"HumanEval/0": 1.0}) == []
    row = {"model": "pretrained", "backend": "hf", "task": "lmforge_passkey", "metric": "acc", "value": 0.75,
           "ci_low": 0.5, "ci_high": 1.0, "clean_value": 0.75, "clean_items": 3, "contaminated_share": 0.0,
           "by_length": [[64, 0.5], [256, 1.0]]}  # fmt: skip
    assert "| pretrained | hf | lmforge_passkey | acc | 64: 0.5, 256: 1 |" in report.card([row], [], [], [])


def test_the_gpu_long_context_preset_extends_a_llama_3_base_fourfold_and_plans_on_one_node() -> None:
    """The preset on Meta-Llama-3-8B's config (8,192 tokens, theta 500k): YaRN x4 to 32k recorded against
    the trained context, attention within documents, and a plan that fits 8 GPUs of 80 GiB."""
    from lmforge.config import load_config
    from training.device import DeviceInfo
    from training.model import model_config_of
    from training.planner import plan_parallelism

    llama3_8b = {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    config = load_config("gpu-long-context", check_paths=False)
    assert extension(config.pretrain.rope_scaling, llama3_8b, config.pretrain.seq_len) == {
        "rope_type": "yarn",
        "rope_theta": 500000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    assert config.serve.engine.max_model_len == config.pretrain.seq_len == 32768
    assert max(config.evaluate.builtin.context_lengths) == 32768
    cfg = config.pretrain.model_copy(update={"model": model_config_of(llama3_8b)})
    node = DeviceInfo("cuda", "H100", 8, 80 * 1024**3, True, 64, capability=(9, 0))
    plan = plan_parallelism(cfg, 128256, node, peak_tflops=989.0, params=8_030_261_248)
    assert plan.world_size == 8 and plan.reasoning[-1].startswith("chosen:")
