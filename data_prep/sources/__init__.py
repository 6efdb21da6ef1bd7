"""Built-in raw-document sources: `builtin:NAME` in `curate.inputs`, read by ingest like any input.

A built-in source generates raw documents from what every lmforge environment has offline (the
`demo` source: text shipped in installed packages plus labelled noise, see `demo.py`). Ingest
writes it into its own output, `sources/NAME/` (the JSONL it then reads, and the source's
ground-truth labels), and reads that file exactly as it reads a user's JSONL: malformed lines
are quarantined, records normalized and sharded. Its cache identity is what generates it: the
generator's code, its settings (`curate.NAME`) and a fingerprint of the package data it draws
from, so the source is not generated just to compute a key.

`builtin:demo` can be listed beside real inputs (a smoke test of a new corpus next to the
planted noise). A source is added here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.errors import ConfigError

if TYPE_CHECKING:
    from lmforge.config import ConfigOrView

PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinSource:
    name: str
    settings: str  # the dotted config field holding its settings (part of ingest's key when listed)
    module: str  # the generator's module (its code is in ingest's identity)
    fingerprint: Callable[[Any], dict[str, Any]]  # (its settings) -> what it draws from, for the key
    build: Callable[[Any, Path], dict[str, Any]]  # (its settings, folder) -> counts; writes NAME.jsonl there


def _demo_fingerprint(settings: Any) -> dict[str, Any]:
    from data_prep.sources.demo import demo_sources_fingerprint

    return demo_sources_fingerprint(settings)


def _demo_build(settings: Any, folder: Path) -> dict[str, Any]:
    from data_prep.sources.demo import build_demo_corpus

    return build_demo_corpus(settings, folder)


SOURCES = {"demo": BuiltinSource("demo", "curate.demo", "data_prep.sources.demo", _demo_fingerprint, _demo_build)}


def is_builtin(path: str) -> bool:
    return path.startswith(PREFIX)


def get_source(path: str) -> BuiltinSource:
    """The source `builtin:NAME` names; a ConfigError naming the known ones otherwise."""
    name = path.removeprefix(PREFIX)
    if name not in SOURCES:
        raise ConfigError(
            f"curate.inputs: unknown built-in source {path!r} (known: {', '.join(PREFIX + n for n in SOURCES)})"
        )
    return SOURCES[name]


def settings_of(source: BuiltinSource, config: ConfigOrView) -> Any:
    """The source's settings section of the (viewed) pipeline config, e.g. `config.curate.demo`."""
    value = config
    for part in source.settings.split("."):
        value = getattr(value, part)
    return value


def materialize(path: str, settings: Any, out_dir: Path) -> Path:
    """Generate `builtin:NAME` into `out_dir/sources/NAME/` (once: a resumed ingest reuses it); its JSONL."""
    import shutil

    from data_prep.records import temp_path

    source = get_source(path)
    folder = out_dir / "sources" / source.name
    jsonl = folder / f"{source.name}.jsonl"
    if jsonl.is_file():
        return jsonl
    partial = temp_path(folder)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    source.build(settings, partial)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete one (its JSONL gone)
    partial.replace(folder)  # whole or not at all
    return jsonl
