"""Which code made a step's output: digests of the step's own modules and versions of its libraries.

Only the hand-bumped `Step.version` is part of a cache key: putting source digests in keys
would rerun a week of training after a comment was fixed. Instead every manifest records
this fingerprint, and a later run compares it with the code it is about to reuse the output
with. A difference is *drift*: `lmforge explain` names it ("code of curate/heuristics
changed since this output was made: data_prep/heuristics.py") and `runtime.on_code_drift`
decides whether the step warns (default) or reruns.

A step's modules are those that define its functions (identity, units, finalize) plus the
ones it names in `Step.code`; its libraries are the distributions it names in
`Step.libraries` (torch, tokenizers, transformers, fasttext, datasketch, ...).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from lmforge.hashing import file_sha256

ROOT = Path(__file__).resolve().parent.parent


def _module_file(name: str) -> Path | None:
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None) if module else None
    if origin is None:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _label(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def step_modules(step: Any) -> list[str]:
    functions = [step.derive, step.finalize, step.run_unit, step.units]
    found = {f.__module__ for f in functions if f is not None and getattr(f, "__module__", None)}
    found.discard("lmforge.graph")  # the default no-op callables
    return sorted(found | set(step.code))


def library_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def _fingerprint(name: str, modules: tuple[str, ...], libraries: tuple[str, ...]) -> dict[str, Any]:
    files = {}
    for module in modules:
        path = _module_file(module)
        if path is not None:
            files[_label(path)] = file_sha256(path)[:16]
    return {"modules": files, "libraries": {lib: library_version(lib) for lib in libraries}}


def fingerprint(step: Any) -> dict[str, Any]:
    """{"modules": {path: sha256 prefix}, "libraries": {distribution: version}} for this process's code."""
    return _fingerprint(step.name, tuple(step_modules(step)), tuple(step.libraries))


def drift(step: Any, recorded: dict[str, Any] | None) -> list[str]:
    """One line per difference between the code that made an output and the code here now."""
    if not recorded:
        return []  # made before fingerprints were recorded: nothing to compare with
    now = fingerprint(step)
    lines: list[str] = []
    changed = [path for path, sha in now["modules"].items() if recorded.get("modules", {}).get(path) not in (None, sha)]
    if changed:
        lines.append(f"code of {step.name} changed since this output was made ({', '.join(changed)})")
    for lib, version in now["libraries"].items():
        before = recorded.get("libraries", {}).get(lib)
        if before is not None and before != version:
            lines.append(f"library {lib} changed {before} -> {version} since this output was made")
    return lines
