"""The interface every serving backend implements (see `serving.backends`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from lmforge.config import ConfigOrView
    from lmforge.engine.graph import StepContext
    from lmforge.engine.stage import Product
    from lmforge.inference.vllm_server import LoraModules

ADAPTERS, SPECULATIVE = "adapters", "speculative"  # the features a backend may support (serve.<feature>)


class ServingBackend:
    """One kind of OpenAI-compatible server the release can start, smoke-test, SLO-check and promote.

    Subclass it in one module and register the class (`serving.backends.BUILTIN` or the
    `lmforge.serving_backends` entry-point group). The defaults describe a server of the lineage's
    Hugging Face model directory (the role `serve.model` chooses) that supports nothing extra.
    """

    name: ClassVar[str]  # serve.backend
    label: ClassVar[str]  # in log lines: "starting <label> for ..."
    description: ClassVar[str]
    section: ClassVar[str]  # its settings, serve.<section>; part of serve/release's reads
    config: ClassVar[type[Any] | None] = None  # the section's model, when the backend brings it (else serve has it)
    supports: ClassVar[frozenset[str]] = frozenset()  # of ADAPTERS, SPECULATIVE
    code: ClassVar[tuple[str, ...]] = ()  # the modules its server runs: part of serve/release's code identity
    libraries: ClassVar[tuple[str, ...]] = ()  # whose versions are part of serve/release's identity

    def upstream(self, config: ConfigOrView) -> tuple[Product, ...]:
        """Products serve/release needs besides the lineage's models (raises ConfigError when the
        stage that makes them is off)."""
        return ()

    def choose(self, ctx: StepContext) -> tuple[str, Path, dict[str, Any]] | None:
        """(the served role's name, the model path to serve, its source: step, key, digest, `from`)
        when this backend serves something other than the model `serve.model` names; else None."""
        return None

    def lineage(self, source: dict[str, Any]) -> dict[str, Any]:
        """What the served model's lineage records about this backend's choice (from `choose`'s source)."""
        return {}

    def settings(self, cfg: Any) -> Any:
        """Its settings beyond `serve.engine` that restart a running server when they change."""
        return None

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
        """The server's command line (never the key: that reaches the guard through the environment)."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """Variables its server needs beyond the guard's (lmforge.inference.vllm_server.server_env)."""
        return {}

    def check(self, cfg: Any) -> str | None:
        """Why `cfg` (serve:) asks for something this backend does not do, or None."""
        wanted = {ADAPTERS: cfg.adapters.enabled, SPECULATIVE: cfg.speculative.method != "off"}
        missing = [f"serve.{feature}" for feature, on in wanted.items() if on and feature not in self.supports]
        if missing:
            return (
                f"serve.backend: {self.name} does not support {' or '.join(missing)} "
                f"(turn {'them' if len(missing) > 1 else 'it'} off, or use a backend that does)"
            )
        return None
