"""Document-level heuristic quality rules: Gopher quality/repetition, C4, FineWeb, length, encoding.

The logic follows datatrove's filters (`gopher_quality_filter.py`, `gopher_repetition_filter.py`,
`c4_filters.py::C4QualityFilter`, `fineweb_quality_filter.py`, current main, e.g. FineWeb drops blank
lines and compares strictly); default thresholds live in each family's module. Work is split in two so
that moving a threshold never recomputes anything:

1. `compute_stats(text, StatParams)` computes every statistic once per document (a flat dict of
   JSON-serializable numbers/bools). `StatParams` holds only the settings that change statistics.
2. `*_failures(stats, config)` (one module per family, data_prep/filters/) are pure threshold
   checks returning namespaced rule names ("gopher_quality:min_doc_words", ...). A threshold of
   None disables its rule (0 is a real threshold, unlike datatrove's truthiness checks); a family
   with `enabled=False` returns [].
   `skip_domains` is the caller's business. Unlike datatrove, which stops at the first failing
   rule, every failing rule is reported.

Deliberate differences from datatrove (no nltk/punkt: nothing can be downloaded):
- Tokens come from a regex (`_TOKEN`): word runs (keeping inner ' ’ . - as in "don't", "3.14",
  "well-known") and runs of other symbols. "Words" are tokens with at least one character outside
  datatrove's PUNCTUATION_SET, exactly as its `non_symbol_words`. Where datatrove uses the full
  token list (symbol and new-line ratio denominators, n-grams) we use all regex tokens too.
- `alpha_words_ratio` divides by words, as the Gopher paper and datatrove's first version did;
  current datatrove divides by all tokens, punctuation included, which fails most punctuation-rich
  prose (64 of the 79 Python reference topics).
- C4 counts sentences in each surviving line with a small regex instead of punkt, and is applied
  at document level only: we count the sentences that survive C4's line rules (always with
  datatrove's defaults remove_citations/filter_javascript/filter_policy on) and record whether a
  surviving line has "lorem ipsum" / "{", but never rewrite the text. The two flags are recorded
  independently (datatrove returns at the first one), so each can be switched off on its own.
- FineWeb's terminal punctuation is the original FineWeb set plus common CJK/Indic/Arabic
  terminators instead of datatrove's full Unicode TERMINAL_PUNCTUATION table.
- `bad_char_ratio` (encoding family) is ours: the share of characters that are U+FFFD, C1
  controls, or part of mojibake as ftfy's badness heuristic finds it ("Ã©", "â€™", "Â ").
  `curate.normalize.fix_encoding` repairs mojibake with `ftfy.fix_encoding` at ingest instead.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from typing import TYPE_CHECKING

from data_prep.filters.base import Stats

if TYPE_CHECKING:
    from data_prep.filters.c4 import C4Config
    from data_prep.filters.fineweb import FineWebConfig
    from data_prep.filters.gopher_repetition import GopherRepetitionConfig

# datatrove.utils.text.PUNCTUATION: a token made only of these is a symbol, not a word.
PUNCTUATION = "!/—”:％１〈&(、━\\【#%「」，】；+^]~“《„';’{|∶´[=-`*．（–？！：$～«〉,><》)?）。…@_.\"}►»" + "".join(
    map(chr, (x for a, b in ((0, 9), (11, 13), (13, 32), (127, 160)) for x in range(a, b)))
)
STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})  # Gopher's list
_TOKEN = re.compile(r"\w+(?:['’.\-]\w+)*|[^\w\s]+")
_HAS_ALPHA = re.compile(r"[^\W\d_]")
_PARAGRAPH_SPLIT = re.compile(r"\n{2,}")
_LINE_SPLIT = re.compile(r"\n+")

# C4 (datatrove c4_filters.py constants).
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_C4_END_PUNCT = (".", "?", "!", '"', "'")
# POLICY_SUBSTRINGS are "terms of use", "privacy policy" and these (tested only if "cookie" occurs):
_C4_COOKIES = re.compile("cookie policy|uses cookies|use of cookies|use cookies")
# A sentence ends at . ! ? (plus closing quotes/brackets) followed by a space and a character that
# is not a lowercase ASCII letter, unless the period ends a common abbreviation or an initial. CJK
# full stops end a sentence wherever they are (a separate regex: checking it everywhere is slow).
_SENTENCE_END = re.compile(
    r"[.!?](?<!\bMr\.)(?<!\bMrs\.)(?<!\bMs\.)(?<!\bDr\.)(?<!\bSt\.)(?<!\bvs\.)(?<!\b[A-Z]\.)"
    r"[.!?]*[\"'”’)\]]*[^\S\n]+(?=[^\sa-z])"
)
_CJK_SENTENCE_END = re.compile("[。！？]+(?=[^\\s])")

_FW_STOP_CHARS = (".", "'", '"', "!", "?", "。", "！", "？", "｡", "।", "؟", "۔")

# Mojibake is found by ftfy's badness heuristic (maintained, tuned on real web text); every
# bad sequence it counts is two or three characters of UTF-8 read as Latin-1/cp1252, so it
# counts as two characters. U+FFFD and C1 controls are counted one by one.
_REPLACEMENT_OR_C1 = re.compile("[\ufffd\x80-\x9f]")
_BAD_HINT = re.compile("[\x80-\xf4\ufffd]")


@dataclass(frozen=True)
class StatParams:
    """The settings that change statistics (not thresholds); part of the statistics' cache key."""

    c4_filter_no_terminal_punct: bool = False
    c4_min_words_per_line: int = 3
    c4_max_word_length: int = 1000
    fw_short_line_length: int = 30
    top_ns: tuple[int, ...] = (2, 3, 4)
    dup_ns: tuple[int, ...] = (5, 6, 7, 8, 9, 10)

    @classmethod
    def from_configs(cls, c4: C4Config, fineweb: FineWebConfig, repetition: GopherRepetitionConfig) -> StatParams:
        return cls(
            c4_filter_no_terminal_punct=c4.filter_no_terminal_punct,
            c4_min_words_per_line=c4.min_words_per_line,
            c4_max_word_length=c4.max_word_length,
            fw_short_line_length=fineweb.short_line_length,
            top_ns=tuple(sorted(repetition.top_n_grams)),
            dup_ns=tuple(sorted(repetition.dup_n_grams)),
        )


def _div(a: float, b: float) -> float:
    return a / b if b else 0.0


def _dup_count_chars(items: list[str]) -> tuple[int, int]:
    """datatrove's find_duplicates: every occurrence after the first counts, with its length."""
    counts = Counter(items)
    extra = [(len(k), v - 1) for k, v in counts.items() if v > 1]
    return sum(v for _, v in extra), sum(n * v for n, v in extra)


def _ngram_stats(tokens: list[str], params: StatParams, n_chars: int, stats: Stats) -> None:
    """Gopher's top n-gram and duplicated n-gram character fractions, over all tokens.

    n-grams are compared by hash (a 64-bit collision is practically impossible). An n-gram can
    only occur twice where its shorter prefix does too, so each n only extends the previous n's
    repeated n-grams (after n=2 a small share of a normal text) unless most of them repeat.
    """
    n_tokens = len(tokens)
    cum = [0, *accumulate(map(len, tokens))]  # characters of tokens[i:j] = cum[j] - cum[i]
    top_ns, dup_ns = set(params.top_ns), set(params.dup_ns)
    repeats: list[tuple[int, int]] | None = None  # (position, hash) of the last n's repeated n-grams
    last_n = 0
    for n in sorted(top_ns | dup_ns):
        if repeats is None or 2 * len(repeats) > n_tokens:
            grams = list(enumerate(map(hash, zip(*(tokens[i:] for i in range(n))))))
        elif n == last_n + 1:
            grams = [(i, hash((g, tokens[i + last_n]))) for i, g in repeats if i + n <= n_tokens]
        else:
            grams = [(i, hash((g, *tokens[i + last_n : i + n]))) for i, g in repeats if i + n <= n_tokens]
        counts = Counter(map(itemgetter(1), grams))
        repeats = [pair for pair in grams if counts[pair[1]] > 1]
        last_n = n
        if n in top_ns:
            # datatrove: Counter.most_common(1) (first seen among ties), its " ".join length x count.
            if repeats:
                top, count = counts.most_common(1)[0]
                i = next(i for i, g in repeats if g == top)
            else:  # every n-gram is unique: the first one, once (none if there are fewer tokens)
                i, count = 0, int(n_tokens >= n)
            top_chars = (cum[i + n] - cum[i] + n - 1) * count if count else 0
            stats[f"top_{n}gram_char_frac"] = _div(top_chars, n_chars)
        if n in dup_ns:
            # datatrove's find_all_duplicate: walk the n-grams with a set of those seen; a repeat
            # counts its characters (joined with "") and jumps n tokens, so overlapping repeats
            # are not double counted. n-grams occurring once never matter and are not walked.
            repeated, next_idx, seen = 0, 0, set()
            for i, g in repeats:
                if i < next_idx:
                    continue
                if g in seen:
                    repeated += cum[i + n] - cum[i]
                    next_idx = i + n
                else:
                    seen.add(g)
            stats[f"dup_{n}gram_char_frac"] = _div(repeated, n_chars)


def _c4_stats(text: str, params: StatParams) -> tuple[int, bool, bool]:
    """C4QualityFilter's line loop (split_paragraph=True): sentences in kept lines, doc-level flags.

    Line filters are reordered cheapest first; that changes nothing since each only drops lines.
    """
    kept, lorem, curly = [], False, False
    for line in text.splitlines():
        words = line.split()
        if len(words) < params.c4_min_words_per_line:
            continue
        if params.c4_max_word_length != -1 and max(map(len, words), default=0) > params.c4_max_word_length:
            continue
        line = line.strip()
        if "[" in line:
            line = _CITATION.sub("", line)
        if params.c4_filter_no_terminal_punct and (not line.endswith(_C4_END_PUNCT) or line.endswith("...")):
            continue
        lower = line.lower()
        lorem = lorem or "lorem ipsum" in lower  # datatrove drops the document here
        if "javascript" in lower:
            continue
        curly = curly or "{" in line  # ... and here
        if "terms of use" in lower or "privacy policy" in lower or "cookie" in lower and _C4_COOKIES.search(lower):
            continue
        kept.append(line)
    # Each non-empty kept line is one sentence, plus one per sentence boundary inside it.
    joined = "\n".join(kept)
    n_sentences = sum(1 for line in kept if line) + len(_SENTENCE_END.findall(joined))
    if "。" in joined or "！" in joined or "？" in joined:
        n_sentences += len(_CJK_SENTENCE_END.findall(joined))
    return n_sentences, lorem, curly


def compute_stats(text: str, params: StatParams = StatParams()) -> Stats:
    """Every statistic the rule families need, computed once (linear in the text size)."""
    n_chars = len(text)
    tokens = _TOKEN.findall(text)
    n_tokens = len(tokens)
    words = [t for t in tokens if t.strip(PUNCTUATION)]
    n_words = len(words)
    lines = text.splitlines()
    stats: Stats = {
        "n_chars": n_chars,
        "n_words": n_words,
        "avg_word_length": _div(sum(map(len, words)), n_words),
        # Gopher: "#" or ellipsis per token (one threshold for both, so their max is enough).
        "symbol_word_ratio": _div(max(text.count("#"), text.count("...") + text.count("…")), n_tokens),
        "bullet_lines_ratio": _div(sum(s.lstrip().startswith(("•", "-")) for s in lines), len(lines)),
        "ellipsis_lines_ratio": _div(sum(s.rstrip().endswith(("...", "…")) for s in lines), len(lines)),
        # Share of words with a letter. Per word as in the Gopher paper (and datatrove's first
        # version): current datatrove also counts punctuation tokens, which fails most prose.
        "alpha_words_ratio": _div(sum(1 for w in words if w.isalpha() or _HAS_ALPHA.search(w)), n_words),
        "n_stop_words": len(STOP_WORDS.intersection(words)),  # distinct, case-sensitive, as datatrove
    }

    paragraphs = _PARAGRAPH_SPLIT.split(text.strip())
    rep_lines = _LINE_SPLIT.split(text)
    dup_paras, dup_para_chars = _dup_count_chars(paragraphs)
    dup_lines, dup_line_chars = _dup_count_chars(rep_lines)
    stats["dup_para_frac"] = _div(dup_paras, len(paragraphs))
    stats["dup_para_char_frac"] = _div(dup_para_chars, n_chars)
    stats["dup_line_frac"] = _div(dup_lines, len(rep_lines))
    stats["dup_line_char_frac"] = _div(dup_line_chars, n_chars)
    _ngram_stats(tokens, params, n_chars, stats)

    stats["c4_num_sentences"], stats["c4_has_lorem_ipsum"], stats["c4_has_curly_bracket"] = _c4_stats(text, params)

    fw_lines = [line for line in text.split("\n") if line.strip()]
    n_newlines = text.count("\n")
    stats["fw_line_punct_ratio"] = _div(sum(line.endswith(_FW_STOP_CHARS) for line in fw_lines), len(fw_lines))
    stats["fw_short_line_ratio"] = _div(
        sum(len(line) <= params.fw_short_line_length for line in fw_lines), len(fw_lines)
    )
    stats["fw_char_dup_ratio"] = _div(_dup_count_chars(fw_lines)[1], n_chars - n_newlines)
    stats["fw_new_line_ratio"] = _div(n_newlines, n_tokens)

    # Most text (ASCII, or typographic punctuation only) has no character a bad sequence starts with.
    bad = _bad_chars(text) if _BAD_HINT.search(text) else 0
    stats["bad_char_ratio"] = _div(bad, n_chars)
    return stats


def _bad_chars(text: str) -> int:
    from ftfy.badness import badness

    return len(_REPLACEMENT_OR_C1.findall(text)) + 2 * badness(text)
