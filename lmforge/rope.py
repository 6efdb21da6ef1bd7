"""RoPE scaling for context extension: continued pretraining at a longer `seq_len` than a model was
trained at stretches its rotary positions.

The frequencies are not computed here. lmforge's Llama is transformers' `LlamaForCausalLM`, so
`linear`, `dynamic` (NTK), `yarn` and `llama3` are transformers' `ROPE_INIT_FUNCTIONS`, and vLLM and
llama.cpp implement the same types from the same config keys. What no library does, and this
module does:

- choose the type and factor from the ratio of the new context to the trained one, and record the
  trained one as `original_max_position_embeddings` (`extension`);
- read a config.json in either shape transformers has written: `rope_parameters` (transformers 5)
  or `rope_scaling` beside a top-level `rope_theta` (4.x, and what most published models still
  ship) (`rope_parameters_of`);
- write both shapes into an exported config.json (`with_both_shapes`), so a reader that knows only
  one (transformers 4.x, an older vLLM or converter) does not silently drop the theta or the scaling,
  the field's known failure;
- say in one line, before any work, where a consumer cannot run a type (`gguf_refusal`).
"""

from __future__ import annotations

from typing import Any

from lmforge.errors import ConfigError

SCALED = ("linear", "dynamic", "yarn", "llama3")
DEFAULT_THETA = 10_000.0


def rope_parameters_of(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's rotary settings in transformers 5's shape (`rope_type`, `rope_theta`, ...),
    whichever shape it was written in; a scaling given only in the legacy `rope_scaling` wins over a
    `rope_parameters` that says `default`."""
    params = dict(config.get("rope_parameters") or {})
    legacy = {("rope_type" if k == "type" else k): v for k, v in (config.get("rope_scaling") or {}).items()}
    if legacy and params.get("rope_type", "default") == "default":
        params.update(legacy)
    if "rope_theta" not in params:
        params["rope_theta"] = float(config.get("rope_theta") or DEFAULT_THETA)
    params.setdefault("rope_type", "default")
    return params


def with_both_shapes(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a config.json's dict) with its rotary settings in both shapes: `rope_parameters`,
    and `rope_theta` plus, for a scaled model, `rope_scaling` (with both `type` and `rope_type`)."""
    params = rope_parameters_of(config)
    config["rope_parameters"] = params
    config["rope_theta"] = params["rope_theta"]
    if params["rope_type"] == "default":
        config.pop("rope_scaling", None)
    else:
        legacy = {k: v for k, v in params.items() if k != "rope_theta"}
        config["rope_scaling"] = {"type": params["rope_type"], **legacy}
    return config


def trained_context(config: dict[str, Any]) -> int | None:
    return config.get("max_position_embeddings") or config.get("n_positions")


def extension(scaling: Any, config: dict[str, Any], seq_len: int) -> dict[str, Any] | None:
    """The rotary settings to continue a model (its config.json as `config`) at `seq_len`, or None
    when the model keeps its own (`seq_len` within its trained context). `scaling`: the preset's
    `pretrain.rope_scaling`. A setting that cannot apply is refused in one line."""
    context, params = trained_context(config), rope_parameters_of(config)
    if context is None:
        raise ConfigError("pretrain.rope_scaling: the base's config.json has no max_position_embeddings")
    if seq_len <= context:
        if scaling.type not in ("auto", "none"):
            raise ConfigError(
                f"pretrain.rope_scaling.type={scaling.type} applies only when pretrain.seq_len ({seq_len}) exceeds "
                f"the model's trained context ({context} tokens); within it the model keeps its own rotary settings"
            )
        return None
    if params["rope_type"] != "default":
        raise ConfigError(
            f"pretrain.seq_len {seq_len} exceeds the base's context of {context} tokens, which it already reaches "
            f"with {params['rope_type']} RoPE scaling (factor {params.get('factor')}); extending a scaled model "
            "again is not supported: use seq_len <= its context"
        )
    kind = "yarn" if scaling.type == "auto" else scaling.type
    if kind == "dynamic":
        raise ConfigError(
            "pretrain.rope_scaling.type=dynamic is not a training-time extension: dynamic NTK rescales by each "
            "input's length at inference (transformers recomputes per length, vLLM fixes one table at the full "
            "length, llama.cpp has none), so a model trained with it is served differently; use yarn, linear or llama3"
        )
    if kind == "none":
        return {"rope_type": "default", "rope_theta": params["rope_theta"]}
    factor = float(scaling.factor or seq_len / context)
    if factor * context < seq_len:
        raise ConfigError(
            f"pretrain.rope_scaling.factor {factor:g} stretches the trained context of {context} tokens to "
            f"{factor * context:g}, short of pretrain.seq_len {seq_len}"
        )
    out: dict[str, Any] = {
        "rope_type": kind,
        "rope_theta": params["rope_theta"],
        "factor": factor,
        "original_max_position_embeddings": int(context),
    }
    if kind == "yarn":
        out |= {"beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow}
    if kind == "llama3":
        out |= {"low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor}
    return out


def apply(model_config: Any, rope: dict[str, Any], seq_len: int) -> Any:
    """A transformers config object set to `rope` and a context of `seq_len` (in place, returned)."""
    model_config.rope_parameters = dict(rope)
    model_config.max_position_embeddings = seq_len
    return model_config


def describe(rope: dict[str, Any] | None) -> str:
    if not rope:
        return "the model's own"
    if rope["rope_type"] == "default":
        return "unscaled"
    return f"{rope['rope_type']} x{rope['factor']:g} from {rope['original_max_position_embeddings']} tokens"


def gguf_refusal(config: dict[str, Any]) -> str | None:
    """Why llama.cpp would run this model with different rotary positions than it was trained with,
    or None. Its converter writes linear, yarn and (for Llama) llama3 scaling; a dynamic-NTK Llama
    would be converted without its scaling and run unscaled."""
    params = rope_parameters_of(config)
    if params["rope_type"] == "dynamic" and config.get("model_type") in ("llama", "mistral", "qwen2"):
        return (
            f"GGUF: llama.cpp has no dynamic-NTK RoPE for {config.get('model_type')}: the converted model would run "
            "unscaled; extend the context with pretrain.rope_scaling.type=yarn, linear or llama3"
        )
    return None
