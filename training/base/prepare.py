"""A base model the user brings: checked, fingerprinted, and prepared for lmforge's stages.

Checks (`check_base`) run when the config loads, so a wrong path fails in one line naming the
field and the file, not an hour into a run. The fingerprint is the content of the files that
shape the model (weights, config, tokenizer, generation config), hashed once and remembered
by path, size, mtime and inode (`lmforge.hashing.FingerprintCache`), or the resolved commit of
a hub snapshot. Preparing (`prepare_base`) makes the directory every later stage reads: the
base's own weights (linked, not copied, unless the vocabulary grows), and a tokenizer with a
chat template, a pad token and the stop tokens of a chat turn:

- the base's own chat template is kept when it has one; otherwise lmforge's ChatML template and
  its `<|im_start|>` / `<|im_end|>` tokens are added (recorded in `base.json`);
- a tokenizer without a pad token gets `<|pad|>`;
- the embeddings grow (mean-initialised, transformers' `resize_token_embeddings`) only where
  the added tokens do not fit the rows the base already has (Qwen-style bases have spare rows);
- weights that come only as PyTorch pickles (`pytorch_model.bin`, or its shards with
  `pytorch_model.bin.index.json`: what `save_pretrained(safe_serialization=False)` wrote) are
  converted to safetensors here, loaded once with `weights_only=True` (a pickle that holds more
  than tensors is refused in one line). Why convert rather than link or refuse: lmforge's rule is
  that weights are read with safetensors or `weights_only=True`, and every later stage (training
  from the base, export, vLLM, the quantizer, `count_weights`) reads the prepared folder; with
  safetensors there, none of them ever unpickles the user's file, and older models with only
  `.bin` weights still work. The original files stay part of the base's fingerprint.

Written here because no library turns an arbitrary causal LM into a chat-ready one with a
record of what changed; the pieces (AutoTokenizer, resize_token_embeddings) are transformers'.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError
from training.model import count_weights, decoder_shape

log = logging.getLogger(__name__)
HUB = "hf:"
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
# files that make up the model: weights, its config and generation config, its tokenizer
IDENTITY_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".jinja", ".tiktoken", ".bin")
WEIGHT_SUFFIXES = (".safetensors",)
PICKLED_WEIGHTS = "pytorch_model*.bin"  # transformers' names for weights saved with torch.save
PREPARED = "base.json"


def is_hub(path: str) -> bool:
    return path.startswith(HUB)


def resolve(path: str, revision: str = "main") -> Path:
    """The local directory of the base: `path` itself, or the hub snapshot of `hf:ORG/NAME` at `revision`."""
    if not is_hub(path):
        return Path(path).expanduser().resolve()
    from huggingface_hub import snapshot_download

    repo = path[len(HUB) :]
    try:
        return Path(snapshot_download(repo, revision=revision))
    except Exception as online:  # offline, or the hub unreachable: the local cache, if it has the revision
        try:
            return Path(snapshot_download(repo, revision=revision, local_files_only=True))
        except Exception:
            raise ConfigError(
                f"base_model.path: {path}@{revision} is neither reachable on the hub nor in the local cache "
                f"({type(online).__name__}); download it where the hub is reachable or give a local directory"
            ) from None


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"base_model.path: {directory}/config.json not found: not a Hugging Face model directory"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"base_model.path: {directory}/config.json is not valid JSON ({exc})") from None


def check_base(path: str, trust_remote_code: bool, source: str) -> None:
    """Raise ConfigError (one line, naming the field and file) where the base cannot be used."""
    if is_hub(path):
        return  # resolved (and downloaded) when the step runs
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    directory = Path(path).expanduser()
    if not directory.exists():
        raise ConfigError(f"{source}: base_model.path: {directory} does not exist")
    if not directory.is_dir():
        raise ConfigError(f"{source}: base_model.path: {directory} is a file, not a model directory")
    config = _read_config(directory)
    model_type = config.get("model_type", "")
    remote = "AutoModelForCausalLM" in config.get("auto_map", {}) or model_type not in CONFIG_MAPPING_NAMES
    if remote and not trust_remote_code:
        raise ConfigError(
            f"{source}: base_model.trust_remote_code: {directory}/config.json needs code from the model's own "
            f"repository (model_type {model_type!r}{', auto_map' if 'auto_map' in config else ''}); "
            "set base_model.trust_remote_code: true only if you trust it"
        )
    architectures = config.get("architectures") or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures) if architectures else True
    if not remote and (model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not causal):
        raise ConfigError(
            f"{source}: base_model.path: {directory}/config.json is not a causal language model "
            f"(model_type {model_type!r}, architectures {architectures})"
        )
    if not any((directory / name).exists() for name in TOKENIZER_MARKERS):
        raise ConfigError(
            f"{source}: base_model.path: {directory} has no tokenizer (none of {', '.join(TOKENIZER_MARKERS)})"
        )
    if not any(directory.glob("*.safetensors")) and not any(directory.glob(PICKLED_WEIGHTS)):
        raise ConfigError(
            f"{source}: base_model.path: {directory} has no weights (*.safetensors, or {PICKLED_WEIGHTS})"
        )


def identity_files(directory: Path) -> list[Path]:
    """The files that make the model what it is (READMEs, licences and hidden files are not)."""
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and p.suffix in IDENTITY_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def fingerprint(path: str, revision: str, workspace: str | Path) -> str:
    """The base's identity for cache keys: a digest of its files' names and SHA-256s (each hashed
    once, then remembered by path, size, mtime and inode), or for a hub model its resolved commit."""
    from lmforge.hashing import digest, fingerprints

    directory = resolve(path, revision)
    if is_hub(path):
        return f"hub:{path[len(HUB) :]}@{directory.name}"  # a snapshot folder is named by its commit
    cache = fingerprints(workspace)
    files = {str(p.relative_to(directory)): cache.file(p) for p in identity_files(directory)}
    cache.save()
    return digest(sorted(files.items()), length=32)


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.symlink(source, target)
    except OSError:
        shutil.copy2(source, target)


def prepare_base(source: Path, out_dir: Path, trust_remote_code: bool) -> dict[str, Any]:
    """Write the prepared base into `out_dir` and return what was done (also saved as base.json)."""
    from transformers import AutoTokenizer, GenerationConfig

    from lmforge.text.chat import CHAT_TEMPLATE, IM_END, IM_START, PAD, has_generation_markers

    config = _read_config(source)
    tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    before = len(tokenizer)
    added: dict[str, Any] = {}
    template = "base"
    if not tokenizer.chat_template:
        template = "lmforge ChatML (the base has none)"
        tokenizer.chat_template = CHAT_TEMPLATE
        added["additional_special_tokens"] = [IM_START, IM_END]
    elif not has_generation_markers(tokenizer.chat_template):
        template = (
            "base (no {% generation %} markers: SFT uses TRL's marked copy where it has one, else masks the prompt)"
        )
    if tokenizer.pad_token is None:
        added["pad_token"] = PAD
    if added:
        tokenizer.add_special_tokens(added)
    rows = int(config.get("vocab_size") or before)
    resized = len(tokenizer) > rows
    out_dir.mkdir(parents=True, exist_ok=True)
    context = int(config.get("max_position_embeddings") or config.get("n_positions") or tokenizer.model_max_length)
    tokenizer.model_max_length = min(context, int(tokenizer.model_max_length or context))
    if resized or not any(source.glob("*.safetensors")):  # grown rows, or pickled weights only
        _save_safetensors(source, out_dir, len(tokenizer) if resized else None, trust_remote_code)
    else:
        for file in source.iterdir():
            if file.suffix in WEIGHT_SUFFIXES or file.name == "model.safetensors.index.json":
                _link_or_copy(file, out_dir / file.name)
        shutil.copy2(source / "config.json", out_dir / "config.json")
    tokenizer.save_pretrained(str(out_dir))
    generation = (
        GenerationConfig.from_pretrained(str(source))
        if (source / "generation_config.json").exists()
        else GenerationConfig.from_model_config(_config_object(out_dir, trust_remote_code))
    )
    stops = [tokenizer.convert_tokens_to_ids(IM_END)] if IM_END in tokenizer.get_vocab() else []
    eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    generation.eos_token_id = list(dict.fromkeys([*stops, *[e for e in eos if e is not None], tokenizer.eos_token_id]))
    generation.pad_token_id = tokenizer.pad_token_id
    generation.save_pretrained(str(out_dir))
    info = {
        "architecture": (config.get("architectures") or [config.get("model_type")])[0],
        "model_type": config.get("model_type"),
        "params": count_weights(out_dir),
        "shape": decoder_shape(config),
        "vocab": {"tokenizer_before": before, "tokenizer_after": len(tokenizer), "embedding_rows": rows},
        "resized_embeddings": resized,
        "added_tokens": sorted(str(v) for vs in added.values() for v in (vs if isinstance(vs, list) else [vs])),
        "chat_template": template,
        "context": context,
        "special": {
            "bos_id": tokenizer.bos_token_id,
            "eos_id": tokenizer.eos_token_id,
            "pad_id": tokenizer.pad_token_id,
        },
    }
    (out_dir.parent / PREPARED).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _config_object(directory: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)


def _save_safetensors(source: Path, out_dir: Path, rows: int | None, trust_remote_code: bool) -> None:
    """The base's weights written as safetensors into `out_dir`, its embeddings grown to `rows` if given.

    Through transformers rather than tensor by tensor: it knows which names a tied head shares
    (safetensors refuses shared storage, and dropping the wrong name of the pair would lose the
    embedding) and how the model's shards are named."""
    import pickle

    from lmforge.inference.hf_load import load_causal_lm

    try:
        model = load_causal_lm(str(source), dtype="auto", trust_remote_code=trust_remote_code, weights_only=True)
    except pickle.UnpicklingError as exc:
        culprit = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        raise ConfigError(
            f"base_model.path: {source}/{PICKLED_WEIGHTS} holds more than tensors"
            f"{f' ({culprit.group(1)})' if culprit else ''}, which torch.load(weights_only=True) refuses and "
            "lmforge does not unpickle; convert it to safetensors where you trust the file"
        ) from None
    if rows is not None:
        model.resize_token_embeddings(rows, mean_resizing=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "generation_config.json").unlink(missing_ok=True)  # rewritten below with the chat stops
