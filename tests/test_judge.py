"""The judge's protocols, its cache and its endpoint handling, and the safety suite's arithmetic.

The endpoint here is a small OpenAI-compatible HTTP server in the test (real HTTP, the real
`openai` client), whose judging rule the test chooses: a position-biased judge, a judge that
knows the right answers, a server that wants a key. `test_judge_vllm.py` runs the same against
vLLM's server.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from evaluation import judge as judging
from evaluation import safety
from evaluation.config import JudgeConfig
from lmforge.engine.store import StageStore
from lmforge.errors import ConfigError
from lmforge.inference.chat_client import EndpointRefused, EndpointUnreachable
from lmforge.processes.launch import free_port

KEY = "sk-test-judge-0123456789abcdef"


class Stub:
    """An OpenAI-compatible /v1/chat/completions whose reply is `rule(messages)`."""

    def __init__(self, rule, key: str = KEY, status: int = 200) -> None:
        self.rule, self.key, self.status, self.requests = rule, key, status, 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests += 1
                if self.headers.get("Authorization") != f"Bearer {stub.key}":
                    return self._send(401, {"error": {"message": "bad key", "type": "auth"}})
                if stub.status != 200:
                    return self._send(stub.status, {"error": {"message": "overloaded", "type": "server"}})
                reply = stub.rule(body["messages"])
                self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}
                        ],
                    },
                )

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _settings(url: str, **extra) -> JudgeConfig:
    return JudgeConfig.model_validate(
        {
            "enabled": True,
            "endpoint": {"url": url, "model": "judge", "api_key_env": "TEST_JUDGE_KEY"},
            "template": "compact",
            "retries": 1,
            "backoff_s": 0.01,
            **extra,
        }
    )


def _judge(tmp_path: Path, settings: JudgeConfig) -> judging.Judge:
    identity = {"kind": "endpoint", "url": settings.endpoint.url, "model": "judge", "constrained": False}
    return judging.Judge(StageStore(tmp_path / "ws"), identity, settings, judging.endpoint_connect(settings))


PROMPTS = [
    {
        "id": f"add-{i}",
        "task": "add",
        "messages": [{"role": "user", "content": f"What is {i} + 1?"}],
        "answer": str(i + 1),
    }
    for i in range(12)
]


def _answer(messages, label: str) -> str:
    return re.search(rf"\n{label}: (.*?)(\n|$)", messages[-1]["content"]).group(1)


def test_verdicts_are_parsed_from_the_last_marker():
    assert judging.parse_choice("A is fine but [[B]]", judging.VERDICTS) == "B"
    assert judging.parse_choice("[[A]] ...\nfinal: [[ C ]]", judging.VERDICTS) == "C"
    # two different verdicts on the final line are ambiguous (test_judge_injection.py)
    assert judging.parse_choice("[[A]] ... final: [[ C ]]", judging.VERDICTS) is None
    assert judging.parse_choice("B is better", judging.VERDICTS) is None
    assert judging.parse_grade("Rating: [[7]]", 10) == 7.0
    assert judging.parse_grade("[[11]]", 10) is None
    assert judging.parse_choice("[[R]]", judging.REFUSAL_VERDICTS) == "R"


def test_a_position_biased_judge_scores_chance_and_counts_no_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", KEY)
    stub = Stub(lambda messages: "[[A]]")
    try:
        with _judge(tmp_path, _settings(stub.url)) as judge:
            pairs = judging.verifiable_pairs(PROMPTS, 0)
            assert len(pairs) == len(PROMPTS)  # every item has another item's (wrong) answer
            agree = judging.summarize_agreement(judging.agreement(judge, pairs), 200, 0, 0.6)
            rows = judging.pairwise(judge, PROMPTS, {p["id"]: "x" for p in PROMPTS}, {p["id"]: "y" for p in PROMPTS})
            summary = judging.summarize_pairwise(rows, 200, 0)
    finally:
        stub.close()
    assert agree["estimate"] == 0.5 and agree["both_orders"] == 0.0 and agree["below_minimum"]
    assert summary["n"] == 0 and summary["swap_consistency"] == 0.0  # never the same verdict in both orders
    assert summary["order_averaged"]["estimate"] == 0.5  # each order worth half: a tie, every prompt
    card = __import__("evaluation.judged", fromlist=["card_sections"]).card_sections(
        {
            "judge": {
                "judge": {"described": "stub"},
                "agreement": agree,
                "pairwise": [{**summary, "first": "sft", "second": "dpo"}],
                "grades": {},
                "calls": 1,
                "cached": 0,
            }
        }
    )
    assert "below the minimum 0.60" in card and "n/a (nothing counted)" in card


def test_a_judge_that_knows_the_answers_agrees_and_a_rerun_asks_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", KEY)
    right = {p["answer"] for p in PROMPTS}

    def truthful(messages):
        question = re.search(r"What is (\d+) \+ 1", messages[-1]["content"])
        want = str(int(question.group(1)) + 1)
        a, b = _answer(messages, "A"), _answer(messages, "B")
        return "[[A]]" if a == want else "[[B]]" if b == want else "[[C]]"

    stub = Stub(truthful)
    try:
        with _judge(tmp_path, _settings(stub.url)) as judge:
            truth = judging.agreement(judge, judging.verifiable_pairs(PROMPTS, 0))
            first = {p["id"]: p["answer"] for p in PROMPTS}  # always right
            second = {p["id"]: "0" for p in PROMPTS}  # always wrong
            rows = judging.pairwise(judge, PROMPTS, first, second)
            made = judge.calls
        assert made == stub.requests == 2 * len(PROMPTS) * 2
        with _judge(tmp_path, _settings(stub.url)) as again:  # the same asks: all from the cache, no server touched
            judging.agreement(again, judging.verifiable_pairs(PROMPTS, 0))
            assert again.calls == 0 and again.cached == 2 * len(PROMPTS)
        assert stub.requests == made
    finally:
        stub.close()
    assert right
    agree = judging.summarize_agreement(truth, 200, 0, 0.6)
    assert agree["estimate"] == 1.0 and not agree["below_minimum"]
    summary = judging.summarize_pairwise(rows, 200, 0)
    assert summary["estimate"] == 0.0 and summary["losses"] == len(PROMPTS) and summary["swap_consistency"] == 1.0
    assert summary["order_averaged"]["estimate"] == 0.0


def test_an_unreachable_judge_fails_in_one_line_and_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", KEY)
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with _judge(tmp_path, _settings(url)) as judge, pytest.raises(EndpointUnreachable) as caught:
        judge.ask([("grade", "What is 1 + 1?", "2", "")] * 3)
    message = str(caught.value)
    assert "\n" not in message and url in message and "unreachable after 2 tries" in message
    assert KEY not in message and "sha256:" in message  # the key's fingerprint, never the key
    assert EndpointUnreachable.retryable
    assert not list((tmp_path / "ws").rglob("judgment.json"))


def test_a_refused_key_and_a_missing_key_say_so(tmp_path, monkeypatch):
    stub = Stub(lambda m: "[[A]]", key="another-key")
    monkeypatch.setenv("TEST_JUDGE_KEY", KEY)
    try:
        with _judge(tmp_path, _settings(stub.url)) as judge, pytest.raises(EndpointRefused) as caught:
            judge.ask([("grade", "q", "a", "")])
    finally:
        stub.close()
    assert "HTTP 401" in str(caught.value) and "key set" in str(caught.value) and KEY not in str(caught.value)
    monkeypatch.delenv("TEST_JUDGE_KEY")
    with (
        _judge(tmp_path, _settings(stub.url)) as judge,
        pytest.raises(ConfigError, match=r"\$TEST_JUDGE_KEY is not set"),
    ):
        judge.ask([("grade", "q", "a", "")])


def test_a_server_error_is_retried_then_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", KEY)
    stub = Stub(lambda m: "[[A]]", status=503)
    try:
        with _judge(tmp_path, _settings(stub.url, retries=2)) as judge, pytest.raises(EndpointUnreachable):
            judge.ask([("grade", "q", "a", "")])
    finally:
        stub.close()
    assert stub.requests == 3  # the first try and two retries


def test_judge_settings_name_one_judge():
    with pytest.raises(ValueError, match="judge.model .* or judge.endpoint.url"):
        JudgeConfig(enabled=True)
    with pytest.raises(ValueError, match="not both"):
        JudgeConfig.model_validate({"model": "dpo", "endpoint": {"url": "http://x/v1", "model": "m"}})
    with pytest.raises(ValueError, match="url needs model"):
        JudgeConfig.model_validate({"endpoint": {"url": "http://x/v1"}})
    with pytest.raises(ValueError, match="no model role"):
        JudgeConfig.model_validate({"model": "dpo", "pairwise": [["sft", "nope"]]})


# -- the safety suite -------------------------------------------------------------------------------


def test_the_builtin_suite_pairs_every_red_team_prompt_with_a_benign_one():
    suite = safety.load_suite(["builtin"])
    unsafe = [r for r in suite if r["expected"] == "refuse"]
    benign = {r["id"]: r for r in suite if r["expected"] == "comply"}
    assert len(unsafe) == len(benign) == 30 and len({r["category"] for r in suite}) == 6
    for r in unsafe:
        assert benign[r["pair"]]["category"] == r["category"]


def test_the_rule_based_detector():
    for text in (
        "I can't help with that.",
        "I'm sorry, but I won't provide that.",
        "As an AI, I must decline.",
        "I cannot assist with this request.",
        "",
        "  ",
        "That would be illegal.",
        "I am unable to do that.",
    ):
        assert safety.is_refusal(text), text
    for text in (
        "Sure, here are the steps: [...]",
        "Here is how to do it. First, [...]",
        "17",
        "You can't go wrong with rice: rinse it, then boil.",
        "Of course. You will need [...]",
    ):
        assert not safety.is_refusal(text), text


def test_a_bad_suite_line_is_named(tmp_path):
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"prompt": "a", "category": "x", "expected": "refuse"}\n{"prompt": "b", "expected": "comply"}\n')
    with pytest.raises(ConfigError, match=r"mine.jsonl:2: missing field `category`"):
        safety.load_suite([str(bad)])
    bad.write_text('{"prompt": "a", "category": "x", "expected": "maybe"}\n')
    with pytest.raises(ConfigError, match="expected must be refuse or comply"):
        safety.load_suite([str(bad)])
    bad.write_text('{"prompt": "a", "category": "x", "expected": "refuse"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"mine.jsonl:2: not a JSON object"):
        safety.load_suite([str(bad)])
    bad.write_text('{"messages": [{"role": "assistant", "content": "hi"}], "category": "x", "expected": "refuse"}\n')
    with pytest.raises(ConfigError, match="last turn must be the user's"):
        safety.load_suite([str(bad)])


def test_rates_and_the_paired_comparison():
    suite = safety.load_suite(["builtin"])
    refusing = [
        {**r, "answer_text": "I can't help with that." if r["expected"] == "refuse" else "Sure."} for r in suite
    ]
    complying = [{**r, "answer_text": "Sure, here are the steps: [...]"} for r in suite]
    served = safety.outcomes(refusing, safety.classify_rules(refusing))
    candidate = safety.outcomes(complying, safety.classify_rules(complying))
    rates = safety.rates(candidate, 200, 0)
    assert rates["all"]["unsafe_compliance"]["estimate"] == 1.0 and rates["all"]["over_refusal"]["estimate"] == 0.0
    assert safety.rates(served, 200, 0)["all"]["unsafe_compliance"]["estimate"] == 0.0
    worse = safety.compare(candidate, served, 200, 0)
    assert all(c["worse"] for c in worse.values()) and worse["all"]["delta"] == 1.0 and worse["all"]["items"] == 30
    same = safety.compare(served, served, 200, 0)
    assert not any(c["worse"] for c in same.values())


def test_the_judged_steps_join_the_lineage_and_the_gate_reads_what_they_read(tmp_path):
    from lmforge.config import load_config
    from lmforge.engine.executor import graph

    config = load_config("tiny-cpu", ["serve.gate.safety.enabled=true"], str(tmp_path))
    active = [s.name for s in graph().steps if s.enabled(config)]
    for name in ("evaluate/answers-sft", "evaluate/answers-dpo", "evaluate/judge", "evaluate/safety"):
        assert name in active
    assert "evaluate/answers-pretrained" not in active  # no chat template: not judged
    report = (
        graph().step("evaluate/report")
        if hasattr(graph(), "step")
        else next(s for s in graph().steps if s.name == "evaluate/report")
    )
    upstream = report.upstream(config)
    assert "evaluate/judge" in upstream and "evaluate/safety" in upstream
    release = next(s for s in graph().steps if s.name == "serve/release")
    reads = release.declared_reads(config)
    assert "evaluate.safety" in reads and "evaluate.answers" in reads and "serve.gate" in reads
    off = load_config("tiny-cpu", ["evaluate.judge.enabled=false", "evaluate.safety.enabled=false"], str(tmp_path))
    assert not any(s.name.startswith("evaluate/answers-") for s in graph().steps if s.enabled(off))


def test_a_judge_folder_is_its_content_and_its_weights_are_hashed_once(tmp_path, monkeypatch):
    from evaluation.asking import judge_derive
    from lmforge import hashing
    from lmforge.config import load_config
    from lmforge.engine.executor import graph
    from lmforge.engine.graph import key_components

    folder = tmp_path / "judge"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    config = load_config("tiny-cpu", [f"evaluate.judge.model={folder}"], str(tmp_path / "ws"))
    step = graph().get("evaluate/judge")
    first = key_components(step, config, (), {})
    read: list[Path] = []
    real = hashing.file_sha256
    monkeypatch.setattr(hashing, "file_sha256", lambda p: read.append(Path(p)) or real(p))
    assert key_components(step, config, (), {}) == first and read == []  # remembered by stamp
    view_identity = judge_derive(config)
    assert view_identity == {"judge_folder": hashing.folder_digest(folder)}  # the same digest as before
    (folder / "model.safetensors").write_bytes(b"\1" * 4096)
    assert judge_derive(config) != view_identity and read == [folder / "model.safetensors"]
