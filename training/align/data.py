"""Alignment data: chat records for SFT, preference pairs for DPO, from the user or built in.

User data (`align.sft.inputs`, `align.dpo.inputs`) is read as curation reads its inputs
(`lmforge.inputs`): every form curation reads, and a malformed record (bad JSON, missing fields, a message
with an unknown role, an empty assistant turn, chosen equal to rejected) is quarantined with
file, line and reason, counted, and never crashes the step.

With no inputs, a built-in instruction set is generated: tasks a tiny model can really learn
and whose answers can be checked exactly (arithmetic, copying, reversing, sorting and
capitalising words, counting words, country capitals), plus multi-turn dialogue from the
chatterbot corpus. Each verifiable record carries its `answer`; each preference pair has the
verified answer as `chosen` and a plausible wrong one as `rejected` (off by one, the wrong
operation, a truncated copy, another item's answer).

Records are split into train and held-out by a hash of their id, so the split does not move
when other records come or go. The held-out split is written as files the evaluation stage
reads as tasks: `heldout_sft.jsonl` (messages, task, answer) and `heldout_preferences.jsonl`
(prompt, chosen, rejected).
"""

from __future__ import annotations

import importlib.resources
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
import yaml

ROLES = ("system", "user", "assistant")
SYSTEM_PROMPT = "You are a helpful assistant. Answer with the result only."

# One verifiable answer each: a short table keeps lookups learnable by a tiny model.
CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Russia": "Moscow",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Turkey": "Ankara",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "Cuba": "Havana",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Denmark": "Copenhagen",
    "Hungary": "Budapest",
    "Belgium": "Brussels",
    "Nepal": "Kathmandu",
}


@dataclass(frozen=True)
class Example:
    """One generated item: the prompt, its verified answer and a plausible wrong one."""

    task: str
    prompt: str
    answer: str
    wrong: str


# A small vocabulary of plain nouns: the tasks test a skill (copy, reverse, sort, count), and a
# tiny model learns a skill faster over a few tokens than over thousands.
WORDS = sorted(
    """apple bird boat book bread cake car cat chair city cloud coat cup desk door dog duck egg farm
fish flag frog game girl goat hat hill horse house key king lake lamp leaf lion map milk moon mouse nest
night pen pig plant queen rain ring river road rock rose salt sea sheep ship shoe sky snow song star stone
sun table tea tent tiger town toy train tree truck wall water whale wind window wolf wood""".split()
)


def _words() -> list[str]:
    return WORDS


def _pick(rng: random.Random, words: list[str], low: int = 2, high: int = 3) -> list[str]:
    return rng.sample(words, rng.randint(low, high))


# several phrasings of the small-table tasks, so a held-out item can be a new question about a
# fact the training split has seen (a lookup nobody was taught cannot be answered)
_ADD = ("What is {a} + {b}?", "Compute {a} plus {b}.", "{a} + {b} =", "Add {a} and {b}.")
_SUB = ("What is {a} - {b}?", "Compute {a} minus {b}.", "{a} - {b} =", "Subtract {b} from {a}.")
_CAPITAL = (
    "What is the capital of {c}?",
    "Name the capital city of {c}.",
    "Which city is the capital of {c}?",
    "The capital of {c} is?",
)


def _add(rng: random.Random, words: list[str]) -> Example:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    wrong = rng.choice([a + b + 1, a + b - 1, a * b if a * b != a + b else a + b + 2])
    return Example("add", rng.choice(_ADD).format(a=a, b=b), str(a + b), str(wrong))


def _subtract(rng: random.Random, words: list[str]) -> Example:
    a = rng.randint(0, 9)
    b = rng.randint(0, a)
    wrong = rng.choice([a - b + 1, a + b if b else a + 1])
    return Example("subtract", rng.choice(_SUB).format(a=a, b=b), str(a - b), str(wrong))


def _copy(rng: random.Random, words: list[str]) -> Example:
    picked = _pick(rng, words)
    return Example("copy", f"Repeat exactly:\n{' '.join(picked)}", " ".join(picked), " ".join(picked[:-1]))


def _reverse(rng: random.Random, words: list[str]) -> Example:
    picked = _pick(rng, words)
    return Example(
        "reverse",
        f"Reverse the order of these words:\n{' '.join(picked)}",
        " ".join(reversed(picked)),
        " ".join(picked),
    )


def _sort(rng: random.Random, words: list[str]) -> Example:
    picked = _pick(rng, words, 3, 3)
    answer = sorted(picked)
    wrong = sorted(picked, reverse=True) if answer != picked[::-1] else picked
    return Example("sort", f"Sort these words alphabetically:\n{' '.join(picked)}", " ".join(answer), " ".join(wrong))


def _upper(rng: random.Random, words: list[str]) -> Example:
    word = rng.choice(words)
    return Example("upper", f"Write this word in capital letters:\n{word}", word.upper(), word)


def _count(rng: random.Random, words: list[str]) -> Example:
    picked = _pick(rng, words, 2, 5)
    return Example(
        "count", f"How many words are in:\n{' '.join(picked)}", str(len(picked)), str(len(picked) + rng.choice([-1, 1]))
    )


def _capital(rng: random.Random, words: list[str]) -> Example:
    country = rng.choice(sorted(CAPITALS))
    other = rng.choice(sorted(c for c in CAPITALS.values() if c != CAPITALS[country]))
    return Example("capital", rng.choice(_CAPITAL).format(c=country), CAPITALS[country], other)


GENERATORS: dict[str, Callable[[random.Random, list[str]], Example]] = {
    "add": _add,
    "subtract": _subtract,
    "copy": _copy,
    "reverse": _reverse,
    "sort": _sort,
    "upper": _upper,
    "count": _count,
    "capital": _capital,
}


def record_id(kind: str, content: Any) -> str:
    return f"{kind}-{xxhash.xxh64_hexdigest(json.dumps(content, sort_keys=True, ensure_ascii=False).encode())}"


def builtin_examples(per_skill: int, seed: int, skills: list[str]) -> list[Example]:
    """`per_skill` distinct examples of each skill (fewer where the skill has fewer distinct prompts)."""
    words = _words()
    out: list[Example] = []
    for skill in skills:
        rng = random.Random(f"{seed}:{skill}")  # the seed string is unchanged since they were called tasks
        seen: set[str] = set()
        for _ in range(per_skill * 20):
            example = GENERATORS[skill](rng, words)
            if example.prompt not in seen and example.wrong != example.answer:
                seen.add(example.prompt)
                out.append(example)
            if len(seen) == per_skill:
                break
    return out


def chat_record(example: Example, system: bool = False) -> dict[str, Any]:
    messages = ([{"role": "system", "content": SYSTEM_PROMPT}] if system else []) + [
        {"role": "user", "content": example.prompt},
        {"role": "assistant", "content": example.answer},
    ]
    return {
        "id": record_id(example.task, example.prompt),
        "task": example.task,
        "messages": messages,
        "answer": example.answer,
        "source": "builtin",
        "split_key": record_id(example.task, example.prompt),
    }


def preference_record(example: Example) -> dict[str, Any]:
    return {
        "id": record_id(f"pref-{example.task}", example.prompt),
        "task": example.task,
        "prompt": [{"role": "user", "content": example.prompt}],
        "chosen": [{"role": "assistant", "content": example.answer}],
        "rejected": [{"role": "assistant", "content": example.wrong}],
        "answer": example.answer,
        "source": "builtin",
        "split_key": record_id(example.task, example.prompt),
    }


def dialogue_records(max_conversations: int, seed: int) -> list[dict[str, Any]]:
    """Multi-turn English dialogue from chatterbot-corpus: user and assistant take turns."""
    root = Path(str(importlib.resources.files("chatterbot_corpus"))) / "data" / "english"
    conversations = []
    for path in sorted(root.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conv in data.get("conversations") or []:
            turns = [str(u).strip() for u in (conv if isinstance(conv, list) else [conv]) if u is not None]
            if len(turns) >= 2 and all(turns):
                conversations.append(turns[: len(turns) - len(turns) % 2])
    random.Random(seed).shuffle(conversations)
    out = []
    for turns in conversations[:max_conversations]:
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        out.append(
            {"id": record_id("dialogue", messages), "task": "dialogue", "messages": messages, "source": "chatterbot"}
        )
    return out


# -- user data ------------------------------------------------------------------------------------


class Rejected(ValueError):
    """A record that cannot be used; its message is the quarantine reason."""


def _messages(value: Any, field: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "assistant" if field != "prompt" else "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise Rejected(f"invalid_{field} (a string or a non-empty list of messages)")
    out = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise Rejected(f"invalid_message ({field}[{index}] needs a string content)")
        if message.get("role") not in ROLES:
            raise Rejected(f"unknown_role ({field}[{index}] has role {message.get('role')!r})")
        if message["role"] == "assistant" and not message["content"].strip():
            raise Rejected(f"empty_assistant_turn ({field}[{index}])")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def validate_chat(data: Any) -> dict[str, Any]:
    """A user SFT record (OpenAI `messages`, or `prompt`/`completion`) as messages; Rejected if unusable."""
    if not isinstance(data, dict):
        raise Rejected(f"not_an_object (got {type(data).__name__})")
    if "messages" in data:
        messages = _messages(data["messages"], "messages")
    elif "prompt" in data and "completion" in data:
        if not isinstance(data["prompt"], str) or not isinstance(data["completion"], str):
            raise Rejected("invalid_prompt_completion (both must be strings)")
        if not data["completion"].strip():
            raise Rejected("empty_assistant_turn (completion)")
        messages = [{"role": "user", "content": data["prompt"]}, {"role": "assistant", "content": data["completion"]}]
    else:
        raise Rejected("missing_messages (needs messages, or prompt and completion)")
    if not any(m["role"] == "assistant" for m in messages):
        raise Rejected("no_assistant_turn")
    record = {
        "id": str(data.get("id") or record_id("chat", messages)),
        "task": str(data.get("task", "user")),
        "messages": messages,
        "source": "user",
    }
    if isinstance(data.get("answer"), str):
        record["answer"] = data["answer"]
    return record


def validate_preference(data: Any) -> dict[str, Any]:
    """A user DPO record (`prompt`, `chosen`, `rejected` as strings or message lists); Rejected if unusable."""
    if not isinstance(data, dict):
        raise Rejected(f"not_an_object (got {type(data).__name__})")
    for field in ("prompt", "chosen", "rejected"):
        if field not in data:
            raise Rejected(f"missing_{field}")
    prompt = _messages(data["prompt"], "prompt")
    chosen, rejected = _messages(data["chosen"], "chosen"), _messages(data["rejected"], "rejected")
    if any(m["role"] != "assistant" for m in chosen + rejected):
        raise Rejected("invalid_completion (chosen and rejected must be assistant messages)")
    if chosen == rejected:
        raise Rejected("identical_pair (chosen equals rejected)")
    return {
        "id": str(data.get("id") or record_id("pref", [prompt, chosen, rejected])),
        "task": str(data.get("task", "user")),
        "prompt": prompt,
        "chosen": chosen,
        "rejected": rejected,
        "source": "user",
    }


def read_user_records(
    paths: list[str], validate: Callable[[Any], dict[str, Any]], label: Callable[[str], str] = str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """(good records, quarantine records, records read) of every input, with the readers curation uses."""
    from lmforge.inputs import quarantine_record, read_input

    good, bad, total = [], [], 0
    for path in paths:
        for raw in read_input(path):
            total += 1
            raw.origin = label(raw.origin)
            try:
                if raw.problem:
                    raise Rejected(raw.problem)
                good.append(validate(raw.data))
            except Rejected as exc:
                bad.append(quarantine_record(raw, str(exc)))
    return good, bad, total


# -- split and write ------------------------------------------------------------------------------


def is_heldout(record_id_: str, fraction: float, seed: int) -> bool:
    return xxhash.xxh64_intdigest(record_id_.encode(), seed=seed) % 1_000_000 < fraction * 1_000_000


def split(
    records: list[dict[str, Any]], fraction: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) by a hash of the record's `split_key` (default its id); a repeated id is kept once.

    The built-in SFT record and preference pair made from one question share a split key, so a
    question held out from SFT is held out from DPO too (else DPO would train on SFT's test items).
    """
    train: list[dict[str, Any]] = []
    heldout: list[dict[str, Any]] = []
    seen: set[str] = set()
    for record in records:
        if record["id"] in seen:
            continue
        seen.add(record["id"])
        (heldout if is_heldout(record.get("split_key", record["id"]), fraction, seed) else train).append(record)
    return train, heldout


def spread_over_tasks(records: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Up to `limit` records taking turns between tasks, so every task is represented."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_task.setdefault(record["task"], []).append(record)
    out: list[dict[str, Any]] = []
    queues = [list(reversed(v)) for _, v in sorted(by_task.items())]
    while len(out) < limit and any(queues):
        for queue in queues:
            if queue and len(out) < limit:
                out.append(queue.pop())
    return out


def task_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    return dict(sorted(Counter(r["task"] for r in records).items()))
