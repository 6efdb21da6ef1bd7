"""Which code makes a step's output: its import closure inside the project, part of its key.

A step's code is the modules defining its functions (identity, units, finalize) plus those it
names in `Step.code` (the entry modules its launches run, which no import reaches), and then
every project module those import, directly or not, found by reading their source: nothing is
listed by hand, so no module a step uses can be forgotten. Each module counts by a digest of
its syntax tree without docstrings, so a comment or docstring edit reruns nothing, while any
edit to what the code does reruns every step that imports it and, through their outputs,
whatever reads those only if the bytes changed (keys take upstream *digests*).

Two kinds of modules are left out, and the closure does not follow their imports: the
orchestration that runs steps but never shapes what they write (`NOT_STEP_CODE`: the CLI,
the executor and store, the terminal, the supervisor, stage registration) and the orchestrator
packages (`flows`, `tasks`). Leaving a module out wrongly would let one key name two
contents, so only modules that provably do not touch outputs are listed; listing too few only
costs reruns.

What no import shows is declared. A project file a step reads *by path* at run time -- a
template it renders, data it loads, a script it copies beside its output for another program to
run -- is listed in `Step.files` (repo-relative paths or globs) and counts by its *bytes* under its
path, beside the modules, so `lmforge explain` names it as it names a module ("code changed:
evaluation/tasks/lmforge_chat_exact.yaml"). One rule decides file or module: what runs by name
in the project's environment is a module (`Step.code`: entry modules a launch runs with `python
-m`, packages loaded with `importlib.import_module`, every module of a named package counting);
what is read or copied by path is a file. So evaluation's `utils.py`, `sandbox.py` and
`lmforge/text/verify.py`, copied beside the task YAMLs and loaded there by lm-eval by path, are files:
the copies are part of the output, so their bytes (a comment included) are what must key it, and
what they load they load by path, which no import closure follows. A pattern that matches no file
is an error when the step is created, never an empty set.

A plug-in another package registers (a curation filter, a serving backend, an alignment method:
`lmforge.plugins`; a stage's step functions) counts as the project's modules do, under
"plugin:<module>": its module is in the `code` of the steps that run it (`lmforge.plugins.keyed`
puts it there), and the imports followed from it are those of its own top-level package and of the
project (what it imports from other distributions are libraries, recorded by version when it names
them in `libraries`). A plug-in module with no Python source (an extension) counts by its bytes.

What else lives outside the project counts through the step's `derive` (the config part of its key),
by content, never by path: a user's reward `module:function` by its source file
(`training.align.steps`), a base model's remote code by its `*.py` files when `trust_remote_code`
is set (`training.base.steps`), a user's task YAML by its folder (`evaluation.steps`). Library
versions are recorded beside the key, not in it (a library upgrade is *drift*: `lmforge explain`
names it and `runtime.on_code_drift` decides whether the step warns or reruns).

Digests are remembered across runs by each file's stamp (mtime, ctime, size, inode); a file
changed within `RACY_NS` of now is digested afresh every time, since a second write in the same
timestamp tick could leave its whole stamp as it was (the rule `lmforge.engine.store` applies to outputs).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from lmforge.engine.store import RACY_NS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lmforge", "training", "data_prep", "evaluation", "serving", "configs")
ORCHESTRATOR = ("flows", "tasks")  # Prefect wrappers: never imported by steps (tests/test_layout.py)
NOT_STEP_CODE = frozenset(
    {
        "lmforge.cli",
        "lmforge.engine.codeprint",
        "lmforge.console",
        "lmforge.errors",
        "lmforge.engine.executor",
        "lmforge.engine.explain",
        "lmforge.engine.graph",
        "lmforge.processes.launcher",
        "lmforge.engine.registry",
        "lmforge.engine.remote",
        "lmforge.server",
        "lmforge.processes.slurm",
        "lmforge.engine.stage",
        "lmforge.engine.stagemap",
        "lmforge.engine.steplog",
        "lmforge.engine.store",
        "lmforge.engine.workspace",
        "lmforge.processes.supervise",
        "lmforge.tracking",
    }
)


def _excluded(module: str) -> bool:
    # `<package>.stage` modules register a stage (its steps, artifacts, CLI): they run nothing a step writes
    return module in NOT_STEP_CODE or module.split(".")[0] in ORCHESTRATOR or module.endswith(".stage")


def _file(module: str) -> Path | None:
    """The project file of `module`, None for anything outside the project."""
    if module.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _plugin_file(module: str) -> Path | None:
    """The file of `module` outside the project (a plug-in's), found as Python would import it; None
    when it has none (built-in, frozen, not importable). Finding a submodule imports its parent
    packages (a plug-in's own package: imported already when it was registered)."""
    if module.split(".")[0] in PACKAGES:
        return None
    try:
        loaded = sys.modules.get(module)
        spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec(module)
    except (ImportError, ValueError, AttributeError):
        return None
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    return origin if origin is not None and origin.is_file() else None


def _source(module: str) -> Path | None:
    """The file of `module`: a project module's, or a plug-in's outside the project."""
    return _file(module) if module.split(".")[0] in PACKAGES else _plugin_file(module)


def _label(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _key(module: str, path: Path) -> str:
    """How the identity names a module: a project file by its path, a plug-in's by "plugin:<module>"."""
    return _label(path) if module.split(".")[0] in PACKAGES else f"plugin:{module}"


class _Normalized(ast.NodeTransformer):
    """Drop docstrings: they do not change what the code does."""

    def _strip(self, node: Any) -> Any:
        self.generic_visit(node)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            if isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        return node

    visit_Module = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _strip


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Project modules that `tree` (of `module`) imports anywhere (functions included), except under
    TYPE_CHECKING; for a plug-in's module outside the project, its own package's modules too."""
    found: set[str] = set()
    own = module.split(".")[0]
    plugin = own not in PACKAGES
    package = module if is_package else module.rpartition(".")[0]
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)  # `from pkg import module`
        todo.extend(ast.iter_child_nodes(node))
    modules = set()
    for name in found:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
            prefix = ".".join(parts[:i])
            if _file(prefix) is not None or (plugin and parts[0] == own and _plugin_file(prefix) is not None):
                modules.add(prefix)
    return modules


def _parse(module: str, path: Path) -> tuple[str, list[str]]:
    """(digest of the normalized syntax tree, project modules it imports)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    imports = _imports(tree, module, path.name == "__init__.py")
    normalized = ast.dump(_Normalized().visit(tree), annotate_fields=False, include_attributes=False)
    return hashlib.sha256(normalized.encode()).hexdigest()[:16], sorted(imports)


def _top_level(tree: ast.Module) -> tuple[dict[str, list[ast.stmt]], list[ast.stmt]]:
    """The module's top-level statements by the names they define (one per imported name), and those
    that define no name (they run on import: always part of a slice). TYPE_CHECKING blocks run never."""
    named: dict[str, list[ast.stmt]] = {}
    unnamed: list[ast.stmt] = []
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If) and _type_checking_only(node):
            body[:0] = node.orelse
        elif isinstance(node, (ast.If, ast.Try)):  # conditional definitions: what either branch defines
            unnamed.append(ast.Expr(node.test) if isinstance(node, ast.If) else ast.Pass())
            inner = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            inner += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
            body[:0] = inner
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            named.setdefault(node.name, []).append(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                one = (
                    ast.Import(names=[alias])
                    if isinstance(node, ast.Import)
                    else ast.ImportFrom(module=node.module, names=[alias], level=node.level)
                )
                named.setdefault((alias.asname or alias.name).split(".")[0], []).append(one)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            for name in names:
                named.setdefault(name, []).append(node)
            if not names:
                unnamed.append(node)
        else:
            unnamed.append(node)
    return named, unnamed


def _slice(module: str, path: Path, roots: tuple[str, ...]) -> tuple[str, list[str]]:
    """(digest, imports) of only the parts of `module` that `roots` reach by name, transitively.

    A root is a top-level name, or `lambda@LINE` for the lambdas on that line. A module that
    defines the functions of many steps (`data_prep/steps.py`) thus counts for each step by what
    that step's functions use: an edit to the tokenizer's step code does not rerun ingestion.
    """
    tree = ast.parse(path.read_bytes(), filename=str(path))
    named, unnamed = _top_level(tree)
    reached: dict[int, ast.AST] = {id(n): n for n in unnamed}
    todo: list[ast.AST] = list(unnamed)
    for root in roots:
        if root.startswith("lambda@"):
            line = int(root.split("@")[1])
            found: list[ast.AST] = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and n.lineno == line]
        else:
            found = list(named.get(root, []))
        if not found:
            raise KeyError(root)
        todo += found
    seen: set[str] = set()
    while todo:
        node = todo.pop()
        reached[id(node)] = node
        for inner in ast.walk(node):
            if isinstance(inner, ast.Name) and inner.id in named and inner.id not in seen:
                seen.add(inner.id)
                todo.extend(named[inner.id])
    nodes = sorted(reached.values(), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
    imports: set[str] = set()
    parts = []
    for node in nodes:
        imports |= _imports(node, module, path.name == "__init__.py")
        parts.append(ast.dump(_Normalized().visit(node), annotate_fields=False, include_attributes=False))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16], sorted(imports)


def _cache_file() -> Path:
    return Path(os.environ.get("LMFORGE_CACHE_DIR", Path.home() / ".cache" / "lmforge")) / "code-digests.json"


@functools.cache
def _disk_cache() -> dict[str, Any]:
    """Parsing the whole project takes about a second: digests are kept across runs, by file stat."""
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _stamp(path: Path) -> str | None:
    """What a cached digest of `path` is trusted by: mtime, ctime, size and inode. None for a file
    changed within the racy window of now: a second write within the same timestamp tick could keep
    every one of those, so its digest is computed afresh each time until it has aged."""
    stat = path.stat()
    if time.time_ns() - max(stat.st_mtime_ns, stat.st_ctime_ns) < RACY_NS:
        return None
    return f"{path}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_size}:{stat.st_ino}"


def _cached(path: Path, slot: str, compute: Callable[[], list[Any]]) -> list[Any]:
    """`compute()` for `path`, remembered under its stamp and `slot` (which slice, or its bytes)."""
    stamp = _stamp(path)  # taken before reading: a write while it is read changes the stamp
    if stamp is None:
        return compute()
    cache = _disk_cache()
    slices = cache.get(stamp)
    if not isinstance(slices, dict):
        slices = cache[stamp] = {}
    entry = slices.get(slot)
    if entry is None:
        entry = slices[slot] = list(compute())
        _dirty.add(stamp)
    return entry


def _read(module: str, roots: tuple[str, ...] = ()) -> tuple[str, frozenset[str]]:
    """(digest, imports) of the whole module, or of the slice `roots` reach (see `_slice`); a plug-in
    module with no Python source (an extension) by its bytes, importing nothing followed."""
    path = _source(module)
    assert path is not None
    if path.suffix != ".py":
        return _bytes_digest(path), frozenset()
    entry = _cached(path, ",".join(roots), lambda: list(_slice(module, path, roots) if roots else _parse(module, path)))
    return entry[0], frozenset(entry[1])


_dirty: set[str] = set()


def _save() -> None:
    """Write new digests back (whole, atomically), dropping entries of files that changed since."""
    if not _dirty:
        return
    cache = _disk_cache()
    current = {key.rsplit(":", 4)[0]: key for key in cache}  # the newest stamp seen per file
    for key in _dirty:
        current[key.rsplit(":", 4)[0]] = key
    kept = {key: cache[key] for key in current.values()}
    target = _cache_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, target)
        _dirty.clear()
    except OSError:  # a read-only home: digests are recomputed next time
        pass


def _package_modules(package: str) -> list[str]:
    path = _source(package)
    if path is None or path.name != "__init__.py":
        return []
    return sorted(
        ".".join((package, *p.relative_to(path.parent).with_suffix("").parts)).removesuffix(".__init__")
        for p in path.parent.rglob("*.py")
    )


def _function_root(function: Any) -> str:
    """The top-level name (or `lambda@LINE`) of the module that holds `function`'s source."""
    qualname = function.__qualname__
    if qualname == "<lambda>":
        return f"lambda@{function.__code__.co_firstlineno}"
    return qualname.split(".<locals>")[0].split(".")[0]  # a closure counts by its factory, a method by its class


def step_roots(step: Any) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """({module: names} of the step's functions, whole modules): the modules defining its functions
    count by what those functions reach; those it names in `Step.code` count whole."""
    functions = [step.derive, step.finalize, step.run_unit, step.units]
    sliced: dict[str, set[str]] = {}
    for function in functions:
        module = getattr(function, "__module__", None)
        if function is None or not module or module == "lmforge.engine.graph":  # the default no-op callables
            continue
        if module.split(".")[0] in sys.stdlib_module_names:  # a library function: its version is Python's
            continue
        sliced.setdefault(module, set()).add(_function_root(function))
    whole = set(step.code)
    for name in step.code:  # a package named in `code`: every module of it (some are loaded by name)
        whole.update(_package_modules(name))
    return {m: tuple(sorted(n)) for m, n in sliced.items()}, sorted(whole)


def closure(sliced: dict[str, tuple[str, ...]], whole: list[str]) -> dict[str, str]:
    """{project file: digest} of the roots and every project module they import, directly or not; a
    plug-in's module outside the project as "plugin:<module>", with the modules of its own package it imports.

    A module that something imports counts whole (replacing its slice, if it had one)."""
    digests: dict[str, str] = {}
    done_whole: set[str] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [(m, n) for m, n in sliced.items() if m not in whole]
    todo += [(m, ()) for m in whole]
    while todo:
        module, names = todo.pop()
        path = _source(module)
        if module in done_whole or path is None or _excluded(module):
            continue
        if not names:
            done_whole.add(module)
        try:
            digest, imports = _read(module, names)
        except KeyError:  # a root the slicer cannot find by name: the module counts whole
            digest, imports = _read(module)
            done_whole.add(module)
        digests[_key(module, path)] = digest
        todo += [(name, ()) for name in imports if name not in done_whole]
    return dict(sorted(digests.items()))


def project_files(patterns: tuple[str, ...], step: str = "") -> list[Path]:
    """The project files `patterns` name (repo-relative paths or globs, `**` included), sorted.

    A pattern outside the project, or one that matches no file, is an error: a step declaring a
    file it reads that is not there would otherwise be keyed as if it read nothing."""
    found: set[Path] = set()
    for pattern in patterns:
        if Path(pattern).is_absolute() or ".." in Path(pattern).parts:
            raise ValueError(f"{step}: Step.files: {pattern!r} is not a path inside the project (repo-relative)")
        matches = {p for p in ROOT.glob(pattern) if p.is_file() and "__pycache__" not in p.parts}
        if not matches:
            raise ValueError(f"{step}: Step.files: {pattern!r} matches no file under {ROOT}")
        found |= matches
    return sorted(found)


def _bytes_digest(path: Path) -> str:
    """A file by its bytes (not its syntax tree): a YAML value or a copied script's comment counts."""
    entry = _cached(path, "<bytes>", lambda: [hashlib.sha256(path.read_bytes()).hexdigest()[:16], []])
    return str(entry[0])


def files_identity(patterns: tuple[str, ...], step: str = "") -> dict[str, str]:
    """{project file: digest of its bytes} of the files a step declares it reads by path (`Step.files`)."""
    return {_label(path): _bytes_digest(path) for path in project_files(patterns, step)}


def code_identity(step: Any) -> dict[str, str]:
    """What enters the step's key: its import closure and the files it reads by path, one digest per file.

    A file both imported and read by path counts by its bytes (any edit to its syntax tree is one to
    its bytes)."""
    check_plugins(step.code)
    identity = {**closure(*step_roots(step)), **files_identity(step.files, step.name)}
    _save()
    return dict(sorted(identity.items()))


def check_plugins(modules: tuple[str, ...]) -> None:
    """Each module of `modules` outside the project (a plug-in's, counted by the closure under
    "plugin:<module>") has a file to count by: one that has none would key nothing of what it runs."""
    for module in modules:
        if module.split(".")[0] in PACKAGES or module.split(".")[0] in ORCHESTRATOR:
            continue
        if _plugin_file(module) is None:
            raise ValueError(f"code: module {module!r} is neither in the project nor importable from a file")


def library_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def fingerprint(step: Any) -> dict[str, Any]:
    """Recorded in the manifest: {"modules": {file: digest}, "libraries": {distribution: version}}."""
    return {
        "modules": code_identity(step),
        "libraries": {lib: library_version(lib) for lib in step.libraries},
    }


def drift(step: Any, recorded: dict[str, Any] | None) -> list[str]:
    """One line per library whose version differs from the one that made the output (code is in the key)."""
    if not recorded:
        return []
    lines: list[str] = []
    for lib in step.libraries:
        before = recorded.get("libraries", {}).get(lib)
        version = library_version(lib)
        if before is not None and before != version:
            lines.append(f"library {lib} changed {before} -> {version} since this output was made")
    return lines


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """lmforge's version and the git commit (and whether the tree is dirty) of this checkout: recorded
    beside a step's key and as an experiment tracker's tags, never part of a key."""
    import subprocess

    import lmforge

    root = Path(__file__).resolve().parents[2]
    version: dict[str, Any] = {"lmforge": lmforge.__version__}
    try:
        version["git"] = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout
        version["dirty"] = bool(dirty.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return version
