"""A plug-in is keyed by its own code without declaring it (issue 52, item 4).

Every registry (`lmforge.plugins.registered`: curation filters, serving backends, alignment
methods) adds the registered object's own module to its `code`, and the code identity follows
that module's imports inside its package as it follows the project's. So a curation filter a
package registers, listing no `code`, re-keys `curate/heuristics` and `curate/select` when its
module or a module it imports is edited; a comment edit re-keys nothing (modules count by their
syntax tree, as the project's do).

The package is a real dist-info on the path, as pip installs it, and each identity is computed in a
fresh process (as a rerun would), without running any step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("curate/heuristics", "curate/select")

LIMITS = "MIN_LETTERS = 20\n"

FILTER = '''"""Documents in capitals: a filter that names no `code`."""

from typing import Any

from pydantic import Field

from data_prep.filters.base import CurationFilter, FilterBase, Stats, failing

from .limits import MIN_LETTERS

FLOOR = 0.0


class LoudConfig(FilterBase):
    max_upper_ratio: float | None = Field(0.3, description="Max share of letters in upper case.")


class Loud(CurationFilter):
    name = "loud"
    description = "Documents in capitals"
    config = LoudConfig

    def stats(self, text: str, cfg: Any) -> Stats:
        letters = [c for c in text if c.isalpha()]
        upper = sum(c.isupper() for c in letters)
        return {"loud_upper_ratio": upper / len(letters) if len(letters) >= MIN_LETTERS else FLOOR}

    def failures(self, stats: Stats, cfg: Any) -> list[str]:
        return failing("loud", cfg.enabled, [("upper_ratio", cfg.max_upper_ratio, stats["loud_upper_ratio"], "max")])
'''

IDENTITIES = """
import json, sys
from pathlib import Path

from data_prep.filters import filters
from lmforge.engine import codeprint
from lmforge.engine.executor import graph
from lmforge.engine.graph import key_components, step_key
from tests.conftest import small_config

config = small_config(Path(sys.argv[1]))
steps = [graph().get(name) for name in sys.argv[2:]]
print(json.dumps({
    "registered": list(filters()),
    "code": {s.name: codeprint.code_identity(s) for s in steps},
    "keys": {s.name: step_key(key_components(s, config, (), {})) for s in steps},
}))
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """`loud_filter` (a package: `loud_filter.loud` imports `loud_filter.limits`) with a
    `lmforge.curation_filters` entry point, installed as pip would."""
    site = tmp_path / "site"
    package = site / "loud_filter"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "limits.py").write_text(LIMITS)
    (package / "loud.py").write_text(FILTER)
    info = site / "loud_filter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: loud-filter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lmforge.curation_filters]\nloud = loud_filter.loud:Loud\n")
    return site


def identities(site: Path, tmp_path: Path) -> dict[str, Any]:
    """The code identities and own keys (upstream digests left out) of the steps that run filters,
    computed in a fresh process with a private code-digest cache."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "LMFORGE_CACHE_DIR": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, "-c", IDENTITIES, str(tmp_path / "ws"), *STEPS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def test_a_filter_that_lists_no_code_is_keyed_by_its_module_and_what_it_imports(site: Path, tmp_path: Path) -> None:
    before = identities(site, tmp_path)
    assert before["registered"][-1] == "loud"
    for name in STEPS:
        code = before["code"][name]
        assert "plugin:loud_filter.loud" in code, (name, sorted(code))
        assert "plugin:loud_filter.limits" in code, (name, sorted(code))  # followed through its import
        assert "plugin:loud_filter" in code  # importing loud_filter.loud runs the package's __init__
        assert "data_prep/filters/base.py" in code  # what it imports from the project counts as the project's

    # the filter's own module: a constant its statistics use
    edit(site / "loud_filter" / "loud.py", "FLOOR = 0.0", "FLOOR = 0.1")
    own = identities(site, tmp_path)
    for name in STEPS:
        assert own["code"][name] != before["code"][name], name
        assert own["keys"][name] != before["keys"][name], name
        changed = {f for f in own["code"][name] if own["code"][name][f] != before["code"][name].get(f)}
        assert changed == {"plugin:loud_filter.loud"}, (name, changed)

    # a module it imports, not named anywhere but in its import
    edit(site / "loud_filter" / "limits.py", "MIN_LETTERS = 20", "MIN_LETTERS = 25")
    imported = identities(site, tmp_path)
    for name in STEPS:
        assert imported["keys"][name] != own["keys"][name], name
        changed = {f for f in imported["code"][name] if imported["code"][name][f] != own["code"][name].get(f)}
        assert changed == {"plugin:loud_filter.limits"}, (name, changed)

    # a comment and a docstring do not change what it does: nothing re-keys
    edit(site / "loud_filter" / "loud.py", "FLOOR = 0.1", '# the ratio of a short text\nFLOOR = 0.1  # "no letters"')
    edit(
        site / "loud_filter" / "loud.py",
        "class LoudConfig(FilterBase):",
        'class LoudConfig(FilterBase):\n    """Its section."""\n',
    )
    assert identities(site, tmp_path) == imported


def test_every_registry_adds_the_plugins_own_module_to_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`registered` (the one loader of every registry) puts the module defining each plug-in first
    in its `code`, before the modules it lists, with no module twice; a built-in that already listed
    its module keeps its `code` as it was (so its steps' keys do not move)."""
    from lmforge.plugins import registered

    (tmp_path / "quiet_plugins.py").write_text(
        "class Quiet:\n    name = 'quiet'\n\n\n"
        "class Listed:\n    name = 'listed'\n    code = ('json', 'quiet_plugins')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "quiet_plugins", raising=False)
    found = registered(("quiet_plugins:Quiet", "quiet_plugins:Listed"), "lmforge.no_such_group", "test plug-in")
    assert found["quiet"].code == ("quiet_plugins",)
    assert found["listed"].code == ("quiet_plugins", "json")
    sys.modules.pop("quiet_plugins", None)

    from data_prep.filters import filters
    from serving.backends import backends
    from training.align.methods import methods

    for registry in (filters(), backends(), methods()):
        for plugin in registry.values():
            assert plugin.code[0] == type(plugin).__module__, plugin.name
            assert len(set(plugin.code)) == len(plugin.code), plugin.name
            assert set(type(plugin).code) <= set(plugin.code), plugin.name
    # the built-in filters and backends listed their own module first: unchanged
    assert filters()["length"].code == ("data_prep.filters.length", "data_prep.heuristics")
    assert backends()["vllm"].code == type(backends()["vllm"]).code


def test_a_stage_a_package_registers_is_keyed_by_its_step_functions_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage registry's plug-ins: a step whose functions live outside the project (a stage another
    package registers) counts their module and what it imports of its package, as a project step does."""
    import importlib

    from lmforge.engine import codeprint
    from lmforge.engine.graph import Step

    monkeypatch.setenv("LMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(codeprint, "_disk_cache", lambda: {})
    monkeypatch.setattr(codeprint, "_dirty", set())
    package = tmp_path / "far_stage"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "limits.py").write_text("LIMIT = 1\n")
    (package / "steps.py").write_text(
        "from far_stage.limits import LIMIT\n\n\ndef finalize(ctx, results):\n    return {'limit': LIMIT}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        steps = importlib.import_module("far_stage.steps")
        step = Step("far/step", 1, "a step of a stage another package registers", finalize=steps.finalize)
        before = codeprint.code_identity(step)
        assert {"plugin:far_stage", "plugin:far_stage.steps", "plugin:far_stage.limits"} <= set(before)
        edit(package / "limits.py", "LIMIT = 1", "LIMIT = 2")
        after = codeprint.code_identity(step)
        assert {f for f in after if after[f] != before[f]} == {"plugin:far_stage.limits"}
    finally:
        for name in ("far_stage", "far_stage.steps", "far_stage.limits"):
            sys.modules.pop(name, None)
