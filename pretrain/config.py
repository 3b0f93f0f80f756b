"""One typed configuration system for every entry point.

A run is described by YAML files that may extend each other (`extends: base.yaml`), plus dotted
command-line overrides (`train.lr=3e-4`). The merged tree is validated against dataclasses: an
unknown key, a wrong type or a bad value stops the program before any work, with a message that
names the key, the file it came from and what was expected.

Value checks live in each dataclass's `__post_init__`, which raises `ValueError("field: message")`;
the loader turns that into a `ConfigError` carrying the full dotted key and its source.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from model.config import ModelConfig

COMMAND_LINE = "<command line>"
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts."""


@dataclasses.dataclass
class RunSection:
    """Where the run lives and how it is seeded."""

    name: str = "run"
    dir: str = "runs/run"
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be a non-empty string")
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")


@dataclasses.dataclass
class DataSource:
    """One shard set (a directory or fsspec URL holding manifest.json) and its mixture weight."""

    path: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path: must name a shard directory or URL")
        if self.weight <= 0:
            raise ValueError(f"weight: must be > 0, got {self.weight}")


@dataclasses.dataclass
class DataSection:
    """Training and validation data."""

    train: list[DataSource] = dataclasses.field(default_factory=list)
    valid: list[str] = dataclasses.field(default_factory=list)
    tokenizer: str = "bytes"
    seq_len: int = 256
    shuffle_buffer: int = 1024
    doc_boundaries: bool = False
    num_workers: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"seq_len: must be >= 2, got {self.seq_len}")
        if self.shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer: must be >= 1, got {self.shuffle_buffer}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers: must be >= 0, got {self.num_workers}")


@dataclasses.dataclass
class TrainSection:
    """Optimisation: batch, schedule, AdamW, clipping, failure policy."""

    steps: int = 100
    global_batch: int = 8
    micro_batch: int = 2
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    nan_policy: Literal["skip", "stop"] = "skip"
    max_skipped_steps: int = 10
    activation_checkpointing: bool = False
    compile: bool = False
    carry_state: bool = False  # truncated BPTT: each batch row continues its text (pretrain/carry.py)
    log_every: int = 10
    max_runtime: float | None = None

    def __post_init__(self) -> None:
        positive = {"steps": self.steps, "global_batch": self.global_batch,
                    "micro_batch": self.micro_batch, "log_every": self.log_every}
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key}: must be >= 1, got {value}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction: must be in (0, 1], got {self.decay_fraction}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        for key, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= value < 1:
                raise ValueError(f"{key}: must be in [0, 1), got {value}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip: must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch: {self.global_batch} is not a multiple of micro_batch={self.micro_batch}"
            )
        if self.max_runtime is not None and self.max_runtime <= 0:
            raise ValueError(f"max_runtime: must be > 0 seconds or null, got {self.max_runtime}")


@dataclasses.dataclass
class EngineSection:
    """Which distributed engine runs the step."""

    kind: Literal["single", "deepspeed", "fsdp"] = "single"
    zero_stage: int = 2
    offload_optimizer: bool = False
    precision: Literal["fp32", "bf16"] = "fp32"
    dist_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s: must be > 0, got {self.dist_timeout_s}")


@dataclasses.dataclass
class CheckpointSection:
    """When and where checkpoints are written, and how a run resumes."""

    dir: str | None = None
    every: int = 50
    keep_last: int = 2
    milestone_every: int = 0
    async_save: bool = True
    resume: str = "auto"

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every: must be >= 0 (0 disables periodic saves), got {self.every}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last: must be >= 1, got {self.keep_last}")
        if self.milestone_every < 0:
            raise ValueError(f"milestone_every: must be >= 0, got {self.milestone_every}")


MIN_TASK_LEN = 128  # room for the needle sentence and question, and for 8 Zipf records


@dataclasses.dataclass
class EvalSection:
    """Periodic held-out evaluation."""

    every: int = 0
    contexts: list[int] = dataclasses.field(default_factory=lambda: [256])
    max_tokens: int = 65536
    tasks: list[Literal["copy", "needle", "zipf"]] = dataclasses.field(default_factory=list)
    task_len: int = 512
    task_examples: int = 16
    haystack: str | None = None

    def __post_init__(self) -> None:
        if self.task_len < MIN_TASK_LEN:
            raise ValueError(
                f"task_len: must be >= {MIN_TASK_LEN} tokens (room for the tasks' prompts), got {self.task_len}"
            )
        if self.task_examples < 1:
            raise ValueError(f"task_examples: must be >= 1, got {self.task_examples}")
        if "needle" in self.tasks and not self.haystack:
            raise ValueError("haystack: the needle task needs a text file to hide the needle in")
        if self.every < 0:
            raise ValueError(f"every: must be >= 0 (0 disables evaluation), got {self.every}")
        if not self.contexts or min(self.contexts) < 2:
            raise ValueError(f"contexts: must be a non-empty list of lengths >= 2, got {self.contexts}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens: must be >= 2, got {self.max_tokens}")


@dataclasses.dataclass
class LogSection:
    """Metric sinks."""

    wandb: bool = True
    wandb_project: str = "recurrent-pretrain"
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops: must be > 0 or null (measure at start-up), got {self.peak_tflops}")


@dataclasses.dataclass
class RunConfig:
    """The whole resolved configuration of one run."""

    run: RunSection = dataclasses.field(default_factory=RunSection)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    engine: EngineSection = dataclasses.field(default_factory=EngineSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)


# ----------------------------------------------------------------------------- reading YAML


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _merge(base: dict, extra: dict, sources: dict[str, str] | None, origin: str, prefix: str = "") -> dict:
    """Deep-merge `extra` into a copy of `base`; with `sources`, record `origin` for each key set."""
    merged = dict(base)
    for key, value in extra.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value, sources, origin, dotted + ".")
        else:
            merged[key] = value
            if sources is not None:
                _record_sources(value, dotted, sources, origin)
    return merged


def _record_sources(value: Any, dotted: str, sources: dict[str, str], origin: str) -> None:
    sources[dotted] = origin
    if isinstance(value, dict):
        for key, sub in value.items():
            _record_sources(sub, f"{dotted}.{key}", sources, origin)


def _load_tree(path: Path, sources: dict[str, str], chain: tuple[Path, ...] = ()) -> dict:
    """Load one file on top of the files it extends (in order), recording each key's file."""
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"{path}: 'extends' forms a cycle: {cycle}")
    data = _read_yaml(path)
    parents = data.pop("extends", [])
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: extends: expected a file name or a list of file names, got {parents!r}")
    tree: dict = {}
    for parent in parents:
        tree = _merge(tree, _load_tree(path.parent / parent, sources, (*chain, path)), None, "")
    return _merge(tree, data, sources, str(path))


def _apply_override(tree: dict, item: str, sources: dict[str, str]) -> None:
    if "=" not in item:
        raise ConfigError(f"{COMMAND_LINE}: override {item!r}: expected key=value, e.g. train.lr=3e-4")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"{COMMAND_LINE}: override {item!r}: malformed key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"{COMMAND_LINE}: override {key}: cannot parse value {raw!r}: {err}") from err
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{COMMAND_LINE}: override {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value
    _record_sources(value, ".".join(parts), sources, COMMAND_LINE)


# ----------------------------------------------------------------------------- typed building


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


class _Mismatch(Exception):
    def __init__(self, key: str, expected: str, got: Any):
        super().__init__(key)
        self.key, self.expected, self.got = key, expected, got


def _convert(tp: Any, value: Any, key: str, sources: dict[str, str]) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch(key, _type_name(tp), value)
        return _build(tp, value, key, sources)
    if origin is Literal:
        if value not in get_args(tp):
            raise _Mismatch(key, _type_name(tp), value)
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        for option in get_args(tp):
            if option is type(None):
                continue
            try:
                return _convert(option, value, key, sources)
            except _Mismatch:
                continue
        raise _Mismatch(key, _type_name(tp), value)
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch(key, _type_name(tp), value)
        (item_tp,) = get_args(tp)
        return [_convert(item_tp, v, f"{key}[{i}]", sources) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch(key, _type_name(tp), value)
        _, item_tp = get_args(tp)
        return {str(k): _convert(item_tp, v, f"{key}.{k}", sources) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch(key, _type_name(tp), value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Mismatch(key, _type_name(tp), value)
        return value
    if tp is float:
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads "3e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Mismatch(key, _type_name(tp), value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _Mismatch(key, _type_name(tp), value)
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {key}")


def _source_of(key: str, sources: dict[str, str]) -> str:
    probe = key
    while probe:
        if probe in sources:
            return sources[probe]
        probe = probe.rsplit(".", 1)[0] if "." in probe else ""
    return "<defaults>"


def _build(cls: type, tree: dict, prefix: str, sources: dict[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in tree:
        if key not in fields:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"{_source_of(dotted, sources)}: {dotted}: unknown key; "
                f"{cls.__name__} {'section ' + prefix + ' ' if prefix else ''}accepts: {known}"
            )
    kwargs = {}
    for name, value in tree.items():
        dotted = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(hints[name], value, dotted, sources)
    try:
        return cls(**kwargs)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        message = str(err)
        field_name, sep, detail = message.partition(": ")
        if sep and field_name in fields:
            dotted = f"{prefix}.{field_name}" if prefix else field_name
            raise ConfigError(f"{_source_of(dotted, sources)}: {dotted}: {detail}") from None
        where = prefix or "<top level>"
        raise ConfigError(f"{_source_of(prefix, sources)}: {where}: {message}") from None


def config_from_dict(tree: dict, sources: dict[str, str] | None = None) -> RunConfig:
    """Validate a plain nested dict (e.g. a resolved config read back from a run directory)."""
    sources = sources if sources is not None else {}
    try:
        return _build(RunConfig, tree, "", sources)
    except _Mismatch as err:
        raise ConfigError(
            f"{_source_of(err.key, sources)}: {err.key}: expected {err.expected}, "
            f"got {err.got!r} ({type(err.got).__name__})"
        ) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read `path` (following `extends`), apply dotted overrides, and validate everything."""
    sources: dict[str, str] = {}
    tree = _load_tree(Path(path), sources)
    for item in overrides:
        _apply_override(tree, item, sources)
    return config_from_dict(tree, sources)


def config_to_dict(config: Any) -> dict:
    """The resolved config as plain data (for run directories, checkpoints and exports)."""
    return dataclasses.asdict(config)


def dump_config(config: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML; reading it back with load_config gives the same config."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
