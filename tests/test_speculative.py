"""Speculative decoding on the served model, for real: vLLM's n-gram and draft-model proposers on CPU.

The check that matters: greedy output with speculation equals greedy output without it, token for
token, over the held-out prompts; and the proposer did propose (vLLM's counters), so the equality
is not the trivial one of a proposer that never ran.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lmforge.errors import ConfigError
from lmforge.inference.vllm_server import (
    EngineConfig,
    SpeculativeConfig,
    TemporaryServer,
    speculation_stats,
    speculative_args,
)

pytestmark = pytest.mark.slow


def _heldout_chats(workspace: Path, count: int) -> list[list[dict]]:
    """Held-out prompts, those whose answers repeat the prompt's words first (copy, reverse, sort:
    where the n-gram proposer has something to propose), then the others."""
    path = next(workspace.glob("align/data/*/heldout_sft.jsonl"))
    records = [json.loads(line) for line in path.read_text().splitlines() if "answer" in line]
    records.sort(key=lambda r: r.get("task") not in ("copy", "reverse", "sort"))
    return [r["messages"][:-1] for r in records[:count]]


def _greedy(server: TemporaryServer, chats: list[list[dict]]) -> list[list[str]]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0)
    out = []
    for messages in chats:
        # past the answer's end too (ignore_eos): 32 tokens of the model's own continuation each
        reply = client.chat.completions.create(
            model=server.served_name,
            messages=messages,
            temperature=0.0,
            max_tokens=32,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
        out.append([t.token for t in reply.choices[0].logprobs.content])
    return out


@pytest.fixture(scope="module")
def distilled(aligned: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The small lineage's draft model, distilled from its DPO model on 2 ranks."""
    from lmforge.engine.executor import run_pipeline_locally
    from tests.conftest import small_config

    workspace = tmp_path_factory.mktemp("draft")
    shutil.copytree(Path(aligned["align/sft"]["dir"]).parents[2], workspace, dirs_exist_ok=True)
    config = small_config(
        workspace, "align.draft.enabled=true", "align.draft.max_steps=40", "align.draft.save_steps=20",
        "align.draft.heldout_chats=100",
    )  # fmt: skip
    return run_pipeline_locally(config, ["align"])


def test_the_draft_is_distilled_from_the_served_model(distilled: dict, aligned: dict) -> None:
    from lmforge.inference.vllm_server import same_tokenizer

    draft = distilled["align/draft"]
    assert distilled["align/dpo"]["key"] == aligned["align/dpo"]["key"]  # the lineage before it is reused
    m = draft["metrics"]
    assert m["student_layers"] < m["teacher_layers"] and m["params_ratio"] < 1
    # distillation made the layer-dropped student agree with its teacher more often, and predict better
    assert m["top1_agreement"] > m["top1_agreement_before"] + 0.05, m
    assert m["heldout_loss"] < m["heldout_loss_before"]
    heldout = next(Path(draft["dir"]).parents[2].glob("align/data/*/heldout_sft.jsonl"))
    assert draft["counts"]["heldout_items"] == min(100, len(heldout.read_text().splitlines()))
    teacher = Path(aligned["align/dpo"]["dir"]) / "hf"
    assert same_tokenizer(teacher, Path(draft["dir"]) / "hf") is None
    rows = [json.loads(line) for line in (Path(draft["dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 40


def test_greedy_output_is_identical_with_and_without_speculation(
    aligned: dict, distilled: dict, tmp_path: Path
) -> None:
    model = Path(aligned["align/dpo"]["dir"]) / "hf"
    draft = Path(distilled["align/draft"]["dir"]) / "hf"  # distilled from the DPO model
    chats = _heldout_chats(Path(aligned["align/dpo"]["dir"]).parents[2], 16)
    proposers = {
        "off": None,
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3),
        "draft": SpeculativeConfig(method="draft", draft_model=str(draft), num_speculative_tokens=3),
    }
    outputs, stats = {}, {}
    with contextlib.ExitStack() as stack:

        def start(name: str) -> TemporaryServer:
            (tmp_path / name).mkdir()
            server = TemporaryServer(model, EngineConfig(), tmp_path / name, "spec", speculative=proposers[name])
            return stack.enter_context(server)  # stopped when the stack closes, also when another failed to start

        # the three start side by side (a vLLM start is mostly single-threaded imports in three processes)
        with ThreadPoolExecutor(len(proposers)) as pool:
            servers = dict(zip(proposers, pool.map(start, proposers)))
        for name, server in servers.items():
            outputs[name] = _greedy(server, chats)
            stats[name] = speculation_stats(server.base_url, server.api_key)
    # up to 32 tokens each (fewer where the small model's 64-token context ends first)
    assert all(outputs["off"]) and sum(map(len, outputs["off"])) > 8 * len(chats)
    for name in ("ngram", "draft"):
        assert outputs[name] == outputs["off"], name
        assert stats[name]["draft_tokens"] > 0, f"{name} never proposed: {stats[name]}"
        assert 0.0 <= stats[name]["acceptance_rate"] <= 1.0
    assert not stats["off"].get("draft_tokens")
    # the distilled draft agrees with the DPO model on many tokens: proposals were accepted, and the
    # output is still the DPO model's (equal to the run without speculation, above)
    assert stats["draft"]["accepted_tokens"] > 0


def test_a_draft_with_another_tokenizer_is_refused_in_one_line(trained: dict, tmp_path: Path) -> None:
    model = Path(trained["dir"]) / "hf"
    other = tmp_path / "other-draft"
    shutil.copytree(model, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = [w for w in vocab if w.isalpha() and len(w) > 3][:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same tokens, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError) as info:
        speculative_args(SpeculativeConfig(method="draft", draft_model=str(other)), model)
    message = str(info.value)
    assert "serve.speculative.draft_model" in message and "tokenizer" in message and "\n" not in message
    with pytest.raises(ConfigError, match="serve.speculative.draft_model: .* is not a model directory"):
        speculative_args(SpeculativeConfig(method="draft", draft_model=str(tmp_path)), model)
    # the same tokenizer passes and reaches vLLM as --speculative-config
    args = speculative_args(SpeculativeConfig(method="draft", draft_model=str(model)), model)
    assert args[0] == "--speculative-config" and json.loads(args[1])["model"] == str(model.resolve())
    assert speculative_args(SpeculativeConfig(), model) == []


def test_speculative_settings_are_checked_when_the_config_loads() -> None:
    from lmforge.config import load_config

    with pytest.raises(ConfigError, match="serve.speculative.draft_model: method draft needs a model directory"):
        load_config("tiny-cpu", ["serve.speculative.method=draft"])
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        load_config("tiny-cpu", ["serve.speculative.method=ngram", "serve.speculative.prompt_lookup_min=4"])


def test_the_release_keeps_speculation_only_where_it_is_not_slower() -> None:
    from serving.steps import slower_levels

    def row(workload: str, clients: int, tps: float, tpot: float, errors: int = 0) -> dict:
        return {"workload": workload, "clients": clients, "output_tokens_per_s": tps, "tpot_ms_p50": tpot,
                "errors": errors}  # fmt: skip

    off = [row("repetition", 1, 100, 10), row("distinct", 32, 400, 40)]
    assert slower_levels(off, [row("repetition", 1, 150, 7), row("distinct", 32, 390, 41)], 0.05) == []
    slower = slower_levels(off, [row("repetition", 1, 150, 7), row("distinct", 32, 300, 41)], 0.05)
    assert slower == ["distinct x32: 300 vs 400 tok/s, TPOT p50 41.0 vs 40.0 ms"]
    assert slower_levels(off, [row("repetition", 1, 100, 12), row("distinct", 32, 400, 40)], 0.05)  # TPOT
    assert slower_levels(off, [row("repetition", 1, 100, 10, errors=1), row("distinct", 32, 400, 40)], 0.05)
