"""The layout the architecture promises: domain packages stay free of Prefect, and each package
imports only the packages the layering allows it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOMAIN = ("data_prep", "training", "evaluation", "serving")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_domain_packages_never_import_prefect_or_the_wrappers() -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & {"prefect", "tasks", "flows"})
        for package in DOMAIN
        for p in (ROOT / package).rglob("*.py")
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert offenders == {}
    assert list((ROOT / "data_prep").rglob("*.py")) and list((ROOT / "training").rglob("*.py"))


# -- package layering ----------------------------------------------------------------------------
# Which project package may import which, besides itself, the standard library and third-party
# packages. Stages import the core and hand each other products (paths and digests), not code:
# what two stages share (the vLLM server, JSONL files, input readers, n-gram keys, HumanEval's
# items, input fingerprints) lives in `lmforge`. A key covers a package or module and everything
# under it; a file's allowance is the union of every key it falls under. An entry allows that
# package or module and everything under it. tests/, benchmarks/ and scripts/ may import anything.
ALLOWED: dict[str, set[str]] = {
    "lmforge": {"configs"},  # the embedded presets: YAML files and their folder, no stage code
    "configs": set(),
    "data_prep": {"lmforge"},
    "training": {"lmforge"},
    "evaluation": {"lmforge"},
    "serving": {"lmforge"},
    # The quantization gate measures each checkpoint with the evaluation stage's metric runs, so
    # both find each other's cached per-task results: a later stage may use these public modules
    # of an earlier one (never its steps), and evaluation never imports serving.
    "serving.quantize": {"evaluation.runs", "evaluation.stats", "evaluation.report", "evaluation.backends"},
    # The release's safety gate measures a candidate as evaluate/safety does, finding its cached answers
    "serving.safety_gate": {"evaluation.asking", "evaluation.answers", "evaluation.safety"},
    "tasks": {"lmforge"},
    "flows": {"lmforge", "tasks"},
}
UNCHECKED = ("tests", "benchmarks", "scripts")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_project_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import anywhere in the tree, function-local ones included;
    `from a import b` names `a.b` when b is a module of this repository."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((node.lineno, full if _is_project_module(full) else base))
    return list(dict.fromkeys(found))  # `from a import b, c` is one line for one module


def forbidden_imports(source: str, path: Path) -> list[str]:
    """One line per import of `source` (the text of `path`) that the allow-list does not permit."""
    module = _module_name(path)
    own = module.split(".")[0]
    allowed = {own}.union(*(names for key, names in ALLOWED.items() if module == key or module.startswith(key + ".")))
    lines = []
    for line, name in _imported_names(ast.parse(source), module, path.name == "__init__.py"):
        top = name.split(".")[0]
        if top not in ALLOWED or any(name == a or name.startswith(a + ".") for a in allowed):
            continue  # standard library, third party, or permitted
        lines.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return lines


def _packages() -> set[str]:
    return {
        p.name
        for p in ROOT.iterdir()
        if (p / "__init__.py").is_file() or (p.is_dir() and not p.name.startswith(".") and any(p.glob("*.py")))
    }


def test_every_package_has_a_place_in_the_allow_list() -> None:
    assert _packages() == {key for key in ALLOWED if "." not in key} | set(UNCHECKED)


def test_packages_import_only_what_the_allow_list_permits() -> None:
    offenders = [
        line
        for package in ALLOWED
        if "." not in package
        for path in sorted((ROOT / package).rglob("*.py"))
        for line in forbidden_imports(path.read_text(), path)
    ]
    assert not offenders, "imports against the layering:\n" + "\n".join(offenders)


def test_the_layering_check_reports_a_planted_import() -> None:
    """The check can fail: imports a stage may not make, at module level and inside a function."""
    planted = (
        "from lmforge.hashing import digest\n"
        "import numpy\n"
        "def run():\n"
        "    from evaluation.runs import evaluate_model\n"
        "    import serving.release\n"
    )
    assert forbidden_imports(planted, ROOT / "data_prep" / "planted.py") == [
        "data_prep/planted.py:4 imports evaluation.runs",
        "data_prep/planted.py:5 imports serving.release",
    ]
    # the gate may use evaluation's metric runs, not its steps, and the serve stage may use neither
    gate = "from evaluation import runs, steps\nfrom . import schemes\n"
    assert forbidden_imports(gate, ROOT / "serving" / "quantize" / "planted.py") == [
        "serving/quantize/planted.py:1 imports evaluation.steps"
    ]
    assert forbidden_imports(gate, ROOT / "serving" / "planted.py") == [
        "serving/planted.py:1 imports evaluation.runs",
        "serving/planted.py:1 imports evaluation.steps",
    ]
    assert forbidden_imports("from flows.pipeline import pipeline\n", ROOT / "lmforge" / "engine" / "executor.py") == [
        "lmforge/engine/executor.py:1 imports flows.pipeline"
    ]


# -- import cycles -------------------------------------------------------------------------------
# No module may reach itself through imports, inside a package or across packages. Every import
# counts: at module level, inside a function (a lazy import only hides a ring) and under
# TYPE_CHECKING (a type named across a ring ties the modules as firmly).


def module_imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """{module: the modules of `modules` it imports}, from {dotted name: source}."""
    import ast

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, source in modules.items():
        is_package = any(other.startswith(f"{module}.") for other in modules)  # its __init__
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for name in names:
                target = owner(name)
                if target is not None and target != module:
                    edges[module].add(target)
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The rings of the import graph (strongly connected groups of two or more modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    rings: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            ring = []
            while True:
                w = stack.pop()
                ring.append(w)
                if w == v:
                    break
            if len(ring) > 1:
                rings.append(sorted(ring))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return rings


def _project_modules() -> dict[str, str]:
    found = {}
    for package in sorted(_packages()):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path.read_text()
    return found


def test_no_module_imports_itself_back() -> None:
    rings = import_cycles(module_imports(_project_modules()))
    assert not rings, "import rings (each module reaches the others and itself):\n" + "\n".join(map(str, rings))


def test_the_cycle_check_reports_a_planted_ring() -> None:
    """A lazy import and a TYPE_CHECKING one still close a ring; a one-way chain is none."""
    modules = {
        "lmforge.config": "from lmforge.engine.graph import Graph\n",
        "lmforge.engine.graph": "def build():\n    from lmforge.engine.stage import Stage\n",
        "lmforge.engine.stage": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmforge.config import PipelineBase\n"
        ),
        "lmforge.hashing": "import lmforge.config\n",
        "training.align.methods": "from training.align.methods.sft import SFT\n",
        "training.align.methods.sft": "from . import AlignMethod\n",
    }
    assert import_cycles(module_imports(modules)) == [
        ["lmforge.config", "lmforge.engine.graph", "lmforge.engine.stage"],
        ["training.align.methods", "training.align.methods.sft"],
    ]
    del modules["training.align.methods"]
    modules["lmforge.engine.stage"] = "import json\n"
    assert import_cycles(module_imports(modules)) == []


# -- the stage maps ------------------------------------------------------------------------------


def test_docs_stage_maps_are_what_lmforge_stages_prints() -> None:
    """Each stage's page (docs/stages/) shows `lmforge stages STAGE`, drawn from the step graph."""
    from lmforge.engine.registry import stage_names
    from lmforge.engine.stagemap import MARKER, readme_with_stage_maps

    pages = sorted((ROOT / "docs" / "stages").glob("*.md"))
    text = "".join(page.read_text() for page in pages)
    missing = [s for s in stage_names() if MARKER.format(stage=s) not in text]
    assert not missing, f"docs/stages/ has no stage map for {missing} (add `{MARKER}` before a code block)"
    drifted = [page.name for page in pages if readme_with_stage_maps(page.read_text()) != page.read_text()]
    assert not drifted, (
        f"the stage maps in docs/stages/{drifted} differ from the step graph: run `lmforge stages --update-docs docs`"
    )


def test_the_cli_core_finds_the_orchestrator_as_a_plugin_and_keeps_old_spellings(capsys) -> None:  # type: ignore[no-untyped-def]
    from lmforge import cli

    assert cli.main(["deploy", "--write-prefect-yaml", "/dev/null"]) == 0  # the old spelling, one release more
    assert "`lmforge deploy` is now `lmforge deployments`" in capsys.readouterr().err
    assert cli._commands is not None and cli._commands.orchestrator is not None  # flows.cli, via entry points
    assert cli.main(["stages", "pretrain"]) == 0
    assert "pretrain/train" in capsys.readouterr().out


# -- test tiers and the components table ---------------------------------------------------------


def test_the_tier_sets_name_test_files_that_exist_and_no_file_twice() -> None:
    from tests.conftest import E2E_FILES, UNIT_FILES

    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert not (UNIT_FILES | E2E_FILES) - files, "a tier set names a file that does not exist"
    assert not UNIT_FILES & E2E_FILES


def test_every_component_in_the_contributing_table_is_started_by_a_test_that_exists() -> None:
    """docs/contributing.md maps each real component to the test that starts it; a renamed or deleted
    test would leave a component that no test starts without anyone noticing."""
    import re

    text = (ROOT / "docs" / "contributing.md").read_text()
    rows = re.findall(r"^\s*\| ([^|]+) \| `(tests/test_\w+\.py)::(test_\w+)` \|$", text, flags=re.M)
    components = {c.strip() for c, _, _ in rows}
    for needed in ("Prefect server", "DeepSpeed, 2 ranks", "FSDP2, 2 ranks", "lm-eval", "llmcompressor", "S3 server"):
        assert needed in components, f"docs/contributing.md's components table has no row for {needed}"
    assert len(rows) >= 12
    for component, path, name in rows:
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{component}: {path} has no test {name}"


# -- parallelisms ----------------------------------------------------------------------------------

# string constants spelled like an engine that do not name the engine: the process launcher that
# is DeepSpeed's runner, and the library's own import name
LAUNCHER_SPELLINGS = {
    ("training/config.py", "launcher"),
    ("training/align/config.py", "launcher"),
    ("lmforge/processes/launch.py", "Launcher"),
    ("lmforge/processes/launch.py", "launch.launcher"),
    ("training/align/config.py", "d.launcher"),
    ("training/device_setup.py", "find_spec"),
}


def _engine_literals(path: Path) -> list[tuple[int, str, str]]:
    """(line, literal, context) of every string constant that is an engine's name."""
    from training.parallel import ENGINE_NAMES

    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in ENGINE_NAMES:
            context, up = "", parents.get(node)
            while up is not None and not context:
                if isinstance(up, ast.AnnAssign | ast.Assign):
                    target = up.target if isinstance(up, ast.AnnAssign) else up.targets[0]
                    context = ast.unparse(target)
                elif isinstance(up, ast.Compare):
                    context = ast.unparse(up.left)
                elif isinstance(up, ast.Call):
                    context = ast.unparse(up.func).rsplit(".", 1)[-1]
                up = parents.get(up)
            out.append((node.lineno, node.value, context))
    return out


def test_no_engine_is_named_outside_its_module() -> None:
    """Adding an engine is one module in training/parallel/engines: nothing else compares a backend
    with a name, so nothing else needs an edit (tests and benchmarks, which compare engines, aside)."""
    found = []
    for package in ("lmforge", "flows", *DOMAIN):
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("training/parallel/engines/"):
                continue
            found += [
                f"{rel}:{line}: {literal!r} ({context})"
                for line, literal, context in _engine_literals(path)
                if (rel, context) not in LAUNCHER_SPELLINGS
            ]
    assert not found, "\n".join(found)


def test_the_engine_literal_check_reports_a_planted_comparison(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('def f(plan):\n    return plan.backend == "fsdp2"\n')
    assert _engine_literals(planted) == [(2, "fsdp2", "plan.backend")]


def test_engines_and_dimensions_are_the_modules_of_their_folders() -> None:
    from training.config import DistributedConfig
    from training.parallel import DIMENSION_NAMES, ENGINE_NAMES, all_dimensions, all_engines

    assert ENGINE_NAMES == tuple(sorted(p.stem for p in (ROOT / "training/parallel/engines").glob("[!_]*.py")))
    assert [e.name for e in all_engines()] == list(ENGINE_NAMES)
    assert DIMENSION_NAMES == tuple(sorted(p.stem for p in (ROOT / "training/parallel/dims").glob("[!_]*.py")))
    assert {d.field for d in all_dimensions()} <= set(DistributedConfig.model_fields)  # each has its degree
