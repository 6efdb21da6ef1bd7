"""Configuration: presets, overrides, and one-line errors that name the field and the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.errors import ConfigError


@pytest.mark.parametrize("preset", ["tiny-cpu", "gpu-1node", "gpu-multinode", "gpu-finetune", "gpu-long-context"])
def test_presets_validate(preset: str) -> None:
    config = load_config(preset, check_paths=False)
    assert config.name == preset
    assert config.pretrain.seq_len >= 256


def test_gpu_preset_extends_tiny_and_overrides() -> None:
    config = load_config("gpu-1node", check_paths=False)
    assert config.pretrain.model.num_layers == 22
    assert config.pretrain.precision == "bf16"
    assert config.curate.near_dedup.bands == 14  # inherited default


def test_set_overrides_parse_yaml_values() -> None:
    config = load_config(
        "tiny-cpu",
        [
            "pretrain.optim.lr=1e-3",
            "curate.langid.keep=[en,fr]",
            "curate.near_dedup.enabled=false",
            "runtime.workers=1",
        ],
    )
    assert config.pretrain.optim.lr == pytest.approx(1e-3)
    assert config.curate.langid.keep == ["en", "fr"]
    assert config.curate.near_dedup.enabled is False
    assert config.runtime.workers == 1


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "curate.near_dedup.treshold=0.7",
            "--set curate.near_dedup.treshold=0.7: curate.near_dedup.treshold: unknown field (did you mean 'threshold'?)",
        ),
        ("pretrain.optim.lr=fast", "pretrain.optim.lr: Input should be a valid number"),
        ("pretrain.lr=1e-3", "--set pretrain.lr=1e-3: pretrain.lr: unknown field (did you mean 'pretrain.optim.lr'?)"),
        ("pretrain.model.num_heads=3", "pretrain.model: hidden_size 256 is not divisible by num_heads 3"),
        ("curate.inputs=[/nonexistent/*.jsonl]", "curate.inputs[0]: no file matches '/nonexistent/*.jsonl'"),
        ("runtime.workers=0", "runtime.workers: Input should be greater than or equal to 1"),
        ("evaluate.backend_models={vllm: [dpoo]}", "evaluate.backend_models: no model role 'dpoo'"),
        ("evaluate.backend_models={vlm: [dpo]}", "evaluate.backend_models.vlm.[key]: Input should be 'hf' or 'vllm'"),
    ],
)
def test_bad_values_give_one_line_naming_the_field(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", [override])
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("extends: tiny-cpu\npretrain:\n  modle: {}\n")
    with pytest.raises(ConfigError, match=rf"{path}: pretrain.modle: unknown field \(did you mean 'model'\?\)"):
        load_config(str(path))


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("curate:\n  inputs: [a, b\n")
    with pytest.raises(ConfigError, match=rf"{path}: line \d+: invalid YAML"):
        load_config(str(path))


def test_extends_cycle_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(f"extends: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"extends: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_config(str(tmp_path / "a.yaml"))


def test_cli_bad_config_exits_nonzero_with_one_line_and_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "config", "validate", "--set", "pretrain.optim.lr=abc"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip() and "accelerator" not in line]
    assert lines == [lines[0]] and lines[0].startswith("config error: --set pretrain.optim.lr=abc: pretrain.optim.lr:")
    assert "Traceback" not in result.stderr


def test_every_stage_step_can_be_switched_off_from_the_command_line() -> None:
    from lmforge.engine.executor import graph

    switches = [
        "near_dedup",
        "langid",
        "quality_classifier",
        "gopher_quality",
        "gopher_repetition",
        "c4",
        "fineweb",
        "length",
        "encoding",
        "pii",
        "mix",
        "exact_dedup",
        "normalize",
        "toxicity",
        "paragraph_dedup",
    ]
    config = load_config(
        "tiny-cpu", [f"curate.{s}.enabled=false" for s in switches] + ["curate.decontaminate.tasks=[]"]
    )
    active = {s.name for s in graph().active(config, ["curate"])}
    # split decides what pack holds out (curate.pack.split_by=id: by id alone)
    assert active == {"curate/ingest", "curate/select", "curate/tokenizer", "curate/split", "curate/pack"}


def test_quality_classifier_needs_exactly_one_selection_rule() -> None:
    from data_prep.config import QualityClassifierConfig

    assert QualityClassifierConfig(threshold=0.4).keep_fraction is None  # a threshold alone replaces the default
    with pytest.raises(ConfigError, match="keep_fraction=null to use a threshold"):
        load_config("tiny-cpu", ["curate.quality_classifier.threshold=0.4"])  # the preset sets keep_fraction
    assert (
        load_config(
            "tiny-cpu", ["curate.quality_classifier.threshold=0.4", "curate.quality_classifier.keep_fraction=null"]
        ).curate.quality_classifier.threshold
        == 0.4
    )
    with pytest.raises(ConfigError, match="needs a rule to select by"):
        load_config("tiny-cpu", ["curate.quality_classifier.keep_fraction=null"])


def test_renamed_fields_still_load_for_one_release_with_a_notice(caplog) -> None:  # type: ignore[no-untyped-def]
    """align.builtin.tasks/per_task are now skills/per_skill ("tasks" are lm-eval's, here)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="lmforge.config"):
        config = load_config("tiny-cpu", ["align.builtin.per_task=7", "align.builtin.tasks=[add,copy]"])
    assert config.align.builtin.per_skill == 7 and config.align.builtin.skills == ["add", "copy"]
    assert "align.builtin.per_task is now align.builtin.per_skill" in caplog.text
    with pytest.raises(ConfigError, match="skils"):
        load_config("tiny-cpu", ["align.builtin.skils=[add]"])


BAD_CONFIGS = [  # each passed `lmforge config validate` before: (overrides, YAML body or None, what the line names)
    (["runtime.step_timeout_s={pretrain/trian: 60}"], None, "runtime.step_timeout_s"),
    (["evaluate.limit={lmforge_chat_exct: 3}"], None, "evaluate.limit"),
    (["pretrain.max_steps=true"], None, "max_steps"),
    ([], "extends: tiny-cpu\npretrain:\n  max_steps: 5\n  max_steps: 7\n", "line 4"),
    (["evaluate.tasks=[/nonexistent/task.yaml]"], None, "evaluate.tasks[0]"),
    ([], 'extends: tiny-cpu\nname: "demo\\n#SBATCH --nodes=1"\n', "name"),
    (['cluster.partition="gpu\\nrm -rf ~"'], None, "cluster.partition"),
    (['cluster.account="a\\rb"'], None, "cluster.account"),
    (['cluster.time="1:00:00\\n#SBATCH --requeue"'], None, "cluster.time"),
    (['cluster.extra_sbatch=["--qos=x\\n#SBATCH --nodes=9"]'], None, "cluster.extra_sbatch"),
    (["evaluate.tasks=[../../outside]"], None, "evaluate.tasks"),
    (["evaluate.limit={../x: 3}"], None, "evaluate.limit"),
    (["runtime.dask_address=tcp://10.1.2.3:8786"], None, "runtime.dask_address"),  # pickles from anyone
    (["runtime.dask_address=10.1.2.3:8786"], None, "runtime.dask_address"),  # tcp by default
]


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("evaluate.contamination.short_ngram=8", "fuzzy_ngram"),  # renamed when the fuzzy path came
        ("curate.decontaminate.min_coverage=0.5", "evaluate.contamination"),  # one rule, set in one place
        ("evaluate.contamination.fuzzy_ngram=20", "fuzzy_ngram 20 is larger than ngram 13"),
    ],
)
def test_contamination_rule_settings_live_in_one_place(override: str, names: str) -> None:
    with pytest.raises(ConfigError, match=names) as error:
        load_config("tiny-cpu", [override])
    assert "\n" not in str(error.value)


def test_a_loopback_or_tls_dask_scheduler_or_an_explicit_opt_in_is_accepted() -> None:
    for settings in (
        ["runtime.dask_address=tcp://127.0.0.1:8786"],
        ["runtime.dask_address=tls://10.1.2.3:8786"],
        ["runtime.dask_address=tcp://10.1.2.3:8786", "runtime.dask_allow_plain_tcp=true"],
    ):
        assert load_config("tiny-cpu", settings).runtime.dask_address


@pytest.mark.parametrize(("overrides", "body", "names"), BAD_CONFIGS)
def test_configs_that_used_to_pass_exit_2_with_one_line(overrides, body, names, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from lmforge import cli

    preset = "tiny-cpu"
    if body is not None:
        (tmp_path / "bad.yaml").write_text(body)
        preset = str(tmp_path / "bad.yaml")
    argv = ["config", "validate", "--config", preset]
    for override in overrides:
        argv += ["--set", override]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("config error: ") and names in err, err


def test_a_step_timeout_for_a_real_step_or_stage_is_accepted() -> None:
    config = load_config("tiny-cpu", ["runtime.step_timeout_s={pretrain/train: 60, curate: 600}"])
    assert config.runtime.step_timeout_s == {"pretrain/train": 60, "curate": 600}


@pytest.mark.parametrize(
    "override",
    [
        "workspace=s3://AKIAEXAMPLE:hunter2secret@bucket/prefix",
        "workspace=az://container/prefix?sv=2024&sig=hunter2secret",
        "runtime.storage.options={endpoint_url: 'http://admin:hunter2secret@127.0.0.1:9000'}",
        "runtime.storage.options={s3_additional_kwargs: {SSECustomerKey: hunter2secret}}",
        "runtime.storage.options={credential: hunter2secret}",
        "runtime.storage.options={client_kwargs: {headers: {Authorization: hunter2secret}}}",
        "tracking.mlflow.tracking_uri=https://user:hunter2secret@mlflow.example:8443",
        "evaluate.judge.endpoint.url=https://judge.example/v1?key=hunter2secret",
        "evaluate.judge.endpoint.url=https://judge.example/v1?X-Amz-Signature=hunter2secret",
    ],
)
def test_a_credential_in_a_url_or_a_storage_option_is_refused_without_repeating_it(override: str) -> None:
    """The config is logged, tracked and kept in manifests and keys: a URL with a user:password part
    or a secret-like query parameter, or a secret-holding fsspec option, is refused in one line that
    names the field and never repeats the secret."""
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", [override], check_paths=False)
    message = str(info.value)
    assert "hunter2secret" not in message and "\n" not in message, message
    assert "credential" in message, message


def test_urls_without_credentials_still_load() -> None:
    config = load_config(
        "tiny-cpu",
        [
            "runtime.storage.options={endpoint_url: 'http://127.0.0.1:9000'}",
            "tracking.mlflow.tracking_uri=http://127.0.0.1:5000/?experiment=1",
            "evaluate.judge.endpoint.url=https://judge.example/v1",
            "evaluate.judge.model=null",
            "evaluate.judge.endpoint.model=judge-1",
        ],
        check_paths=False,
    )
    assert config.evaluate.judge.endpoint.url == "https://judge.example/v1"


def test_backend_models_narrows_one_backend_and_leaves_the_others_every_model() -> None:
    from evaluation.steps import RUN_STEPS

    def evaluated(*overrides: str) -> set[str]:
        config = load_config("tiny-cpu", list(overrides))
        return {step.name for step in RUN_STEPS if step.enabled(config)}

    every = {f"evaluate/{m}-{b}" for m in ("pretrained", "sft", "dpo") for b in ("hf", "vllm")}
    assert evaluated() == every
    assert evaluated("evaluate.backend_models={vllm: [dpo]}") == every - {
        "evaluate/pretrained-vllm",
        "evaluate/sft-vllm",
    }
    # a role outside evaluate.models, or a backend outside evaluate.backends, stays off
    assert evaluated("evaluate.models=[sft]", "evaluate.backend_models={vllm: [dpo]}") == {"evaluate/sft-hf"}
    assert evaluated("evaluate.backends=[hf]", "evaluate.backend_models={vllm: [dpo], hf: [sft]}") == {
        "evaluate/sft-hf"
    }
