"""Prompt sets and the answers a model gives to them, cached by content.

The judge (`evaluation.judge`) and the safety suite (`evaluation.safety`) read what a model
*answers*, not what it scores: each model of the lineage answers each prompt set once, on its own
temporary vLLM server (the model as it will be served), through the OpenAI chat API
(`lmforge.inference.chat_client`). A set's answers are kept under their own content address
(`evaluate/answer-sets/<key>`: the model's digest, the prompts, the sampling settings, the engine
settings and vLLM's version), so the evaluation stage and the release gate, which both ask for
the safety answers of a model, find each other's; a rerun starts no server at all.

A prompt set is a list of records `{"id", "messages": [...], ...}`; other fields (a category, the
expected behaviour, a verified answer) travel with the answers.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError, DataError
from lmforge.hashing import atomic_write_json, digest
from lmforge.jsonl import read_jsonl, write_jsonl

log = logging.getLogger(__name__)
ANSWER_SETS = "evaluate/answer-sets"  # the content-addressed answer cache


def read_prompt_file(path: str | Path, required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """A user's prompts: JSONL, one object a line with `prompt` (a string) or `messages` (chat turns
    ending with the user's), an optional `id` (else the line number) and the fields `required` names.
    A bad line fails in one line naming the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such prompt file")
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{where}: not a JSON object ({exc.__class__.__name__})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: not a JSON object")
            if isinstance(row.get("prompt"), str) and row["prompt"].strip():
                messages = [{"role": "user", "content": row["prompt"]}]
            elif isinstance(row.get("messages"), list) and row["messages"]:
                messages = row["messages"]
                if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                    raise ConfigError(f"{where}: messages: each turn needs a string `content`")
                if messages[-1].get("role") != "user":
                    raise ConfigError(f"{where}: messages: the last turn must be the user's")
            else:
                raise ConfigError(f"{where}: needs `prompt` (a non-empty string) or `messages`")
            for name in required:
                if name not in row:
                    raise ConfigError(f"{where}: missing field `{name}`")
            ident = str(row.get("id", f"{path.stem}-{number}"))
            if ident in seen:
                raise ConfigError(f"{where}: id {ident!r} appears twice")
            seen.add(ident)
            records.append({**{k: v for k, v in row.items() if k != "prompt"}, "id": ident, "messages": messages})
    if not records:
        raise ConfigError(f"{path}: no prompts")
    return records


def heldout_prompts(heldout_sft: Path, limit: int, seed: int) -> list[dict[str, Any]]:
    """Up to `limit` prompts held out from SFT (the built-in chat skills and dialogue), spread over
    the skills: the same items every run (ordered by a digest of id and seed, then round-robin)."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in read_jsonl(heldout_sft):
        by_task.setdefault(row.get("task", "chat"), []).append(row)
    for rows in by_task.values():
        rows.sort(key=lambda r: digest([seed, r["id"]]))
    picked: list[dict[str, Any]] = []
    while len(picked) < limit and any(by_task.values()):
        for task in sorted(by_task):
            if by_task[task] and len(picked) < limit:
                row = by_task[task].pop(0)
                picked.append(
                    {
                        "id": row["id"],
                        "task": row.get("task", "chat"),
                        "messages": [m for m in row["messages"] if m["role"] != "assistant"][-1:],
                        "answer": row.get("answer"),
                        "reference": row["messages"][-1]["content"]
                        if row["messages"][-1]["role"] == "assistant"
                        else None,
                    }
                )
    return picked


def chat_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer with the chat template its server renders (no `{% generation %}` marks)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    source = Path(model_dir) / "chat_template.jinja"
    if source.exists():
        tokenizer.chat_template = source.read_text().replace("{% generation %}", "").replace("{% endgeneration %}", "")
    if not tokenizer.chat_template:
        raise ConfigError(
            f"{model_dir}: the model has no chat template, so it cannot answer chat prompts "
            "(the judge and the safety suite ask chat models: an alignment stage's, or your own with a template)"
        )
    return tokenizer


def prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return len(ids)


def set_key(model_digest: str, prompts: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    return digest({"model": model_digest, "prompts": [[p["id"], p["messages"]] for p in prompts], "settings": settings})


def with_current_labels(prompts: list[dict[str, Any]], stored: Any, directory: Path) -> list[dict[str, Any]]:
    """A cached set's answers joined by id onto the prompts as they are now. The set's address covers
    each prompt's id and messages, not its labels (a safety prompt's `expected` and `category`, a judge
    prompt's reference): a user who relabels a prompt must see the rates move, so everything but the
    answer comes from the prompt file of this run, never from the stored rows."""
    answers = {row["id"]: row["answer_text"] for row in stored}
    missing = [p["id"] for p in prompts if p["id"] not in answers]
    if missing:
        raise DataError(f"{directory}/answers.jsonl: no answer for prompt id {missing[0]!r} its address covers")
    return [{**p, "answer_text": answers[p["id"]]} for p in prompts]


def answer_all(
    store: Any,
    model_dir: Path,
    model_digest: str,
    sets: dict[str, list[dict[str, Any]]],
    settings: dict[str, Any],
    engine: Any,
    work_dir: Path,
    name: str,
    concurrency: int = 4,
) -> dict[str, list[dict[str, Any]]]:
    """{set: [prompt record + "answer_text"]} for each prompt set, from the cache or from a temporary
    vLLM server of the model (started once, only when some set is not cached).

    `settings` ({max_tokens, temperature, seed} and the engine's identity) is part of each set's
    address; answers are limited to the context the server has left after the prompt."""
    out: dict[str, list[dict[str, Any]]] = {}
    missing: dict[str, Path] = {}
    for set_name, prompts in sets.items():
        key = set_key(model_digest, prompts, settings)
        manifest, _ = store.check(ANSWER_SETS, key)
        directory = store.step_dir(ANSWER_SETS, key)
        if manifest is not None:
            out[set_name] = with_current_labels(prompts, read_jsonl(directory / "answers.jsonl"), directory)
        else:
            missing[set_name] = directory
    if out:
        log.info("%s: answers reused for %s", name, ", ".join(sorted(out)))
    if not missing:
        return out
    from lmforge.inference.chat_client import ChatEndpoint, ChatRequest
    from lmforge.inference.vllm_server import TemporaryServer, check_servable, served_context

    tokenizer = chat_tokenizer(model_dir)
    context = served_context(model_dir, engine)
    check_servable(model_dir)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(TemporaryServer(model_dir, engine, work_dir / "answers-server", name))
        endpoint = ChatEndpoint(
            f"{server.base_url}/v1", name, server.api_key, what=f"the {name} model's server", concurrency=concurrency
        )
        for set_name, directory in missing.items():
            prompts = sets[set_name]
            requests = []
            for p in prompts:
                room = context - prompt_tokens(tokenizer, p["messages"])
                if room < 1:
                    raise ConfigError(
                        f"prompt {p['id']} of {set_name} is longer than the {name} model's context ({context} tokens)"
                    )
                requests.append(
                    ChatRequest(
                        p["messages"],
                        min(int(settings["max_tokens"]), room),
                        float(settings["temperature"]),
                        int(settings["seed"]),
                    )
                )
            replies = endpoint.complete_all(requests)
            rows = [{**p, "answer_text": reply} for p, reply in zip(prompts, replies, strict=True)]
            directory.mkdir(parents=True, exist_ok=True)
            write_jsonl(directory / "answers.jsonl", rows)
            atomic_write_json(directory / "about.json", {"model": model_digest, "set": set_name, "settings": settings})
            store.finish(directory, {"step": ANSWER_SETS, "key": directory.name, "set": set_name})
            out[set_name] = rows
            log.info("%s answered %d %s prompts", name, len(rows), set_name)
    return out
