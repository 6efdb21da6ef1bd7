"""Text normalization shared by ingest, dedup and filters.

Two different normalizations:
- `normalize_document` is applied to every document at ingest (NFC, control characters,
  whitespace) and changes the stored text;
- `dedup_words` is the aggressive view used only to compare documents (lowercase, no
  punctuation or accents, digits folded to 0), after datatrove's `simplify_text`.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Literal

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_ODD_SPACES = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_ZERO_WIDTH = re.compile(r"[\u200b\u200c\u200d\u2060\ufeff]")
_TRAILING_WS = re.compile(r"[ \t]+\n")
_MANY_BLANK_LINES = re.compile(r"\n{3,}")
_PUNCT_OR_SPACE = re.compile(r"[\W_]+", re.UNICODE)
_DIGIT = re.compile(r"\d")


def normalize_document(
    text: str, form: Literal["NFC", "NFD", "NFKC", "NFKD"] = "NFC", fix_encoding: bool = False
) -> str:
    """Unicode `form`, control characters removed, line endings and odd spaces unified.

    `fix_encoding` first repairs mojibake with ftfy (before C1 controls, which are part of some
    mojibake, are removed).

    Leading indentation is kept (code depends on it); trailing spaces and runs of more
    than one blank line are removed.
    """
    if fix_encoding:
        import ftfy

        text = ftfy.fix_encoding(text)
    text = unicodedata.normalize(form, text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ZERO_WIDTH.sub("", _CONTROL.sub("", text))
    text = _ODD_SPACES.sub(" ", text)
    text = _TRAILING_WS.sub("\n", text + "\n")
    text = _MANY_BLANK_LINES.sub("\n\n", text)
    return text.strip("\n").rstrip()


_COMBINING_MARKS = re.compile(r"[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]")


def _strip_accents(text: str) -> str:
    return _COMBINING_MARKS.sub("", unicodedata.normalize("NFD", text))


def dedup_words(text: str) -> list[str]:
    """The word sequence near-dedup compares: lowercase, accents and punctuation removed, digits -> 0."""
    simple = _strip_accents(text.lower()) if not text.isascii() else text.lower()
    simple = _DIGIT.sub("0", simple)
    return _PUNCT_OR_SPACE.sub(" ", simple).split()


def shingle_set(text: str, n: int) -> set[str]:
    """Word n-gram shingles of the dedup view; a document shorter than n words is one shingle."""
    words = dedup_words(text)
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)
