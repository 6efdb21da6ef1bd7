"""A planted set for semantic dedup: documents, and paraphrases of some of them that MinHash misses.

About 2,000 documents on 40 topics (each topic its own vocabulary of nouns, verbs and adjectives,
every content word with a synonym the generator also uses, as language does), written as 6 to 10
sentences each with people's names in them. 200 of them are paraphrases of another document: its
sentences reordered, about a third of its content words swapped for their synonyms, its names
swapped for others. Documents of one topic share most of their vocabulary, so a rule that finds
"about the same thing" instead of "saying the same thing" shows as false positives.

`benchmarks/semantic_dedup.py` and `tests/test_dedup.py` use it; `planted_set()` is deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_SYLLABLES = [
    "ka", "lo", "mi", "ren", "sat", "tor", "vel", "dun", "pra", "gil", "mor", "tes", "fan", "quo", "bri",
    "zen", "hup", "cas", "wim", "jor", "nel", "bax", "sim", "rud", "pek",
]  # fmt: skip
_NAMES = [
    "Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jonas", "Keiko", "Luis",
    "Maya", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yusuf",
]  # fmt: skip
_GLUE = ["the", "a", "this", "every", "that", "some"]


def _word(rng: random.Random, used: set[str]) -> str:
    while True:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
        if word not in used:
            used.add(word)
            return word


@dataclass
class PlantedSet:
    texts: list[str]
    # paraphrase index -> the index of the document it paraphrases
    paraphrase_of: dict[int, int] = field(default_factory=dict)

    def pairs(self) -> set[tuple[int, int]]:
        return {(min(a, b), max(a, b)) for a, b in self.paraphrase_of.items()}


def planted_set(docs: int = 2000, paraphrases: int = 200, topics: int = 40, seed: int = 0) -> PlantedSet:
    rng = random.Random(seed)
    used: set[str] = set()
    # each topic: 25 nouns, 12 verbs, 12 adjectives; each word has one synonym
    vocab = []
    for _ in range(topics):
        kinds = {
            kind: [(_word(rng, used), _word(rng, used)) for _ in range(n)]
            for kind, n in (("n", 25), ("v", 12), ("a", 12))
        }
        vocab.append(kinds)
    synonym = {w: s for topic in vocab for pairs in topic.values() for a, b in pairs for w, s in ((a, b), (b, a))}

    def sentence(topic: dict) -> list[str]:
        pick = lambda kind: rng.choice(rng.choice(topic[kind]))  # noqa: E731 -- either word of a synonym pair
        words = [rng.choice(_GLUE), pick("a"), pick("n"), pick("v"), rng.choice(_GLUE), pick("n")]
        if rng.random() < 0.5:
            words += ["with", rng.choice(_NAMES)]
        if rng.random() < 0.5:
            words += ["and", pick("v"), rng.choice(_GLUE), pick("a"), pick("n")]
        return words

    bases = docs - paraphrases
    sentences = []
    for i in range(bases):
        topic = vocab[i % topics]
        sentences.append([sentence(topic) for _ in range(rng.randint(6, 10))])
    texts = [_render(s) for s in sentences]
    planted = PlantedSet(texts)
    for source in rng.sample(range(bases), paraphrases):
        names = dict(zip(_NAMES, rng.sample(_NAMES, len(_NAMES))))
        rewritten = []
        for words in sentences[source]:
            out = []
            for w in words:
                if w in names:
                    out.append(names[w])
                elif w in synonym and rng.random() < 0.35:
                    out.append(synonym[w])
                else:
                    out.append(w)
            rewritten.append(out)
        rng.shuffle(rewritten)
        planted.paraphrase_of[len(planted.texts)] = source
        planted.texts.append(_render(rewritten))
    return planted


def _render(sentences: list[list[str]]) -> str:
    return " ".join(" ".join(words).capitalize() + "." for words in sentences)
