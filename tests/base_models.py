"""A user's own base model, built offline as it would lie on disk, for tests that bring one to lmforge.

Each builder trains a tokenizer on the given texts with the `tokenizers` library, wraps it as a plain
`PreTrainedTokenizerFast` (no pad token, no chat template; transformers 5 saves it as tokenizer_class
"TokenizersBackend"), trains a tiny causal LM on the same texts
for a few steps so that it is not random, and saves both with `save_pretrained` (safetensors weights,
config, generation config, tokenizer files). Nothing lmforge-specific is written: lmforge sees only
the folder, exactly as it would see a model a user trained elsewhere.

- `build_qwen2_base`: `Qwen2ForCausalLM`, SentencePiece-style Unigram tokenizer (Metaspace,
  `<s>` / `</s>` / `<unk>`), untied head, config vocab padded to a multiple of 64 past the tokenizer.
- `build_neox_base`: `GPTNeoXForCausalLM`, byte-level BPE tokenizer (`<|endoftext|>` as bos, eos
  and unk), untied head, the same vocab padding.
- `build_moe_base`: a mixture of experts, Mixtral's or Qwen2-MoE's architecture, byte-level BPE.
- `demo_texts`: deterministic English text from the built-in demo corpus's real sources.
- `corrupt_one_byte`: damages one byte of a saved model's tensor data; the file still loads.

Both builders are deterministic for a seed (one CPU thread, a forked RNG) and take seconds.
Keyword arguments beyond the signature override the model config (e.g. `hidden_size=128`).
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_VOCAB_SIZE = 2000
_SEQ_LEN = 128
_BATCH = 8
_LR = 3e-3
_MAX_POSITIONS = 512


def demo_texts(n: int = 400) -> list[str]:
    """n documents of English text from the demo corpus's real sources, the same on every call.

    Python's reference documentation (`pydoc_data`, as the demo corpus's "prose" documents, in
    chunks of about 1,000 characters) followed by the English chatterbot dialogues ("dialogue"
    documents); cycled if n asks for more than there are.
    """
    from data_prep.config import DemoCorpusConfig
    from data_prep.sources import demo

    cfg = DemoCorpusConfig(prose_chunk_chars=1000)
    texts = [d.text for d in demo._prose_docs(cfg)]
    try:
        convs = demo._load_conversations()
        texts += [d.text for d in demo._dialogue_docs(cfg, {"english": convs.get("english", [])})]
    except Exception:  # chatterbot-corpus missing: the prose alone is plenty
        pass
    texts = [t for t in texts if t.strip()]
    return [texts[i % len(texts)] for i in range(n)]


def _padded_vocab(n_tokens: int) -> int:
    """The next multiple of 64 above the tokenizer's size: embedding rows no token uses, as Qwen has."""
    return (n_tokens // 64 + 1) * 64


@contextlib.contextmanager
def _deterministic(seed: int) -> Iterator[None]:
    """Seeded torch RNG and one intra-op thread (bit-identical results), both restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def _train(model: Any, tokenizer: Any, texts: list[str], steps: int, seed: int, eos_id: int) -> tuple[float, float]:
    """A few AdamW steps on random windows of the texts joined by eos; (first loss, last loss)."""
    import torch

    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    data = torch.tensor(ids, dtype=torch.long)
    if len(data) <= _SEQ_LEN + 1:
        raise ValueError(f"texts give only {len(data)} tokens; need more than {_SEQ_LEN + 1}")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - _SEQ_LEN, (_BATCH,), generator=gen)
        batch = torch.stack([data[s : s + _SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses[0], losses[-1]


def _finish(
    model: Any, tokenizer: Any, out_dir: Path, texts: list[str], steps: int, seed: int, name: str, t0: float
) -> Path:
    from transformers import GenerationConfig

    eos_id = model.config.eos_token_id
    first, last = _train(model, tokenizer, texts, steps, seed, eos_id)
    if not last < first:
        raise RuntimeError(f"{name}: training loss did not fall ({first:.3f} -> {last:.3f})")
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Always safetensors in transformers 5: `safe_serialization` is gone (silently swallowed by **kwargs).
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(
        f"{name}: {steps} steps, loss {first:.3f} -> {last:.3f}, vocab {len(tokenizer)} "
        f"(config {model.config.vocab_size}), {time.perf_counter() - t0:.1f}s -> {out_dir}"
    )
    return out_dir


def _canonical_unigram(tok: Any) -> Any:
    """The trained Unigram made run-independent: the piece set is stable but the trainer (Rust hash
    maps) leaves ~1e-11 noise on scores and appends rare required characters in random order. Scores
    are rounded, the lowest (those characters) share one floor score, and ties are ordered by piece."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    n_special = len(data["added_tokens"])
    pieces = vocab[n_special:]
    floor = min(score for _, score in pieces) + 0.01
    pieces = sorted(((p, round(max(score, floor), 5)) for p, score in pieces), key=lambda ps: (-ps[1], ps[0]))
    data["model"]["vocab"] = vocab[:n_special] + [list(ps) for ps in pieces]
    return Tokenizer.from_str(json.dumps(data))


def _wrap(tok: Any, **special: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=_MAX_POSITIONS, **special)
    assert tokenizer.pad_token is None and tokenizer.chat_template is None
    return tokenizer


def _unigram_tokenizer(texts: list[str]) -> Any:
    """SentencePiece-style: Unigram over Metaspace, `<unk>` (0), `<s>` (1), `</s>` (2), nothing added to encodings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=_VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(_canonical_unigram(tok), bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _byte_bpe_tokenizer(texts: list[str]) -> Any:
    """GPT-2 style: byte-level BPE with all 256 byte symbols, `<|endoftext|>` (0) as bos, eos and unk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    eot = "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[eot],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok, bos_token=eot, eos_token=eot, unk_token=eot)


_TOKENIZERS = {"unigram": _unigram_tokenizer, "byte_bpe": _byte_bpe_tokenizer}


def _decoder_settings(tok: Any) -> dict[str, Any]:
    """The config fields the Llama-like builders share: 2 layers, 4 heads over 2 KV heads, untied head,
    the vocab padded past the tokenizer, its bos and eos."""
    return {
        "vocab_size": _padded_vocab(len(tok)),
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": _MAX_POSITIONS,
        "tie_word_embeddings": False,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }


def build_qwen2_base(
    out_dir: Path,
    texts: list[str],
    steps: int = 150,
    seed: int = 0,
    *,
    tokenizer: str = "byte_bpe",
    **config_overrides: Any,
) -> Path:
    """A tiny untied Qwen2ForCausalLM with its own tokenizer, trained briefly on texts; out_dir.

    tokenizer="unigram": SentencePiece-style Unigram, about 2,000 pieces, Metaspace
    pre-tokenizer and decoder, `<unk>` (0), `<s>` (1, bos), `</s>` (2, eos); no pad, no chat template.
    Beware: transformers 5 `AutoTokenizer` forces `Qwen2Tokenizer` on any model_type "qwen2" folder and
    rebuilds a byte-level BPE from tokenizer.json's vocab, which mangles a Unigram (no spaces on decode)
    and adds pad `<|endoftext|>`; `PreTrainedTokenizerFast.from_pretrained` loads the file as saved.
    tokenizer="byte_bpe" (default, as Qwen's own): the byte-level BPE of `build_neox_base`, which survives that rebuild (but
    `AutoTokenizer` then reports pad `<|endoftext|>`, i.e. eos, as Qwen's own tokenizer does).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t0 = time.perf_counter()
    tok = _TOKENIZERS[tokenizer](texts)
    settings = {**_decoder_settings(tok), "hidden_size": 64, "intermediate_size": 128}
    config = Qwen2Config(**{**settings, **config_overrides})
    with _deterministic(seed):
        model = Qwen2ForCausalLM(config)
        return _finish(model, tok, Path(out_dir), texts, steps, seed, "qwen2", t0)


def build_moe_base(out_dir: Path, texts: list[str], kind: str, steps: int = 150, seed: int = 0) -> Path:
    """A tiny untied mixture of experts with the byte-level BPE tokenizer: `kind` "mixtral"
    (`MixtralForCausalLM`, 4 experts, top-2) or "qwen2_moe" (`Qwen2MoeForCausalLM`, 4 routed experts,
    top-2, and its shared expert); head size 32, what vLLM's CPU kernels take."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    t0 = time.perf_counter()
    tok = _byte_bpe_tokenizer(texts)
    settings = {**_decoder_settings(tok), "hidden_size": 128, "num_experts_per_tok": 2}
    if kind == "mixtral":
        config, cls = MixtralConfig(**settings, num_local_experts=4, intermediate_size=128), MixtralForCausalLM
    else:
        config, cls = (
            Qwen2MoeConfig(
                **settings,
                num_experts=4,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=256,
                intermediate_size=256,
                decoder_sparse_step=1,
            ),
            Qwen2MoeForCausalLM,
        )
    with _deterministic(seed):
        return _finish(cls(config), tok, Path(out_dir), texts, steps, seed, kind, t0)


def build_neox_base(
    out_dir: Path,
    texts: list[str],
    steps: int = 150,
    seed: int = 0,
    *,
    tokenizer: str = "unigram",
    **config_overrides: Any,
) -> Path:
    """A tiny untied GPTNeoXForCausalLM with its own tokenizer, trained briefly on texts; out_dir.

    tokenizer="unigram" (default): SentencePiece-style Unigram (`<unk>`, `<s>`, `</s>`); "byte_bpe":
    byte-level BPE with `<|endoftext|>` as bos, eos and unk. Either: no pad token, no chat template.
    """
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    t0 = time.perf_counter()
    tok = _TOKENIZERS[tokenizer](texts)
    settings: dict[str, Any] = {
        "vocab_size": _padded_vocab(len(tok)),
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": _MAX_POSITIONS,
        "tie_word_embeddings": False,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    config = GPTNeoXConfig(**{**settings, **config_overrides})
    with _deterministic(seed):
        model = GPTNeoXForCausalLM(config)
        return _finish(model, tok, Path(out_dir), texts, steps, seed, "gpt_neox", t0)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def corrupt_one_byte(model_dir: Path) -> None:
    """Invert one byte of tensor data in model_dir/model.safetensors (header untouched: it still loads).

    The byte is the least significant one of the middle element of the largest tensor (inverted for
    32/64-bit types, its lowest bit flipped for 16-bit ones), so the file parses and the value changes
    only slightly (never to NaN or inf): a checksum notices, loading does not.
    """
    path = Path(model_dir) / "model.safetensors"
    with path.open("r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        name = max(tensors, key=lambda k: (tensors[k]["data_offsets"][1] - tensors[k]["data_offsets"][0], k))
        begin, end = tensors[name]["data_offsets"]
        width = _DTYPE_BYTES.get(tensors[name]["dtype"], 1)
        n_elements = (end - begin) // width
        if n_elements == 0:
            raise ValueError(f"{path}: no tensor data to corrupt")
        offset = 8 + header_len + begin + (n_elements // 2) * width  # little-endian: byte 0 is least significant
        f.seek(offset)
        (value,) = f.read(1)
        f.seek(offset)
        f.write(bytes([value ^ (0xFF if width >= 4 else 0x01)]))  # 16-bit floats: spare the exponent bit
