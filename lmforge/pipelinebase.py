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

# fsspec option names that hold secrets (s3fs, gcsfs, adlfs and their botocore/google/azure kwargs),
# compared lower-cased
SECRET_OPTIONS = ("key", "secret", "token", "password", "account_key", "sas_token", "connection_string",
                  "client_secret", "aws_secret_access_key", "aws_session_token", "credentials", "credential",
                  "session_token", "secret_access_key", "access_token", "refresh_token", "ssecustomerkey",
                  "sse_customer_key", "headers", "client_certificate_password", "private_key",
                  "api_key")  # fmt: skip


class StorageConfig(StrictModel):
    """A workspace on object storage (`workspace: s3://bucket/prefix`, `gs://`, `az://`): how this machine
    reaches it and where its local working copy lives (`lmforge.engine.remote`). Credentials are never
    here: each cloud's own chain (environment, profile, instance role, application default credentials)."""

    options: dict[str, Any] = runtime_field(
        default_factory=dict,
        description="fsspec storage options that are not secrets, e.g. {endpoint_url: http://127.0.0.1:9000} "
        "for an S3-compatible server, {client_kwargs: {region_name: eu-west-1}}.",
    )
    local_copy: str | None = runtime_field(
        None,
        description="This machine's working copy of a remote workspace (steps read and write local files; "
        "outputs are uploaded when they finish); None: ~/.cache/lmforge/workspaces/<digest of the URL and endpoint>.",
    )
    local_copy_max_gb: float | None = runtime_field(
        None,
        gt=0,
        description="Bound on the working copy: outputs already on the store, least recently used first, "
        "are removed to stay under it (they are downloaded again when needed); None: unbounded.",
    )
    keep_checkpoints: int = runtime_field(
        2,
        ge=1,
        description="Training checkpoints kept on the store per step (uploaded in the background as each is "
        "sealed; a run on a machine without them resumes from the newest).",
    )
    lease_s: float = runtime_field(
        120.0,
        ge=10,
        description="A machine computing a step holds a lease on it in the store, renewed every third of this; "
        "another machine waits for it, and takes a lease not renewed for this long over.",
    )

    @field_validator("options")
    @classmethod
    def _no_secrets(cls, value: dict[str, Any]) -> dict[str, Any]:
        from lmforge.urlcheck import REFUSED, refuse_credentials

        def walk(item: Any, path: str) -> None:
            if isinstance(item, dict):
                for k, v in item.items():
                    if str(k).lower() in SECRET_OPTIONS:
                        raise ValueError(
                            f"runtime.storage.options.{path}{k}: {REFUSED} (it is logged, tracked and kept in "
                            "manifests); use the store's own chain: environment, profile, instance role, "
                            "application default credentials"
                        )
                    walk(v, f"{path}{k}.")
            elif isinstance(item, list):
                for i, v in enumerate(item):
                    walk(v, f"{path}{i}.")
            elif isinstance(item, str):
                refuse_credentials(item, f"runtime.storage.options.{path.rstrip('.')}")

        walk(value, "")
        return value


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
    storage: StorageConfig = StorageConfig()
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

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        from lmforge.urlcheck import refuse_credentials

        return refuse_credentials(value, "tracking.mlflow.tracking_uri")


class TrackingConfig(StrictModel):
    """Experiment trackers; an unreachable one is a warning, never a failed step."""

    mlflow: MlflowConfig = MlflowConfig()


class PipelineBase(StrictModel):
    """The top level of the pipeline config; `lmforge.config.pipeline_model()` adds one section per
    stage, and the registered stages as `stages`' default."""

    name: str = runtime_field("custom", description="Preset name, shown in the UI.")
    workspace: str = runtime_field(
        "./workspace",
        description="Where stage outputs live (content-addressed): a folder, or an object-store URL "
        "(s3://bucket/prefix, gs://, az://) every machine of the pipeline shares (runtime.storage).",
    )
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

    @field_validator("workspace")
    @classmethod
    def _workspace_url(cls, value: str) -> str:
        from lmforge.urlcheck import refuse_credentials

        scheme, sep, rest = value.partition("://")
        if not sep:
            return value
        refuse_credentials(value, "workspace")
        if scheme == "file":
            return rest or "/"
        import fsspec

        if scheme not in fsspec.available_protocols():
            raise ValueError(f"workspace {value}: no fsspec filesystem for {scheme}:// (s3://, gs://, az://, a folder)")
        if not rest.strip("/"):
            raise ValueError(f"workspace {value}: name a bucket (and a prefix): {scheme}://bucket/prefix")
        return value.rstrip("/")


# What a stage's config-reading helpers may be handed: the whole pipeline config, or a running
# step's view of it (`StepContext.config`), which offers the same attributes.
ConfigOrView: TypeAlias = PipelineBase | ConfigView
