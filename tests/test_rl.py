"""The RL road of the alignment stage: a reward model (TRL RewardTrainer) and online RL (TRL
GRPOTrainer) on 2 CPU ranks, the reward-hacking watch, resume after a killed rank, cache identity."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from lmforge.engine.executor import run_pipeline_locally
from tests.conftest import SMALL_RL, small_config


def _workspace(rl_aligned: dict) -> Path:
    return Path(rl_aligned["align/rl"]["dir"]).parents[2]


def _without_rl(rl_aligned: dict, tmp_path: Path) -> Path:
    """A copy of the session's RL lineage whose RL step is to train again (from the same DPO and reward models)."""
    workspace = tmp_path / "ws"
    shutil.copytree(_workspace(rl_aligned), workspace)
    shutil.rmtree(workspace / "align" / "rl")
    return workspace


@pytest.mark.slow
def test_reward_model_ranks_held_out_pairs_and_is_exported_as_a_sequence_classifier(rl_aligned: dict) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from training.align.methods.reward import pairwise_accuracy

    manifest = rl_aligned["align/reward"]
    m = manifest["metrics"]
    hf = Path(manifest["dir"]) / "hf"
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    model = AutoModelForSequenceClassification.from_pretrained(hf)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    heldout = [
        json.loads(line) for line in (Path(rl_aligned["align/data"]["dir"]) / "heldout_preferences.jsonl").open()
    ]
    again = pairwise_accuracy(model, tokenizer, heldout)  # the summary's figure, from the exported directory
    assert again["pairwise_accuracy"] == pytest.approx(m["pairwise_accuracy"], abs=1e-9)
    low, high = m["pairwise_accuracy_ci"]
    assert low <= m["pairwise_accuracy"] <= high and m["items"] == len(heldout) > 20
    # 50 held-out pairs on a 2-layer model: the point estimate is above chance; the tiny-cpu-rl
    # preset's interval (README) is the measured acceptance figure
    assert m["pairwise_accuracy"] > 0.5 and m["mean_margin"] > 0, m
    assert (Path(manifest["dir"]) / "checkpoints").exists() and (Path(manifest["dir"]) / "metrics.jsonl").exists()


@pytest.mark.slow
def test_grpo_trains_from_dpo_on_two_ranks_with_its_metrics_watch_and_export(rl_aligned: dict) -> None:
    manifest = rl_aligned["align/rl"]
    out = Path(manifest["dir"])
    m = manifest["metrics"]
    assert manifest["counts"]["steps"] == 20 and manifest["extra"]["world_size"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    for key in (
        "reward",
        "reward_std",
        "kl",
        "entropy",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "rewards/verifier_reward/mean",
        "rewards/reward_model/mean",
    ):
        assert all(key in r for r in trained), key
    watched = [r for r in rows if "watch/heldout_verified" in r]
    assert [r["step"] for r in watched] == [0, 10, 20]  # the start, then every eval_every
    assert all("watch/kl_p90" in r and "watch/heldout_rm_score" in r for r in watched[1:])
    # the KL to the start is reported as a distribution, from the exported model
    assert 0 <= m["kl_p50"] <= m["kl_p90"] <= m["kl_max"] and m["kl_mean"] > 0
    assert m["exact_match_delta_ci"][0] <= m["exact_match_delta"] <= m["exact_match_delta_ci"][1]
    hacking = [w for w in manifest["extra"]["warnings"] if w.startswith("reward hacking")]
    assert m["heldout_items"] > 30 and m["reward_hacking"] == bool(hacking)
    # beside the held-out figures, the same on RL's own prompts: whether it learnt the skill or its prompts
    assert m["rl_prompts_items"] == min(m["heldout_items"], m["prompt_filter"]["kept"])
    assert 0 <= m["rl_prompts_exact_match_after"] <= 1
    low, high = m["rl_prompts_exact_match_delta_ci"]
    assert low <= m["rl_prompts_exact_match_delta"] <= high
    # the prompt filter scored 96 training prompts with 4 samples each on both ranks and kept the
    # ones answered right sometimes, not never or always; RL trained on those alone
    scored = [json.loads(line) for line in (out / "prompt_filter.jsonl").read_text().splitlines()]
    assert len(scored) == 96 and all(r["samples"] == 4 and 0 <= r["passes"] <= 4 for r in scored)
    assert all(r["kept"] == (0 < r["passes"] < 4) for r in scored)
    pf = m["prompt_filter"]
    assert pf["scored"] == 96 and pf["kept"] == sum(r["kept"] for r in scored) > 0
    assert pf["never_right"] + pf["always_right"] + pf["kept"] == 96
    assert f"prompt filter: kept {pf['kept']} of 96 prompts" in (out / "logs" / "rank-0.log").read_text()
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (out / "hf" / "tokenizer_config.json").exists() and (out / "tensorboard").exists()
    spec = json.loads((out / "run_spec.json").read_text())
    assert Path(spec["base_dir"]).parent.parent.name == "dpo", "RL starts from DPO in [sft, dpo, reward, rl]"
    # held-out prompts are never trained on
    train = {json.dumps(r["messages"][:-1]) for r in map(json.loads, open(spec["train"]))}
    assert not any(json.dumps(r["messages"][:-1]) in train for r in spec["heldout_all"])


@pytest.mark.slow
def test_changing_rl_beta_reruns_only_rl_and_explain_names_it(rl_aligned: dict) -> None:
    from lmforge.engine.explain import explain

    config = small_config(_workspace(rl_aligned), *SMALL_RL, "align.rl.beta=0.2")
    lines = {e.step: e for e in explain(config, ["align"])}
    for step in ("align/data", "align/sft", "align/dpo", "align/reward"):
        assert lines[step].reuse, step
    assert not lines["align/rl"].reuse and "align.rl.beta changed 0.04 -> 0.2" in lines["align/rl"].reasons
    # what reads RL's model follows it; what does not, does not
    downstream = {e.step: e for e in explain(config, ["evaluate"])}
    assert "upstream align/rl will be recomputed" in " ".join(downstream["evaluate/rl-hf"].reasons)
    assert "align/rl" not in " ".join(downstream["evaluate/dpo-hf"].reasons)


@pytest.mark.slow
def test_a_reward_that_pays_for_length_trips_the_hacking_watch_and_stop_on_hacking_fails_the_step(
    rl_aligned: dict, tmp_path: Path
) -> None:
    from lmforge.errors import DeterministicError, is_retryable

    workspace = _without_rl(rl_aligned, tmp_path)
    gamed = [
        *SMALL_RL,
        "align.recipe=[sft, dpo, rl]",
        "align.rl.rewards=[{kind: function, function: 'tests.rl_rewards:pays_for_length'}]",
        "align.rl.lr=1e-3",
        "align.rl.beta=0.0",
        "align.rl.max_steps=20",
        "align.rl.eval_every=5",
    ]
    manifest = run_pipeline_locally(small_config(workspace, *gamed), ["align"])["align/rl"]
    m = manifest["metrics"]
    assert m["reward_hacking"], m
    (warning,) = [w for w in manifest["extra"]["warnings"] if not w.startswith("RL raised exact match")]
    assert warning.startswith("reward hacking: held-out reward rose") and "\n" not in warning
    assert m["heldout_length_after"] > m["heldout_length_before"]
    shutil.rmtree(Path(manifest["dir"]))
    with pytest.raises(DeterministicError, match=r"align.rl.stop_on_hacking: step \d+: reward hacking") as info:
        run_pipeline_locally(small_config(workspace, *gamed, "align.rl.stop_on_hacking=true"), ["align"])
    assert not is_retryable(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_rl_as_a_lora_adapter_trains_only_the_adapter_and_exports_it_merged(rl_aligned: dict, tmp_path: Path) -> None:
    """Before: align/rl trained every weight, also where SFT and DPO were LoRA adapters on a large base."""
    from safetensors.torch import load_file

    workspace = _without_rl(rl_aligned, tmp_path)
    lora = [
        *SMALL_RL,
        "align.rl.lora=true",
        "align.lora.r=4",
        "align.rl.lr=1e-3",
        "align.rl.max_steps=4",
        "align.rl.save_steps=2",
        "align.rl.eval_every=2",
        "align.rl.prompt_filter.samples=0",
    ]
    manifest = run_pipeline_locally(small_config(workspace, *lora), ["align"])["align/rl"]
    out = Path(manifest["dir"])
    assert manifest["extra"]["lora"] and manifest["counts"]["steps"] == 4
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["peft_type"] == "LORA"
    assert manifest["metrics"]["merge_parity_max_abs_logit_diff"] < 1e-3
    # the export is the start model with the adapter merged in: the linear layers moved, nothing else did
    start = load_file(Path(json.loads((out / "run_spec.json").read_text())["base_dir"]) / "model.safetensors")
    merged = load_file(out / "hf" / "model.safetensors")
    assert merged.keys() == start.keys()
    moved = {name for name in start if not (merged[name] == start[name]).all()}
    assert moved and all(name.endswith("proj.weight") for name in moved), sorted(moved)
    assert (merged["model.embed_tokens.weight"] == start["model.embed_tokens.weight"]).all()
    assert 0 <= manifest["metrics"]["exact_match_after"] <= 1


def test_rl_configuration_errors_are_one_line_naming_the_field(tmp_path: Path) -> None:
    from lmforge.errors import ConfigError
    from training.align.methods.rl import import_function

    for bad, message in (
        ("align.recipe=[dpo, sft]", "recipe"),
        ("align.recipe=[sft, rl, dpo]", "recipe"),
        ("align.recipe=[sft, rl]", "rl.rewards uses the reward model"),
        ("align.rl.global_batch_size=30", "not a multiple of num_generations"),
        ("align.rl.rewards=[{kind: function}]", "function"),
    ):
        extra = ["align.rl.rewards=[{kind: reward_model}]"] if "rl.rewards uses" in message else []
        with pytest.raises(Exception, match=message) as info:
            small_config(tmp_path, *extra, bad)
        assert "\n" not in str(info.value).strip().splitlines()[0]
    for path, message in (
        ("tests.rl_rewards:missing", "cannot import tests.rl_rewards:missing"),
        ("no_such_module:f", "cannot import no_such_module:f"),
        ("tests.rl_rewards:NOT_CALLABLE", "tests.rl_rewards:NOT_CALLABLE is not callable"),
    ):
        with pytest.raises(ConfigError, match=f"align.rl.rewards: {message}"):
            import_function(path)


def test_the_verifier_is_the_one_evaluation_scores_with() -> None:
    from lmforge.text.verify import is_correct, partial_credit
    from training.align.methods.rl import partial_verifier_reward, verifier_reward

    assert is_correct(" 17\n", "17") and is_correct("17\nmore text", "17") and not is_correct("17.", "17")
    assert verifier_reward([[{"role": "assistant", "content": "Paris"}], "Rome"], ["Paris", "Paris"]) == [1.0, 0.0]
    assert verifier_reward(["x"], [None]) == [None]  # no verified answer: no opinion
    assert partial_credit("Paris", "Paris") == 1.0 and 0 < partial_credit("Pari", "Paris") < 0.5
    assert partial_verifier_reward(["", "12"], ["13", "13"])[0] == 0.0
    built = (Path(__file__).parents[1] / "evaluation" / "tasks" / "lmforge_chat_exact.yaml").read_text()
    assert "utils.chat_exact_results" in built  # lm-eval scores the chat task with lmforge/text/verify.py


@pytest.mark.slow
def test_a_killed_rank_mid_rl_is_retried_and_resumes_to_the_same_held_out_reward(
    rl_aligned: dict, tmp_path: Path, prefect_server
) -> None:
    from flows.pipeline import pipeline
    from tests.conftest import SMALL_ALIGN, SMALL_CURATE, SMALL_PRETRAIN
    from tests.test_align import _kill_rank_when

    workspace = _without_rl(rl_aligned, tmp_path)
    done = threading.Event()
    killer = threading.Thread(target=_kill_rank_when, args=(workspace, 1, 15, done, "rl"), daemon=True)
    killer.start()
    result = pipeline(
        preset="tiny-cpu",
        overrides=[*SMALL_CURATE, *SMALL_PRETRAIN, *SMALL_ALIGN, *SMALL_RL],
        workspace=str(workspace),
        stages=["align"],
    )
    done.set()
    manifest, reference = result["manifests"]["align/rl"], rl_aligned["align/rl"]
    assert manifest["key"] == reference["key"]
    assert manifest["counts"]["attempts"] == 2, "the kill should have cost exactly one retry"
    rank0 = (Path(manifest["dir"]) / "logs" / "rank-0.log").read_text()
    assert "resuming from checkpoint-10" in rank0
    # the retry trained on the prompts the first attempt kept, read back rather than sampled again
    assert rank0.count("prompt filter: kept") == 1
    kept = (Path(reference["dir"]) / "prompt_filter.jsonl").read_text()
    assert (Path(manifest["dir"]) / "prompt_filter.jsonl").read_text() == kept
    for metric in ("heldout_configured_reward_after", "heldout_rm_score_after", "exact_match_after"):
        assert manifest["metrics"][metric] == pytest.approx(reference["metrics"][metric], abs=1e-4), metric


@pytest.mark.slow
def test_evaluation_compares_the_whole_road_and_quantization_takes_the_rl_model(
    rl_aligned: dict, tmp_path: Path
) -> None:
    from lmforge.engine.executor import graph
    from lmforge.engine.stage import hf_model
    from serving.quantize.steps import model_role

    workspace = tmp_path / "ws"
    shutil.copytree(_workspace(rl_aligned), workspace)
    settings = [
        *SMALL_RL,
        "evaluate.tasks=[lmforge_chat_exact, lmforge_preference]",
        "evaluate.backends=[hf]",
        "evaluate.models=[sft, dpo, rl]",
    ]
    config = small_config(workspace, *settings)
    manifests = run_pipeline_locally(config, ["evaluate"])
    rl_dir = Path(rl_aligned["align/rl"]["dir"]).relative_to(_workspace(rl_aligned))
    assert manifests["evaluate/rl-hf"]["extra"]["model_dir"] == str(workspace / rl_dir / "hf")
    card = (Path(manifests["evaluate/report"]["dir"]) / "comparison.md").read_text()
    for step in ("sft -> dpo", "dpo -> rl"):
        assert f"| hf | lmforge_chat_exact | exact_match | {step} |" in card, card
    # RL's model scores the same on lm-eval's task as in its own summary (one verifier, one rule)
    rl_exact = manifests["evaluate/rl-hf"]["metrics"]["lmforge_chat_exact/exact_match"]
    assert 0 <= rl_exact <= 1
    assert model_role(config) == "rl" and graph().has(hf_model("rl"), config)


def test_a_gain_on_rl_prompts_that_misses_held_out_ones_is_one_warning_line() -> None:
    from training.align.methods.rl import generalisation

    own = {"rl_prompts_exact_match_delta": 0.063, "rl_prompts_exact_match_delta_ci": [0.007, 0.12]}
    held = {"exact_match_delta": -0.007, "exact_match_delta_ci": [-0.026, 0.012]}
    warning = generalisation(own, held)  # tiny-cpu-rl's figures (README): the policy memorised its prompts
    assert warning is not None and "\n" not in warning
    assert warning.startswith("RL raised exact match on its own prompts by +0.063 [+0.007, +0.120]")
    assert "(-0.007 [-0.026, +0.012])" in warning
    assert generalisation(own, {"exact_match_delta": 0.03, "exact_match_delta_ci": [0.01, 0.05]}) is None
    assert generalisation({**own, "rl_prompts_exact_match_delta_ci": [-0.01, 0.12]}, held) is None


@pytest.mark.slow
def test_the_prompt_filter_keeps_the_pass_rates_asked_for_and_fails_in_one_line_when_none_qualify(
    aligned: dict, tmp_path: Path
) -> None:
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmforge.errors import ConfigError
    from training.align.methods.rl import filter_prompts, prompt_records

    hf = Path(aligned["align/sft"]["dir"]) / "hf"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)
    records = prompt_records(str(Path(aligned["align/data"]["dir"]) / "sft" / "train.jsonl"), "verifiable")
    rl = {"seed": 0, "temperature": 1.0, "max_completion_length": 8}

    def spec(out: Path, low: float, high: float) -> dict:
        out.mkdir()
        limits = {"samples": 4, "min_pass_rate": low, "max_pass_rate": high, "pool": 24}
        return {"out_dir": str(out), "config": {**rl, "prompt_filter": limits}}

    try:
        everything = spec(tmp_path / "all", 0.0, 1.0)
        kept = filter_prompts(everything, model, tokenizer, records)
        rows = [json.loads(line) for line in (tmp_path / "all" / "prompt_filter.jsonl").read_text().splitlines()]
        assert len(rows) == 24 and sorted(map(json.dumps, kept)) == sorted(
            json.dumps({k: r[k] for k in ("prompt", "answer", "task")}) for r in rows if 0 < r["passes"] < 4
        )
        # pass rates come in quarters: none lies strictly between 0.8 and 1
        with pytest.raises(
            ConfigError, match=r"^align.rl.prompt_filter: none of 24 prompts has a pass rate in"
        ) as info:
            filter_prompts(spec(tmp_path / "none", 0.8, 1.0), model, tokenizer, records)
        assert "\n" not in str(info.value) and "prompt_filter.jsonl" in str(info.value)
    finally:
        PartialState._reset_state()  # the in-process state filter_prompts made; launched ranks make their own


def test_the_watch_fires_on_a_drop_beyond_noise_not_on_three_answers_of_64() -> None:
    from training.align.methods.rl import hacking

    spec = {"config": {"hacking": {"min_reward_gain": 0.05, "max_accuracy_drop": 0.02, "max_loss_rise": 0.05}}}

    def figures(right: list[int], rm: float) -> dict:
        hits = [float(i in right) for i in range(64)]
        return {"heldout_rm_score": rm, "heldout_verified": sum(hits) / 64, "heldout_verified_items": hits}

    start = figures(list(range(14)), 0.896)  # tiny-cpu-rl's watch at step 0: 0.219
    noise = figures(list(range(3, 14)), 1.189)  # 0.172: 3 answers lost, as at its step 100
    assert hacking(spec, start, noise) is None
    gamed = figures([0, 1], 1.189)  # 14 right answers -> 2: the reward-model score rose, accuracy fell
    verdict = hacking(spec, start, gamed)
    assert verdict is not None and "verified accuracy 0.219 -> 0.031" in verdict
    # a start recorded without per-item answers (an older attempt's rl_start.json): the margin alone
    old = {k: v for k, v in start.items() if k != "heldout_verified_items"}
    assert hacking(spec, old, noise) is not None
