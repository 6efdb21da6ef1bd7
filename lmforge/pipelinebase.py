"""The top level of the pipeline config (`name`, `workspace`, `stages`, `runtime`, `cluster`,
`tracking`) and the type every stage's helpers are handed (`PipelineBase`, `ConfigOrView`).

A leaf of the core: it imports no other lmforge module that could import it back, so the stage
contract (`lmforge.engine.stage`), the step graph and the executor can name the config's type without
an import ring. `lmforge.config` builds the whole model from the registered stages on top of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Self, TypeAlias

from pydantic import Field, field_validator, model_validator

from lmforge.configbase import RUNTIME_MARK, ConfigView, StrictModel, runtime_field


class RuntimeConfig(StrictModel):
    workers: int = runtime_field(2, description="Local worker processes for sharded steps.", ge=1)
    verify: Literal["checksum", "size"] = runtime_field(
        "checksum",
        description="How stage outputs are verified before reuse: full SHA-256, or sizes only (huge corpora).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = runtime_field(
        "INFO", description="Log level of lmforge's loggers."
    )
    on_code_drift: Literal["warn", "rerun"] = runtime_field(
        "warn",
        description="When the libraries that shape a step's output (its `libraries`: torch, tokenizers, ...) "
        "changed version since the output was made: warn (one line, reuse the output) or rerun the step. "
        "Code needs no such setting: it is part of every step's key.",
    )
    step_timeout_s: dict[str, float] = runtime_field(
        default_factory=dict,
        description="Wall-clock limit in seconds per step or stage name, e.g. "
        "{pretrain/train: 86400, curate: 3600}; a step over its limit is stopped.",
    )
    dispatch: Literal["local", "deployments"] = runtime_field(
        "local",
        description="local: the pipeline runs every stage in its own process; deployments: each stage "
        "runs as its deployment (`lmforge deployments`), so GPU stages land on a GPU work pool's worker.",
    )
    deployment: str | None = runtime_field(
        None,
        description="Name of the stage deployments to dispatch to (lmforge-<stage>/<name>); default: the preset name.",
    )
    task_runner: Literal["process", "dask"] = runtime_field(
        "process",
        description="Where sharded units run: a local process pool, or a Dask cluster through "
        "prefect-dask's DaskTaskRunner (Prefect runs only; --local always uses processes).",
    )
    dask_address: str | None = runtime_field(
        None,
        description="Scheduler address of the Dask cluster (tls://host:8786; tcp:// only on loopback or with "
        "dask_allow_plain_tcp); None: a local cluster of `workers` processes.",
    )
    dask_allow_plain_tcp: bool = runtime_field(
        False,
        description="Accept a tcp:// scheduler on another host. Dask ships pickled code and data, unencrypted "
        "and unauthenticated over tcp://: anyone who can reach the port can run code on every worker.",
    )

    @model_validator(mode="after")
    def _dask_transport(self) -> Self:
        address = self.dask_address or ""
        scheme, _, rest = address.rpartition("://")  # Dask's default scheme is tcp
        host = rest.rsplit(":", 1)[0].strip("[]")
        if (
            scheme in ("tcp", "")
            and address
            and host not in ("127.0.0.1", "localhost", "::1")
            and not self.dask_allow_plain_tcp
        ):
            raise ValueError(
                f"runtime.dask_address={address}: a plain-TCP Dask scheduler on another host takes pickled code from "
                "anyone who reaches it; use tls:// (with certificates), or set runtime.dask_allow_plain_tcp=true "
                "on a network you trust"
            )
        return self


def _one_line(value: Any) -> Any:
    """Values rendered into `#SBATCH` lines: a newline or control character would inject shell lines."""
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, str) and any(ord(c) < 32 or ord(c) == 127 for c in item):
            raise ValueError(f"{item!r} holds a newline or control character (it is written into the job script)")
    return value


class ClusterConfig(StrictModel):
    """A SLURM cluster for `lmforge slurm render|submit STAGE` (multi-node training)."""

    _single_lines = field_validator("time", "partition", "account", "extra_sbatch")(_one_line)

    nodes: int = runtime_field(1, description="Nodes of the job.", ge=1)
    gpus_per_node: int = runtime_field(
        8, description="GPUs per node (--gpus-per-node, and slots in the hostfile).", ge=0
    )
    cpus_per_task: int = runtime_field(16, description="CPUs per node for the launcher and its ranks.", ge=1)
    time: str = runtime_field("24:00:00", description="Wall-clock limit of the job (HH:MM:SS or D-HH:MM:SS).")
    partition: str | None = runtime_field(None, description="SLURM partition.")
    account: str | None = runtime_field(None, description="SLURM account.")
    requeue: bool = runtime_field(
        True, description="Requeue on preemption; the requeued job resumes from the last checkpoint."
    )
    setup: list[str] = runtime_field(
        default_factory=list, description="Shell lines run on the first node before the stage (module load, exports)."
    )
    extra_sbatch: list[str] = runtime_field(default_factory=list, description="More #SBATCH options, e.g. --qos=high.")


class MlflowConfig(StrictModel):
    """MLflow experiment tracking (`lmforge.tracking`): logged after each computed step, never part of a key."""

    enabled: bool = runtime_field(
        False,
        description="Log one MLflow run per pipeline run, with a nested run per computed step that trains, "
        "evaluates or quantizes (parameters, metric series, evaluation and quantization results, artifacts).",
    )
    tracking_uri: str | None = runtime_field(
        None,
        description="Where runs are logged: any MLflow tracking URI (http://host:5000, databricks, ...); "
        "None: sqlite:///<workspace>/mlflow.db, which needs no server (`mlflow ui --backend-store-uri ...`).",
    )
    experiment: str | None = runtime_field(None, description="MLflow experiment name; None: the preset name (`name`).")

    _single_lines = field_validator("tracking_uri", "experiment")(_one_line)


class TrackingConfig(StrictModel):
    """Experiment trackers; an unreachable one is a warning, never a failed step."""

    mlflow: MlflowConfig = MlflowConfig()


class PipelineBase(StrictModel):
    """The top level of the pipeline config; `lmforge.config.pipeline_model()` adds one section per
    stage, and the registered stages as `stages`' default."""

    name: str = runtime_field("custom", description="Preset name, shown in the UI.")
    workspace: str = runtime_field("./workspace", description="Where stage outputs live (content-addressed).")
    stages: list[str] = Field(
        default_factory=list,
        json_schema_extra=RUNTIME_MARK,
        description="Stages `lmforge run` runs (the lifecycle order applies).",
    )
    runtime: RuntimeConfig = RuntimeConfig()
    cluster: ClusterConfig = ClusterConfig()
    tracking: TrackingConfig = TrackingConfig()

    if TYPE_CHECKING:
        # The stage sections (`config.curate`, `config.pretrain`, ...) and `debug` are added by
        # `pipeline_model()` from the registry at runtime; to the type checker they are Any.
        def __getattr__(self, name: str) -> Any: ...

    _single_line_name = field_validator("name")(_one_line)


# What a stage's config-reading helpers may be handed: the whole pipeline config, or a running
# step's view of it (`StepContext.config`), which offers the same attributes.
ConfigOrView: TypeAlias = PipelineBase | ConfigView
