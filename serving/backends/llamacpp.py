"""llama.cpp's OpenAI-compatible server on the GGUF file quantize/gguf shipped (`serve.backend: llamacpp`).

The file is the smallest GGUF type that passed quantize/gguf's gate (serving.quantize.gguf); the
server is llama-cpp-python's app with lmforge's guard outermost (serving.backends.llamacpp_server),
run in the llama.cpp environment (.venv-llamacpp, `LMFORGE_LLAMACPP_ENV=1 bash scripts/setup.sh`).
It serves one model: no LoRA adapters, no speculative decoding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from lmforge.configbase import StrictModel, runtime_field
from lmforge.engine.stage import Product
from lmforge.engine.store import relocated
from lmforge.errors import ConfigError, GateFailed
from serving.backends.base import ServingBackend

if TYPE_CHECKING:
    from lmforge.config import ConfigOrView
    from lmforge.engine.graph import StepContext
    from lmforge.inference.vllm_server import LoraModules

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-llamacpp"
GGUF_MODEL = Product("gguf-model")  # quantize/gguf's files and its gate's verdict


class LlamaCppConfig(StrictModel):
    """llama.cpp's OpenAI-compatible server (`serve.backend: llamacpp`), serving the GGUF file quantize/gguf shipped."""

    python: str | None = runtime_field(
        None, description="Python of the llama.cpp environment; default: .venv-llamacpp/bin/python beside the project."
    )
    n_ctx: int | None = Field(None, ge=16, description="Context length served (default: the model's).")
    n_threads: int | None = runtime_field(None, description="CPU threads (default: llama.cpp's).", ge=1)


def llamacpp_python(configured: str | None, field: str) -> Path:
    """The llama.cpp environment's Python, or one line saying how to make it."""
    path = Path(configured).expanduser() if configured else DEFAULT_VENV / "bin" / "python"
    if not path.exists():
        raise ConfigError(
            f"{field}: the llama.cpp environment is missing ({path} does not exist); build it with "
            "`LMFORGE_LLAMACPP_ENV=1 bash scripts/setup.sh` (about 3 minutes)"
            + ("" if configured else " or point quantize.gguf.python at a Python with llama-cpp-python")
        )
    return path


def server_command(gguf_file: Path, cfg: LlamaCppConfig, *, port: int, host: str, served_name: str) -> list[str]:
    """llama.cpp's OpenAI-compatible server for `gguf_file` (serving/backends/llamacpp_server.py), in the
    llama.cpp environment; the key reaches it through the guard's environment, never this command line."""
    python = llamacpp_python(cfg.python, "serve.llamacpp.python")
    command = [str(python), "-m", "serving.backends.llamacpp_server", "--model", str(gguf_file),
               "--served-name", served_name, "--host", host, "--port", str(port)]  # fmt: skip
    if cfg.n_ctx:
        command += ["--n-ctx", str(cfg.n_ctx)]
    if cfg.n_threads:
        command += ["--n-threads", str(cfg.n_threads)]
    return command


class LlamaCpp(ServingBackend):
    name = "llamacpp"
    label = "llama.cpp"
    description = "llama.cpp's OpenAI-compatible server on the GGUF file quantize/gguf shipped (serve.llamacpp)"
    section = "llamacpp"
    config = LlamaCppConfig
    code = ("serving.backends.llamacpp", "serving.backends.llamacpp_server", "serving.backends.llamacpp_cpu")

    def upstream(self, config: ConfigOrView) -> tuple[Product, ...]:
        if not config.quantize.gguf.enabled:
            raise ConfigError(
                "serve.backend: llamacpp serves the GGUF file quantize/gguf ships: set quantize.gguf.enabled"
            )
        return (GGUF_MODEL,)

    def choose(self, ctx: StepContext) -> tuple[str, Path, dict[str, Any]]:
        """The GGUF file quantize/gguf's gate shipped."""
        verdict = json.loads((ctx.path(GGUF_MODEL) / "verdict.json").read_text())
        if verdict["chosen"] is None:
            raise GateFailed(f"serve.backend=llamacpp: {verdict['decision']}")
        manifest = ctx.manifest(GGUF_MODEL)
        here = Path(manifest["dir"])
        # the tokenizer the SLO benchmark sizes its prompts with: the copy inside this output (outputs made
        # before it had one name the model folder on the machine that made them, which may not exist here)
        tokenizer = verdict.get("tokenizer_dir")
        return (
            f"{verdict['model']}-gguf-{verdict['chosen']}",
            relocated(verdict["file"], manifest["key"], here),  # recorded where it was made
            {
                "step": manifest["step"],
                "key": manifest["key"],
                "digest": manifest["digest"],
                "type": verdict["chosen"],
                "verdict": verdict["decision"],
                "from": verdict["model"],
                "tokenizer_dir": str(relocated(tokenizer, manifest["key"], here))
                if tokenizer
                else verdict["model_dir"],
            },
        )

    def lineage(self, source: dict[str, Any]) -> dict[str, Any]:
        return {"gguf": {"type": source["type"], "gate": source["key"], "verdict": source["verdict"]}}

    def settings(self, cfg: Any) -> Any:
        return cfg.llamacpp.model_dump(mode="json")

    def command(
        self,
        model: Path,
        cfg: Any,
        *,
        port: int,
        host: str,
        served_name: str,
        directory: Path,
        lora: LoraModules | None,
    ) -> list[str]:
        return server_command(model, cfg.llamacpp, port=port, host=host, served_name=served_name)

    def environment(self) -> dict[str, str]:
        # serving.backends.llamacpp_server and lmforge.inference.vllm_guard, from this checkout
        return {"PYTHONPATH": str(REPO_ROOT)}
