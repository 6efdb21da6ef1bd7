"""One lm-eval process: every task of one model on one backend, each written as soon as it is done.

    python -m evaluation.lmeval_entry --spec <out>/lmeval_spec_<backend>.json   (via lmforge.processes.launch.run_entry)

Started through lmforge's launcher, so cancelling the stage stops it. For each task in the spec
it calls `lm_eval.simple_evaluate` (never a loop of its own), with `log_samples`, and writes
`result.json` (metrics, lm-eval's stderr, the resolved task config and the exact model
arguments) and `samples.jsonl` (each item's id, prompt, response and per-item metric) into the
task's own result folder. A crash loses at most the task in progress: the step's retry skips
the ones already written.

Backends: `hf` (transformers in this process) and `vllm` (lm-eval's `local-completions` against
a vLLM server the step started; the API key comes in OPENAI_API_KEY, as lm-eval reads it).
Rolling windows match across the two: the API backend scores windows of max_length - 2 tokens,
so the hf backend is given max_length - 2 as well.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from evaluation.backends import backend
from lmforge.hashing import atomic_write_text
from lmforge.processes.entry import main

log = logging.getLogger("evaluation.lmeval")


def model_arguments(spec: dict[str, Any]) -> tuple[str, str]:
    return backend(spec["backend"]).lm_eval_model(spec)


def _plain(value: Any) -> Any:
    """lm-eval mixes numpy scalars and tuples into its output; JSON wants plain values."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def sample_rows(samples: list[dict[str, Any]], metrics: list[str]) -> list[dict[str, Any]]:
    rows = []
    for sample in samples:
        doc = sample.get("doc", {})
        rows.append(
            {
                "doc_id": sample["doc_id"],
                "id": str(doc.get("id", doc.get("task_id", sample["doc_id"]))),
                "filter": sample.get("filter"),
                "target": _plain(sample.get("target")),
                "arguments": _plain(sample.get("arguments")),
                "resps": _plain(sample.get("resps")),
                "filtered_resps": _plain(sample.get("filtered_resps")),
                "metrics": {m: _plain(sample[m]) for m in metrics if m in sample},
            }
        )
    return rows


def generation_cap(manager: Any, name: str, max_length: int) -> dict[str, int] | None:
    """Cap a generation task's `max_gen_toks` at half the model's context, so a short-context model
    keeps room for the prompt (lm-eval refuses a budget as long as the context); None when it fits.
    The cap is recorded with the result (its `config.generation_kwargs`)."""
    loaded = manager.load([name])["tasks"]
    for task in loaded.values():
        if task.get_config("output_type") != "generate_until":
            continue
        wanted = (task.get_config("generation_kwargs") or {}).get("max_gen_toks", 256)
        if wanted > max_length // 2:
            log.warning(
                "%s: max_gen_toks %d capped at %d (half of the model's context %d)",
                name,
                wanted,
                max_length // 2,
                max_length,
            )
            return {"max_gen_toks": max_length // 2}
    return None


def evaluate_task(spec: dict[str, Any], task: dict[str, Any], model: str, model_args: str) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = Path(task["out_dir"])
    manager = TaskManager(include_path=task["include_path"], include_defaults=task["include_path"] is None)
    gen_kwargs = generation_cap(manager, task["name"], spec["max_length"])
    started = time.time()
    result = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task["name"]],
        task_manager=manager,
        limit=task["limit"],
        gen_kwargs=gen_kwargs,
        batch_size=spec["batch_size"],
        device=spec["device"],
        log_samples=True,
        bootstrap_iters=spec["bootstrap_iters"],
        confirm_run_unsafe_code=bool(task.get("unsafe_code")),
        apply_chat_template=False,
        random_seed=spec["seed"],
        numpy_random_seed=spec["seed"],
        torch_random_seed=spec["seed"],
        fewshot_random_seed=spec["seed"],
    )
    name = task["name"]
    metrics = sorted({key.split(",")[0] for key in result["results"][name] if "_stderr" not in key and "," in key})
    out.mkdir(parents=True, exist_ok=True)
    rows = sample_rows(result["samples"][name], metrics)
    # each file is written whole (temporary name, then renamed), result.json last: it marks the task done
    atomic_write_text(out / "samples.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    summary = {
        "task": name,
        "backend": spec["backend"],
        "model_args": model_args.replace(spec.get("base_url") or "\0", "<server>"),
        "results": _plain(result["results"][name]),
        "n_samples": _plain(result["n-samples"][name]),
        "config": _plain(result["configs"][name]),
        "lm_eval_version": result.get("lm_eval_version"),
        "seconds": round(time.time() - started, 2),
        "metrics": metrics,
    }
    atomic_write_text(out / "result.json", json.dumps(summary, indent=1, default=str))
    log.info(
        "%s on %s: %s (%.0fs)",
        name,
        spec["backend"],
        {k: v for k, v in summary["results"].items() if "," in k and "stderr" not in k},
        summary["seconds"],
    )


def run_tasks(spec: dict[str, Any], rank: int) -> None:
    os.environ.setdefault("LMFORGE_SANDBOX_LIMITS", json.dumps(spec["sandbox"]))
    model, model_args = model_arguments(spec)
    for task in spec["tasks"]:
        evaluate_task(spec, task, model, model_args)


if __name__ == "__main__":
    sys.exit(main(run_tasks, quiet=("lm_eval", "httpx", "urllib3", "transformers")))
