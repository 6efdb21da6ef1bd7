"""Which config fields change which step's cache key (and which change none).

Each row sets one field and lists exactly the steps whose own identity changes. Steps
downstream of those change too, through their upstream digests, but only if the upstream
output bytes change: that is content addressing, tested in test_curation_pipeline.py.
"""

from __future__ import annotations

import functools

import pytest

from lmforge.config import load_config
from lmforge.engine.executor import graph
from lmforge.hashing import digest

ALL_STEPS = [
    "curate/ingest",
    "curate/minhash",
    "curate/paragraphs",
    "curate/langid",
    "curate/heuristics",
    "curate/quality-model",
    "curate/quality",
    "curate/decontaminate",
    "curate/select",
    "curate/tokenizer",
    "curate/split",
    "curate/pack",
    "pretrain/train",
    "align/data",
    "align/sft",
    "align/dpo",
    "evaluate/tasks",
    "evaluate/index-documents",
    "evaluate/index-chat",
    "evaluate/index-preference",
    "evaluate/contamination",
    "evaluate/pretrained-hf",
    "evaluate/pretrained-vllm",
    "evaluate/sft-hf",
    "evaluate/sft-vllm",
    "evaluate/dpo-hf",
    "evaluate/dpo-vllm",
    "evaluate/report",
    "quantize/calibration",
    "quantize/w8a8-int8",
    "quantize/w4a16",
    "quantize/w4a16-awq",
    "quantize/w8a16",
    "quantize/w8a8-fp8",
    "quantize/gate",
    "serve/release",
]
EVAL_RUNS = {f"evaluate/{m}-{b}" for m in ("pretrained", "sft", "dpo") for b in ("hf", "vllm")}
CALIBRATED = {"quantize/w8a8-int8", "quantize/w4a16", "quantize/w4a16-awq", "quantize/w8a16"}
QUANT = CALIBRATED | {"quantize/w8a8-fp8"}  # FP8's scales are each channel's maximum: no calibration
INDEXES = {"evaluate/index-documents", "evaluate/index-chat", "evaluate/index-preference"}


def identities(overrides: list[str]) -> dict[str, str]:
    config = load_config("tiny-cpu", overrides, "/tmp/lmforge-keys-test")
    return {step.name: digest([step.version, step.identity(config)]) for step in graph().steps}


ROWS = [
    ("curate.demo.seed=8", {"curate/ingest"}),
    ("curate.docs_per_shard=500", {"curate/ingest"}),
    ("curate.normalize.unicode_form=NFKC", {"curate/ingest"}),
    ("curate.near_dedup.ngram=4", {"curate/minhash"}),
    ("curate.near_dedup.bands=16", {"curate/minhash"}),
    ("curate.near_dedup.threshold=0.7", {"curate/select"}),
    ("curate.langid.max_chars=500", {"curate/langid"}),
    ("curate.langid.min_score=0.5", {"curate/select"}),
    ("curate.langid.keep=[en]", {"curate/select"}),
    ("curate.gopher_quality.min_doc_words=30", {"curate/select"}),
    ("curate.gopher_repetition.dup_line_frac=0.5", {"curate/select"}),
    ("curate.fineweb.short_line_length=40", {"curate/heuristics", "curate/select"}),
    ("curate.c4.min_words_per_line=2", {"curate/heuristics", "curate/select"}),
    ("curate.quality_classifier.epochs=5", {"curate/quality-model"}),
    ("curate.quality_classifier.keep_fraction=0.5", {"curate/select"}),
    ("curate.pii.phone=false", {"curate/select"}),
    ("curate.mix.weights={code: 1.0}", {"curate/select"}),
    ("curate.tokenizer.vocab_size=2048", {"curate/tokenizer"}),
    ("curate.paragraph_dedup.min_chars=80", {"curate/select"}),  # a threshold: the paragraph hashes are kept
    ("curate.paragraph_dedup.skip_domains=[]", {"curate/select"}),
    ("curate.pack.val_fraction=0.2", {"curate/split"}),  # pack reads the split, not the fraction
    ("curate.pack.link_min_shared=3", {"curate/split"}),
    ("curate.pack.seed=3", {"curate/split", "curate/pack"}),
    ("pretrain.optim.lr=1e-3", {"pretrain/train"}),
    ("pretrain.max_steps=10", {"pretrain/train"}),
    ("pretrain.global_batch_size=32", {"pretrain/train"}),
    ("pretrain.guardrails.spike_zscore=4", {"pretrain/train"}),
    ("pretrain.checkpoint.every_steps=10", {"pretrain/train"}),
    ("align.builtin.per_skill=10", {"align/data"}),
    ("align.heldout_fraction=0.2", {"align/data"}),
    ("align.sft.lr=1e-4", {"align/sft"}),
    ("align.method=lora", {"align/sft"}),
    ("align.lora.r=8", set()),  # LoRA's shape matters only when a step uses LoRA
    ("align.method=lora;align.lora.r=8", {"align/sft"}),
    ("align.dpo.beta=0.3", {"align/dpo"}),
    ("align.dpo.lora=true", {"align/dpo"}),
    ("align.precision=bf16", {"align/sft", "align/dpo"}),
    ("curate.decontaminate.tasks=[]", {"curate/decontaminate"}),
    ("evaluate.tasks=[lmforge_continuation]", {"evaluate/tasks", "quantize/gate"}),  # the gate runs evaluate.tasks
    ("evaluate.limit={lmforge_continuation: 5}", EVAL_RUNS | {"quantize/gate"}),  # the gate measures the same way
    (  # decontamination applies the same rule (its key; it runs only with curate.decontaminate.tasks)
        "evaluate.contamination.ngram=10",
        INDEXES | {"evaluate/contamination", "curate/decontaminate"},
    ),
    ("evaluate.contamination.max_fraction=0.5", {"evaluate/contamination", "evaluate/report"}),  # the verdict says it
    # a query-time rule: the indexes are kept; decontamination applies the same rule
    ("evaluate.contamination.min_similarity=0.7", {"evaluate/contamination", "curate/decontaminate"}),
    ("evaluate.contamination.min_coverage=0.5", {"evaluate/contamination", "curate/decontaminate"}),
    ("evaluate.contamination.fuzzy_ngram=6", INDEXES | {"evaluate/contamination", "curate/decontaminate"}),
    ("quantize.calibration.num_samples=32", {"quantize/calibration"}),
    ("quantize.calibration.smoothing_strength=0.5", {"quantize/w8a8-int8"}),  # SmoothQuant is W8A8's alone
    ("quantize.group_size=64", {"quantize/w4a16", "quantize/w4a16-awq"}),
    ("quantize.calibration.dampening_frac=0.05", {"quantize/w8a8-int8", "quantize/w4a16", "quantize/w8a16"}),  # GPTQ's
    ("quantize.calibration.enabled=false", CALIBRATED),
    ("quantize.model=sft", QUANT),
    # not a chat model: no chats to calibrate on (calibration's key changes through its upstream: chats drop out)
    ("quantize.model=pretrained", QUANT),
    ("quantize.gate.max_drop=0.1", {"quantize/gate"}),
    ("quantize.gate.choose=fastest;quantize.gate.speed_requests=8", {"quantize/gate"}),  # the rule is the gate's
    ("serve.model=quantized:w8a8-int8", {"serve/release"}),
    ("serve.model=sft", {"serve/release"}),
    ("serve.adapters.enabled=true", {"serve/release"}),
    ("serve.backend=llamacpp", {"serve/release"}),
    ("serve.llamacpp.n_ctx=64", set()),  # a backend not chosen: its section is not read
    # the hf backend reads the served context length too (its windows match what will be served)
    ("serve.engine.max_model_len=128", EVAL_RUNS | {"quantize/gate", "serve/release"}),
    (  # what the KV cache stores changes what the served model computes
        "serve.engine.kv_cache_dtype=fp8",
        EVAL_RUNS - {f"evaluate/{m}-hf" for m in ("pretrained", "sft", "dpo")} | {"quantize/gate", "serve/release"},
    ),
    (
        "serve.engine.dtype=float32",
        EVAL_RUNS - {f"evaluate/{m}-hf" for m in ("pretrained", "sft", "dpo")} | {"quantize/gate", "serve/release"},
    ),
    # how work is run, not what it produces: no key changes
    ("runtime.workers=8", set()),
    ("runtime.verify=size", set()),
    ("workspace=/elsewhere", set()),
    ("curate.near_dedup.batch_docs=64", set()),
    ("curate.semantic_dedup.batch_docs=64", set()),
    ("pretrain.distributed.micro_batch_size=4", set()),
    ("pretrain.distributed.num_ranks=1", set()),
    ("pretrain.distributed.zero_stage=3", set()),
    ("pretrain.distributed.activation_checkpointing=true", set()),
    ("pretrain.checkpoint.keep_last=5", set()),
    ("pretrain.log_every=1", set()),
    ("pretrain.eval_every=5", set()),
    ("pretrain.resume=never", set()),
    ("pretrain.init=scratch", set()),  # without a base model it changes nothing
    ("runtime.log_level=DEBUG", set()),
    ("runtime.on_code_drift=rerun", set()),
    ("runtime.step_timeout_s={pretrain/train: 60}", set()),
    ("pretrain.distributed.launcher=deepspeed", set()),
    ("pretrain.distributed.launcher=torchrun", set()),
    ("pretrain.distributed.hostfile=pyproject.toml", set()),
    # a second node needs a hostfile, and the batch must still split: 4 x 2 ranks x 2 nodes = 16
    (
        "pretrain.distributed.num_nodes=2;pretrain.distributed.hostfile=pyproject.toml;"
        "pretrain.distributed.micro_batch_size=4",
        set(),
    ),
    ("pretrain.distributed.master_port=29999", set()),
    ("pretrain.distributed.offload=optimizer", set()),
    ("pretrain.distributed.memory_headroom=0.5", set()),
    # the engine and its layout: the same model up to reduction order (tests/test_pretrain_fsdp2.py)
    ("pretrain.distributed.backend=fsdp2", set()),
    ("pretrain.distributed.prefer_backend=fsdp2", set()),
    ("pretrain.distributed.backend=fsdp2;pretrain.distributed.sharding=full", set()),
    ("pretrain.distributed.backend=fsdp2;pretrain.distributed.tensor_parallel=2", set()),
    ("pretrain.distributed.tensor_parallel=auto", set()),
    ("pretrain.distributed.backend=fsdp2;pretrain.distributed.pipeline_parallel=2", set()),
    ("pretrain.distributed.pipeline_schedule=gpipe", set()),
    ("pretrain.compile=true", set()),
    ("pretrain.eval_batches=2", set()),
    ("pretrain.peak_tflops=1.0", set()),
    ("pretrain.parity_tolerance=0.01", set()),
    ("pretrain.assumed_mfu=0.3", set()),
    ("align.sft.micro_batch_size=4", set()),
    ("align.dpo.micro_batch_size=2", set()),
    ("align.sft.eval_every=5", set()),
    ("align.dpo.eval_every=5", set()),
    ("align.sft.log_every=5", set()),
    ("align.dpo.log_every=5", set()),
    ("align.distributed.launcher=torchrun", set()),
    ("align.distributed.num_ranks=1", set()),
    ("align.distributed.zero_stage=2", set()),
    ("align.distributed.num_ranks=2;align.distributed.tensor_parallel=2", set()),
    ("align.distributed.master_port=29998", set()),
    ("align.distributed.launcher=deepspeed;align.distributed.hostfile=pyproject.toml", set()),
    (
        "align.distributed.launcher=deepspeed;align.distributed.num_nodes=2;align.distributed.hostfile=pyproject.toml;"
        "align.sft.micro_batch_size=4;align.dpo.micro_batch_size=2",
        set(),
    ),
    ("align.lora.merge_parity_tolerance=0.01", set()),
    # the alignment road: which steps run; RL's start (DPO or SFT) reaches its key as upstream
    ("align.recipe=[sft, dpo, reward, rl]", set()),
    ("align.reward.micro_batch_size=4", set()),
    ("align.reward.eval_every=5", set()),
    ("align.reward.log_every=5", set()),
    ("align.rl.micro_batch_size=4", set()),
    ("align.rl.eval_every=5", set()),
    ("align.rl.log_every=5", set()),
    ("align.rl.use_vllm=true", set()),
    ("align.rl.stop_on_hacking=true", set()),
    ("align.rl.heldout_prompts=8", set()),
    ("align.rl.hacking.min_reward_gain=0.2", set()),
    ("align.rl.hacking.max_accuracy_drop=0.1", set()),
    ("align.rl.hacking.max_loss_rise=0.2", set()),
    # the draft model for speculative decoding: whether it is distilled is which steps run
    ("align.draft.enabled=true", set()),
    ("align.draft.micro_batch_size=4", set()),
    ("align.draft.eval_every=5", set()),
    ("align.draft.log_every=5", set()),
    ("align.draft.heldout_chats=50", set()),
    ("align.eval_generations=10", set()),
    ("align.distributed.node_launcher=slurm", set()),
    ("align.distributed.backend=fsdp2", set()),
    ("pretrain.distributed.node_launcher=slurm", set()),
    # which steps run, and how evaluation talks to its backends
    ("evaluate.models=[dpo]", set()),
    ("evaluate.backends=[hf]", set()),
    ("evaluate.backend_models={vllm: [dpo]}", set()),
    ("evaluate.batch_size=2", set()),
    ("evaluate.num_concurrent=1", set()),
    # how the judge is reached, not what it is asked: no key changes
    ("evaluate.judge.concurrency=1", set()),
    ("evaluate.judge.retries=0", set()),
    ("evaluate.judge.backoff_s=5", set()),
    ("evaluate.judge.timeout_s=10", set()),
    ("evaluate.judge.endpoint.api_key_env=OTHER_KEY", set()),
    ("evaluate.judge.endpoint.require_key=false", set()),
    ("evaluate.backend_tolerance={acc: 0.1}", set()),
    ("quantize.python=/usr/bin/python3", set()),
    ("quantize.schemes=[w4a16]", set()),
    # where and how the server runs
    ("serve.host=0.0.0.0", set()),
    ("serve.port=8123", set()),
    ("serve.require_api_key=true", set()),
    ("serve.front=false", set()),
    ("serve.inherit_env=[MY_SETTING]", set()),
    ("evaluate.allow_unsafe_code=[humaneval]", set()),
    ("serve.slo.ttft_p90_ms=100", set()),
    ("serve.adapters.max_loras=2", set()),
    ("serve.llamacpp.python=/usr/bin/python3", set()),
    ("serve.llamacpp.n_threads=2", set()),
    ("quantize.gguf.enabled=true", set()),
    ("quantize.gguf.python=/usr/bin/python3", set()),
    ("serve.adapters.max_cpu_loras=4", set()),
    ("serve.adapters.parity_tolerance=0.01", set()),
    ("serve.slo.tpot_p90_ms=10", set()),
    ("serve.engine.max_num_seqs=8", set()),
    ("serve.engine.max_num_batched_tokens=512", set()),
    ("serve.engine.enable_prefix_caching=false", set()),
    ("serve.engine.enable_chunked_prefill=false", set()),
    ("serve.engine.tensor_parallel_size=2", set()),
    ("serve.engine.gpu_memory_utilization=0.5", set()),
    ("serve.engine.cpu_kv_cache_gib=2", set()),
    ("serve.engine.cpu_threads_bind=auto", set()),
    ("serve.engine.cpu_executor=mp", set()),
    ("serve.engine.cpu_threads=3", set()),
    ("serve.engine.enforce_eager=false", set()),
    ("serve.engine.max_stop_strings=8", set()),
    ("serve.engine.startup_timeout_s=60", set()),
    ("serve.engine.max_n=2", set()),
    ("serve.engine.max_prompts_per_request=8", set()),
    ("serve.gpu_wait_s=5", set()),
    ("serve.drain_timeout_s=5", set()),
    ("serve.alias=prod", set()),
    ("serve.engine.api_paths=[/v1/completions]", set()),
    ("serve.engine.max_request_tokens=4096", set()),
    ("serve.engine.max_request_bytes=2048", set()),
    ("serve.engine.max_concurrent_per_key=8", set()),
    # orchestration: where stages and units run, never what they produce
    ("runtime.dispatch=deployments", set()),
    ("runtime.deployment=other", set()),
    ("runtime.task_runner=dask", set()),
    ("runtime.dask_address=tcp://127.0.0.1:8786", set()),
    ("runtime.dask_allow_plain_tcp=true", set()),
    # object storage: where outputs are kept and how this machine reaches them, never what they are
    ("runtime.storage.options={endpoint_url: http://127.0.0.1:9000}", set()),
    ("runtime.storage.local_copy=/tmp/elsewhere", set()),
    ("runtime.storage.local_copy_max_gb=5", set()),
    ("runtime.storage.lease_s=60", set()),
    ("runtime.storage.keep_checkpoints=4", set()),
    ("cluster.nodes=4", set()),
    ("cluster.gpus_per_node=4", set()),
    ("cluster.cpus_per_task=8", set()),
    ("cluster.time=01:00:00", set()),
    ("cluster.partition=gpu", set()),
    ("cluster.account=ml", set()),
    ("cluster.requeue=false", set()),
    ("cluster.setup=[module load cuda]", set()),
    ("cluster.extra_sbatch=[--qos=high]", set()),
    # experiment tracking: logged from a step's finished output, never part of what it makes
    ("tracking.mlflow.enabled=true", set()),
    ("tracking.mlflow.tracking_uri=http://127.0.0.1:5000", set()),
    ("tracking.mlflow.experiment=other", set()),
]


@pytest.mark.parametrize("override, changed", ROWS)
def test_field_changes_exactly_these_steps(override: str, changed: set[str]) -> None:
    before, after = identities([]), identities(override.split(";"))
    assert {name for name in ALL_STEPS if before[name] != after[name]} == changed


SEMANTIC_ON = ["curate.semantic_dedup.enabled=true"]
SEMANTIC_STEPS = [*ALL_STEPS, "curate/semantic-encoder", "curate/semantic"]


@pytest.mark.parametrize(
    "override, changed",
    [
        ("curate.semantic_dedup.threshold=0.6", {"curate/select"}),  # re-selects from the stored pairs
        ("curate.semantic_dedup.skip_domains=[code]", {"curate/select"}),
        # what is stored: embedded again, as MinHash signs again for store_min_jaccard
        ("curate.semantic_dedup.store_min_cosine=0.2", {"curate/semantic"}),
        ("curate.semantic_dedup.cluster_probes=3", {"curate/semantic"}),
        ("curate.semantic_dedup.dim=256", {"curate/semantic-encoder"}),
        ("curate.semantic_dedup.batch_docs=7", set()),
    ],
)
def test_semantic_dedup_fields_key_the_step_that_uses_them(override: str, changed: set[str]) -> None:
    before, after = identities(SEMANTIC_ON), identities([*SEMANTIC_ON, override])
    assert {name for name in SEMANTIC_STEPS if before[name] != after[name]} == changed


def test_the_chosen_backends_section_keys_the_release() -> None:
    """serve/release reads the section of the backend it starts (serving.backends), and only that."""
    before = identities(["serve.backend=llamacpp"])
    after = identities(["serve.backend=llamacpp", "serve.llamacpp.n_ctx=64"])
    assert {name for name in ALL_STEPS if before[name] != after[name]} == {"serve/release"}


def test_every_runtime_field_is_pinned_above() -> None:
    """A new field marked runtime (kept out of every key) must get a row proving it changes nothing."""
    from lmforge.config import PipelineConfig
    from lmforge.configbase import runtime_paths

    pinned = {part.split("=")[0] for override, changed in ROWS if not changed for part in override.split(";")}
    # every alignment method's section extends TrainConfig: its runtime fields are SFT's, pinned above once
    from training.align.methods import methods
    from training.align.sections import TrainConfig

    shared = [f for f in TrainConfig.model_fields if f"align.sft.{f}" in pinned]
    pinned |= {f"align.{name}.{f}" for name in methods() for f in shared}
    # debug: fault injection, keyed apart only when set (test_debug_settings_key_a_step_apart)
    # base_model.path: which base is read is its content (in the keys), not where it lies
    structural = {"name", "workspace", "stages", "debug", "base_model.path"} | {
        p for p in runtime_paths(PipelineConfig) if p.endswith(".enabled")
    }
    assert set(runtime_paths(PipelineConfig)) - structural - pinned == set()


def test_select_reads_only_enabled_attribute_steps() -> None:
    config = load_config(
        "tiny-cpu",
        [
            "curate.langid.enabled=false",
            "curate.near_dedup.enabled=false",
            "curate.paragraph_dedup.enabled=false",
            "curate.decontaminate.tasks=[]",
        ],
    )
    assert graph().get("curate/select").upstream(config) == ("curate/ingest", "curate/heuristics", "curate/quality")


# companions a perturbation needs to stay valid (a threshold replaces the keep-fraction)
COMPANIONS = {
    "curate.quality_classifier.threshold": ["curate.quality_classifier.keep_fraction=null"],
    # the fastText toxicity classifier is trained on a labelled file: one is given with the other
    "curate.toxicity.classifier": ["curate.toxicity.labelled_file=pyproject.toml"],
    "curate.toxicity.labelled_file": ["curate.toxicity.classifier=fasttext"],
    # the preset's judge is a model of the lineage; an endpoint replaces it, URL and model together
    "evaluate.judge.endpoint.url": ["evaluate.judge.model=null", "evaluate.judge.endpoint.model=m"],
    "evaluate.judge.endpoint.model": ["evaluate.judge.model=null", "evaluate.judge.endpoint.url=http://127.0.0.1:9/v1"],
    "quantize.gate.choose": ["quantize.gate.speed_requests=8"],  # fastest needs the speed measured
    "pretrain.model.experts.num": ["pretrain.model.experts.top_k=1"],  # one expert: top-2 of it is refused
    "align.lora.target_parameters": ["align.lora.dropout=0"],  # PEFT adapts parameters without dropout
}
# fields that matter only in a context (LoRA's shape when a step uses LoRA): compared within it
# and a serving backend's section, read when that backend is chosen
CONTEXT = {"align.lora.": ["align.method=lora"], "serve.llamacpp.": ["serve.backend=llamacpp"]}


def _leaves(model: type, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted path, annotation) of every leaf field that is not a runtime field."""
    from pydantic import BaseModel

    from lmforge.configbase import is_runtime_field

    found: list[tuple[str, object]] = []
    for name, field in model.model_fields.items():
        if is_runtime_field(model, name):
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _leaves(annotation, f"{prefix}{name}.")
        else:
            found.append((f"{prefix}{name}", annotation))
    return found


def _candidates(value: object, annotation: object = None) -> list[str]:
    """YAML values to try in place of `value`, in order; the config model keeps the valid ones."""
    import json
    import typing

    literals = [a for a in typing.get_args(annotation) if isinstance(a, str)]
    if isinstance(value, str) and literals:
        return [a for a in literals if a != value]

    if isinstance(value, bool):
        return [json.dumps(not value)]
    if isinstance(value, int):
        return [str(value + 1), str(value * 2), str(max(value - 1, 0))]
    if isinstance(value, float):
        return [repr(value * 0.5), repr(round(value + 0.05, 6)), repr(value * 1.5), repr(value * 0.9)]
    if isinstance(value, str):
        # then model roles (serve.model, quantize.model) and a serving backend (serve.backend): validated
        # against their registries, not a Literal
        return [
            "fp32",
            "bf16",
            "NFKC",
            "ratio",
            "zscore",
            "none",
            "pyproject.toml",
            value + "x",
            "pretrained",
            "sft",
            "llamacpp",
            "0.1",
        ]  # fmt: skip  (0.1: a number where a literal or a number goes, max_increase)
    if value is None:  # then lists of roles (judge.grade, safety.models) and of pairs of roles (judge.pairwise)
        return ["0.5", "1", "64", "x", "[lmforge_continuation]", '["sft"]', '[["sft", "dpo"]]']
    if isinstance(value, list):
        value = [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]  # sections in a list
        return (
            [json.dumps(value[:-1]), json.dumps(value + value[-1:])]
            if value
            else ['["pyproject.toml"]', '["x"]', "[1]"]
        )
    if isinstance(value, dict):
        return [json.dumps({k: v for k, v in list(value.items())[:-1]})] if value else ['{"x": 0.5}', '{"2": 0.3}']
    return []


def test_every_result_changing_field_changes_a_step_key() -> None:
    """The other direction: no field outside the runtime set can change a result without changing a key."""
    from lmforge.config import pipeline_model

    @functools.cache  # most fields share the empty context: compute its keys once
    def keys(overrides: tuple[str, ...]) -> tuple[object, dict[str, str]]:
        config = load_config("tiny-cpu", list(overrides), "/tmp/lmforge-keys-test", check_paths=False)
        return config, {step.name: digest([step.version, step.identity(config)]) for step in graph().steps}

    base_config, _ = keys(())
    sections = [
        name
        for name in pipeline_model().model_fields
        if name not in ("name", "workspace", "stages", "runtime", "debug")
    ]
    unkeyed, untried = [], []
    for path, annotation in [
        leaf
        for section in sections
        for leaf in _leaves(pipeline_model().model_fields[section].annotation, f"{section}.")
    ]:
        value = base_config
        for part in path.split("."):
            value = getattr(value, part)
        context = [o for prefix, extra in CONTEXT.items() if path.startswith(prefix) for o in extra]
        _, base = keys(tuple(context))
        tried = []
        for candidate in _candidates(value, annotation):
            try:
                config = load_config(
                    "tiny-cpu",
                    [*context, f"{path}={candidate}", *COMPANIONS.get(path, [])],
                    "/tmp/lmforge-keys-test",
                    check_paths=False,
                )
            except Exception:  # noqa: BLE001 - not a valid value for this field; try the next
                continue
            after = config
            for part in path.split("."):
                after = getattr(after, part)
            if after == value:
                continue
            tried.append(f"{path}={candidate}")
            # a value may resolve to the same thing (precision auto -> fp32 on this machine): try the next
            if any(digest([step.version, step.identity(config)]) != base[step.name] for step in graph().steps):
                break
        else:
            (unkeyed if tried else untried).append(tried[0] if tried else path)
    assert unkeyed == [], f"fields that change no step's key: {unkeyed}"
    assert untried == [], f"fields the test could not perturb: {untried}"


def test_debug_settings_key_a_step_apart() -> None:
    """Fault injection is no part of a normal run's key, and a step run with one set never shares a
    key with a normal run (what it makes may be broken on purpose)."""
    from lmforge.engine.graph import key_components, step_key

    plain = load_config("tiny-cpu")
    faulty = load_config("tiny-cpu", ["debug.quantize.break_scale_factor=40"])
    step = graph().get("quantize/w4a16")
    assert step.identity(plain) == step.identity(faulty)
    assert "debug" not in key_components(step, plain, (), {})
    assert key_components(step, faulty, (), {})["debug"] == {"break_scale_factor": 40.0}
    assert step_key(key_components(step, plain, (), {})) != step_key(key_components(step, faulty, (), {}))
    other = graph().get("pretrain/train")  # another stage's debug settings leave it alone
    assert key_components(other, plain, (), {}) == key_components(other, faulty, (), {})


def test_a_step_reads_only_what_its_key_holds() -> None:
    """Inside a step the configuration offers only its declared reads (and runtime fields): a field
    read but not hashed fails loudly instead of silently reusing a stale output."""
    from lmforge.errors import UndeclaredConfigRead

    config = load_config("tiny-cpu")
    view = graph().get("align/dpo").view(config)
    assert view.align.dpo.beta == config.align.dpo.beta
    assert view.align.distributed.num_ranks == config.align.distributed.num_ranks  # runtime: how, not what
    assert view.runtime.workers == config.runtime.workers
    with pytest.raises(UndeclaredConfigRead, match="align/dpo reads align.sft.lr"):
        view.align.sft.lr  # noqa: B018 - the read itself is what is tested
    with pytest.raises(UndeclaredConfigRead, match="reads pretrain.max_steps"):
        getattr(view.pretrain, "max_steps", None)  # not an AttributeError: no silent default
    with pytest.raises(UndeclaredConfigRead, match="not a config field"):
        view.align.model_dump()  # a whole section only where the whole section is declared
