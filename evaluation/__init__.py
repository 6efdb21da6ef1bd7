"""Evaluation domain: lm-eval benchmarks of every model in the lineage, and contamination checks.

`build` makes the built-in tasks offline, `lmeval_entry` runs lm-eval itself (hf or a vLLM
server), `stats` and `report` turn per-item logs into intervals and comparisons,
`contamination` indexes the lineage's training sources and checks every item against them, and
`sandbox` is the only place generated code runs. The steps are in `evaluation.steps`.
"""
