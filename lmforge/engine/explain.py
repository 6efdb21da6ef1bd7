"""`lmforge explain`: would each step be reused, and if not, exactly why.

For every step of the requested stages (and what they need upstream) this computes the
key the current config gives, checks the store, and when the output cannot be reused
compares the key's ingredients with those of the step's last completed run: the config
fields that differ, the project files of its code that changed ("code changed:
data_prep/heuristics.py"), the upstream outputs that changed, a version bump, or damage to an
existing output. A reusable output made with other versions of the libraries that shape it
is reported as drift ("library datasketch changed 1.6 -> 1.7"); with
`runtime.on_code_drift: rerun` it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmforge.engine.codeprint import code_identity
from lmforge.engine.executor import graph, plan_step
from lmforge.engine.graph import config_identity
from lmforge.engine.store import StageStore
from lmforge.hashing import flatten

if TYPE_CHECKING:
    from lmforge.pipelinebase import PipelineBase


@dataclass
class Explanation:
    step: str
    key: str | None
    reuse: bool
    reasons: list[str]


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def diff_components(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two key-component records."""
    reasons: list[str] = []
    if old.get("version") != new.get("version"):
        reasons.append(f"step version changed {old.get('version')} -> {new.get('version')} (code semantics changed)")
    before, after = flatten(old.get("config", {})), flatten(new.get("config", {}))
    for name in sorted(set(before) | set(after)):
        if before.get(name, "<unset>") == after.get(name, "<unset>"):
            continue
        if name.endswith(".content"):  # a digest of input files (a base model's weights, config, tokenizer)
            old_digest, new_digest = str(before.get(name, "<unset>")), str(after.get(name, "<unset>"))
            reasons.append(f"{name.removesuffix('.content')} content changed ({old_digest[:12]} -> {new_digest[:12]})")
        else:
            reasons.append(f"{name} changed {_fmt(before.get(name, '<unset>'))} -> {_fmt(after.get(name, '<unset>'))}")
    old_code, new_code = old.get("code"), new.get("code")
    if old_code is not None and new_code is not None and old_code != new_code:
        edited = sorted(f for f in set(old_code) | set(new_code) if old_code.get(f) != new_code.get(f))
        shown = ", ".join(edited[:4]) + (f" and {len(edited) - 4} more" if len(edited) > 4 else "")
        reasons.append(f"code changed: {shown}")
    elif old_code is None and new_code is not None:
        reasons.append("code is part of the key now (this output was made before it was)")
    old_up, new_up = old.get("upstream", {}), new.get("upstream", {})
    for name in sorted(set(old_up) | set(new_up)):
        if name not in old_up:
            reasons.append(f"now reads upstream {name}")
        elif name not in new_up:
            reasons.append(f"no longer reads upstream {name}")
        elif old_up[name] != new_up[name]:
            reasons.append(f"upstream {name} output changed ({old_up[name][:12]} -> {new_up[name][:12]})")
    return reasons


def explain(config: PipelineBase, stages: list[str]) -> list[Explanation]:
    store = StageStore.for_config(config, fetch=False)  # explaining downloads nothing
    manifests: dict[str, dict[str, Any]] = {}
    rerun: set[str] = set()
    out: list[Explanation] = []
    for step in graph().active(config, stages):
        stale = [u for u in graph().upstream(step, config) if u in rerun]
        if stale:
            rerun.add(step.name)
            reasons = [
                f"upstream {u} will be recomputed (reused after all if it reproduces the same bytes)" for u in stale
            ]
            latest = store.latest(step.name)
            if latest is not None:
                own = {
                    "step": step.name,
                    "version": step.version,
                    "config": config_identity(step, config),
                    "code": code_identity(step),
                    "upstream": {},
                }
                reasons += diff_components({**latest["key_components"], "upstream": {}}, own)
            out.append(Explanation(step.name, None, False, reasons))
            continue
        plan = plan_step(step, config, store, manifests)
        if plan.cached:
            manifests[step.name] = plan.manifest  # type: ignore[assignment]
            drifted = [f"{line} (runtime.on_code_drift=warn: reused anyway)" for line in plan.drift]
            found = step.findings(plan.manifest) if step.findings and plan.manifest else []
            out.append(Explanation(step.name, plan.key, True, ["complete and verified", *drifted, *found]))
            continue
        rerun.add(step.name)
        latest = store.latest(step.name)
        if latest is None:
            reasons = ["never run in this workspace"]
        elif latest["key"] == plan.key:
            reasons = [plan.reason]
        else:
            reasons = diff_components(latest["key_components"], plan.components) or [plan.reason]
        out.append(Explanation(step.name, plan.key, False, reasons))
    return out


def format_explanations(items: list[Explanation]) -> str:
    width = max((len(i.step) for i in items), default=10)
    lines = []
    for item in items:
        verdict = "reuse    " if item.reuse else "recompute"
        key = (item.key or "?")[:16].ljust(16)
        lines.append(f"{item.step.ljust(width)}  {key}  {verdict}  {item.reasons[0]}")
        lines.extend(f"{'':{width}}  {'':16}  {'':9}  {reason}" for reason in item.reasons[1:])
    return "\n".join(lines)
