"""Shared fixtures: small configs, one curated workspace per session, one Prefect test server."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.s3server import s3, s3_endpoint  # noqa: F401 - fixtures: a real S3 server on 127.0.0.1 (test_remote_workspace)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A demo corpus small enough to curate in seconds, still with every kind of noise.
SMALL_CURATE = [
    "curate.demo.max_stdlib_files=25",
    "curate.demo.max_pypi_docs=60",
    "curate.demo.num_exact_duplicates=30",
    "curate.demo.num_near_duplicates=48",
    "curate.demo.num_boilerplate=16",
    "curate.demo.num_spam=16",
    "curate.demo.num_encoding_junk=10",
    "curate.demo.num_short=10",
    "curate.demo.num_long=1",
    "curate.demo.num_pii_docs=10",
    "curate.demo.num_contaminated=6",
    "curate.docs_per_shard=300",
    "curate.tokenizer.vocab_size=1024",
    "curate.pack.val_fraction=0.1",
    # the shared lineage keeps the planted HumanEval copies, so the gate's tests have something to flag
    "curate.decontaminate.tasks=[]",
    # and the data it trained on before paragraph dedup and the grouped split (their own tests in
    # test_curation_pipeline.py and test_dedup.py): on this data FSDP2's loss left DeepSpeed's behind
    # (val drop 0.07 against 0.35 nats), an open question for FSDP2, not for curation
    "curate.paragraph_dedup.enabled=false",
    "curate.pack.split_by=id",
]
# A model that trains in seconds on 2 CPU ranks (head dim 32 and widths in multiples of 32: what vLLM serves on CPU).
SMALL_PRETRAIN = [
    "pretrain.model.hidden_size=64",
    "pretrain.model.intermediate_size=192",
    "pretrain.model.num_layers=2",
    "pretrain.model.num_heads=2",
    "pretrain.model.num_kv_heads=1",
    "pretrain.seq_len=64",
    "pretrain.global_batch_size=8",
    "pretrain.distributed.micro_batch_size=4",
    "pretrain.max_steps=160",
    "pretrain.optim.warmup_steps=5",
    "pretrain.optim.lr=1e-2",
    "pretrain.checkpoint.every_steps=20",
    "pretrain.eval_every=40",
    "pretrain.eval_batches=4",
    "pretrain.log_every=20",
]


# Alignment that finishes in seconds on the small model (the CLI test runs tiny-cpu's real settings).
SMALL_ALIGN = [
    "align.builtin.per_skill=60",
    "align.builtin.dialogue_conversations=30",
    # 120 steps: at 40 the model had not learnt to end a turn on some CPUs (it answered the smoke
    # prompt with 24 x "B" on an AMD EPYC host, so the served model was rightly not promoted)
    "align.sft.max_steps=120",
    "align.sft.save_steps=10",
    "align.sft.eval_every=20",
    "align.dpo.max_steps=20",
    "align.dpo.save_steps=10",
    "align.dpo.eval_every=10",
    "align.eval_generations=40",
]

# The RL road on the small model: a reward model and a few GRPO steps (mechanics; the tiny-cpu-rl
# preset is where GRPO's gain is measured).
SMALL_RL = [
    "align.recipe=[sft, dpo, reward, rl]",
    "align.reward.max_steps=150",
    "align.reward.lr=1e-3",
    "align.reward.global_batch_size=16",
    "align.reward.micro_batch_size=8",
    "align.reward.save_steps=50",
    "align.rl.rewards=[{kind: verifier}, {kind: reward_model, weight: 0.5}]",
    "align.rl.max_steps=20",
    "align.rl.lr=1e-4",
    "align.rl.save_steps=10",
    "align.rl.eval_every=10",
    "align.rl.global_batch_size=32",
    "align.rl.micro_batch_size=16",
    "align.rl.num_generations=8",
    "align.rl.max_completion_length=16",
    "align.rl.heldout_prompts=24",
    # DAPO-style prompt filtering over both ranks; a retried attempt reads the kept prompts back
    "align.rl.prompt_filter.samples=4",
    "align.rl.prompt_filter.pool=96",
]

# Evaluation on few items (the metric runs; contamination still checks every item).
SMALL_EVAL = [
    "evaluate.builtin.continuation_items=40",
    "evaluate.builtin.ppl_docs=8",
    "evaluate.builtin.ppl_max_chars=1500",
    "evaluate.limit={lmforge_continuation: 20, lmforge_chat_exact: 20, lmforge_preference: 20, lmforge_humaneval: 3}",
    "evaluate.bootstrap_iters=100",
    "evaluate.contamination.action=annotate",  # the planted HumanEval copies are flagged, not fatal (see above)
    # vLLM checked against hf on the model that ships (one temporary server, not three); every model on hf
    "evaluate.backend_models={vllm: [dpo]}",
    # the judged steps have tests of their own (test_judge*.py, test_safety_gate.py): the shared lineage skips them
    "evaluate.judge.enabled=false",
    "evaluate.safety.enabled=false",
]


# Quantization of the small model: groups of 32 (its width is 64), few short calibration samples.
SMALL_QUANT = [
    "quantize.group_size=32",
    "quantize.calibration.num_samples=16",
    "quantize.calibration.max_seq_len=64",
    "quantize.schemes=[w8a8-int8,w4a16,w4a16-awq,w8a8-fp8]",  # GPTQ beside AWQ, INT8 beside FP8
]
# Serving it: its context is 64 tokens, so short answers and SLO requests.
SMALL_SERVE = ["serve.smoke_max_tokens=24", "serve.slo.max_tokens=8", "serve.slo.concurrency=[1, 4]"]


def small_config(workspace: Path, *extra: str):
    from lmforge.config import load_config

    return load_config(
        "tiny-cpu",
        [*SMALL_CURATE, *SMALL_PRETRAIN, *SMALL_ALIGN, *SMALL_EVAL, *SMALL_QUANT, *SMALL_SERVE, *extra],
        str(workspace),
    )


def _lineage_root(factory: pytest.TempPathFactory) -> Path:
    """Where the shared lineage lives: under pytest-xdist, the folder every worker's base temp is in
    (one per test run), so each stage of the lineage is built once per run, not once per worker."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "lineage"
    root.mkdir(exist_ok=True)
    return root


def _shared_stage(
    factory: pytest.TempPathFactory, name: str, source: Path | None, stages: list[str], *extra: str
) -> dict:
    """The lineage's stage `name` in `_lineage_root(factory) / name`: a copy of `source` (the previous
    stage's workspace) run through `stages`, built by whichever worker asks first while the others wait
    on its lock and then read what it returned. A build that failed fails the other workers' tests at
    once with its error."""
    import fcntl

    from lmforge.engine.executor import run_pipeline_locally

    root = _lineage_root(factory)
    workspace, done, failed = root / name, root / f"{name}.json", root / f"{name}.failed"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return json.loads(done.read_text())
        if failed.exists():
            pytest.fail(f"building the shared lineage's {name!r} failed on another worker: {failed.read_text()}")
        shutil.rmtree(workspace, ignore_errors=True)  # what a worker that died mid-build left
        try:
            if source is not None:
                shutil.copytree(source, workspace)
            result = run_pipeline_locally(small_config(workspace, *extra), stages)
        except BaseException as error:
            failed.write_text(f"{type(error).__name__}: {error}"[:2000])
            raise
        done.write_text(json.dumps(result))
        return result


@pytest.fixture(scope="session")
def curated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A workspace with the small demo corpus curated once per test run (no Prefect); read-only."""
    manifests = _shared_stage(tmp_path_factory, "curated", None, ["curate"])
    return Path(manifests["curate/pack"]["dir"]).parents[2], manifests


@pytest.fixture
def curated_copy(curated: tuple[Path, dict], tmp_path: Path) -> Path:
    """A private copy of the curated workspace that a test may modify."""
    target = tmp_path / "ws"
    shutil.copytree(curated[0], target, symlinks=True)
    return target


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect API for every test that runs flows or tasks."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def trained(curated: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted 2-rank pretraining run of the small model (also the reference for resume tests)."""
    return _shared_stage(tmp_path_factory, "trained", curated[0], ["pretrain"])["pretrain/train"]


@pytest.fixture(scope="session")
def aligned(trained: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """SFT and DPO of the small pretrained model on 2 ranks, once per test run (the reference for resume tests)."""
    return _shared_stage(tmp_path_factory, "aligned", Path(trained["dir"]).parents[2], ["align"])


@pytest.fixture(scope="session")
def rl_aligned(aligned: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The small lineage's RL road (reward model, then GRPO from DPO) on 2 ranks, once per test run."""
    return _shared_stage(tmp_path_factory, "rl", Path(aligned["align/sft"]["dir"]).parents[2], ["align"], *SMALL_RL)


@pytest.fixture(scope="session")
def evaluated(aligned: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The small lineage evaluated (every model on hf, the shipped one on vLLM too), once per test run."""
    return _shared_stage(tmp_path_factory, "evaluated", Path(aligned["align/sft"]["dir"]).parents[2], ["evaluate"])


@pytest.fixture(scope="session")
def quantized(evaluated: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both schemes of the small DPO model, calibrated (llmcompressor) and gated on vLLM, once per test run."""
    source = Path(evaluated["evaluate/report"]["dir"]).parents[2]
    return _shared_stage(tmp_path_factory, "quantized", source, ["quantize"])


# -- tiers and scheduling --------------------------------------------------------------------------
# Every test gets one tier marker (docs/contributing.md): `unit` (in-process, no server, no
# subprocess, no workspace fixture: `pytest -m unit` is the check before every commit),
# `component` (starts a real component: Prefect, training ranks, vLLM, an S3 server, a subprocess),
# `e2e` (the trained lineage or a whole pipeline). Each test file names its tier here, so a new file
# has to choose (tests/test_layout.py checks that every file is in exactly one set); a test of a
# `unit` file that uses a workspace or server fixture is `component` whatever its file says.
UNIT_FILES = frozenset(
    {
        "test_config.py",
        "test_dedup.py",
        "test_executor_logs.py",
        "test_heuristics.py",
        "test_hf_loading.py",
        "test_ingest.py",
        "test_judge.py",
        "test_judge_injection.py",
        "test_langid_quality_pii.py",
        "test_layout.py",
        "test_lineage_graph.py",
        "test_refusal_detector.py",
        "test_rope.py",
        "test_runtime_files_identity.py",
        "test_safety_labels.py",
        "test_store.py",
        "test_tokenizer_pack_reader.py",
        "test_toxicity_windows.py",
        "test_training_units.py",
    }
)
E2E_FILES = frozenset(
    {
        "test_adapters.py",
        "test_align_plugin.py",
        "test_base_model.py",
        "test_cli_end_to_end.py",
        "test_orchestration.py",
        "test_remote_workspace.py",
    }
)
# the session fixtures of the shared trained lineage: a test using one is `e2e`. Under pytest-xdist
# (`--dist loadgroup`, scripts/test.sh) every such test runs on one worker (the group "lineage",
# `group_of` below), and every other test with the rest of its file (a module fixture, a file's Prefect
# server or S3 bucket, is built once): the files are spread over the workers. Each stage is built once
# per run in a folder every worker reads (`_shared_stage` above: `curated` serves every worker). Files
# spread by recorded seconds with the lineage's tests as files too were not faster on a fresh clone
# (tests 42:46, 4,135 CPU-s, against 38:56 and 3,919 for this order; other changes ran in between).
LINEAGE_FIXTURES = frozenset({"trained", "aligned", "rl_aligned", "evaluated", "quantized"})
COMPONENT_FIXTURES = frozenset({"curated", "curated_copy", "prefect_server", "s3", "s3_endpoint"})
TIERS = ("unit", "component", "e2e")


def tier_of(item: pytest.Item) -> str:
    used = set(getattr(item, "fixturenames", ()))
    name = item.path.name
    if used & LINEAGE_FIXTURES or name in E2E_FILES:
        return "e2e"
    if name in UNIT_FILES and not used & COMPONENT_FIXTURES:
        return "unit"
    return "component"


# The longest files outside the lineage, by their seconds on a fresh clone (2026-11-29, `2d52b09`): queued
# longest first on the worker the lineage leaves free. By test count, test_adapters.py (4 tests, 11 minutes,
# all CPU) came after test_orchestration.py, whose killed-stage test waits a minute on Prefect, while the
# lineage's worker ran the CLI's load tests: the cores were 72-85% busy for 4 minutes (the timeline below).
LONG_FILES = {
    "test_adapters.py": 676.0,
    "test_moe.py": 300.0,  # 2026-12-01: 346 s in CI at 83ea38a, before its bases trained 60 SFT steps, not 120
    "test_base_model.py": 441.0,
    "test_orchestration.py": 328.0,
    "test_remote_workspace.py": 324.0,
}


# Where each pytest-xdist worker writes the group of every test it collected, for the controller's
# scheduler (`pytest_xdist_make_scheduler` below). pytest-xdist 3.8's own `--dist loadgroup` renames
# node ids through `item._nodeid`, which pytest 9 no longer reads: its groups are silently ignored.
GROUPS_ENV = "LMFORGE_XDIST_GROUPS"


def group_of(item: pytest.Item) -> str:
    lineage = set(getattr(item, "fixturenames", ())) & LINEAGE_FIXTURES
    return "lineage" if lineage else item.nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    import tempfile

    if not os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "numprocesses", None):
        os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="lmforge-xdist-groups-")  # the workers inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = os.environ.get(GROUPS_ENV)
    if folder and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # the tier markers are there before `-m` deselects by them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
    worker, folder = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(GROUPS_ENV)
    if worker and folder:
        groups = {item.nodeid: [group_of(item), tier_of(item)] for item in items}
        (Path(folder) / f"{worker}.json.tmp").write_text(json.dumps(groups))
        (Path(folder) / f"{worker}.json.tmp").rename(Path(folder) / f"{worker}.json")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # type: ignore[no-untyped-def]
    """`--dist loadgroup` with the groups above: the lineage's tests on one worker, every other file whole."""
    if config.getvalue("dist") != "loadgroup" or not os.environ.get(GROUPS_ENV):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):  # type: ignore[misc]
        groups: dict[str, list[str]] | None = None

        def _group(self, nodeid: str) -> list[str]:
            if self.groups is None:  # every worker has collected (and written its file) before scheduling starts
                self.groups = {}
                for path in sorted(Path(os.environ[GROUPS_ENV]).glob("*.json")):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid, [nodeid.split("::", 1)[0], "component"])

        def _split_scope(self, nodeid: str) -> str:
            return self._group(nodeid)[0]

        def schedule(self) -> None:
            """xdist's, with the groups queued longest first (the lineage's, then whole-pipeline files,
            then those that start a component, then unit tests; by test count within each): xdist
            orders them by test count alone, which started a 2-test 9-minute file last while the
            other worker had nothing left."""
            if self.collection is not None or not self.collection_is_completed:
                return super().schedule()
            reorder = self.config.option.loadscopereorder
            self.config.option.loadscopereorder = False
            self._assign_work_unit = lambda node: None  # the first assignment waits for the order below
            try:
                super().schedule()
            finally:
                self.config.option.loadscopereorder = reorder
                del self._assign_work_unit
            if not self.collection:
                return
            rank = {"e2e": 1, "component": 2, "unit": 3}

            def weight(scope: str, nodeids: dict) -> tuple[int, float, int]:
                first = 0 if scope == "lineage" else min(rank[self._group(n)[1]] for n in nodeids)
                return (first, -LONG_FILES.get(Path(scope).name, 0.0), -len(nodeids))

            ordered = sorted(self.workqueue.items(), key=lambda kv: weight(*kv))
            self.workqueue.clear()
            self.workqueue.update(ordered)
            for node in self.nodes:
                self._assign_work_unit(node)

    return ByGroup(config, log)


def _cpu_seconds() -> float:
    """CPU time of this process and of every process it (or they) started and waited for."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_CPU_AT = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    """Each phase's report carries the CPU seconds it used (`cpu_s`): on 2 cores CPU, not wall time,
    is what two workers share, so the summary's CPU column is what a change has to bring down. A
    server a test leaves running is counted when it is waited for, by the test that stops it."""
    outcome = yield
    report = outcome.get_result()
    start = item.stash.get(_CPU_AT, None)
    now = _cpu_seconds()
    if start is not None:
        report.user_properties.append(("cpu_s", round(now - start, 3)))
    item.stash[_CPU_AT] = now


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT] = _cpu_seconds()


class _CpuSampler:
    """The machine's busy share (both cores, from /proc/stat) every few seconds while the tests run, read
    by the controller: the timeline below shows when the two workers left the cores idle."""

    def __init__(self, every: float = 5.0) -> None:
        import threading

        self.samples: list[tuple[float, float]] = []  # (time, busy share 0..1 since the sample before)
        self._stop = threading.Event()
        self._every = every
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _read() -> tuple[float, float]:
        fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    def _run(self) -> None:
        import time

        total, idle = self._read()
        while not self._stop.wait(self._every):
            now_total, now_idle = self._read()
            if now_total > total:
                self.samples.append((time.time(), 1.0 - (now_idle - idle) / (now_total - total)))
            total, idle = now_total, now_idle

    def busy(self, start: float, stop: float) -> float | None:
        inside = [b for t, b in self.samples if start < t <= stop + self._every / 2]
        return sum(inside) / len(inside) if inside else None

    def close(self) -> None:
        self._stop.set()


_SAMPLER = pytest.StashKey[_CpuSampler]()


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") and Path("/proc/stat").exists():
        session.config.stash[_SAMPLER] = _CpuSampler()


def _timeline(terminalreporter, window: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    """Per two minutes of the run: how busy the cores were, and the file each worker spent most of the
    window on (with its test phases' CPU per second of it): a stretch of idle cores names what waited."""
    sampler = terminalreporter.config.stash.get(_SAMPLER, None)
    phases = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            node, start, stop = (
                getattr(report, "node", None),
                getattr(report, "start", None),
                getattr(report, "stop", None),
            )
            if getattr(report, "when", None) in ("setup", "call", "teardown") and node is not None and start:
                cpu = float(dict(getattr(report, "user_properties", ())).get("cpu_s", 0.0))
                phases.append((node.gateway.id, start, stop, cpu, report.nodeid.split("::", 1)[0]))
    if sampler is not None:
        sampler.close()
    if not phases:
        return
    begin, end = min(p[1] for p in phases), max(p[2] for p in phases)
    workers = sorted({p[0] for p in phases})
    terminalreporter.write_sep("=", "timeline: cores busy, and each worker's main file (its CPU per second)")
    t = begin
    while t < end:
        cells = []
        for worker in workers:
            by_file: dict[str, list[float]] = {}
            for w, start, stop, cpu, path in phases:
                overlap = min(stop, t + window) - max(start, t)
                if w == worker and overlap > 0:
                    row = by_file.setdefault(path, [0.0, 0.0])
                    row[0] += overlap
                    row[1] += cpu * overlap / max(stop - start, 1e-6)
            if by_file:
                path, (wall, cpu) = max(by_file.items(), key=lambda kv: kv[1][0])
                cells.append(f"{worker} {Path(path).name} {cpu / wall:.1f}")
            else:
                cells.append(f"{worker} -")
        busy = sampler.busy(t, t + window) if sampler is not None else None
        share = f"{100 * busy:3.0f}%" if busy is not None else "  ?"
        terminalreporter.write_line(f"{(t - begin) / 60:5.0f} min {share}  " + "  |  ".join(cells))
        t += window


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    """Seconds per test file (setup, call and teardown together), wall and CPU, and per tier, so the
    next slow file shows in CI's log where it happens (`--durations` beside it lists the slowest tests)."""
    files: dict[str, list[float]] = {}
    tiers: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            path = report.nodeid.split("::", 1)[0]
            cpu = dict(getattr(report, "user_properties", ())).get("cpu_s", 0.0)
            row = files.setdefault(path, [0.0, 0.0])
            row[0] += report.duration
            row[1] += float(cpu)
            tier = next((k for k in TIERS if k in getattr(report, "keywords", {})), "?")
            tiers[tier] = tiers.get(tier, 0.0) + report.duration
    if not files:
        return
    terminalreporter.write_sep("=", "seconds per test file (setup + call + teardown): wall, CPU")
    for path, (seconds, cpu) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{seconds:8.1f}s {cpu:8.1f}s  {path}")
    terminalreporter.write_line(
        f"{sum(r[0] for r in files.values()):8.1f}s {sum(r[1] for r in files.values()):8.1f}s  in all; "
        "by tier (wall): " + ", ".join(f"{k} {v:.0f}s" for k, v in sorted(tiers.items(), key=lambda kv: -kv[1]))
    )
    _timeline(terminalreporter)
