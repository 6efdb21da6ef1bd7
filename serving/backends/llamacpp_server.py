"""llama.cpp's OpenAI-compatible server for a GGUF file, behind the same guard as every vLLM server.

    python -m serving.backends.llamacpp_server --model F.gguf --served-name NAME --host 127.0.0.1 --port P [--n-ctx N]

Run with the llama.cpp environment's Python (.venv-llamacpp) and this repository on PYTHONPATH. It
is llama-cpp-python's own server app (`llama_cpp.server.app.create_app`: /v1/completions,
/v1/chat/completions with the chat template the GGUF file carries, /v1/models, streaming), with
`lmforge.inference.vllm_guard.Guard` outermost: a key on every path but /health, bounded bodies, `n` and
concurrency, its settings from the environment (the key never on the command line; llama.cpp's own
`--api_key` would put it there and guard /v1 only). Standard library and llama.cpp only.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from lmforge.inference.vllm_guard import Guard
    from serving.backends.llamacpp_cpu import without_weight_repacking

    without_weight_repacking()

    parser = argparse.ArgumentParser(prog="python -m serving.backends.llamacpp_server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--n-ctx", type=int, default=0, help="0: the model's own context length")
    parser.add_argument("--n-threads", type=int, default=None)
    args = parser.parse_args(argv)
    model = ModelSettings(
        model=args.model,
        model_alias=args.served_name,
        n_ctx=args.n_ctx,
        n_threads=args.n_threads or ModelSettings.model_fields["n_threads"].default,
        seed=0,
        verbose=False,
    )
    app = create_app(server_settings=ServerSettings(host=args.host, port=args.port), model_settings=[model])

    @app.get("/health", include_in_schema=False)
    def health() -> dict[str, str]:  # the model is loaded before the app exists: up means ready
        return {"status": "ok"}

    app.add_middleware(Guard)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
