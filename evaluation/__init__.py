"""Evaluation domain: lm-eval benchmarking and contamination checks (the evaluation stage).

Not built yet. The curation stage already plants HumanEval prompts in the demo corpus
(`curate/demo/*/labels.jsonl`, kind "contamination") for the contamination check to find.
"""
