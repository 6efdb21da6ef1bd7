"""Tests of data_prep.heuristics: statistics once, rule families as pure threshold checks."""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from pydoc_data.topics import topics

import pytest

from data_prep.config import CurateConfig
from data_prep.filters import filters
from data_prep.filters.c4 import C4Config, c4_failures
from data_prep.filters.encoding import EncodingConfig, encoding_failures
from data_prep.filters.fineweb import FineWebConfig, fineweb_failures
from data_prep.filters.gopher_quality import GopherQualityConfig, gopher_quality_failures
from data_prep.filters.gopher_repetition import GopherRepetitionConfig, gopher_repetition_failures
from data_prep.filters.length import LengthConfig, length_failures
from data_prep.heuristics import _TOKEN, PUNCTUATION, StatParams, compute_stats
from data_prep.textnorm import normalize_document

DEFAULT = CurateConfig()


def own_stats(text: str, cfg: CurateConfig = DEFAULT) -> dict:
    """The statistics filters compute beside the shared pass (the toxicity score), as curate/heuristics adds them."""
    return {k: v for name, f in filters().items() for k, v in f.stats_batch([text], getattr(cfg, name))[0].items()}


def all_failures(text: str, cfg: CurateConfig = DEFAULT) -> list[str]:
    stats = compute_stats(text, StatParams.from_configs(cfg.c4, cfg.fineweb, cfg.gopher_repetition))
    stats |= own_stats(text, cfg)
    return [rule for name, f in filters().items() for rule in f.failures(stats, getattr(cfg, name))]


# Real reference prose from Python's documentation (hard-wrapped paragraphs, some code).
GOOD_TOPICS = ["naming", "exceptions", "execmodel", "objects", "import"]
PROSE = topics["naming"]
PROSE_PARAGRAPH = topics["exceptions"].split("\n\n")[1]  # one real paragraph, ~60 words

FRENCH = (
    "L’été dernier, nous sommes allés à la mer avec François et Hélène. « C’est très agréable », "
    "a dit l’élève. Où est le café ? Il coûte 3,50 € — déjà payé… Ça va, garçon ? Noël approche, "
    "et les enfants préparent une œuvre naïve pour leurs parents. À bientôt !"
)
GERMAN = (
    "Die Straße war nass. „Grüß Gott“, sagte der Mann aus Köln. Über die Brücke gehen Jäger mit "
    "Hüten. Fußgänger müssen warten – das heißt: „Fuß“ ist kein „Gruß“. Äpfel, Öl und Übermut."
)


def gopher_quality(text: str) -> list[str]:
    return gopher_quality_failures(compute_stats(text), GopherQualityConfig())


def words_prose(n: int, seed: int = 0) -> str:
    """n words of real prose (from the reference topics), for padding constructed documents."""
    words = " ".join(topics[t] for t in GOOD_TOPICS).split()
    start = random.Random(seed).randrange(len(words) - n)
    return " ".join(words[start : start + n])


# ---- good text ----------------------------------------------------------------------------------


@pytest.mark.parametrize("topic", GOOD_TOPICS)
def test_reference_prose_passes_every_family(topic):
    assert all_failures(topics[topic]) == []


def test_prose_statistics_are_plausible():
    stats = compute_stats(PROSE)
    assert stats["n_chars"] == len(PROSE)
    assert 800 < stats["n_words"] < 1200
    assert 4 < stats["avg_word_length"] < 6
    assert stats["n_stop_words"] == 8  # all of the, be, to, of, and, that, have, with
    assert stats["alpha_words_ratio"] > 0.9
    assert stats["c4_num_sentences"] >= 20
    assert stats["bad_char_ratio"] == 0
    assert not stats["c4_has_lorem_ipsum"] and not stats["c4_has_curly_bracket"]


def test_stats_are_flat_json_and_complete():
    stats = compute_stats(PROSE)
    expected = {
        "n_chars", "n_words", "avg_word_length", "symbol_word_ratio", "bullet_lines_ratio",
        "ellipsis_lines_ratio", "alpha_words_ratio", "n_stop_words", "dup_line_frac", "dup_para_frac",
        "dup_line_char_frac", "dup_para_char_frac", "c4_num_sentences", "c4_has_lorem_ipsum",
        "c4_has_curly_bracket", "fw_line_punct_ratio", "fw_short_line_ratio", "fw_char_dup_ratio",
        "fw_new_line_ratio", "bad_char_ratio",
    }  # fmt: skip
    expected |= {f"top_{n}gram_char_frac" for n in (2, 3, 4)}
    expected |= {f"dup_{n}gram_char_frac" for n in range(5, 11)}
    assert set(stats) == expected
    assert all(type(v) in (int, float, bool) for v in stats.values())
    assert json.loads(json.dumps(stats)) == stats


# ---- each bad document fails the expected rule --------------------------------------------------


def test_too_few_words():
    stats = compute_stats(PROSE_PARAGRAPH[:200])
    assert stats["n_words"] < 50
    assert "gopher_quality:min_doc_words" in gopher_quality_failures(stats, GopherQualityConfig())
    assert length_failures(compute_stats("Too short."), LengthConfig()) == ["length:too_short"]
    assert length_failures(compute_stats("x" * 600_000), LengthConfig()) == ["length:too_long"]


def test_hash_symbols():
    text = " ".join(f"#{w}" for w in words_prose(120).split()[:40]) + " " + words_prose(80)
    assert gopher_quality(text) == ["gopher_quality:max_symbol_word_ratio"]


def test_bullet_only_list_page():
    items = [words_prose(8, seed) for seed in range(30)]
    page = "\n".join(f"• {item}" for item in items)
    dashes = "\n".join(f"- {item}" for item in items)
    assert "gopher_quality:max_bullet_lines_ratio" in gopher_quality(page)
    assert "gopher_quality:max_bullet_lines_ratio" in gopher_quality(dashes)
    # A few bullets in an article are fine.
    mixed = PROSE + "\n" + "\n".join(f"• {item}" for item in items[:5])
    assert "gopher_quality:max_bullet_lines_ratio" not in gopher_quality(mixed)


def test_ellipsis_lines():
    teasers = "\n".join(words_prose(12, seed) + "..." for seed in range(20))
    stats = compute_stats(teasers)
    assert stats["ellipsis_lines_ratio"] == 1.0
    assert "gopher_quality:max_ellipsis_lines_ratio" in gopher_quality_failures(stats, GopherQualityConfig())
    teasers = teasers.replace("...", "…")
    assert "gopher_quality:max_ellipsis_lines_ratio" in gopher_quality(teasers)


def test_mostly_numbers_fail_alpha_ratio():
    table = " ".join(str(random.Random(1).randint(0, 10**6)) for _ in range(300)) + " " + words_prose(40)
    assert "gopher_quality:max_non_alpha_words_ratio" in gopher_quality(table)


def test_no_stop_words():
    text = " ".join(w for w in words_prose(400).split() if w not in {"the", "be", "to", "of", "and", "that", "have"})
    text = text.replace(" with ", " ")
    assert compute_stats(text)["n_stop_words"] <= 1
    assert "gopher_quality:min_stop_words" in gopher_quality(text)


def test_repeated_lines_and_paragraphs():
    para = PROSE_PARAGRAPH
    doc = "\n\n".join([para] * 4 + [topics["exceptions"].split("\n\n")[2]])
    failures = gopher_repetition_failures(compute_stats(doc), GopherRepetitionConfig())
    for rule in ("dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac"):
        assert f"gopher_repetition:{rule}" in failures
    assert "fineweb:char_dup_ratio" in fineweb_failures(compute_stats(doc), FineWebConfig())


def test_keyword_stuffed_spam_fails_top_ngram():
    filler = words_prose(150).split()
    rng = random.Random(3)
    for _ in range(60):
        filler.insert(rng.randrange(len(filler)), "cheap viagra")
    failures = gopher_repetition_failures(compute_stats(" ".join(filler)), GopherRepetitionConfig())
    assert "gopher_repetition:top_2_gram" in failures
    assert not any("dup_" in f for f in failures)  # no repeated lines or paragraphs involved


def test_copy_pasted_sentences_fail_duplicated_ngrams():
    passage = words_prose(40, 7)
    doc = " ".join([words_prose(100), passage, words_prose(30, 1), passage, words_prose(30, 2), passage])
    failures = gopher_repetition_failures(compute_stats(doc), GopherRepetitionConfig())
    assert {f"gopher_repetition:duplicated_{n}_n_grams" for n in range(5, 11)} <= set(failures)
    assert not any(f.startswith("gopher_repetition:dup_") for f in failures)  # one line, one paragraph


def test_lorem_ipsum_and_curly_bracket():
    lorem = PROSE + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."
    assert c4_failures(compute_stats(lorem), C4Config()) == ["c4:lorem_ipsum"]
    code = PROSE + "\nThe template is rendered as {name} in every page."
    assert c4_failures(compute_stats(code), C4Config()) == ["c4:curly_bracket"]
    # As in datatrove, only lines surviving the line rules count: a short line or a line
    # mentioning javascript is dropped before the check.
    for ignored in ["\n{", "\nLorem ipsum.", "\nEnable JavaScript to see {this} page."]:
        assert c4_failures(compute_stats(PROSE + ignored), C4Config()) == []


def test_few_sentences():
    # C4 counts per line: the one real sentence must sit on one line to count once.
    text = "Home\nProducts\nAbout us\nContact\n" + PROSE_PARAGRAPH.split(".")[0].replace("\n", " ") + "."
    stats = compute_stats(text)
    assert stats["c4_num_sentences"] == 1
    assert c4_failures(stats, C4Config()) == ["c4:too_few_sentences"]


def test_c4_sentence_count_follows_line_rules():
    lines = [
        "This line has one sentence.",
        "Two sentences here. And here is the second!",
        "Short line",  # two words: dropped
        "We use cookies to improve this site.",  # policy: dropped
        "No terminal punctuation on this line",
        "Dr. Smith met J. Doe at noon. They talked.",  # abbreviations do not end sentences
        "A wiki sentence with a citation.[12]",  # the citation is removed before the punctuation test
    ]
    stats = compute_stats("\n".join(lines))
    assert stats["c4_num_sentences"] == 1 + 2 + 1 + 2 + 1
    strict = StatParams.from_configs(C4Config(filter_no_terminal_punct=True), FineWebConfig(), GopherRepetitionConfig())
    assert compute_stats("\n".join(lines), strict)["c4_num_sentences"] == 1 + 2 + 2 + 1
    japanese = "これは文です。これも文です。そして三つ目です。"  # one "word" for str.split()
    assert compute_stats(japanese, StatParams(c4_min_words_per_line=1))["c4_num_sentences"] == 3


def test_navigation_menu_fails_fineweb():
    menu = "\n".join(["Home", "Products", "Pricing", "Blog", "About us", "Careers", "Contact", "Log in"] * 6)
    page = menu + "\n" + PROSE_PARAGRAPH.replace("\n", " ")
    failures = fineweb_failures(compute_stats(page), FineWebConfig())
    assert "fineweb:short_line_ratio" in failures
    assert "fineweb:line_punct_ratio" in failures
    assert "fineweb:list_ratio" in failures


def test_newline_ratio_alone_fails_list_ratio():
    # Long, distinct, punctuated lines, but two newlines for every four tokens.
    doc = "\n\n".join(f"Internationalization considerations chapter{i}." for i in range(12))
    stats = compute_stats(doc)
    assert stats["fw_new_line_ratio"] > 0.3
    assert fineweb_failures(stats, FineWebConfig()) == ["fineweb:list_ratio"]


def test_line_punct_exclude_zero():
    stats = compute_stats(PROSE_PARAGRAPH.replace(".", ""))
    assert stats["fw_line_punct_ratio"] == 0
    assert "fineweb:line_punct_ratio" in fineweb_failures(stats, FineWebConfig())
    assert "fineweb:line_punct_ratio" not in fineweb_failures(stats, FineWebConfig(line_punct_exclude_zero=True))


# ---- encoding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["cp1252", "latin-1"])
@pytest.mark.parametrize("text", [FRENCH, GERMAN], ids=["fr", "de"])
def test_mojibake_fails_and_real_accents_pass(text, codec):
    assert compute_stats(text)["bad_char_ratio"] == 0
    assert encoding_failures(compute_stats(text), EncodingConfig()) == []
    garbled = text.encode("utf-8").decode(codec, errors="replace")
    for version in (garbled, normalize_document(garbled)):  # raw, and after ingest cleanup
        stats = compute_stats(version)
        assert stats["bad_char_ratio"] > 0.05
        assert encoding_failures(stats, EncodingConfig()) == ["encoding:bad_chars"]
    # Every garbled character leaves at least one flagged character behind, also once ingest has
    # turned the U+00A0 of "à" (Ã + nbsp) into a space (with cp1252; Latin-1 leaves C1 controls
    # that ingest deletes, so only the raw text is checked there).
    n_special = sum(ord(c) > 127 for c in text)
    for version in (garbled, normalize_document(garbled)) if codec == "cp1252" else (garbled,):
        assert round(compute_stats(version)["bad_char_ratio"] * len(version)) >= n_special


@pytest.mark.parametrize(
    "text",
    [
        "¿Dónde está la estación? ¡Qué día más bonito! El niño comió piña y jamón. «¡Olé!»",
        "Съешь же ещё этих мягких французских булок, да выпей чаю. «Ёлка» — это ёлка.",
        "日本語のテキストです。「こんにちは」と彼は言った。東京は大きい都市です！",
    ],
    ids=["es", "ru", "ja"],
)
def test_other_scripts_score_zero_and_their_mojibake_scores_high(text):
    assert compute_stats(text)["bad_char_ratio"] == 0
    garbled = normalize_document(text.encode("utf-8").decode("cp1252", errors="replace"))
    assert compute_stats(garbled)["bad_char_ratio"] > 0.2


def test_mojibake_of_a_grave_survives_ingest_cleanup():
    # "à" is C3 A0 in UTF-8: read as cp1252 it becomes "Ã" + U+00A0, which ingest turns into a space.
    garbled = normalize_document("Voilà, il va à Paris, là-bas, à pied.".encode().decode("cp1252"))
    assert "Ã " in garbled
    assert round(compute_stats(garbled)["bad_char_ratio"] * len(garbled)) >= 4
    assert encoding_failures(compute_stats(garbled), EncodingConfig()) == ["encoding:bad_chars"]


def test_replacement_characters():
    text = PROSE_PARAGRAPH[:300] + "\ufffd" * 10
    assert encoding_failures(compute_stats(text), EncodingConfig()) == ["encoding:bad_chars"]


# ---- thresholds: None disables, enabled=False disables, stats never depend on thresholds --------

BAD_CASES = [
    (GopherQualityConfig, "min_doc_words", "Only a few words here.", "gopher_quality:min_doc_words"),
    (GopherQualityConfig, "max_bullet_lines_ratio", "• item one\n" * 30, "gopher_quality:max_bullet_lines_ratio"),
    (GopherRepetitionConfig, "dup_line_frac", "\n".join([PROSE_PARAGRAPH] * 5), "gopher_repetition:dup_line_frac"),
    (C4Config, "min_num_sentences", "Home\nAbout\nContact", "c4:too_few_sentences"),
    (C4Config, "filter_lorem_ipsum", PROSE + "\nLorem ipsum dolor sit amet.", "c4:lorem_ipsum"),
    (C4Config, "filter_curly_bracket", PROSE + "\nfunction f() { return 1; }", "c4:curly_bracket"),
    (FineWebConfig, "short_line_thr", "\n".join(["Home", "Products", "Contact"] * 5), "fineweb:short_line_ratio"),
    (FineWebConfig, "line_punct_thr", "\n".join(["Home", "Products", "Contact"] * 5), "fineweb:line_punct_ratio"),
]


@pytest.mark.parametrize("cls, field, text, rule", BAD_CASES, ids=[c[3] for c in BAD_CASES])
def test_none_or_disabled_turns_a_rule_off(cls, field, text, rule):
    family = rule.split(":")[0]
    fn = filters()[family].failures
    stats = compute_stats(text)
    assert rule in fn(stats, cls())
    off = None if cls.model_fields[field].annotation is not bool else False
    assert rule not in fn(stats, cls(**{field: off}))
    assert fn(stats, cls(enabled=False)) == []


@pytest.mark.parametrize(
    "cfg, fn, text",
    [
        (EncodingConfig(enabled=False), encoding_failures, "Ã©tÃ© â€™ " * 20),
        (LengthConfig(enabled=False), length_failures, "tiny"),
    ],
)
def test_length_and_encoding_switch_off_with_enabled(cfg, fn, text):
    # Their thresholds are plain numbers in the config (no None), so `enabled` is the switch.
    assert fn(compute_stats(text), type(cfg)()) != []
    assert fn(compute_stats(text), cfg) == []


def test_repetition_ngram_thresholds_can_be_dropped():
    spam = " ".join(["buy cheap pills"] * 40 + [words_prose(50)])
    stats = compute_stats(spam)
    assert "gopher_repetition:top_2_gram" in gopher_repetition_failures(stats, GopherRepetitionConfig())
    cfg = GopherRepetitionConfig(top_n_grams={}, dup_n_grams={})
    assert not any("gram" in f for f in gopher_repetition_failures(stats, cfg))


def test_threshold_changes_do_not_change_stats_but_stat_params_do():
    a = CurateConfig()
    b = CurateConfig()
    b.gopher_quality.min_doc_words = 5
    b.fineweb.short_line_thr = 0.1
    b.gopher_repetition.top_n_grams = {2: 0.5, 3: 0.5, 4: 0.5}
    params = lambda c: StatParams.from_configs(c.c4, c.fineweb, c.gopher_repetition)  # noqa: E731
    assert params(a) == params(b)
    assert hash(params(a)) == hash(params(b))
    b.fineweb.short_line_length = 80
    b.gopher_repetition.dup_n_grams = {6: 0.1}
    assert params(b) != params(a)
    stats = compute_stats(PROSE, params(b))
    assert stats["fw_short_line_ratio"] > compute_stats(PROSE)["fw_short_line_ratio"]
    assert [k for k in stats if k.startswith("dup_") and "gram" in k] == ["dup_6gram_char_frac"]


def test_rule_families_registry_matches_curate_config():
    assert list(filters()) == ["length", "encoding", "gopher_quality", "gopher_repetition", "c4", "fineweb", "toxicity"]
    stats = compute_stats(PROSE) | own_stats(PROSE)
    for name, family in filters().items():
        assert isinstance(getattr(DEFAULT, name), family.config)
        assert family.failures(stats, getattr(DEFAULT, name)) == []


def test_empty_document_fails_without_crashing():
    failures = all_failures("")
    assert "length:too_short" in failures
    assert "gopher_quality:min_doc_words" in failures
    assert "c4:too_few_sentences" in failures


# ---- agreement with a literal port of datatrove's repetition/quality code -----------------------


def _datatrove_reference(text: str, top_ns=(2, 3, 4), dup_ns=range(5, 11)) -> dict[str, float]:
    """datatrove's own loops (gopher_repetition_filter.py etc.) on our tokens, written naively.

    The alpha ratio divides by non-symbol words: the documented deviation from current datatrove.
    """
    words = _TOKEN.findall(text)

    def find_duplicates(x):
        seen, chars, elems = set(), 0, 0
        for e in x:
            if e in seen:
                chars, elems = chars + len(e), elems + 1
            else:
                seen.add(e)
        return elems, chars

    def find_all_duplicate(n):
        seen, rep, idx = set(), 0, 0
        while idx < len(words) - n + 1:
            gram = "".join(words[idx : idx + n])
            if gram in seen:
                rep, idx = rep + len(gram), idx + n
            else:
                seen.add(gram)
                idx += 1
        return rep

    out = {}
    paragraphs = re.split(r"\n{2,}", text.strip())
    d, c = find_duplicates(paragraphs)
    out["dup_para_frac"], out["dup_para_char_frac"] = d / len(paragraphs), c / len(text)
    lines = re.split("\n+", text)
    d, c = find_duplicates(lines)
    out["dup_line_frac"], out["dup_line_char_frac"] = d / len(lines), c / len(text)
    for n in top_ns:
        grams = [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]
        top = Counter(grams).most_common(1)
        out[f"top_{n}gram_char_frac"] = len(top[0][0]) * top[0][1] / len(text) if top else 0.0
    for n in dup_ns:
        out[f"dup_{n}gram_char_frac"] = find_all_duplicate(n) / len(text)
    non_symbol = [w for w in words if any(ch not in set(PUNCTUATION) for ch in w)]
    out["n_words"] = len(non_symbol)
    out["alpha_words_ratio"] = sum(any(c.isalpha() for c in w) for w in words) / len(non_symbol)
    out["symbol_word_ratio"] = max(text.count("#"), text.count("...") + text.count("…")) / len(words)
    fw_lines = [line for line in text.split("\n") if line.strip() != ""]  # fineweb_quality_filter.py
    out["fw_line_punct_ratio"] = sum(line.endswith((".", "'", '"', "!", "?")) for line in fw_lines) / len(fw_lines)
    out["fw_short_line_ratio"] = sum(len(line) <= 30 for line in fw_lines) / len(fw_lines)
    out["fw_char_dup_ratio"] = find_duplicates(fw_lines)[1] / len(text.replace("\n", ""))
    out["fw_new_line_ratio"] = text.count("\n") / len(words)
    return out


def _random_repetitive_doc(rng: random.Random) -> str:
    vocab = "the cat sat on a mat and buy cheap pills now , . # ... - 42".split()
    seps = [" "] * 6 + ["\n", "\n\n"]
    doc = "".join(rng.choice(vocab) + rng.choice(seps) for _ in range(rng.randint(12, 400))).strip()
    return doc + " " + words_prose(rng.randint(0, 50), rng.randint(0, 99))


def test_matches_literal_datatrove_port():
    rng = random.Random(1234)
    docs = [topics[t] for t in GOOD_TOPICS] + [_random_repetitive_doc(rng) for _ in range(150)]
    docs += [(PROSE_PARAGRAPH + "\n") * 3, "a b a b a b"]
    for doc in docs:
        ours, ref = compute_stats(doc), _datatrove_reference(doc)
        for key, value in ref.items():
            assert ours[key] == pytest.approx(value, abs=1e-12), (key, doc[:80])
        # n values with gaps between them take another path through the n-gram code.
        ours = compute_stats(doc, StatParams(top_ns=(3,), dup_ns=(5, 8)))
        for key, value in _datatrove_reference(doc, top_ns=(3,), dup_ns=(5, 8)).items():
            assert ours[key] == pytest.approx(value, abs=1e-12), (key, doc[:80])


def test_duplicated_ngrams_skip_overlaps_like_datatrove():
    # n=2 over a b a b a b: "ab" new, "ba" new, "ab" repeat (+2, jump 2), "ab" repeat (+2): 4 chars.
    stats = compute_stats("a b a b a b", StatParams(top_ns=(2,), dup_ns=(2,)))
    assert stats["dup_2gram_char_frac"] == pytest.approx(4 / 11)
    assert stats["top_2gram_char_frac"] == pytest.approx(3 * len("a b") / 11)


def test_megabyte_document_is_fast_enough():
    # Guards against quadratic work: ~1 MB of spam (all n-grams repeat) and of prose.
    spam = "buy cheap pills online best price buy cheap pills now\n" * 19_000
    prose = ("\n\n".join(topics.values()) * 3)[:1_000_000]
    for doc in (spam, prose):
        start = time.perf_counter()
        compute_stats(doc)
        assert time.perf_counter() - start < 20
