"""The served model's own OpenAPI schema, fuzzed by schemathesis (tests/api_fuzz.py): a real vLLM
server behind lmforge's guard on 127.0.0.1, every operation it publishes, each generated request sent
without the key and with it. No 5xx, no 2xx without the key, nothing beyond the bounds accepted.

Findings this fuzzing made (fixed): vLLM mounts routes lmforge does not serve (`/v1/systemone`
answered 501; `/scale_elastic_ep` changes the server; `/v1/responses` keeps responses any key holder
can read back), now 404 behind the key (`serve.engine.api_paths`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.api_fuzz import OPEN, fuzz

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("LMFORGE_FUZZ_EXAMPLES_PER_OPERATION", "6"))
BUDGET_S = float(os.environ.get("LMFORGE_FUZZ_BUDGET_S", "60"))


def test_the_served_api_fuzzed_from_its_own_schema_with_and_without_the_key(tmp_path: Path) -> None:
    from lmforge.inference.vllm_guard import Limits
    from lmforge.inference.vllm_server import EngineConfig, TemporaryServer
    from tests.base_models import build_qwen2_base, demo_texts

    model = build_qwen2_base(tmp_path / "model", demo_texts(100), steps=5, hidden_size=128, intermediate_size=256)
    cfg = EngineConfig(max_model_len=256, max_prompts_per_request=8, max_request_tokens=1024, max_num_seqs=16)
    limits = Limits(max_n=cfg.max_n, max_prompts=8, max_tokens=1024, context=256)
    with TemporaryServer(model, cfg, tmp_path / "server", "fuzzed") as server:
        report = fuzz(server.base_url, server.api_key, limits, examples=EXAMPLES, budget_s=BUDGET_S)
    print(f"{report.examples} examples over {len(report.per_operation)} operations: {dict(report.statuses)}")
    assert report.failures == [], report.failures[:10]
    assert report.examples >= 50 and len(report.per_operation) >= 10
    generating = {f"POST {p}" for p in ("/v1/completions", "/v1/chat/completions")}
    assert generating <= report.per_operation.keys()
    assert report.statuses["keyed 200"] > 0  # some fuzzed requests were served, not all refused
    assert sum(n for s, n in report.statuses.items() if s.startswith("anonymous 2")) <= sum(
        n for op, n in report.per_operation.items() if tuple(op.split(" ", 1)) in OPEN
    )
