"""Evaluation: lm-eval on every model of the lineage (hf and vLLM), intervals, the comparison card,
per-task result caching, contamination checks with their gate, and the HumanEval sandbox."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation.contamination import Index, build_index, check_tasks
from lmforge.errors import ConfigError
from lmforge.text.textmatch import Rule


def _edit(text: str, rate: float, rng: random.Random) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), max(1, int(len(words) * rate))):
        words[i] = rng.choice(["alpha", "beta", "gamma", "delta"])
    return " ".join(words)


def test_lightly_edited_items_are_found_by_the_gate_and_by_decontamination_alike(tmp_path: Path) -> None:
    """HumanEval items planted in longer documents with 0/1/3/10% of words replaced, dropped or inserted and
    whitespace changed: recall >= 0.95 at every rate and <= 1% of clean items flagged (other HumanEval items,
    documentation paragraphs, templated chat prompts whose siblings are training data), for the evaluation
    gate's check and for curation's decontamination, which apply one rule. Before the fuzzy path, an item
    with every 13-gram window edited was missed (the issue measured 14 of 18 lightly edited copies)."""
    from data_prep.decontaminate import ItemIndex, shard_attributes
    from tests.planted_items import RATES, planted_fixture

    fixture, rule = planted_fixture(), Rule()
    build_index(fixture.training, tmp_path / "index", rule)
    records = list(check_tasks(fixture.items, {"documents": Index(tmp_path / "index", rule)}, rule))
    assert len(records) == sum(len(v) for v in fixture.items.values())  # one record per item
    planted = [r for r in records if fixture.is_planted(r["task"], r["doc_id"])]
    clean = [r for r in records if not fixture.is_planted(r["task"], r["doc_id"])]
    index = ItemIndex.build([(task, i["id"], i["text"]) for task, items in fixture.items.items() for i in items], rule)
    columns = shard_attributes(index, [text for _, text in fixture.training])
    removed = {doc for (doc, _), hit in zip(fixture.training, columns["decontaminated"]) if hit}
    for rate in RATES:
        at_rate = [r for r in planted if fixture.planted[(r["task"], r["doc_id"])][1] == rate]
        gate_recall = sum(r["contaminated"] for r in at_rate) / len(at_rate)
        docs = [fixture.planted[(r["task"], r["doc_id"])][0] for r in at_rate]
        removed_recall = sum(d in removed for d in docs) / len(docs)
        assert gate_recall >= 0.95 and removed_recall >= 0.95, (rate, gate_recall, removed_recall)
    assert sum(r["contaminated"] for r in clean) / len(clean) <= 0.01  # humaneval, docs and templated chats
    others = [doc for doc, _ in fixture.training if not doc.startswith("planted")]
    assert sum(doc in removed for doc in others) / len(others) <= 0.01
    fuzzy = [r for r in planted if r["contaminated"] and r["path"] == "fuzzy"]
    assert fuzzy and all(r["overlap"] < rule.min_coverage <= 1 and r["similarity"] >= 0.8 for r in fuzzy)
    for r in planted:  # each finding names its document (HumanEval/56 and /61 are near-twins), span, rule and path
        assert r["train_doc_id"].startswith("planted") and r["span"], r
        assert r["rule"] == rule.describe() and r["path"] in {"exact", "fuzzy"}


def test_short_items_are_matched_whole_not_by_a_single_shared_phrase(tmp_path: Path) -> None:
    rule = Rule()
    build_index(
        [("t1", "What is 3 + 5? 8"), ("t2", "a long unrelated sentence about rivers and hills and the sea")],
        tmp_path / "index",
        rule,
    )
    items = {"chat": [{"id": "a", "text": "What is 3 + 5? 8"}, {"id": "b", "text": "What is 4 + 5? 9"}]}
    records = {r["doc_id"]: r for r in check_tasks(items, {"sft": Index(tmp_path / "index", rule)}, rule)}
    assert records["a"]["contaminated"] and records["a"]["checked_by"] == "fuzzy"
    assert not records["b"]["contaminated"]


def test_an_item_shorter_than_the_exact_ngram_is_found_by_the_fuzzy_path(tmp_path: Path) -> None:
    """Items of 5-12 words have no 13-gram: the fuzzy path alone checks them. One word inserted or dropped is
    the same item; a changed slot word of a templated prompt is its sibling, not a copy."""
    rule = Rule()
    items = {
        "chat": [
            {"id": "inserted", "text": "Return the sum of all even numbers in the list"},  # 10 words
            {"id": "dropped", "text": "Reverse the order of these words: snow flag moon"},
            {"id": "sibling", "text": "Reverse the order of these words: bird town girl\ngirl town bird"},
        ]
    }
    training = [
        ("t1", "Exercise 4. Return the SUM of all the even\nnumbers in the list! Good luck."),
        ("t2", "Please reverse order of these words: snow flag moon"),
        ("t3", "Reverse the order of these words: bird lamp town\ntown lamp bird"),  # the prompt and its answer
    ]
    build_index(training, tmp_path / "index", rule)
    records = {r["doc_id"]: r for r in check_tasks(items, {"sft": Index(tmp_path / "index", rule)}, rule)}
    inserted, dropped, sibling = records["inserted"], records["dropped"], records["sibling"]
    assert inserted["contaminated"] and inserted["path"] == "fuzzy" and inserted["checked_by"] == "fuzzy"
    assert inserted["train_doc_id"] == "t1" and "even numbers" in inserted["span"] and 0.9 <= inserted["similarity"] < 1
    assert dropped["contaminated"] and dropped["train_doc_id"] == "t2"
    assert not sibling["contaminated"] and sibling["similarity"] >= rule.min_similarity  # close, but another item


def test_held_out_builtin_chats_at_gpu_scale_stay_under_the_presets_gate(tmp_path: Path) -> None:
    """The built-in skills split as gpu-1node splits them (2,000 per skill, 10% held out): held-out prompts have
    training siblings with other slot words at every turn, and must not read as contaminated (its gate fails
    the run above 1%). A similarity bar for short items flagged 4.4% of them."""
    from lmforge.config import load_config
    from training.align.data import builtin_examples, is_heldout, record_id

    config = load_config("gpu-1node", check_paths=False)
    align = config.align
    train, held = [], []
    for e in builtin_examples(align.builtin.per_skill, align.builtin.seed, list(align.builtin.skills)):
        rid = record_id(e.task, e.prompt)
        held_out = is_heldout(rid, align.heldout_fraction, align.builtin.seed)
        (held if held_out else train).append((rid, f"{e.prompt}\n{e.answer}"))
    rule = Rule()
    build_index(train, tmp_path / "index", rule)
    items = {"chat": [{"id": i, "text": text} for i, text in held]}
    records = list(check_tasks(items, {"sft": Index(tmp_path / "index", rule)}, rule))
    share = sum(r["contaminated"] for r in records) / len(records)
    assert len(records) > 400 and share <= config.evaluate.contamination.max_fraction, share


HOSTILE = {
    "write_outside": "    open('/tmp/lmforge-sandbox-canary', 'w').write('x')\n    return 0\n",
    "socket": "    import socket\n    socket.create_connection(('127.0.0.1', 9), timeout=2)\n    return 0\n",
    "fork_bomb": "    import os\n    while True:\n        os.fork()\n",
    "infinite_loop": "    while True:\n        pass\n",
    "early_exit": "    import sys\n    sys.exit(0)\n",
    # prints the marker the tests' program once held in its own source, then exits 0 before any test ran
    "forge_marker": "    import os, re\n"
    "    for t in set(re.findall(r'PASSED-[0-9a-f]+', open(globals().get('__file__') or 'prog.py').read())):\n"
    "        print(t, flush=True)\n"
    "    os._exit(0)\n",
}


def test_hostile_humaneval_code_is_stopped_and_scores_zero_through_lm_eval(tmp_path: Path) -> None:
    """A fake model answers HumanEval with correct code and with code that attacks the machine;
    lm-eval runs the task to the end and only the correct answers score."""
    import lm_eval
    import lm_eval.models  # noqa: F401 - fill lm-eval's lazy model registry first: registering into an empty one hides "dummy"
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.tasks import TaskManager

    from evaluation.build import build
    from lmforge.text.humaneval import humaneval_items

    problems = {p["prompt"]: p for p in humaneval_items()[: len(HOSTILE) + 2]}
    hostile = dict(zip(list(problems)[2:], HOSTILE.values()))

    @register_model("lmforge-test-oracle")
    class Oracle(LM):  # noqa: D401 - a test double for a model
        def generate_until(self, requests):  # type: ignore[no-untyped-def]
            return [hostile.get(r.args[0], problems[r.args[0]]["canonical_solution"]) for r in requests]

        def loglikelihood(self, requests):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    build(tmp_path, ["lmforge_humaneval"], {}, {})
    result = lm_eval.simple_evaluate(
        model="lmforge-test-oracle",
        tasks=["lmforge_humaneval"],
        limit=len(problems),
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        confirm_run_unsafe_code=True,
        log_samples=True,
    )
    assert result["results"]["lmforge_humaneval"]["pass@1,sandbox"] == pytest.approx(2 / len(problems))
    verdicts = [json.loads(s["filtered_resps"][0]) for s in result["samples"]["lmforge_humaneval"]]
    assert [v["passed"] for v in verdicts] == [True, True] + [False] * len(HOSTILE)
    statuses = dict(zip(HOSTILE, (v["status"] for v in verdicts[2:])))
    # exiting 0 ends only the candidate's process (or is a raise there): the tests' process fails the call
    assert statuses["early_exit"] == statuses["forge_marker"] == "failed"
    assert set(statuses.values()) <= {
        "failed",
        "timeout",
        "killed:SIGXCPU",
        "killed:SIGKILL",
    }
    assert not Path("/tmp/lmforge-sandbox-canary").exists()


@pytest.mark.slow
def test_every_model_is_evaluated_on_hf_and_the_shipped_one_on_vllm_too_with_intervals(evaluated: dict) -> None:
    report = json.loads((Path(evaluated["evaluate/report"]["dir"]) / "report.json").read_text())
    seen = {(r["model"], r["backend"], r["task"]) for r in report["results"]}
    # the lineage sets evaluate.backend_models={vllm: [dpo]}: vLLM only where it is compared with hf
    assert {m for m, b, _ in seen if b == "vllm"} == {"dpo"} and "evaluate/sft-vllm" not in evaluated
    tasks = (
        "lmforge_continuation",
        "lmforge_heldout_ppl",
        "lmforge_chat_exact",
        "lmforge_preference",
        "lmforge_humaneval",
    )
    for model, backend in (("pretrained", "hf"), ("sft", "hf"), ("dpo", "hf"), ("dpo", "vllm")):
        assert all((model, backend, task) in seen for task in tasks), (model, backend)
    # the hf-vs-vLLM agreement covers the shipped model's every task
    assert {(a["model"], a["task"]) for a in report["backend_agreement"]} == {("dpo", t) for t in tasks}
    row = next(r for r in report["results"] if r["task"] == "lmforge_continuation" and r["backend"] == "hf")
    assert row["ci_low"] <= row["value"] <= row["ci_high"] and row["stderr"] is not None and row["items"] == 20
    assert {(d["from"], d["to"]) for d in report["deltas"]} == {("pretrained", "sft"), ("sft", "dpo")}
    assert all(
        a["agree"] for a in report["backend_agreement"] if a["task"] in ("lmforge_continuation", "lmforge_preference")
    )
    card = (Path(evaluated["evaluate/report"]["dir"]) / "comparison.md").read_text()
    assert "pretrained -> sft" in card and "hf vs vLLM" in card
    samples = Path(evaluated["evaluate/dpo-vllm"]["dir"]) / "results" / "lmforge_chat_exact" / "samples.jsonl"
    first = json.loads(samples.read_text().splitlines()[0])
    assert first["arguments"][0][0].startswith("<|im_start|>user\n") and "exact_match" in first["metrics"]


@pytest.mark.slow
def test_the_metric_equals_what_the_lm_eval_command_line_prints(evaluated: dict, tmp_path: Path) -> None:
    run = Path(evaluated["evaluate/sft-hf"]["dir"])
    mine = json.loads((run / "results" / "lmforge_continuation" / "result.json").read_text())
    model = evaluated["evaluate/sft-hf"]["extra"]["model_dir"]
    context = json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"]
    tasks = evaluated["evaluate/tasks"]["dir"]
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={model},dtype=float32,max_length={context - 2}",
            "--device",
            "cpu",
            "--include_path",
            tasks,
            "--tasks",
            "lmforge_continuation",
            "--limit",
            "20",
            "--seed",
            "0,0,0,0",
            "--output_path",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    result = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]["lmforge_continuation"]
    assert (
        result["acc_norm,none"] == mine["results"]["acc_norm,none"]
        and result["acc,none"] == mine["results"]["acc,none"]
    )
    import re

    printed = re.search(r"\|acc_norm\|[^|]*\|\s*([0-9.]+)\|", cli.stdout)  # the table the command line prints
    assert printed and float(printed.group(1)) == pytest.approx(mine["results"]["acc_norm,none"], abs=5e-3), cli.stdout


@pytest.mark.slow
def test_adding_a_task_computes_only_that_task_and_a_rerun_is_all_cache_hits(evaluated: dict, tmp_path: Path) -> None:
    import shutil

    from lmforge.engine.executor import run_pipeline_locally
    from tests.conftest import small_config

    workspace = tmp_path / "ws"
    shutil.copytree(Path(evaluated["evaluate/report"]["dir"]).parents[2], workspace)
    fewer = small_config(
        workspace, "evaluate.tasks=[lmforge_continuation, lmforge_chat_exact]", "evaluate.backends=[hf]"
    )
    first = run_pipeline_locally(fewer, ["evaluate"])  # every task result exists already: nothing is evaluated
    more = small_config(
        workspace,
        "evaluate.tasks=[lmforge_continuation, lmforge_chat_exact, lmforge_preference]",
        "evaluate.backends=[hf]",
    )
    for name in ("lmforge_preference",):  # forget that task's results, as if it were new
        for manifest in (workspace / "evaluate" / "results").glob("*/manifest.json"):
            if json.loads(manifest.read_text())["task"] == name:
                shutil.rmtree(manifest.parent)
    second = run_pipeline_locally(more, ["evaluate"])
    log = Path(second["evaluate/dpo-hf"]["dir"]) / "lmeval_spec_hf.json"
    assert [t["name"] for t in json.loads(log.read_text())["tasks"]] == ["lmforge_preference"]
    assert not (Path(first["evaluate/dpo-hf"]["dir"]) / "lmeval_spec_hf.json").exists()
    again = run_pipeline_locally(more, ["evaluate"])
    assert all(again[n]["timings"]["finished_at"] == second[n]["timings"]["finished_at"] for n in again)


USER_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: "{data}"
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _user_task(folder: Path, name: str, word: str, answer) -> Path:  # type: ignore[no-untyped-def]
    """A three-item two-way choice task in its own folder, as a user writes one; returns its YAML."""
    folder.mkdir()
    items = [
        {"question": f"{a} {word} {b} is", "choices": [str(answer(a, b)), str(answer(a, b) + 3)], "label": 0}
        for a, b in [(1, 2), (2, 5), (4, 4)]
    ]
    (folder / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / "task.yaml").write_text(USER_TASK.format(name=name, data=folder / "items.jsonl"))
    return folder / "task.yaml"


@pytest.mark.slow
def test_editing_a_user_task_reruns_its_evaluation_and_reuses_the_unchanged_tasks(
    evaluated: dict, tmp_path: Path
) -> None:
    """A user task's definition was keyed in `evaluate/tasks`' identity but reached its output only as
    manifest `extra`: after an edit to its YAML, `evaluate/tasks` was rebuilt into the same bytes, so
    its output digest, and with it every metric run's key, stayed the same, and the runs were reused
    with the old task's results. (A built-in task hid it: its rendered YAML holds the output's own
    path, so any new key of `evaluate/tasks` gave new bytes; user tasks alone do not.) Its definition
    is in the output now (`tasks.json`, no paths): the run reruns, lm-eval evaluates only the edited
    task, and the unchanged task's result is reused inside the run."""
    import shutil

    from lmforge.engine.executor import run_pipeline_locally
    from lmforge.engine.explain import explain
    from tests.conftest import small_config

    workspace = tmp_path / "ws"
    shutil.copytree(Path(evaluated["evaluate/report"]["dir"]).parents[2], workspace)
    sums = _user_task(tmp_path / "sums", "lmforge_test_sums", "plus", lambda a, b: a + b)
    products = _user_task(tmp_path / "products", "lmforge_test_products", "times", lambda a, b: a * b)

    def config_with(task: Path):  # type: ignore[no-untyped-def]
        tasks = f"evaluate.tasks=[{task}, {products}]"
        return small_config(workspace, tasks, "evaluate.models=[dpo]", "evaluate.backends=[hf]")

    run = "evaluate/dpo-hf"

    def evaluated_tasks(manifests: dict) -> list[str]:
        """The tasks lm-eval was asked to evaluate for this output of the metric run (not those reused)."""
        spec = Path(manifests[run]["dir"]) / "lmeval_spec_hf.json"
        return [t["name"] for t in json.loads(spec.read_text())["tasks"]]

    first = run_pipeline_locally(config_with(sums), ["evaluate"])
    assert evaluated_tasks(first) == ["lmforge_test_sums", "lmforge_test_products"]
    # a second metric, as a user edits a task: another task, whose results must be computed anew
    metric = "metric_list:\n  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    sums.write_text(sums.read_text().replace("metric_list:\n", metric))
    plans = {e.step: e for e in explain(config_with(sums), ["evaluate"])}
    assert not plans["evaluate/tasks"].reuse and any("task_files" in r for r in plans["evaluate/tasks"].reasons)
    second = run_pipeline_locally(config_with(sums), ["evaluate"])
    assert second[run]["key"] != first[run]["key"], "the metric run was reused with the old task definition"
    assert second["evaluate/tasks"]["digest"] != first["evaluate/tasks"]["digest"]
    assert evaluated_tasks(second) == ["lmforge_test_sums"]  # the edited task only: the other one's result reused
    result = json.loads((Path(second[run]["dir"]) / "results" / "lmforge_test_sums" / "result.json").read_text())
    assert result["metrics"] == ["acc", "acc_norm"]  # the edited definition is what ran
    kept = Path("results") / "lmforge_test_products" / "samples.jsonl"
    assert (Path(second[run]["dir"]) / kept).read_bytes() == (Path(first[run]["dir"]) / kept).read_bytes()
    listed = (Path(second["evaluate/tasks"]["dir"]) / "tasks.json").read_text()
    assert "lmforge_test_sums" in listed and str(tmp_path) not in listed
    # the same task folder elsewhere: `evaluate/tasks` is keyed by the path it is given, but makes the same
    # bytes, so nothing downstream reruns
    moved = tmp_path / "elsewhere"
    shutil.copytree(sums.parent, moved)
    third = run_pipeline_locally(config_with(moved / sums.name), ["evaluate"])
    assert third["evaluate/tasks"]["key"] != second["evaluate/tasks"]["key"]
    assert third["evaluate/tasks"]["digest"] == second["evaluate/tasks"]["digest"]
    downstream = [n for n in third if n.startswith("evaluate/") and n not in ("evaluate/tasks",)]
    assert all(third[n]["timings"]["finished_at"] == second[n]["timings"]["finished_at"] for n in downstream)


@pytest.mark.slow
def test_the_contamination_gate_fails_naming_the_task_and_the_source(evaluated: dict, tmp_path: Path) -> None:
    import shutil

    from evaluation.steps import ContaminationGateFailed
    from lmforge.engine.executor import run_pipeline_locally
    from lmforge.errors import is_retryable
    from tests.conftest import small_config

    workspace = tmp_path / "ws"
    shutil.copytree(Path(evaluated["evaluate/report"]["dir"]).parents[2], workspace)
    strict = small_config(
        workspace, "evaluate.contamination.action=fail", "evaluate.contamination.max_fraction={lmforge_humaneval: 0.0}"
    )
    with pytest.raises(
        ContaminationGateFailed,
        match=r"lmforge_humaneval has \d+\.\d% of its items in training data "
        r"\(limit 0\.0%\), most from documents",
    ) as info:
        run_pipeline_locally(strict, ["evaluate"])
    assert not is_retryable(info.value)
    records = [
        json.loads(line)
        for line in (workspace / "evaluate" / "contamination")
        .glob("*/contamination.jsonl")
        .__next__()
        .read_text()
        .splitlines()
    ]
    planted = [r for r in records if r["task"] == "lmforge_humaneval" and r["contaminated"]]
    assert planted and all(r["doc_id"].startswith("HumanEval/") and r["train_doc_id"] and r["span"] for r in planted)


def test_decontamination_index_finds_exact_and_edited_copies_of_items() -> None:
    from data_prep.decontaminate import ItemIndex, load_items, shard_attributes

    rng = random.Random(1)
    items = load_items(["lmforge_humaneval"])
    index = ItemIndex.build(items, Rule())
    exact, edited = items[3][2], _edit(items[7][2], 0.05, rng)
    unrelated = "def add(a, b):\n    return a + b\n" * 5
    columns = shard_attributes(index, [f"header\n{exact}\nfooter", edited, unrelated, "short text"])
    assert columns["decontaminated"] == [True, True, False, False]
    assert columns["eval_item"][:2] == [f"lmforge_humaneval:{items[3][1]}", f"lmforge_humaneval:{items[7][1]}"]
    assert columns["eval_overlap"][0] == 1.0 and columns["eval_path"][:2] == ["exact", columns["eval_path"][1]]
    assert columns["eval_similarity"][1] >= 0.8 and columns["eval_path"][2:] == [None, None]


def _run_steps(config, targets: list[str]) -> dict:
    """Execute `targets` and every step they read from (cache hits where outputs exist), nothing else."""
    from lmforge.engine.executor import execute_step, graph, make_pool, pool_unit_runner
    from lmforge.engine.store import StageStore

    wanted = set(targets)
    for step in reversed(graph().steps):
        if step.name in wanted:
            wanted.update(graph().upstream(step, config))
    store, manifests = StageStore(config.workspace), {}
    with make_pool(1) as pool:
        for step in graph().steps:
            if step.name in wanted and step.enabled(config):
                manifests[step.name], _ = execute_step(step, config, store, manifests, pool_unit_runner(pool, store))
    return manifests


@pytest.mark.slow
def test_decontaminated_curation_makes_the_next_contamination_report_clean(evaluated: dict, tmp_path: Path) -> None:
    import shutil

    import pyarrow.parquet as pq

    from tests.conftest import small_config

    workspace = tmp_path / "ws"
    shutil.copytree(Path(evaluated["evaluate/report"]["dir"]).parents[2], workspace)
    before = json.loads((Path(evaluated["evaluate/contamination"]["dir"]) / "summary.json").read_text())
    assert next(s for s in before if s["task"] == "lmforge_humaneval")["contaminated"] > 0  # the demo's planted copies
    config = small_config(workspace, "curate.decontaminate.tasks=[lmforge_humaneval]")
    manifests = _run_steps(config, ["evaluate/contamination"])
    select = manifests["curate/select"]
    removed = pq.read_table(Path(select["dir"]) / "removed").to_pylist()
    planted = [
        json.loads(line)
        for line in next(workspace.glob("curate/ingest/*/sources/demo/labels.jsonl")).read_text().splitlines()
    ]
    planted_ids = {p["id"] for p in planted if p["kind"] == "contamination"}
    dropped = {r["id"] for r in removed if r["reason"] == "decontaminated"}
    assert planted_ids and planted_ids <= dropped, planted_ids - dropped
    assert select["counts"]["removed"]["decontaminated"] == len(dropped)
    counts = select["counts"]
    assert counts["input"] == counts["kept"] + counts["removed_total"] + counts["quarantined"]
    after = json.loads((Path(manifests["evaluate/contamination"]["dir"]) / "summary.json").read_text())
    assert next(s for s in after if s["task"] == "lmforge_humaneval")["contaminated"] == 0


@pytest.mark.slow
def test_explain_and_the_card_name_the_rule_that_flagged_each_item(evaluated: dict) -> None:
    from lmforge.engine.explain import explain
    from tests.conftest import small_config

    workspace = Path(evaluated["evaluate/report"]["dir"]).parents[2]
    check = next(e for e in explain(small_config(workspace), ["evaluate"]) if e.step == "evaluate/contamination")
    rule = Rule().describe()
    assert check.reuse and f"rule: {rule}" in check.reasons, check.reasons
    humaneval = next(line for line in check.reasons if line.startswith("lmforge_humaneval:"))
    assert "items flagged (" in humaneval and " by exact" in humaneval  # the demo's verbatim planted copies
    card = (Path(evaluated["evaluate/report"]["dir"]) / "comparison.md").read_text()
    assert rule in card and "### Flagged items" in card
    records = [
        json.loads(line)
        for line in (Path(evaluated["evaluate/contamination"]["dir"]) / "contamination.jsonl").read_text().splitlines()
    ]
    flagged = [r for r in records if r["contaminated"]]
    assert flagged and all(r["rule"] == rule and f"| {r['doc_id']} | {r['path']} |" in card for r in flagged)


def test_a_killed_lmeval_run_leaves_nothing_that_passes_for_done(tmp_path: Path) -> None:
    """A truncated result.json (lm-eval killed mid-write before results were atomic) is removed, not finished."""
    from evaluation.runs import keep_finished
    from lmforge.engine.store import StageStore

    store = StageStore(tmp_path)
    good, truncated, no_samples = (tmp_path / n for n in ("good", "truncated", "no-samples"))
    for directory in (good, truncated, no_samples):
        directory.mkdir()
    (good / "samples.jsonl").write_text('{"id": 0}\n')
    (good / "result.json").write_text(json.dumps({"task": "t", "results": {"acc,none": 0.5}}))
    (truncated / "samples.jsonl").write_text('{"id": 0}\n')
    (truncated / "result.json").write_text('{"task": "t", "results": {"acc,n')
    (no_samples / "result.json").write_text(json.dumps({"task": "t", "results": {"acc,none": 0.5}}))
    keep_finished({"good": good, "truncated": truncated, "no-samples": no_samples}, store)
    assert store.read_manifest(good) is not None
    assert not truncated.exists() and not no_samples.exists()


def test_a_user_task_is_keyed_by_its_whole_folder_not_where_it_lives(tmp_path: Path) -> None:
    """lm-eval reads the YAML's folder (`!function utils.x`, included YAMLs, data): before, only the YAML counted."""
    import shutil

    from evaluation.steps import _task_files
    from tests.conftest import small_config

    folder = tmp_path / "mytask"
    folder.mkdir()
    (folder / "task.yaml").write_text("task: mytask\nprocess_results: !function utils.score\n")
    (folder / "utils.py").write_text("def score(doc, results):\n    return {'acc': 1.0}\n")

    def key(path: Path) -> str:
        return _task_files(small_config(tmp_path / "ws", f"evaluate.tasks=[{path}]"))["task_files"][str(path)]

    first = key(folder / "task.yaml")
    (folder / "utils.py").write_text("def score(doc, results):\n    return {'acc': 0.0}\n")
    edited = key(folder / "task.yaml")
    assert edited != first  # the scoring function changed: another task
    shutil.copytree(folder, tmp_path / "elsewhere")
    assert key(tmp_path / "elsewhere" / "task.yaml") == edited  # same content elsewhere: the same task


def test_a_registry_task_is_keyed_by_its_definition_and_dataset() -> None:
    from evaluation.steps import registry_identity

    identity = registry_identity(["hellaswag"])["hellaswag"]
    assert identity["dataset"] == "Rowan/hellaswag" and len(identity["definition"]) == 32
    with pytest.raises(ConfigError, match="not-a-task"):
        registry_identity(["not-a-task"])


def test_model_code_runs_only_in_the_sandbox_unless_a_task_is_named(tmp_path: Path) -> None:
    """Before: confirm_run_unsafe_code=True for every task, so a stock humaneval would have run model code in
    the evaluation process itself. lm-eval refuses an unsafe task unless told: lmforge tells it only for
    its own sandboxed task, or for a task `evaluate.allow_unsafe_code` names."""
    import lm_eval
    import lm_eval.models  # noqa: F401 - the stock models (dummy), whatever another test registered before
    from lm_eval.tasks import TaskManager

    from evaluation.build import build
    from evaluation.runs import unsafe_code_allowed

    built = build(tmp_path, ["lmforge_humaneval"], {}, {})
    assert unsafe_code_allowed("lmforge_humaneval", built["lmforge_humaneval"], [])
    stock = {"include_path": None, "builtin": False}
    assert not unsafe_code_allowed("humaneval", stock, []) and not unsafe_code_allowed("mbpp", stock, ["humaneval"])
    assert unsafe_code_allowed("humaneval", stock, ["humaneval"])
    with pytest.raises(ValueError, match="unsafe"):  # what a stock humaneval meets when not named
        lm_eval.simple_evaluate(
            model="dummy",
            tasks=["lmforge_humaneval"],
            limit=1,
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            confirm_run_unsafe_code=False,
        )


def test_the_backends_field_accepts_exactly_the_registered_backends() -> None:
    from typing import get_args

    from evaluation.backends import BACKENDS, REFERENCE, SERVED, BackendName

    assert set(get_args(BackendName)) == set(BACKENDS)
    assert REFERENCE != SERVED and {REFERENCE, SERVED} <= set(BACKENDS)
