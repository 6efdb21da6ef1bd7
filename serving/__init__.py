"""Serving domain: vLLM's OpenAI-compatible server (`engine`), used by evaluation, the quantization
gate and the serving stage, so a model is judged the way it will be served."""
