"""Serving domain: quantization and vLLM deployment (the last stages).

Not built yet. `pretrain/train/*/hf` is already a directory vLLM loads as it is.
"""
