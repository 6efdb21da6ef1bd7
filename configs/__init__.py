"""YAML presets: `tiny-cpu` (the embedded default) and GPU presets that validate but are not run on CPU."""

from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parent


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
