"""lmforge: a language model's whole life as one Prefect pipeline.

The `lmforge` package holds the orchestrator-free core: typed configuration, the
content-addressed stage store, the step graph with its cache keys, the CLI, and what several
stages use (the vLLM server, input readers, JSONL files, n-gram keys), so no stage imports another.
"""

__version__ = "0.1.0"
