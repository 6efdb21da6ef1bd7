"""Held-out measurements of an aligned model, with 95% bootstrap intervals.

- assistant-token loss: cross-entropy over exactly the tokens the chat template marks as the
  assistant's (its content and `<|im_end|>`), as TRL trains them; token-weighted over all items;
- exact match: greedy generation with the chat template, stopped at `<|im_end|>`, compared
  with the verified answer after stripping whitespace;
- preference accuracy: how often the model gives the chosen answer a higher sequence
  log-probability than the rejected one.

These are the alignment stage's own checks (they let it warn about DPO over-optimisation as it
trains); the evaluation stage runs the same held-out files through lm-eval.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def bootstrap_ci(
    values: list[float], weights: list[float] | None = None, iters: int = 1000, seed: int = 0
) -> tuple[float, float, float]:
    """(estimate, low, high): the weighted mean and its 95% percentile bootstrap interval over items."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    v = np.asarray(values, dtype=np.float64)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(v), size=(iters, len(v)))
    means = (v[picks] * w[picks]).sum(axis=1) / np.maximum(w[picks].sum(axis=1), 1e-12)
    return float((v * w).sum() / w.sum()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def paired_bootstrap(
    before: list[float], after: list[float], iters: int = 1000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean of after - before, 95% interval) resampling the same items for both."""
    if not before:
        return float("nan"), float("nan"), float("nan")
    return bootstrap_ci([b - a for a, b in zip(before, after)], iters=iters, seed=seed)


def _masked(tokenizer: Any, messages: list[dict[str, str]], max_len: int) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return out["input_ids"][:max_len], out["assistant_masks"][:max_len]


def assistant_loss(
    model: Any, tokenizer: Any, records: list[dict[str, Any]], max_len: int, batch_size: int = 16
) -> dict[str, float]:
    """Token-weighted assistant-token loss over `records`, with a bootstrap interval over items."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    per_item: list[float] = []
    counts: list[float] = []
    model.eval()
    for start in range(0, len(records), batch_size):
        rows = [_masked(tokenizer, r["messages"], max_len) for r in records[start : start + batch_size]]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        target = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, (row, assistant) in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
            target[i, : len(row)] = torch.tensor(assistant, dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        scored = target[:, 1:]
        for i in range(len(rows)):
            n = int(scored[i].sum())
            if n:
                per_item.append(float(losses[i][scored[i]].mean()))
                counts.append(n)
    loss, low, high = bootstrap_ci(per_item, counts)
    return {"loss": loss, "loss_ci_low": low, "loss_ci_high": high, "items": len(per_item)}


def generate_answers(
    model: Any, tokenizer: Any, records: list[dict[str, Any]], max_new_tokens: int = 24, batch_size: int = 32
) -> list[str]:
    """Greedy answers to each record's prompt (every message before the last assistant turn)."""
    return [group[0] for group in sample_answers(model, tokenizer, records, max_new_tokens, batch_size)]


def sample_answers(
    model: Any,
    tokenizer: Any,
    records: list[dict[str, Any]],
    max_new_tokens: int,
    batch_size: int = 32,
    samples: int = 1,
    temperature: float | None = None,
) -> list[list[str]]:
    """`samples` answers to each record's prompt: greedy without a temperature, else sampled from the
    full distribution at that temperature (no top-k or top-p, as the RL rollouts sample)."""
    import torch

    device = next(model.parameters()).device
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature is not None:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    # a mixture of experts trained with its load-balancing loss (TRL turns the router logits on) would
    # compute that loss at every decoding step, where a padded batch's mask does not fit the cached logits
    if hasattr(model.config.get_text_config(), "output_router_logits"):
        sampling["output_router_logits"] = False
    answers: list[list[str]] = []
    tokenizer.padding_side = "left"
    model.eval()
    for start in range(0, len(records), batch_size):
        prompts = [prompt_messages(r) for r in records[start : start + batch_size]]
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                num_return_sequences=samples,
                eos_token_id=stop,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        rows = [
            tokenizer.decode(row, skip_special_tokens=True).strip() for row in out[:, batch["input_ids"].shape[1] :]
        ]
        answers.extend(rows[i : i + samples] for i in range(0, len(rows), samples))
    return answers


def prompt_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    if "prompt" in record:  # a preference record
        return record["prompt"]
    messages = record["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last]


def exact_match(model: Any, tokenizer: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Exact match on the records that carry an `answer`, overall and per task (`lmforge.text.verify`)."""
    from lmforge.text.verify import is_correct

    verifiable = [r for r in records if "answer" in r]
    answers = generate_answers(model, tokenizer, verifiable)
    hits = [float(is_correct(a, r["answer"])) for a, r in zip(answers, verifiable)]
    score, low, high = bootstrap_ci(hits)
    tasks: dict[str, list[float]] = {}
    for hit, record in zip(hits, verifiable):
        tasks.setdefault(record["task"], []).append(hit)
    return {
        "exact_match": score,
        "exact_match_ci_low": low,
        "exact_match_ci_high": high,
        "items": len(hits),
        "by_task": {t: round(sum(v) / len(v), 4) for t, v in sorted(tasks.items())},
        "hits": hits,
        "examples": [
            {"prompt": prompt_messages(r)[-1]["content"], "answer": r["answer"], "model": a}
            for r, a in list(zip(verifiable, answers))[:5]
        ],
    }


def sequence_logprob(
    model: Any, tokenizer: Any, prompt: list[dict[str, str]], completion: list[dict[str, str]], max_len: int
) -> float:
    """Sum of log-probabilities of the completion's assistant tokens after the prompt."""
    import torch

    ids, assistant = _masked(tokenizer, prompt + completion, max_len)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits.float().cpu()[0]
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    mask = torch.tensor(assistant[1:], dtype=torch.bool)
    return float(logprobs[mask].sum())


def preference_accuracy(model: Any, tokenizer: Any, records: list[dict[str, Any]], max_len: int) -> dict[str, Any]:
    """Share of pairs where the chosen completion is more likely than the rejected one."""
    wins, margins = [], []
    model.eval()
    for record in records:
        chosen = sequence_logprob(model, tokenizer, record["prompt"], record["chosen"], max_len)
        rejected = sequence_logprob(model, tokenizer, record["prompt"], record["rejected"], max_len)
        wins.append(float(chosen > rejected))
        margins.append(chosen - rejected if math.isfinite(chosen - rejected) else 0.0)
    score, low, high = bootstrap_ci(wins)
    return {
        "preference_accuracy": score,
        "preference_accuracy_ci_low": low,
        "preference_accuracy_ci_high": high,
        "mean_logprob_margin": float(np.mean(margins)) if margins else float("nan"),
        "items": len(wins),
        "wins": wins,
    }
