"""llama.cpp's own converter, `convert_hf_to_gguf.py`, run from the llama.cpp sources setup.sh unpacked.

    python -m serving.quantize.gguf_convert LLAMA_CPP_DIR MODEL_DIR --outfile F.gguf --outtype bf16

It runs with .venv's Python (the converter needs torch, transformers and numpy, all there) and the
vendored `gguf-py` beside it. One addition, made here instead of in a GGUF writer of lmforge's own:
llama.cpp names a BPE tokenizer's pre-tokenizer by hashing how it splits a probe string and knows
only the hashes of published models, so a tokenizer lmforge trained is "not recognized". When the
hash is unknown, the pre-tokenizer transformers actually runs is read from the loaded tokenizer and
named when llama.cpp implements it: plain byte-level BPE with the GPT-2 regex and no normalizer
(what data_prep/tokenizer.py trains) is `gpt-2`; Qwen2's split regex before byte-level is `qwen2`
(transformers applies it to any `qwen2` model's BPE). Anything else still fails, in the converter's
words. The gate then checks llama.cpp's tokenization against transformers' on held-out text.
And one more: transformers 5 keeps GPT-NeoX's rotary settings in `rope_parameters`, while the
converter reads `rotary_pct`; the old names are filled in from the new (the gate's conversion-drift
check, bf16 perplexity in llama.cpp against transformers', would catch a misread setting).
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

# the Split regex transformers' Qwen2Tokenizer puts before a non-regex ByteLevel (llama.cpp's "qwen2")
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def known_pre_tokenizer(tokenizer: Any) -> str | None:
    """llama.cpp's name for the pre-tokenizer `tokenizer` (as transformers loads it) really runs, when
    it is one llama.cpp implements: GPT-2's byte-level regex, or Qwen2's split before byte-level."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.pre_tokenizer is None:
        return None
    normalizer = json.loads(backend.normalizer.__getstate__()).get("type") if backend.normalizer else None
    state = json.loads(backend.pre_tokenizer.__getstate__())
    if state.get("type") == "ByteLevel" and state.get("use_regex", True) and normalizer is None:
        return "gpt-2"
    parts = state.get("pretokenizers", []) if state.get("type") == "Sequence" else []
    if (
        len(parts) == 2
        and parts[0].get("type") == "Split"
        and (parts[0].get("pattern") or {}).get("Regex") == QWEN2_SPLIT
        and parts[0].get("behavior") == "Isolated"
        and parts[1].get("type") == "ByteLevel"
        and not parts[1].get("use_regex", True)
        and normalizer in (None, "NFC")  # Qwen's own tokenizers normalize to NFC; llama.cpp's qwen2 matches them
    ):
        return "qwen2"
    return None


# transformers 5 keeps these in `rope_parameters`; llama.cpp's converter still reads the old names
LEGACY_NAMES = {"gpt_neox": {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"}}


def with_legacy_names(config: dict[str, Any]) -> dict[str, Any]:
    rope = config.get("rope_parameters") or {}
    for old, new in LEGACY_NAMES.get(config.get("model_type", ""), {}).items():
        if old not in config and new in rope:
            config[old] = rope[new]
    return config


def main() -> None:
    source = Path(sys.argv[1]).resolve()
    script = source / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import conversion.base as base  # the converter's own package, from `source`

    recognized = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self: Any, tokenizer: Any) -> str:
        try:
            return recognized(self, tokenizer)
        except NotImplementedError:
            name = known_pre_tokenizer(tokenizer)
            if name is None:
                raise
            print(f"lmforge: an unpublished BPE tokenizer; its pre-tokenizer is llama.cpp's {name}", file=sys.stderr)
            return name

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    load_hparams = base.ModelBase.load_hparams
    base.ModelBase.load_hparams = staticmethod(lambda *a, **k: with_legacy_names(load_hparams(*a, **k)))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
