"""The layout the architecture promises: domain packages stay free of Prefect."""

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
    offenders = {str(p.relative_to(ROOT)): sorted(_imports(p) & {"prefect", "tasks", "flows"})
                 for package in DOMAIN for p in (ROOT / package).rglob("*.py")}
    offenders = {path: names for path, names in offenders.items() if names}
    assert offenders == {}
    assert list((ROOT / "data_prep").rglob("*.py")) and list((ROOT / "training").rglob("*.py"))
