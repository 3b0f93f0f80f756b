"""The config system: inheritance, overrides, and a clear error for each kind of bad input."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from pretrain.config import ConfigError, RunConfig, dump_config, load_config


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def base(tmp_path: Path) -> Path:
    text = "run:\n  name: base\n  seed: 7\ntrain:\n  lr: 0.001\n  steps: 10\nmodel:\n  d_model: 64\n"
    write(tmp_path / "base.yaml", text)
    return tmp_path / "base.yaml"


def test_defaults_validate() -> None:
    assert isinstance(RunConfig(), RunConfig)


def test_child_inherits_and_overrides_parent(tmp_path: Path, base: Path) -> None:
    child = write(tmp_path / "child.yaml", "extends: base.yaml\ntrain:\n  steps: 20\n")
    cfg = load_config(child)
    assert cfg.run.name == "base" and cfg.run.seed == 7  # inherited
    assert cfg.train.lr == 0.001  # inherited, sibling of an overridden key
    assert cfg.train.steps == 20  # overridden


def test_multi_level_and_list_extends(tmp_path: Path, base: Path) -> None:
    write(tmp_path / "mid.yaml", "extends: base.yaml\nmodel:\n  n_layers: 3\n")
    write(tmp_path / "other.yaml", "engine:\n  kind: deepspeed\n")
    top = write(tmp_path / "top.yaml", "extends: [mid.yaml, other.yaml]\nmodel:\n  n_heads: 2\n")
    cfg = load_config(top)
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads) == (64, 3, 2)
    assert cfg.engine.kind == "deepspeed"


def test_dotted_overrides_are_typed(base: Path) -> None:
    overrides = ["train.lr=3e-4", "train.weight_decay=1E-2", "model.n_layers=4", "engine.kind=fsdp"]
    cfg = load_config(base, [*overrides, "train.max_runtime=null"])
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.weight_decay == pytest.approx(0.01)
    assert cfg.model.n_layers == 4 and cfg.engine.kind == "fsdp" and cfg.train.max_runtime is None


def test_int_accepted_where_float_expected(base: Path) -> None:
    assert load_config(base, ["train.lr=1"]).train.lr == 1.0


def test_list_of_sections(tmp_path: Path) -> None:
    cfg_path = write(
        tmp_path / "d.yaml", "data:\n  train:\n    - {path: a, weight: 2}\n    - {path: b}\n  valid: [v]\n"
    )
    cfg = load_config(cfg_path)
    assert [(s.path, s.weight) for s in cfg.data.train] == [("a", 2.0), ("b", 1.0)]


def test_resolved_config_round_trips(tmp_path: Path, base: Path) -> None:
    cfg = load_config(base, ["train.steps=33"])
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


@pytest.mark.parametrize(
    ("text", "overrides", "fragments"),
    [
        ("train:\n  lrr: 0.1\n", [], ["train.lrr", "unknown key", "lr"]),
        ("bogus: 1\n", [], ["bogus", "unknown key"]),
        ("train:\n  steps: ten\n", [], ["train.steps", "expected an integer", "'ten'"]),
        ("train:\n  steps: 1.5\n", [], ["train.steps", "expected an integer"]),
        ("log:\n  wandb: 1\n", [], ["log.wandb", "expected a boolean"]),
        ("engine:\n  kind: horovod\n", [], ["engine.kind", "'single'", "'deepspeed'", "'fsdp'"]),
        ("train:\n  lr: -1\n", [], ["train.lr", "must be > 0"]),
        ("train:\n  global_batch: 10\n  micro_batch: 4\n", [], ["train.global_batch", "multiple of micro_batch"]),
        ("model:\n  d_model: 30\n  n_heads: 4\n", [], ["model.n_heads", "divide"]),
        ("data:\n  train: [{weight: 1}]\n", [], ["data.train", "path"]),
        ("train: 3\n", [], ["train", "expected a mapping"]),
        ("train:\n  spike: {factor: 1}\n", [], ["train.spike.factor", "must be > 1"]),
        ("train:\n  spike: {max_rollbacks: -1}\n", [], ["train.spike.max_rollbacks", "0 turns spike rollback off"]),
        ("train:\n  straggler_factor: 0.9\n", [], ["train.straggler_factor", "must be > 1"]),
        ("checkpoint:\n  hang_timeout_s: 0\n", [], ["checkpoint.hang_timeout_s", "must be > 0", "null"]),
        ("", ["eval.hang_timeout_s=1800"], ["<command line>", "eval.hang_timeout_s=1800.0",
                                            "below engine.dist_timeout_s"]),
        ("train:\n  max_no_progress_requeues: -1\n", [], ["train.max_no_progress_requeues", "must be >= 0"]),
        ("data:\n  skip_samples: [[4, 2]]\n", [], ["data.skip_samples", "0 <= first < end", "[4, 2]"]),
        ("data:\n  interleave: 12\n", [], ["data.interleave", "power of two", "12"]),
        ("data:\n  task: {name: mqar, params: {num_pairs: [8, 16]}}\n", [],
         ["data.task.params.num_pairs", "expected an integer or a number or a boolean or a string", "[8, 16]"]),
        ("", ["train.lr=abc"], ["<command line>", "train.lr", "expected a number"]),
        ("", ["train.nope=1"], ["<command line>", "train.nope", "unknown key"]),
        ("", ["trainlr"], ["<command line>", "key=value"]),
    ],
)
def test_bad_input_names_key_file_and_expectation(
    tmp_path: Path, text: str, overrides: list[str], fragments: list[str]
) -> None:
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    message = str(err.value)
    if "<command line>" not in fragments:
        assert str(path) in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_error_names_the_file_that_set_the_key(tmp_path: Path, base: Path) -> None:
    write(tmp_path / "parent.yaml", "train:\n  warmup_steps: -3\n")
    child = write(tmp_path / "child.yaml", "extends: parent.yaml\ntrain:\n  steps: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(child)
    assert "parent.yaml" in str(err.value) and "train.warmup_steps" in str(err.value)


def test_missing_file_and_cycle(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_yaml_is_read_safely(tmp_path: Path) -> None:
    path = write(tmp_path / "evil.yaml", "run: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_every_shipped_config_validates() -> None:
    root = Path(__file__).resolve().parents[1] / "configs"
    shipped = [p for p in root.rglob("*.yaml") if "extends" in p.read_text() or "model:" in p.read_text()]
    for path in shipped:
        data = yaml.safe_load(path.read_text()) or {}
        if set(data) - {"extends"} <= set(RunConfig.__dataclass_fields__):
            load_config(path)


def test_model_entry_points_share_the_typed_reader(tmp_path: Path, base: Path) -> None:
    """Model-only commands (model.summary) read `model:` with the run loader's checks."""
    from model.config import load_model_config

    child = write(tmp_path / "child.yaml", "extends: base.yaml\nmodel:\n  n_layers: 3\n")
    assert load_model_config(child) == load_config(child).model
    bad = write(tmp_path / "bad.yaml", "extends: base.yaml\nmodel:\n  n_layers: three\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: model\.n_layers: expected an integer"):
        load_model_config(bad)
    with pytest.raises(ConfigError, match=r"expected a `model:` mapping"):
        load_model_config(write(tmp_path / "none.yaml", "train:\n  steps: 5\n"))


def test_a_key_that_is_a_python_keyword_keeps_its_yaml_name(tmp_path: Path, base: Path) -> None:
    """`init.from` is the field `from_`: the file, errors and the resolved config all say `from`."""
    cfg = load_config(base, ["init.from=runs/short"])
    assert cfg.init.from_ == "runs/short"
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert yaml.safe_load((tmp_path / "resolved.yaml").read_text())["init"] == {"from": "runs/short"}
    assert load_config(tmp_path / "resolved.yaml") == cfg
    for wrong in ("init.from_=runs/short", "init.form=runs/short"):
        with pytest.raises(ConfigError, match=r"unknown key; InitSection section init accepts: from$"):
            load_config(base, [wrong])


def test_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    lines = ["a: &a ['lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol']"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
              f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]" for i in range(9)]
    text = "\n".join(lines) + "\n"
    assert len(text) < 1024
    path = write(tmp_path / "bomb.yaml", text)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="aliases") as err:
        load_config(path)
    assert time.monotonic() - started < 1.0
    assert str(path) in str(err.value)


def test_duplicate_key_names_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path / "dup.yaml", "train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr'") as err:
        load_config(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize("key", ["train.lr", "train.grad_clip", "model.init_std", "log.peak_tflops"])
def test_every_float_rejects_nan_and_infinity(base: Path, key: str, value: str) -> None:
    with pytest.raises(ConfigError, match="a finite number") as err:
        load_config(base, [f"{key}={value}"])
    assert key in str(err.value) and "<command line>" in str(err.value)


@pytest.mark.parametrize(
    "override", ["train.eps=0", "train.eps=1.5", "train.eps=-1e-8", "train.beta1=1", "train.beta2=-0.1"]
)
def test_eps_and_betas_are_range_checked(base: Path, override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(base, [override])


def test_long_values_are_truncated_in_errors(base: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(base, ["train.lr=[" + ", ".join(["1"] * 5000) + "]"])
    assert len(str(err.value)) < 300


def test_bad_key_in_a_command_line_list_item_blames_the_command_line(tmp_path: Path) -> None:
    path = write(tmp_path / "base.yaml", "data:\n  train:\n    - path: a\n")
    with pytest.raises(ConfigError, match="unknown key") as err:
        load_config(path, ["data.train=[{path: b, bogus: 1}]"])
    assert str(err.value).startswith("<command line>: data.train[0].bogus"), str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path / "inline.yaml", "data:\n  train:\n    - path: a\n      bogus: 1\n"))
    assert str(err.value).startswith(str(tmp_path / "inline.yaml")), str(err.value)


def test_a_list_set_item_by_item_gets_an_example_of_the_list_syntax(tmp_path: Path) -> None:
    path = write(tmp_path / "base.yaml", "data:\n  train:\n    - path: shards/a\n      weight: 2.0\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["data.train.0.path=shards/b"])
    message = str(err.value)
    assert message.startswith("<command line>: override data.train.0.path: data.train is a list"), message
    example = message.split("e.g. ")[1]
    assert example == "data.train='[{path: shards/a, weight: 2.0}]'", message
    fixed = example.replace("'", "").replace("shards/a", "shards/b")  # the example, as the shell passes it
    assert load_config(path, [fixed]).data.train[0].path == "shards/b"


def test_a_misspelled_section_on_the_command_line_blames_the_command_line(base: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(base, ["trian.lr=3e-4"])
    assert str(err.value).startswith("<command line>: trian: unknown key"), str(err.value)
