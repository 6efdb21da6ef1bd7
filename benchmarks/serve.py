"""Serving latency and throughput: vLLM (as `serve/release` runs it) against two baselines, same model, same prompts.

    .venv/bin/python benchmarks/serve.py --workspace WS          # the model WS serves (or its DPO model)
    .venv/bin/python benchmarks/serve.py --model DIR [--concurrency 1,8,32] [--max-tokens 32]
    .venv/bin/python benchmarks/serve.py --model DIR --speculative [--draft DRAFT_DIR]
    .venv/bin/python benchmarks/serve.py --model DIR --kv-cache-dtype fp8   # FP8 KV cache beside the model's dtype
    .venv/bin/python benchmarks/serve.py --workspace WS --adapters [--concurrency 1,8] [--lora-ops both]

Rows, for the `shared-prefix` workload (a long system prompt shared by every request, then a
short question) and the `distinct` one (prompts of the same length with nothing shared):

- vLLM, prefix caching on (the serving stage's settings), at each concurrency level;
- vLLM, prefix caching off, same levels (the baseline for the prefix-caching effect on TTFT);
- Hugging Face `generate`, one request at a time, and batched (all of a level's prompts as one
  left-padded batch): what a user would write without a server.

With `--speculative`: vLLM without speculation, with its n-gram proposer and with a draft model,
on a `repetition` workload (a phrase said over and over: the continuation is in the context, the
case speculation is for) and the `distinct` one, each level's output tokens/s and TPOT against
no speculation, and the proposers' acceptance rate and mean accepted length (vLLM's counters).

With `--adapters` (a workspace whose release serves LoRA adapters, `serve.adapters.enabled`): one
vLLM server with the N adapters against N vLLM servers of the merged models, all running at once:
resident memory (RSS of each server's process tree, summed) and output tokens/s at each level, the
clients spread round-robin over the N served names (or servers).

TTFT/TPOT/latency p50/p90/p99 and output tokens/s, then the ratios the README quotes: vLLM's
throughput at the highest level over HF's (sequential and batched), and TTFT p50 of the
shared-prefix workload with caching off over on. Every request generates exactly
`--max-tokens` tokens (ignore_eos / min_new_tokens), so engines do the same work.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving import slo  # noqa: E402


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    current = Path(args.workspace) / "serving" / "current.json"
    if current.exists():
        return Path(json.loads(current.read_text())["model_dir"])
    found = sorted(Path(args.workspace).glob("align/dpo/*/hf/config.json"))
    if not found:
        sys.exit(f"no served or DPO model under {args.workspace}; pass --model DIR")
    return found[-1].parent


def hf_rows(model_dir: Path, concurrency: list[int], per_client: int, max_tokens: int, prefix_words: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()

    def generate(texts: list[str], new: int) -> float:
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(
                **batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        return time.perf_counter() - started

    rows = []
    for workload in slo.WORKLOADS:
        for clients in concurrency:
            texts = slo.prompts(workload, clients * per_client, prefix_words, seed=clients)
            generate(texts[:1], 2)  # warm up
            # one at a time: each request's TTFT is its own prefill + first token
            samples, started = [], time.perf_counter()
            for text in texts:
                ttft = generate([text], 1)
                total = generate([text], max_tokens)
                samples.append(slo.Sample(ttft, total, max_tokens))
            rows.append(
                {
                    "engine": "hf generate, sequential",
                    "workload": workload,
                    "clients": clients,
                    **slo.summarize(samples, time.perf_counter() - started),
                }
            )
            # batched: every request of the level in one batch, so each waits for the batch
            samples, started = [], time.perf_counter()
            for i in range(0, len(texts), clients):
                chunk = texts[i : i + clients]
                ttft = generate(chunk, 1)
                total = generate(chunk, max_tokens)
                samples += [slo.Sample(ttft, total, max_tokens) for _ in chunk]
            rows.append(
                {
                    "engine": "hf generate, batched",
                    "workload": workload,
                    "clients": clients,
                    **slo.summarize(samples, time.perf_counter() - started),
                }
            )
            if clients == concurrency[-1]:
                pass
    return rows


def vllm_rows(
    model_dir: Path,
    prefix_caching: bool,
    concurrency: list[int],
    per_client: int,
    max_tokens: int,
    prefix_words: int,
    kv_cache_dtype: str = "auto",
) -> list[dict]:
    from lmforge.inference.vllm_server import EngineConfig, TemporaryServer

    cfg = EngineConfig(enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype)
    with tempfile.TemporaryDirectory() as work, TemporaryServer(model_dir, cfg, Path(work), "bench") as server:
        rows = slo.run(server.base_url, server.api_key, "bench", concurrency, per_client, max_tokens, prefix_words)
    label = "vLLM" + ("" if prefix_caching else ", prefix caching off")
    label += f", KV cache {kv_cache_dtype}" if kv_cache_dtype != "auto" else ""
    return [{"engine": label, **r} for r in rows]


def kv_cache_report(model_dir: Path, dtype: str, shape: tuple) -> None:  # type: ignore[type-arg]
    """vLLM with the model's KV-cache dtype and with `dtype` (FP8), same levels: tok/s and TPOT ratios."""
    from lmforge.inference.vllm_server import EngineConfig, kv_cache_problem

    if problem := kv_cache_problem(EngineConfig(kv_cache_dtype=dtype), model_dir):  # type: ignore[arg-type]
        sys.exit(problem)
    rows = vllm_rows(model_dir, True, *shape) + vllm_rows(model_dir, True, *shape, kv_cache_dtype=dtype)
    print(slo.table(rows))
    base = {(r["workload"], r["clients"]): r for r in rows if r["engine"] == "vLLM"}
    for r in rows:
        if r["engine"] != "vLLM":
            b = base[(r["workload"], r["clients"])]
            print(
                f"KV cache {dtype}, {r['workload']} x{r['clients']}: tok/s "
                f"{r['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x of the model's dtype, "
                f"TPOT p50 {r['tpot_ms_p50']:.1f} vs {b['tpot_ms_p50']:.1f} ms"
            )


def speculation_rows(
    model_dir: Path, draft: str | None, concurrency: list[int], per_client: int, max_tokens: int, prefix_words: int
) -> tuple[list[dict], dict[str, dict]]:
    """vLLM without speculation, with the n-gram proposer and (given a draft) with the draft model, on a
    workload where speculation should help (repetition) and one where it should not (distinct)."""
    from lmforge.inference.vllm_server import EngineConfig, SpeculativeConfig

    proposers: dict[str, SpeculativeConfig | None] = {"off": None, "ngram": SpeculativeConfig(method="ngram")}
    if draft:
        proposers["draft"] = SpeculativeConfig(method="draft", draft_model=draft)
    rows, stats = [], {}
    for name, proposer in proposers.items():
        with tempfile.TemporaryDirectory() as work:
            found, figures = slo.speculation_levels(
                model_dir, EngineConfig(), proposer, Path(work), concurrency, per_client, max_tokens, prefix_words
            )
        if proposer is not None:
            stats[name] = figures
        rows += [{"engine": f"vLLM, speculation {name}", **r} for r in found]
    return rows, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", default="workspace")
    parser.add_argument("--model")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prefix-words", type=int, default=120)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument(
        "--kv-cache-dtype", choices=["fp8", "fp8_e4m3", "fp8_e5m2"], help="vLLM with this KV cache beside the default"
    )
    parser.add_argument(
        "--speculative", action="store_true", help="compare speculative decoding (off / ngram / --draft) instead"
    )
    parser.add_argument("--draft", help="--speculative: a draft model directory with the served model's tokenizer")
    parser.add_argument(
        "--adapters",
        action="store_true",
        help="one server with the workspace's LoRA adapters vs one merged server each",
    )
    parser.add_argument(
        "--lora-ops",
        choices=["both", "grouped", "upstream"],
        default="both",
        help="--adapters: the CPU LoRA ops of the adapter server (lmforge's grouped ones, vLLM's own: upstream, or both)",
    )
    parser.add_argument(
        "--workloads", default="shared-prefix,distinct", help="--adapters: the SLO workloads to run (comma-separated)"
    )
    args = parser.parse_args()
    if args.adapters:
        return adapters_report(args)
    model_dir = _model_dir(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    words = slo.fit_prefix_words(model_dir, args.max_tokens, args.prefix_words)
    shape = (levels, args.requests_per_client, args.max_tokens, words)
    print(
        f"model: {model_dir}\nlevels: {levels} clients x {args.requests_per_client} requests, "
        f"{args.max_tokens} tokens each, system prompt {words} words (what the context holds)\n",
        flush=True,
    )
    if args.speculative:
        return speculative_report(model_dir, args, shape)
    if args.kv_cache_dtype:
        return kv_cache_report(model_dir, args.kv_cache_dtype, shape)
    rows = vllm_rows(model_dir, True, *shape)
    rows += vllm_rows(model_dir, False, *shape)
    rows += hf_rows(model_dir, *shape)
    print(slo.table(rows))

    def pick(engine: str, workload: str, clients: int) -> dict:
        return next(r for r in rows if r["engine"] == engine and r["workload"] == workload and r["clients"] == clients)

    top = levels[-1]
    vllm = pick("vLLM", "distinct", top)["output_tokens_per_s"]
    print(
        f"\nthroughput at {top} clients (distinct prompts): vLLM {vllm:.1f} tok/s = "
        f"{vllm / pick('hf generate, sequential', 'distinct', top)['output_tokens_per_s']:.1f}x HF sequential, "
        f"{vllm / pick('hf generate, batched', 'distinct', top)['output_tokens_per_s']:.1f}x HF batched"
    )
    for clients in levels:
        on = pick("vLLM", "shared-prefix", clients)["ttft_ms_p50"]
        off = pick("vLLM, prefix caching off", "shared-prefix", clients)["ttft_ms_p50"]
        print(
            f"prefix caching, shared-prefix TTFT p50 at {clients} clients: {off:.0f} ms off -> {on:.0f} ms on "
            f"({off / on:.2f}x)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def speculative_report(model_dir: Path, args: argparse.Namespace, shape: tuple) -> None:  # type: ignore[type-arg]
    rows, stats = speculation_rows(model_dir, args.draft, *shape)
    print(slo.table(rows))
    for name, figures in stats.items():
        print(
            f"{name}: acceptance rate {figures.get('acceptance_rate', float('nan')):.3f}, mean accepted length "
            f"{figures.get('mean_accepted_length', float('nan')):.2f} tokens per step "
            f"({figures.get('accepted_tokens', 0):.0f} of {figures.get('draft_tokens', 0):.0f} proposed tokens)"
        )
    base = {(r["workload"], r["clients"]): r for r in rows if r["engine"] == "vLLM, speculation off"}
    for r in rows:
        if r["engine"] == "vLLM, speculation off":
            continue
        b = base[(r["workload"], r["clients"])]
        print(
            f"{r['engine']}, {r['workload']} x{r['clients']}: tok/s {r['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x, "
            f"TPOT p50 {r['tpot_ms_p50']:.1f} vs {b['tpot_ms_p50']:.1f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "stats": stats}, indent=1))


def _rss_gib(pid: int) -> float:
    """Resident memory of a process and its descendants (vLLM's engine core runs in a child)."""
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in (root, *root.children(recursive=True))) / 2**30


def adapters_report(args: argparse.Namespace) -> None:
    """One vLLM server with the release's N LoRA adapters (with lmforge's grouped CPU LoRA ops, and with
    vLLM's own: `--lora-ops`) vs N servers of the merged models, on the SLO's workloads."""
    import contextlib
    import os

    from lmforge.inference.vllm_server import EngineConfig, LoraModules, TemporaryServer

    releases = sorted(Path(args.workspace).glob("serve/release/*/release.json"), key=lambda p: p.stat().st_mtime)
    release = next((json.loads(p.read_text()) for p in reversed(releases) if "adapters" in p.read_text()), None)
    if release is None:
        sys.exit(f"no release with LoRA adapters under {args.workspace} (serve.adapters.enabled: true)")
    workspace = Path(args.workspace)
    roles = release["lineage"]["adapters"]
    folder = Path(release["model_dir"]).parent  # <release>/adapters/{base,<role>}
    merged = {role: workspace / a["step"] / a["key"] / "hf" for role, a in roles.items()}
    levels = [int(c) for c in args.concurrency.split(",")]
    words = slo.fit_prefix_words(Path(release["model_dir"]), args.max_tokens, args.prefix_words)
    shape = (levels, args.requests_per_client, args.max_tokens, words, tuple(args.workloads.split(",")))
    rank = max(a["rank"] for a in roles.values())
    lora = LoraModules({role: str(folder / role) for role in roles}, max_lora_rank=max(8, 1 << (rank - 1).bit_length()),
                       max_loras=len(roles))  # fmt: skip
    print(f"{len(roles)} fine-tunes ({', '.join(roles)}, rank up to {rank}) of {release['model_dir']}; "
          f"levels {levels}\n", flush=True)  # fmt: skip
    results = {}
    ops = ["grouped", "upstream"] if args.lora_ops == "both" else [args.lora_ops]
    with tempfile.TemporaryDirectory() as work:
        for which in ops:  # the server's environment picks the ops (lmforge.inference.vllm_cpu_lora)
            os.environ["LMFORGE_VLLM_LORA_OPS"] = which
            name = (
                f"1 server, {len(roles)} LoRA adapters, {'lmforge grouped' if which == 'grouped' else 'vLLM torch'} ops"
            )
            with TemporaryServer(
                Path(release["model_dir"]), EngineConfig(), Path(work) / which, "base", lora=lora
            ) as one:
                targets = [(one.base_url, one.api_key, role) for role in roles]
                slo.run_mixed(targets, [len(roles)], 1, args.max_tokens, words, ("distinct",))  # warm-up, not counted
                memory = _rss_gib(one.service.process.pid)
                rows = slo.run_mixed(targets, *shape)
                results[name] = (memory, rows)
        os.environ.pop("LMFORGE_VLLM_LORA_OPS", None)
        with contextlib.ExitStack() as stack:
            servers = [
                stack.enter_context(TemporaryServer(path, EngineConfig(), Path(work) / role, role))
                for role, path in merged.items()
            ]
            targets = [(s.base_url, s.api_key, s.served_name) for s in servers]
            slo.run_mixed(targets, [len(servers)], 1, args.max_tokens, words, ("distinct",))  # warm-up, not counted
            memory = sum(_rss_gib(s.service.process.pid) for s in servers)
            rows = slo.run_mixed(targets, *shape)
            results[f"{len(servers)} servers, merged"] = (memory, rows)
    table = [{"engine": name, **r} for name, (_, rows) in results.items() for r in rows]
    print(slo.table(table))
    merged_mem, merged_rows = results[f"{len(merged)} servers, merged"]
    for name, (memory, rows) in results.items():
        if name.endswith("merged"):
            continue
        print(
            f"\n{name}: resident memory {memory:.2f} GiB vs {merged_mem:.2f} GiB merged: {merged_mem / memory:.2f}x less"
        )
        for a, b in zip(rows, merged_rows, strict=True):
            ours, theirs = a["output_tokens_per_s"], b["output_tokens_per_s"]
            print(f"  {a['workload']} x{a['clients']}: tok/s {ours:.0f} vs {theirs:.0f} merged ({ours / theirs:.2f}x), "
                  f"TTFT p90 {a['ttft_ms_p90']:.0f} vs {b['ttft_ms_p90']:.0f} ms, "
                  f"TPOT p90 {a['tpot_ms_p90']:.1f} vs {b['tpot_ms_p90']:.1f} ms")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"memory_gib": {k: m for k, (m, _) in results.items()}, "rows": table}))


if __name__ == "__main__":
    main()
