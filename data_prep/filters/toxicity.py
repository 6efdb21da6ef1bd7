"""Offensive language: documents whose P(toxic) is above `curate.toxicity.max_score` are removed.

The score is computed by curate/heuristics (the attribute column `toxicity_score`) and the
threshold applied by curate/select (rule `toxicity:score`), so moving the threshold re-selects
without rescoring. Two classifiers:

- `profanity-check` (default): alt-profanity-check, the maintained fork of profanity-check, a
  linear SVM (calibrated) on TF-IDF of words trained on labelled offensive/clean comments;
  `predict_prob(texts)` is P(offensive). Its model and vectorizer ship inside the wheel and the
  library loads them itself, with joblib (pickle), from its own package files when imported.
  That is acceptable: it is the installed package's own data, trusted exactly as much as the
  package's code that `import` runs; lmforge never unpickles a file a user names.
- `fasttext`: a fastText supervised classifier trained on a labelled file the user gives
  (`labelled_file`, one example a line: `__label__toxic TEXT` or `__label__clean TEXT`); the
  score is P(toxic). The file's content is part of curate/heuristics' key (`files`), so editing
  it rescores. Training is seeded and single-threaded (the same model in every worker process);
  each process trains it once and keeps it for the file's content.

Long documents are scored in windows and the maximum kept, so one offensive paragraph in a long
clean document is found: the text is split into paragraphs at blank lines, a paragraph longer than
`max_window_chars` is cut at spaces into pieces of at most that, and consecutive pieces are
joined until a window holds at least `min_window_chars` (a short tail joins the last window).
Windows of one short line score high on a single word ("Robots are stupid", a title with "Idiot"
in it); windows of a few thousand characters dilute an offensive paragraph below any threshold.
On the demo corpus plus 40 planted offensive documents (benchmarks/toxicity.py) 200/1000 found
38 of 40 and removed no demo document at the default max_score 0.9 (the highest demo document
scored 0.889: Dutch dialogue, "hoe"; the highest English one 0.731).

A shard's windows are scored in one call (`stats_batch`): one predict call costs about 3 ms
whatever its size, as much as scoring 60 windows in a batch.
"""

from __future__ import annotations

import functools
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from data_prep.filters.base import CurationFilter, FilterBase, Stats, failing
from lmforge.errors import ConfigError
from lmforge.hashing import file_sha256

TOXIC, CLEAN = "__label__toxic", "__label__clean"
_PARAGRAPH = re.compile(r"\n[^\S\n]*\n")
_SPACES = re.compile(r"\s*")
_LABELLED = re.compile(rf"^({TOXIC}|{CLEAN})\s+(\S.*)$")
# the fastText classifier's training settings (a small labelled file: many epochs, word bigrams)
_FASTTEXT = {"epoch": 25, "lr": 0.5, "wordNgrams": 2, "dim": 32, "minCount": 1, "bucket": 100_000, "seed": 0}


class ToxicityConfig(FilterBase):
    """Offensive language: remove documents whose P(toxic), the maximum over windows of the text, is above max_score."""

    classifier: Literal["profanity-check", "fasttext"] = Field(
        "profanity-check",
        description="profanity-check: alt-profanity-check's model (shipped in its wheel); fasttext: a fastText "
        "classifier trained on labelled_file.",
    )
    labelled_file: str | None = Field(
        None,
        description="classifier fasttext: the training file, one example a line, '__label__toxic TEXT' or "
        "'__label__clean TEXT'. Its content is part of curate/heuristics' key.",
    )
    max_score: float | None = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="Documents whose score (P(toxic)) is above this are removed (rule toxicity:score). "
        "0.9 removes no document of the demo corpus and 38 of 40 planted offensive ones.",
    )
    min_window_chars: int = Field(
        200, ge=1, description="Paragraphs are joined into windows of at least this many characters, each scored."
    )
    max_window_chars: int = Field(
        1000, ge=50, description="Paragraphs longer than this are cut at spaces into windows of at most this."
    )

    @model_validator(mode="after")
    def _classifier_file(self) -> ToxicityConfig:
        if self.classifier == "fasttext" and not self.labelled_file:
            raise ValueError("classifier fasttext is trained on labelled_file: set it")
        if self.classifier != "fasttext" and self.labelled_file:
            raise ValueError("labelled_file is read by classifier fasttext only")
        if self.min_window_chars > self.max_window_chars:
            raise ValueError(
                f"min_window_chars {self.min_window_chars} is above max_window_chars {self.max_window_chars}"
            )
        return self


def _cut(paragraph: str, max_chars: int) -> list[str]:
    """`paragraph` (stripped) in pieces of at most max_chars: each ends before the last space in the
    second half of the next max_chars characters (after max_chars if there is none), and the
    whitespace after a cut is skipped. An offset walks through the paragraph: re-slicing the rest
    at every cut (`rest = rest[cut:].lstrip()`, before issue 52) copied it each time, quadratic in
    one long paragraph (8 MB took seconds, 100 MB minutes). The pieces are the same: the regex
    class of _SPACES is exactly the characters str.lstrip removes (str.isspace)."""
    pieces, start, end = [], 0, len(paragraph)
    while end - start > max_chars:
        cut = paragraph.rfind(" ", start + max_chars // 2, start + max_chars + 1)
        cut = cut if cut >= 0 else start + max_chars
        pieces.append(paragraph[start:cut])
        start = _SPACES.match(paragraph, cut).end()  # type: ignore[union-attr]  # \s* always matches
    if start < end:
        pieces.append(paragraph[start:])
    return pieces


def windows(text: str, min_chars: int = 200, max_chars: int = 1000) -> list[str]:
    """The pieces of `text` scored one by one (see the module docstring); at least one. Linear in
    the text's length, however long its paragraphs."""
    pieces: list[str] = []
    for paragraph in _PARAGRAPH.split(text):
        pieces += _cut(paragraph.strip(), max_chars)
    out: list[str] = []
    current = ""
    for piece in pieces:
        current = f"{current}\n\n{piece}" if current else piece
        if len(current) >= min_chars:
            out.append(current)
            current = ""
    if current:
        if out:
            out[-1] = f"{out[-1]}\n\n{current}"
        else:
            out.append(current)
    return out or [text]


# -- the classifiers ---------------------------------------------------------------------------


@functools.cache
def _profanity_check():  # type: ignore[no-untyped-def]
    """alt-profanity-check's predict_prob; importing it loads its own model (once per process)."""
    try:
        from profanity_check import predict_prob
    except ImportError:
        raise ConfigError(
            "curate.toxicity: classifier profanity-check needs: pip install alt-profanity-check"
        ) from None
    return predict_prob


def read_labelled(path: str) -> list[tuple[str, str]]:
    """(label, text) of each non-blank line; a malformed line is a one-line ConfigError naming it."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"curate.toxicity.labelled_file: {path} does not exist") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"curate.toxicity.labelled_file: {path} is not UTF-8 ({error.reason})") from None
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        match = _LABELLED.match(line.strip())
        if match is None:
            raise ConfigError(
                f"curate.toxicity.labelled_file: {path}, line {number}: expected '{TOXIC} TEXT' or "
                f"'{CLEAN} TEXT', got {line.strip()[:60]!r}"
            )
        examples.append((match.group(1), match.group(2)))
    missing = [label for label in (TOXIC, CLEAN) if label not in {lab for lab, _ in examples}]
    if missing:
        raise ConfigError(f"curate.toxicity.labelled_file: {path} has no {missing[0]} example")
    return examples


@functools.lru_cache(maxsize=2)
def _fasttext_model(path: str, sha256: str) -> Any:
    """The classifier trained on `path` (whose content has digest `sha256`), once per process."""
    from data_prep.langid import fasttext_module
    from data_prep.quality import fasttext_line

    fasttext = fasttext_module()
    examples = read_labelled(path)
    with tempfile.TemporaryDirectory() as scratch:
        train = Path(scratch) / "train.txt"
        train.write_text("".join(f"{label} {fasttext_line(text)}\n" for label, text in examples), encoding="utf-8")
        return fasttext.train_supervised(input=str(train), thread=1, verbose=0, **_FASTTEXT)


def _fasttext_scores(path: str, texts: list[str]) -> list[float]:
    from data_prep.quality import fasttext_line

    try:
        digest = file_sha256(path)
    except FileNotFoundError:
        raise ConfigError(f"curate.toxicity.labelled_file: {path} does not exist") from None
    model = _fasttext_model(path, digest).f
    # k=1 as data_prep.quality does (the binding's batch call is wrong for k>1); with two
    # classes the top probability gives the other
    labels, probs = model.multilinePredict([fasttext_line(t) for t in texts], 1, 0.0, "replace")
    return [
        min(float(p[0]), 1.0) if lab and lab[0] == TOXIC else max(0.0, 1.0 - float(p[0])) if lab else 0.0
        for lab, p in zip(labels, probs)
    ]


def scores(texts: list[str], cfg: ToxicityConfig) -> list[float]:
    """Each text's score: the maximum P(toxic) over its windows, all windows in one predict call."""
    per_text = [windows(t, cfg.min_window_chars, cfg.max_window_chars) for t in texts]
    flat = [w for ws in per_text for w in ws]
    if not flat:
        return []
    if cfg.classifier == "fasttext":
        assert cfg.labelled_file is not None  # the config's validator
        probs = _fasttext_scores(cfg.labelled_file, flat)
    else:
        probs = [float(p) for p in _profanity_check()(flat)]
    out, start = [], 0
    for ws in per_text:
        out.append(max(probs[start : start + len(ws)]))
        start += len(ws)
    return out


class Toxicity(CurationFilter):
    name = "toxicity"
    description = "Offensive language: P(toxic) of a classifier, the maximum over windows of the text."
    config = ToxicityConfig
    stat_fields = ("classifier", "labelled_file", "min_window_chars", "max_window_chars")
    code = ("data_prep.filters.toxicity", "data_prep.quality", "data_prep.langid")
    libraries = ("alt-profanity-check", "scikit-learn", "fasttext-wheel")

    def stats(self, text: str, cfg: Any) -> Stats:
        return self.stats_batch([text], cfg)[0]

    def stats_batch(self, texts: list[str], cfg: Any) -> list[Stats]:
        return [{"toxicity_score": s} for s in scores(texts, cfg)]

    def files(self, cfg: Any) -> list[str]:
        return [cfg.labelled_file] if cfg.classifier == "fasttext" and cfg.labelled_file else []

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return failing("toxicity", cfg.enabled, [("score", cfg.max_score, stats["toxicity_score"], "max")])
