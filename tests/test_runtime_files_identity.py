"""Every file a step reads at run time is part of its key, not only the modules it imports.

What no import shows: the task YAML evaluation renders, the scripts it copies beside them to run
inside lm-eval (`utils.py`, `sandbox.py`, `verify.py`), a user's reward module named in the config,
a base model's remote code. Each test edits one such file and computes every step's key before
and after, without running anything.

What is compared is each step's *own* key: `key_components` with the upstream digests held fixed
(empty). A step downstream of an edited reader re-keys only through its upstream's output digest,
and only if that output's bytes change when the reader runs: at key-computation time exactly the
direct readers change, and that is what each test asserts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lmforge.engine import codeprint
from lmforge.engine.executor import graph
from lmforge.engine.explain import diff_components
from lmforge.engine.graph import key_components, step_key
from lmforge.engine.store import RACY_NS
from tests.conftest import small_config

PACKAGES = ("lmforge", "training", "data_prep", "evaluation", "serving", "configs")


def own_keys(config: Any) -> dict[str, str]:
    """Each step's key with its upstream digests left out (see the module docstring)."""
    return {s.name: step_key(key_components(s, config, (), {})) for s in graph().steps}


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {name for name in before if before[name] != after[name]}


@pytest.fixture
def digest_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """A private, empty code-digest cache (the user's ~/.cache is neither read nor written)."""
    cache: dict[str, Any] = {}
    monkeypatch.setenv("LMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(codeprint, "_disk_cache", lambda: cache)
    monkeypatch.setattr(codeprint, "_dirty", set())
    return cache


@pytest.fixture
def project_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digest_cache: dict[str, Any]) -> Path:
    """A copy of the project's packages that code identities are computed from: a test edits its
    bytes, never the real files."""
    root = tmp_path / "project"
    for package in PACKAGES:
        shutil.copytree(codeprint.ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    # past the racy window of the copies' ctimes, so their digests are cached as those of the real files are
    time.sleep(RACY_NS / 1e9 + 0.1)
    monkeypatch.setattr(codeprint, "ROOT", root)
    return root


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


# -- project files read by path ------------------------------------------------------------------


def test_editing_a_task_yaml_reruns_only_the_task_build_and_explain_names_the_file(
    project_copy: Path, tmp_path: Path
) -> None:
    config = small_config(tmp_path / "ws")
    task = graph().get("evaluate/tasks")
    before, components = own_keys(config), key_components(task, config, (), {})
    _edit(project_copy / "evaluation/tasks/lmforge_chat_exact.yaml", "max_gen_toks: ", "max_gen_toks: 1")
    assert changed(before, own_keys(config)) == {"evaluate/tasks"}
    reasons = diff_components(components, key_components(task, config, (), {}))
    assert reasons == ["code changed: evaluation/tasks/lmforge_chat_exact.yaml"]


def test_a_comment_edit_to_the_copied_utils_py_reruns_the_task_build(project_copy: Path, tmp_path: Path) -> None:
    # utils.py is copied into the task folder: its bytes are output, so even a comment counts
    config = small_config(tmp_path / "ws")
    before = own_keys(config)
    _edit(project_copy / "evaluation/tasks/utils.py", "\n", "\n# an edited comment\n")
    assert changed(before, own_keys(config)) == {"evaluate/tasks"}


def test_editing_verify_py_reruns_its_importers_and_the_task_build_that_copies_it(
    project_copy: Path, tmp_path: Path
) -> None:
    config = small_config(tmp_path / "ws")
    importers = {
        s.name for s in graph().steps if "lmforge/text/verify.py" in codeprint.closure(*codeprint.step_roots(s))
    }
    # RL rewards with it by import; evaluation copies it beside the task YAMLs (no import shows that)
    assert "align/rl" in importers and "evaluate/tasks" not in importers
    before = own_keys(config)
    _edit(project_copy / "lmforge/text/verify.py", "\ndef ", "\nEDITED = 1\n\n\ndef ")
    assert changed(before, own_keys(config)) == importers | {"evaluate/tasks"}


def test_every_file_the_task_build_renders_or_copies_is_declared() -> None:
    from evaluation import build

    declared = set(codeprint.project_files(graph().get("evaluate/tasks").files))
    read = {build.SANDBOX, build.VERIFY, build.TEMPLATES / "utils.py"}
    read |= {build.TEMPLATES / f"{task}.yaml" for task in build.BUILTIN}
    assert {p.resolve() for p in read} <= declared


def test_a_declared_file_pattern_that_matches_nothing_fails_at_registration() -> None:
    from lmforge.engine.graph import Step

    def finalize(ctx: Any, results: Any) -> dict[str, Any]:
        return {}

    for pattern, message in (
        ("evaluation/tasks/*.nothing", "matches no file"),
        ("/etc/passwd", "not a path inside the project"),
        ("../outside.yaml", "not a path inside the project"),
    ):
        with pytest.raises(ValueError, match=f"^x/y: Step.files: {re.escape(repr(pattern))} .*{message}"):
            Step("x/y", 1, "a step", finalize=finalize, files=(pattern,))


# -- user code named in the config ---------------------------------------------------------------

REWARD = "def score(prompts, completions, **columns):\n    return [float(len(c) > 3) for c in completions]\n"


def test_editing_a_user_reward_module_reruns_only_rl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digest_cache: dict[str, Any]
) -> None:
    (tmp_path / "lmf_user_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(
        tmp_path / "ws",
        "align.recipe=[sft, rl]",
        "align.rl.rewards=[{kind: verifier}, {kind: function, function: 'lmf_user_reward:score', weight: 0.5}]",
    )
    rl = graph().get("align/rl")
    before, components = own_keys(config), key_components(rl, config, (), {})
    (tmp_path / "lmf_user_reward.py").write_text(REWARD.replace("> 3", "> 4"))
    assert changed(before, own_keys(config)) == {"align/rl"}
    reasons = diff_components(components, key_components(rl, config, (), {}))
    assert len(reasons) == 1 and reasons[0].startswith("reward_functions.lmf_user_reward:score content changed")
    assert "lmf_user_reward" not in sys.modules  # its source was read, never run


def test_a_reward_module_that_cannot_be_found_is_a_one_line_config_error(tmp_path: Path) -> None:
    from lmforge.errors import ConfigError

    config = small_config(
        tmp_path / "ws", "align.recipe=[sft, rl]", "align.rl.rewards=[{kind: function, function: 'lmf_no_such:f'}]"
    )
    with pytest.raises(ConfigError, match=r"^align\.rl\.rewards: cannot import lmf_no_such:f \(") as info:
        graph().get("align/rl").identity(config)
    assert "\n" not in str(info.value)


# -- a base model's remote code ------------------------------------------------------------------


def _base(directory: Path, remote: bool) -> Path:
    directory.mkdir()
    if remote:
        config = {"model_type": "lmfmystery", "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    else:
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / "modeling_x.py").write_text("class XForCausalLM:\n    layers = 2\n")
    return directory


def test_editing_a_trusted_base_remote_code_reruns_only_the_base_import(
    tmp_path: Path, digest_cache: dict[str, Any]
) -> None:
    trusted = _base(tmp_path / "remote", remote=True)
    config = small_config(tmp_path / "ws", f"base_model.path={trusted}", "base_model.trust_remote_code=true")
    base = graph().get("base_model/import")
    before, components = own_keys(config), key_components(base, config, (), {})
    (trusted / "modeling_x.py").write_text("class XForCausalLM:\n    layers = 3\n")
    edited = own_keys(config)
    assert changed(before, edited) == {"base_model/import"}
    reasons = diff_components(components, key_components(base, config, (), {}))
    assert len(reasons) == 1 and reasons[0].startswith("base_model.remote_code.modeling_x.py content changed"), reasons
    (trusted / "configuration_x.py").write_text("X = 1\n")  # a new file of its code counts too
    assert changed(edited, own_keys(config)) == {"base_model/import"}
    # without trust_remote_code the base's .py files are never run, so they are not part of its key
    plain = _base(tmp_path / "plain", remote=False)
    config = small_config(tmp_path / "ws", f"base_model.path={plain}")
    before = own_keys(config)
    (plain / "modeling_x.py").write_text("class XForCausalLM:\n    layers = 3\n")
    assert changed(before, own_keys(config)) == set()


# -- the code-digest cache's stamps --------------------------------------------------------------


def _module_in(root: Path, text: str) -> Path:
    path = root / "lmforge" / "lmf_stamp_probe.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _same_size_rewrite(path: Path, text: str) -> None:
    """Rewrite in place (same inode) with the same size, then set the mtime back to what it was."""
    st = os.stat(path)
    assert len(text.encode()) == st.st_size
    with open(path, "r+") as f:
        f.write(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_ino == st.st_ino


def test_a_same_tick_rewrite_with_the_same_size_and_mtime_gets_a_new_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digest_cache: dict[str, Any]
) -> None:
    monkeypatch.setattr(codeprint, "ROOT", tmp_path)
    path = _module_in(tmp_path, "A = 1\n")
    # the file system's clock does not tick between the two writes (a coarse timestamp granularity):
    # the probe's mtime and ctime read as they were at the first write, so its whole stamp is unchanged
    tick = path.stat().st_mtime_ns
    real_stat = Path.stat

    def stat(self: Path, **kwargs: Any) -> Any:
        st = real_stat(self, **kwargs)
        if self != path:
            return st
        return SimpleNamespace(
            st_mode=st.st_mode, st_size=st.st_size, st_ino=st.st_ino, st_mtime_ns=tick, st_ctime_ns=tick
        )

    monkeypatch.setattr(Path, "stat", stat)
    first = codeprint._read("lmforge.lmf_stamp_probe")[0]
    _same_size_rewrite(path, "B = 2\n")
    assert codeprint._read("lmforge.lmf_stamp_probe")[0] != first


def test_a_later_rewrite_with_the_same_size_and_mtime_gets_a_new_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digest_cache: dict[str, Any]
) -> None:
    monkeypatch.setattr(codeprint, "ROOT", tmp_path)
    path = _module_in(tmp_path, "A = 1\n")
    time.sleep(RACY_NS / 1e9 + 0.1)  # out of the racy window: this digest is cached by its stamp
    first = codeprint._read("lmforge.lmf_stamp_probe")[0]
    assert digest_cache  # it was cached
    _same_size_rewrite(path, "B = 2\n")  # mtime, size and inode as before; only the ctime tells
    time.sleep(RACY_NS / 1e9 + 0.1)  # the rewrite aged too: the cache is consulted, by the whole stamp
    assert codeprint._read("lmforge.lmf_stamp_probe")[0] != first
