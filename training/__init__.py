"""Pretraining domain: Llama model, parallelism planner, DeepSpeed launch and training loop,
verified checkpoints, stability guardrails, metrics and Hugging Face export.

Never imports prefect; deepspeed is imported only inside the functions that use it.
"""
