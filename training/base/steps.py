"""The base-model stage's one step: `base_model/import`.

It reads the base the user brings (`base_model.path`), and hands every later stage a
prepared copy as `hf-model:base` (see `training.base.prepare`). Its key is the base's
content (or hub commit), not its path, and with `trust_remote_code` the base's own Python files
too (they run when it is loaded); its output digest covers the prepared directory, so a
changed byte of the weights reruns what reads the base and nothing upstream of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.configbase import ConfigView
from lmforge.engine.graph import Step, StepContext
from lmforge.engine.remote import local_workspace
from lmforge.engine.stage import BASE_MODEL as BASE
from lmforge.engine.stage import has_base

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

IMPORT = "base_model/import"


def starts_from_base(config: PipelineBase) -> bool:
    """Alignment starts from the base itself when a base is set and this run does not pretrain."""
    return has_base(config) and "pretrain" not in config.stages


def remote_code(directory: Path) -> dict[str, dict[str, str]]:
    """{file: {"content": SHA-256}} of the base folder's Python files (hidden ones aside): the
    `modeling_*.py`, `configuration_*.py` and `tokenization_*.py` transformers runs with
    `trust_remote_code`, and any module those import from beside them."""
    from lmforge.hashing import file_sha256

    files = sorted(
        p
        for p in directory.rglob("*.py")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    return {str(p.relative_to(directory)): {"content": file_sha256(p)} for p in files}


def _content(config: ConfigView) -> dict[str, Any]:
    """The base by content: its weights, config and tokenizer (`prepare.fingerprint`), and with
    `trust_remote_code` its own Python code, which then runs (without it, it never does). A hub
    base is named by its commit, which covers its code."""
    from training.base.prepare import fingerprint, is_hub, resolve

    b = config.base_model
    if not b.path:  # no base model: the step is off, its identity empty
        return {}
    identity: dict[str, Any] = {"content": fingerprint(b.path, b.revision, local_workspace(config))}
    if b.trust_remote_code and not is_hub(b.path):
        identity["remote_code"] = remote_code(resolve(b.path, b.revision))
    return {"base_model": identity}


def _finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from training.base.prepare import check_base, prepare_base, resolve

    b = ctx.config.base_model
    source = resolve(b.path, b.revision)
    check_base(str(source), b.trust_remote_code, "base_model")
    info = prepare_base(source, ctx.out_dir / "hf", b.trust_remote_code)
    return {
        "counts": {"params": info["params"], "added_tokens": len(info["added_tokens"])},
        "metrics": {"vocab": info["vocab"]["tokenizer_after"]},
        "extra": {
            **info,
            "source": b.path + (f"@{b.revision}" if b.path.startswith("hf:") else ""),
            "identity": ctx.identity.get("base_model", {}).get("content"),
            "hf_dir": str(ctx.out_dir / "hf"),
        },
    }


def _findings(manifest: dict[str, Any]) -> list[str]:
    extra = manifest.get("extra", {})
    return [
        f"{extra.get('architecture')} with {extra.get('params', 0) / 1e6:.2f}M parameters from {extra.get('source')}",
        f"chat template: {extra.get('chat_template')}; added tokens: {', '.join(extra.get('added_tokens', [])) or 'none'}"
        + ("; embeddings resized" if extra.get("resized_embeddings") else ""),
    ]


BASE_STEPS = [
    Step(
        IMPORT,
        1,
        "Check and fingerprint the base model; add a chat template, pad and chat tokens where it lacks them",
        reads=("base_model.revision", "base_model.trust_remote_code"),
        derive=_content,
        finalize=_finalize,
        provides={BASE: "hf"},
        findings=_findings,
        code=("training.base.prepare", "lmforge.text.chat"),
        libraries=("transformers", "tokenizers"),
    ),
]
