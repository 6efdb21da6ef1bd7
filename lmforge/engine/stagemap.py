"""`lmforge stages`: the registered stages, their steps, and what each step consumes and produces.

It is drawn from the step graph itself (`Step.upstream`, `Step.provides`) for a configuration
(the tiny-cpu preset unless told otherwise), so it cannot drift from what runs. The docs'
per-stage diagrams (docs/stages/) are this output (`lmforge stages STAGE`); `tests/test_layout.py` checks
that they agree.

A consumed product reads `kind:role <- step`, the step that provides it in this configuration;
`[...]` marks an optional product (read when the lineage has it) and a bare name a step of the
same stage read by name. A step switched off in this configuration is listed with `(off)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.engine.stage import Maybe, Product

if TYPE_CHECKING:
    from lmforge.engine.graph import Graph, Step
    from lmforge.engine.stage import Stage
    from lmforge.pipelinebase import PipelineBase

WIDTH = 100


def _consumed(graph: Graph, step: Step, config: PipelineBase) -> list[str]:
    out: list[str] = []
    for want in step.upstream(config):
        optional = isinstance(want, Maybe)
        product = want.product if isinstance(want, Maybe) else want
        if isinstance(product, Product):
            providers = graph.providers(product, config)
            if not providers and optional:
                continue
            text = f"{product} <- {providers[0].name}" if providers else f"{product} <- (nothing enabled)"
        else:
            text = str(product)
        out.append(f"[{text}]" if optional else text)
    return out


def stage_lines(stage: Stage, graph: Graph, config: PipelineBase) -> list[str]:
    """The lines describing one stage: its header, then one line per step."""
    after = ", ".join(stage.after) or "-"
    lines = [f"{stage.name}  (after: {after}; runs on {stage.resources.pool})"]
    steps = [s for s in graph.steps if s.stage == stage.name]
    width = max((len(s.name) for s in steps), default=0)
    for step in steps:
        on = step.enabled(config)
        items = _consumed(graph, step, config) if on else []
        produced = ", ".join(str(p) for p in step.provides)
        head = f"  {step.name.ljust(width)}  {'' if on else '(off) '}reads "
        lines += _wrap(head, items or ["-"], f"  => {produced}" if produced else "")
    return lines


def _wrap(head: str, items: list[str], tail: str) -> list[str]:
    """`head` + the items joined by ", " + `tail`, continued under the first item past WIDTH columns."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else tail)
        if line != head and len(line) + 1 + len(piece) > WIDTH:
            lines.append(line)
            line = " " * len(head) + piece
        else:
            line += ("" if line == head else " ") + piece
    lines.append(line)
    return lines


def format_stages(stage: str | None = None, config: PipelineBase | None = None) -> str:
    """`lmforge stages [STAGE]`: every registered stage (or one), in lifecycle order."""
    from lmforge.config import load_config
    from lmforge.engine.executor import graph
    from lmforge.engine.registry import get_stage, stages

    config = config if config is not None else load_config("tiny-cpu", [], None, check_paths=False)
    chosen = [get_stage(stage)] if stage else list(stages())
    blocks = ["\n".join(stage_lines(s, graph(), config)) for s in chosen]
    return "\n\n".join(blocks)


MARKER = "<!-- lmforge stages {stage} -->"


def readme_with_stage_maps(text: str, config: PipelineBase | None = None) -> str:
    """`text` (the README) with the code block after each `<!-- lmforge stages STAGE -->` redrawn."""
    import re

    def redraw(match: re.Match[str]) -> str:
        return f"{match.group(1)}```\n{format_stages(match.group(2), config)}\n```"

    return re.sub(r"(<!-- lmforge stages ([\w-]+) -->\n)```\n.*?\n```", redraw, text, flags=re.DOTALL)
