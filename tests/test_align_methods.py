"""The seam inside the alignment stage: methods are plug-ins (`training.align.methods`), found in one
registry, and the stage's graph and rank entry name none of them."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILTIN = ("sft", "dpo", "reward", "rl", "draft")


def test_the_registry_holds_the_builtin_methods_in_order_each_with_its_step() -> None:
    from training.align.methods import AlignMethod, methods
    from training.align.steps import ALIGN_STEPS

    found = methods()
    assert tuple(found)[: len(BUILTIN)] == BUILTIN  # the first built-ins, in the order recipes run them
    assert all(
        isinstance(m, AlignMethod) and type(m).__module__ == f"training.align.methods.{n}" for n, m in found.items()
    )
    assert [s.name for s in ALIGN_STEPS] == ["align/data", *(f"align/{n}" for n in found)]


def test_the_entry_and_the_training_steps_branch_on_no_method() -> None:
    """No `spec["kind"] == ...` chain, no comparison with a method's name, in the code every method
    shares (the rank entry, its kit, the training part of the step graph): what a method reads, builds
    and produces is in its own module. (The data step still writes the two data formats to folders
    named after the sections whose `inputs` they come from, `align.sft.inputs` and `align.dpo.inputs`.)"""
    steps = (ROOT / "training/align/steps.py").read_text()
    shared = {
        "training/align/entry.py": (ROOT / "training/align/entry.py").read_text(),
        "training/align/kit.py": (ROOT / "training/align/kit.py").read_text(),
        "training/align/steps.py (training)": steps[steps.index("# -- training") :],
    }
    for name, text in shared.items():
        compared = {
            c.value
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Compare)
            for c in ast.walk(node)
            if isinstance(c, ast.Constant) and c.value in BUILTIN
        }
        assert not compared, f"{name} branches on method(s) {sorted(compared)}"
        assert not re.search(r"""\[["']kind["']\]\s*(==|!=|in)""", text), name
    planted = 'if spec["kind"] == "dpo":\n    pass\n'  # the check sees a branch when there is one
    assert any(isinstance(c, ast.Constant) and c.value == "dpo" for c in ast.walk(ast.parse(planted).body[0].test))


def test_a_method_step_counts_its_own_module_and_not_the_other_methods() -> None:
    """Code identity follows modules: editing one method re-keys its step and the steps that read its
    output (which import its product from its module), and a new method re-keys nothing that exists."""
    from lmforge.engine.codeprint import closure, step_roots
    from training.align.steps import ALIGN_STEPS

    for step in ALIGN_STEPS[1:]:
        name = step.name.split("/")[1]
        files = {f for f in closure(*step_roots(step)) if f.startswith("training/align/methods/")}
        own = {f"training/align/methods/{name}.py", "training/align/methods/__init__.py"}
        # and the modules of the methods whose output it reads (their products are defined there):
        # SFT's for every method after it, and RL's start (DPO) and rewards (the reward model's score)
        # (the draft distils the served model, named by role: it imports no method)
        reads = {"draft": set(), "rl": {"sft", "dpo", "reward"}}.get(name, {"sft"})
        expected = own | {f"training/align/methods/{m}.py" for m in reads}
        assert files == expected, (step.name, sorted(files))


def test_the_recipe_is_checked_against_the_registry() -> None:
    from lmforge.config import load_config
    from lmforge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"no alignment method 'nope' \(registered: sft, dpo, reward, rl"):
        load_config("tiny-cpu", ["align.recipe=[sft, nope]"], "/tmp/unused")
    with pytest.raises(ConfigError, match="steps run in the order sft, dpo, reward, rl"):
        load_config("tiny-cpu", ["align.recipe=[sft, rl, dpo]"], "/tmp/unused")
    assert load_config("tiny-cpu", ["align.recipe=[sft, reward, rl]"], "/tmp/unused").align.recipe[-1] == "rl"


def test_an_unknown_method_in_a_spec_is_one_line() -> None:
    from lmforge.errors import ConfigError
    from training.align.methods import method

    with pytest.raises(ConfigError, match=r"no alignment method 'nope' \(registered: sft, dpo"):
        method("nope")


def test_a_name_registered_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry point that reuses a built-in's name would silently replace what every recipe means."""
    import importlib.metadata

    import training.align.methods as registry

    class Point:
        name, value = "sft_again", "training.align.methods.sft:SFT"

        def load(self) -> object:
            from training.align.methods.sft import SFT

            return SFT

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [Point()] if group == registry.GROUP else [])
    registry.methods.cache_clear()
    try:
        with pytest.raises(ValueError, match="alignment method 'sft' registered twice"):
            registry.methods()
    finally:
        registry.methods.cache_clear()


def test_model_roles_come_from_the_stages_and_every_consumer_reads_them() -> None:
    """base and pretrained from their stages, then one role per method that trains a policy (not the
    reward model or the draft): evaluation's runs, quantization's and serving's choices follow them."""
    from evaluation.steps import RUN_STEPS
    from lmforge.engine.registry import roles
    from serving.steps import adapter_roles, auto_order
    from training.align.methods import methods

    policies = [n for n, m in methods().items() if m.role() is not None]
    assert policies[:3] == ["sft", "dpo", "rl"] and "reward" not in policies and "draft" not in policies
    assert [(r.name, r.aligned) for r in roles()] == [
        ("base", False),
        ("pretrained", False),
        *((name, True) for name in policies),
    ]
    assert {r.name: r.saw for r in roles()}["dpo"] == ("documents", "chat", "preference")
    # every role names the sources the contamination check indexes (RL once said "sft", "dpo": method
    # names, not sources, and its chat and preference overlap went unchecked)
    from evaluation.steps import INDEXES

    assert all(set(r.saw) <= set(INDEXES) for r in roles()), {r.name: r.saw for r in roles()}
    assert {r.name: r.saw for r in roles()}["rl"] == ("documents", "chat", "preference")
    assert [s.name for s in RUN_STEPS][::2] == [f"evaluate/{r.name}-hf" for r in roles()]
    assert auto_order() == ("quantized", *reversed(policies), "pretrained", "base")
    assert adapter_roles() == tuple(policies)


def test_no_role_or_backend_name_is_spelled_outside_the_module_that_defines_it() -> None:
    """The seams hold: a role literal ("sft", "dpo", "rl") appears only in its method's module, a
    serving backend's name only under serving/backends/, an evaluation backend's only in
    evaluation/backends.py (docstrings and comments aside: the check reads string constants)."""
    root = Path(__file__).resolve().parents[1]
    owners = {
        "sft": "training/align/methods/sft.py",
        "dpo": "training/align/methods/dpo.py",
        "rl": "training/align/methods/rl.py",
        "llamacpp": "serving/backends/",
        "vllm": ("serving/backends/", "evaluation/backends.py"),
        "hf": "evaluation/backends.py",
    }
    found = []
    for package in ("lmforge", "training", "evaluation", "serving", "data_prep", "flows", "tasks"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and node.value in owners and id(node) not in docstrings:
                    where = owners[node.value]
                    if not rel.startswith(where if isinstance(where, tuple) else (where,)):
                        found.append(f"{rel}:{node.lineno} {node.value!r}")
    # "hf" is also the model folder's name inside a step's output (`<out>/hf`): those are paths;
    # DPO's `loss_type: [sigmoid, "sft"]` is TRL's name for its NLL term, not the role
    found = [f for f in found if not f.endswith("'hf'") or "evaluation" in f or "serving" in f]
    found = [f for f in found if not f.startswith("training/align/methods/dpo.py") or not f.endswith("'sft'")]
    assert not found, found


def _chat_tokenizer(template: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["user", "assistant", "Add", "2", "and", "3.", "5", "6", "Name", "a", "colour.", "red", "blue"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "[UNK]"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    return tokenizer


def test_a_pair_is_tokenized_as_sft_sees_it_the_assistant_turn_labelled_and_nothing_appended() -> None:
    """ORPO and SimPO rows (kit.pair_tokens): the chat template's tokens, labels on the assistant turn
    its generation markers mark (the answer and its end-of-turn), no BOS before it and no EOS after
    the template's tail: TRL's own rows scored `\\n<|endoftext|>` too, most of ORPO's NLL."""
    from lmforge.text.chat import CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE
    from training.align.kit import pair_tokens

    feature = {
        "chat_prompt": [{"role": "user", "content": "Add 2 and 3."}],
        "chat_chosen": [{"role": "assistant", "content": "5"}],
        "chat_rejected": [{"role": "assistant", "content": "6"}],
    }
    tokenizer = _chat_tokenizer(CHAT_TEMPLATE)
    row = pair_tokens(tokenizer, feature, max_length=64)
    ids = tokenizer.convert_tokens_to_ids
    for side, answer in (("chosen", "5"), ("rejected", "6")):
        tokens = row[f"{side}_input_ids"]
        assert tokens[: len(row["prompt_input_ids"])] == row["prompt_input_ids"]  # the prompt, then the answer
        assert tokens[0] == ids("<|im_start|>") and tokenizer.eos_token_id not in tokens  # no BOS/EOS added
        labelled = [t for t in row[f"{side}_labels"] if t != -100]
        assert labelled == [ids(answer), ids("<|im_end|>")], tokenizer.convert_ids_to_tokens(labelled)
        assert row[f"{side}_attention_mask"] == [1] * len(tokens)
    # a template without generation markers: everything after the prompt is the completion
    plain = pair_tokens(_chat_tokenizer(PLAIN_CHAT_TEMPLATE), feature, max_length=64)
    assert [t for t in plain["chosen_labels"] if t != -100] == plain["chosen_input_ids"][
        len(plain["prompt_input_ids"]) :
    ]
    # truncated to max_length like every other row
    assert len(pair_tokens(tokenizer, feature, max_length=5)["chosen_input_ids"]) == 5
