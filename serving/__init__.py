"""Serving domain: releasing the lineage's model behind vLLM's OpenAI-compatible server (`release`:
start a candidate, smoke-test it, promote it; "deploy" is kept for Prefect deployments),
its SLO check (`slo`), and the quantization stage (`serving.quantize`). The server itself
(`lmforge.inference.vllm_server`) is in the core: evaluation and the quantization gate start it too, so a
model is judged the way it will be served."""
