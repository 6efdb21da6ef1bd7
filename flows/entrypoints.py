"""Module-level flows for deployment entrypoints: `flows/entrypoints.py:<stage>` and `:pipeline`.

A deployment names its flow by file and attribute; stage flows are made by one factory
(`flows.stage.stage_flow`), so this module binds each registered stage's flow to its name.
"""

from flows.pipeline import pipeline
from flows.stage import stage_flow
from lmforge.engine.registry import stage_names

for _name in stage_names():
    globals()[_name.replace("-", "_")] = stage_flow(_name)

__all__ = ["pipeline", *[n.replace("-", "_") for n in stage_names()]]
