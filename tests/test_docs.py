"""The docs cannot lie: the generated references match the code, every snippet validates, the site
builds strictly, and the README stays a short guide with the two commands."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = ROOT / ".venv-docs" / "bin" / "mkdocs"


def _leaf_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every leaf field's dotted path, walked here independently of lmforge.reference."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        annotation = info.annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        origin = typing.get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out |= _leaf_paths(annotation, f"{prefix}{name}.")
        elif origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            out |= _leaf_paths(args[0], f"{prefix}{name}[].")
        elif origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            out |= _leaf_paths(args[1], f"{prefix}{name}{{}}.")
        elif len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            out |= _leaf_paths(args[0], f"{prefix}{name}.")
        else:
            out.add(f"{prefix}{name}")
    return out


def test_the_configuration_reference_lists_every_leaf_field_of_the_typed_models() -> None:
    from lmforge.config import pipeline_model

    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    expected = _leaf_paths(pipeline_model())
    assert expected - listed == set(), f"fields missing from the reference: {sorted(expected - listed)[:10]}"
    assert listed - expected == set(), f"the reference lists fields the models lack: {sorted(listed - expected)[:10]}"
    assert len(expected) > 300  # the whole pipeline, every stage's section


def test_the_cli_reference_lists_every_command() -> None:
    import argparse

    from lmforge.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = {name for name, parser in sub.choices.items() if parser.prog == f"lmforge {name}"}
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    documented = set(re.findall(r"^## `lmforge (\S+)`", page, re.M))
    assert commands == documented, commands ^ documented
    assert "`--set`" in page and "describe" in page


def test_the_generated_pages_are_what_the_code_generates() -> None:
    from lmforge.reference import stale

    assert stale() == [], "run `python -m lmforge.reference write`"


def test_a_stale_page_is_found(tmp_path: Path) -> None:
    from lmforge.reference import stale, write

    write(tmp_path)
    assert stale(tmp_path) == []
    page = tmp_path / "configuration.md"
    page.write_text(page.read_text().replace("`pretrain.optim.lr`", "`pretrain.optim.learning_rate`"))
    assert stale(tmp_path) == ["configuration.md"]


def test_the_snippet_check_fails_on_a_planted_wrong_field_and_command(tmp_path: Path) -> None:
    from lmforge.reference import check_snippets

    good = tmp_path / "good.md"
    good.write_text(
        "Run `lmforge run --set pretrain.optim.lr=1e-3` or `lmforge explain`.\n\n"
        "```bash\nlmforge stage curate --set curate.near_dedup.threshold=0.9   # a comment\n"
        "lmforge serve start|stop|status\nlmforge stage STAGE --local\n```\n\n"
        "```yaml\npretrain:\n  optim:\n    lr: 1.0e-3\n```\n"
    )
    assert check_snippets([good]) == []
    bad = tmp_path / "bad.md"
    bad.write_text(
        "Pass `--set pretrain.optim.lrr=1e-3`.\n\n"
        "```bash\nlmforge stage curate --set curate.near_dedup.treshold=0.9\nlmforge evaluate-all\n"
        "lmforge run --set align.dpo.beta=high\n```\n\n"
        "```yaml\npretrain:\n  max_step: 10\n```\n"
    )
    problems = {p.where.rsplit(":", 1)[1]: p.why for p in check_snippets([bad])}
    assert "no configuration field 'pretrain.optim.lrr'" in problems["1"]
    assert "no configuration field 'curate.near_dedup.treshold'" in problems["4"]
    assert "invalid choice: 'evaluate-all'" in problems["5"]
    assert "align.dpo.beta" in problems["6"]
    assert "pretrain.max_step: unknown field (did you mean 'max_steps'?)" in problems["10"]


def test_the_readme_and_the_docs_pass_the_snippet_check() -> None:
    from lmforge.reference import DOCS, check_snippets

    problems = check_snippets([ROOT / "README.md", DOCS])
    assert not problems, "\n".join(map(str, problems))


def test_the_readme_is_short_and_gives_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):  # every page it links to exists
        assert (ROOT / link).exists(), link


def test_config_describe_prints_a_field_and_suggests_for_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    from lmforge.cli import main

    assert main(["config", "describe", "pretrain.optim.lr"]) == 0
    out = capsys.readouterr().out
    assert "type:        float" in out and "cache key:   yes: pretrain/train" in out
    assert main(["config", "describe", "runtime.workers"]) == 0
    assert "cache key:   no" in capsys.readouterr().out
    assert main(["config", "describe", "pretrain.lr"]) == 2
    assert "did you mean 'pretrain.optim.lr'" in capsys.readouterr().err


@pytest.mark.skipif(not MKDOCS.exists(), reason=".venv-docs is missing (scripts/setup.sh makes it)")
def test_mkdocs_strict_builds_the_site_and_fails_on_a_broken_link_or_anchor(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}

    def build(root: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(MKDOCS), "build", "--strict", "--site-dir", str(site)],  # --quiet would hide what --strict counts
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    assert build(copy).returncode == 0
    assert (site / "reference" / "configuration" / "index.html").exists()
    page = copy / "docs" / "index.md"
    original = page.read_text()
    page.write_text(original + "\nSee [nowhere](nowhere.md).\n")
    broken = build(copy)
    assert broken.returncode != 0 and "nowhere.md" in broken.stdout + broken.stderr
    page.write_text(original + "\nSee [the gates](concepts/lineage.md#no-such-section).\n")
    broken = build(copy)
    assert broken.returncode != 0 and "no-such-section" in broken.stdout + broken.stderr
