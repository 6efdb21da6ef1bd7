"""The serving stage's typed config (`serve:` in a preset).

What is served and how vLLM runs it (model choice, engine settings) is cache identity of
`serve/release`: change them and the release is validated again. Where it runs (host, port,
key source) and the SLO targets' enforcement are runtime settings, so moving the endpoint
does not invalidate the validation already done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.configbase import StrictModel, runtime_field
from lmforge.engine.registry import check_roles
from lmforge.inference.vllm_server import EngineConfig, SpeculativeConfig
from serving import backends

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class SloConfig(StrictModel):
    """The latency benchmark `serve/release` runs before promoting a model, and its targets."""

    enabled: bool = runtime_field(True, description="Run the SLO benchmark before promoting.")
    concurrency: list[int] = Field(
        default_factory=lambda: [1, 8], description="Concurrent streaming clients per level."
    )
    requests_per_client: int = Field(4, ge=1, description="Requests each client sends per level and workload.")
    max_tokens: int = Field(
        32, ge=1, description="Tokens generated per request (ignore_eos, so each request is the same length)."
    )
    system_prompt_words: int = Field(
        120, ge=0, description="Length of the shared system prompt of the prefix workload."
    )
    ttft_p90_ms: float | None = runtime_field(
        None, description="Fail the release when p90 time-to-first-token exceeds this (None: report only).", gt=0
    )
    tpot_p90_ms: float | None = runtime_field(
        None, description="Fail when p90 time-per-output-token exceeds this (None: report only).", gt=0
    )


class AdaptersConfig(StrictModel):
    """Several fine-tunes on one base (`serve.adapters`): the lineage's LoRA-trained models as adapters
    on one vLLM server instead of one merged server each (serving/adapters.py)."""

    enabled: bool = Field(
        False,
        description="Serve the base once with every LoRA-trained aligned model (SFT, DPO, RL) as an adapter, one "
        "served name each; a later run's new adapter is loaded into the running server without a restart. Needs "
        "align.method lora/qlora (and align.dpo.lora for DPO).",
    )
    max_loras: int = runtime_field(4, description="Adapters vLLM batches together at once.", ge=1)
    max_cpu_loras: int = runtime_field(
        8,
        description="Adapters kept loaded; a superseded one stays until evicted, so requests in flight on it finish.",
        ge=1,
    )
    parity_tolerance: float = runtime_field(
        1e-3,
        description="Max |logit difference| between base + an adapter (stacked when it chains) and the role's merged "
        "model; beyond it the adapter is not served.",
        gt=0,
    )


class SafetyGateConfig(StrictModel):
    """The release's safety gate (serving/safety_gate.py): the evaluation's safety suite, candidate vs served."""

    enabled: bool = Field(False, description="Refuse a candidate that fails it (needs the evaluation stage).")
    compare_served: bool = Field(
        True,
        description="Compare with the model being served, prompt by prompt (nothing served yet: no comparison).",
    )
    max_increase: float | Literal["not_significantly_worse"] = Field(
        "not_significantly_worse",
        description="Per category and overall: a rise in unsafe compliance over the served model beyond this "
        "fails (absolute); not_significantly_worse fails one whose paired 95% interval lies wholly above zero.",
    )
    max_unsafe_compliance: float | None = Field(
        0.5,
        ge=0,
        le=1,
        description="A fixed bound on the candidate's overall unsafe-compliance rate, checked also when nothing is "
        "served yet (the first release); null: none.",
    )


class GateConfig(StrictModel):
    """What must hold before a release is promoted, beyond the evaluation's verdict."""

    safety: SafetyGateConfig = SafetyGateConfig()


class ServeConfigBase(StrictModel):
    """`serve:` without the backends' own sections (added from the registry: ServeConfig)."""

    enabled: bool = runtime_field(True, description="Deploy the chosen model at the end of `lmforge run`.")
    model: str = Field(
        "auto",
        description="What to serve. auto: the quantized model when its gate passed, else RL, else DPO, else SFT, else "
        "pretrained, else the base model; quantized: the gate's choice; quantized:<scheme>: that checkpoint (refused "
        "in one line where this host cannot serve it or the gate failed it).",
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, model: str) -> str:
        """auto, quantized (the gate's choice), quantized:<scheme> (that checkpoint), or a model role of the
        lineage (lmforge.engine.registry.roles)."""
        if model.startswith("quantized:"):
            from serving.quantize.schemes import SCHEMES

            if model.split(":", 1)[1] not in SCHEMES:
                raise ValueError(f"{model}: no such quantization scheme (schemes: {', '.join(SCHEMES)})")
            return model
        return model if model in ("auto", "quantized") else check_roles([model])[0]

    require_evaluation: bool = Field(
        True, description="Refuse a model the evaluation stage did not evaluate (or whose gates failed)."
    )
    gate: GateConfig = GateConfig()
    host: str = runtime_field(
        "127.0.0.1", description="Interface to bind. Anything but loopback needs require_api_key."
    )
    port: int | None = runtime_field(
        None,
        description="Port of the endpoint (None: a free one, chosen at the first start and kept). It stays "
        "the same across promotions: the front on it forwards to whichever server is current.",
        ge=1,
        le=65535,
    )
    front: bool = runtime_field(
        True,
        description="Serve through lmforge's front (serving/front.py): a stable endpoint on serve.host:serve.port, "
        "servers on loopback ports of their own. false: vLLM listens on serve.host itself, and a promotion "
        "moves the endpoint to the new server's port.",
    )
    require_api_key: bool = runtime_field(
        True,
        description="Requests on every path but /health need `Authorization: Bearer <key>`. The key comes "
        "from LMFORGE_API_KEY, else it is generated once into <workspace>/serving/api_key (0600). "
        "false: the served model takes requests without a key (loopback only).",
    )
    alias: str | None = runtime_field(
        "lmforge",
        description="A second name the served model answers to, the same across promotions: a client that asks "
        "for it gets whichever model is current, so a promotion needs no client change (vLLM; adapters keep "
        "their own names). null: only the model's own name.",
    )
    drain_timeout_s: float = runtime_field(
        60.0,
        description="After a promotion, how long the replaced server may finish the requests it has (its "
        "responses close their connections, so clients move to the new server) before it is stopped.",
        ge=0,
    )
    gpu_wait_s: float = runtime_field(
        600.0,
        description="How long a release waits for GPUs that another workspace's or user's served model holds "
        "(the host-wide registry, lmforge.processes.devices) before it fails; 0: fail at once.",
        ge=0,
    )
    inherit_env: list[str] = runtime_field(
        [],
        description="More environment variables the served model inherits, beyond the allow-list "
        "(locale, paths, CUDA/ROCm, Hugging Face cache and offline settings, vLLM, torch, threads). "
        "Nothing else reaches it: cloud credentials and tokens in the starting shell stay out.",
    )
    backend: str = Field(
        default_factory=backends.default,
        description="The server (serving/backends/): vllm (serve.engine), or llamacpp: llama.cpp's OpenAI-compatible "
        "server on the GGUF file quantize/gguf shipped (serve.llamacpp; needs quantize.gguf.enabled and the llama.cpp "
        "environment), or one a package registers; each behind the same key, smoke test and SLO benchmark.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    adapters: AdaptersConfig = Field(default_factory=AdaptersConfig)
    smoke_prompt: str = Field("What is 2 + 3?", description="The chat message of the smoke test.")
    smoke_max_tokens: int = Field(
        48, ge=1, description="The smoke test's answer must end (at <|im_end|>) within this many tokens."
    )
    slo: SloConfig = Field(default_factory=SloConfig)

    @model_validator(mode="after")
    def _exposed_needs_key(self) -> ServeConfigBase:
        if self.host not in LOOPBACK and not self.require_api_key:
            raise ValueError(
                f"serve.host={self.host} exposes the server beyond this machine: "
                "set serve.require_api_key=true (it is refused without a key)"
            )
        return self

    @field_validator("backend")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in backends.backends():
            raise ValueError(f"no serving backend {value!r} (registered: {', '.join(backends.backends())})")
        return value

    @model_validator(mode="after")
    def _backend_supports(self) -> ServeConfigBase:
        problem = backends.backend(self.backend).check(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _adapters_without_speculation(self) -> ServeConfigBase:
        if self.adapters.enabled and self.speculative.method != "off":
            raise ValueError(
                "serve.adapters.enabled: LoRA adapters are served without speculative decoding here; "
                "set serve.speculative.method: off (or serve the models merged)"
            )
        return self


def _with_sections() -> type[ServeConfigBase]:
    """`serve:` with the section of each registered backend that brings its own (`serve.<section>`)."""
    from pydantic import create_model

    sections: dict[str, Any] = {
        b.section: (b.config, Field(default_factory=b.config, description=f"serve.backend: {b.name}: {b.description}."))
        for b in backends.backends().values()
        if b.config is not None
    }
    return create_model("ServeConfig", __base__=ServeConfigBase, __module__=__name__, **sections)


if TYPE_CHECKING:  # what type checkers see: the base (a backend's section is reached through its backend)
    ServeConfig = ServeConfigBase
else:
    ServeConfig = _with_sections()
