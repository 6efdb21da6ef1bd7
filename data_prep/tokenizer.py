"""Byte-level BPE tokenizer training with Hugging Face `tokenizers`, saved in HF format.

The saved directory loads with `AutoTokenizer.from_pretrained` and carries the special
tokens and a ChatML chat template the alignment stage uses. Fertility (tokens per
whitespace word) is reported per language and per domain: a tokenizer that splits one
language into many more pieces than another costs that language context and compute.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from lmforge.text.chat import CHAT_TEMPLATE, IM_END, IM_START, PAD

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, PAD, IM_START, IM_END]


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int, out_dir: Path) -> dict[str, int]:
    """Train, wrap as a fast HF tokenizer and save; returns the realised vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1_000_000,
    )
    fast.save_pretrained(str(out_dir))
    eos_id, pad_id = tokenizer.token_to_id(EOS), tokenizer.token_to_id(PAD)
    if eos_id is None or pad_id is None:
        raise RuntimeError(f"the trained tokenizer lacks its special tokens {EOS!r} and {PAD!r}")
    return {"vocab_size": tokenizer.get_vocab_size(), "eos_id": eos_id, "pad_id": pad_id}


def load_tokenizer(directory: Path):  # type: ignore[no-untyped-def]
    """The raw `tokenizers.Tokenizer` (fast batch encoding without transformers' overhead)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def fertility(directory: Path, groups: dict[str, list[str]]) -> dict[str, float]:
    """Tokens per whitespace-separated word for each group of sample texts."""
    tokenizer = load_tokenizer(directory)
    out: dict[str, float] = {}
    for name, texts in sorted(groups.items()):
        words = sum(len(t.split()) for t in texts)
        if words:
            tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts))
            out[name] = round(tokens / words, 3)
    return out


def sample_groups(
    rows: Iterable[dict[str, str]], keys: tuple[str, ...], per_group: int, seed: int
) -> dict[str, list[str]]:
    """Reservoir-sample up to `per_group` texts for every value of each key (e.g. lang, domain)."""
    rng = random.Random(seed)
    groups: dict[str, list[str]] = defaultdict(list)
    seen: dict[str, int] = defaultdict(int)
    for row in rows:
        for key in keys:
            name = f"{key}={row.get(key) or 'unknown'}"
            seen[name] += 1
            if len(groups[name]) < per_group:
                groups[name].append(row["text"])
            elif (j := rng.randrange(seen[name])) < per_group:
                groups[name][j] = row["text"]
    return dict(groups)
