"""The run configuration: one dataclass per section of the YAML files every run is described by.

Reading, `extends`, overrides and the typed checks are `model.config_loader`'s; value checks live in
each dataclass's `__post_init__` (`ValueError("field: message")`, reported with the dotted key and
the file it came from).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from data_pipeline import synthetic
from data_pipeline.storage import StorageSettings
from model import family
from model.config import ModelConfig, as_trained
from model.config_loader import ConfigError as ConfigError  # re-exported: run code reports config errors by it
from model.config_loader import build_config, check_range, dump_yaml, read_mapping, read_tree, short, to_plain


def check_hang_timeout(value: float | None) -> None:
    """A section's `hang_timeout_s`: seconds > 0, or null for the watchdog's derived deadline."""
    if value is not None:
        check_range("hang_timeout_s", value, low=0, low_open=True, note=" (or null: derived from measured times)")


@dataclasses.dataclass
class RunSection:
    """Where the run lives and how it is seeded."""

    name: str = "run"
    dir: str = "runs/run"
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be a non-empty string")
        check_range("seed", self.seed, low=0)


@dataclasses.dataclass
class DataSource:
    """One shard set (a directory or fsspec URL holding manifest.json) and its mixture weight."""

    path: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path: must name a shard directory or URL")
        check_range("weight", self.weight, low=0, low_open=True)


@dataclasses.dataclass
class TaskSource:
    """A synthetic task of data_pipeline.synthetic as the training data, examples of data.seq_len
    tokens; `params` overrides the task's constructor arguments (e.g. alpha, num_pairs)."""

    name: str = ""
    params: dict[str, int | float | bool | str] = dataclasses.field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in synthetic.TASKS:
            raise ValueError(f"name: unknown synthetic task {self.name!r}; known: {', '.join(sorted(synthetic.TASKS))}")
        if synthetic.TASKS[self.name].needs_haystack:
            raise ValueError(f"name: the {self.name!r} task needs a haystack text and cannot be training data")


@dataclasses.dataclass
class DataSection:
    """Training and validation data: shard sets (`train`) or one synthetic task (`task`).

    `mixture_change: true` declares that `train` differs on purpose from what the run's checkpoint
    was reading (sources added, removed or reweighted, or a source's shards rebuilt): the resume then
    continues with the new mixture from the saved position. Without it such a resume is refused
    (pretrain/run/resume_rules.py); set it on the command line of the one start that changes the data."""

    train: list[DataSource] = dataclasses.field(default_factory=list)
    task: TaskSource | None = None
    valid: list[str] = dataclasses.field(default_factory=list)
    tokenizer: str = "bytes"
    seq_len: int = 256
    shuffle_buffer: int = 1024
    # shuffle windows read side by side (a power of two; 1: window after window); world size x windows a rank
    # reads together lays each rank's samples together in the shards, so that its range reads on an object
    # store fetch blocks of its own samples (docs/data.md, "Interleaved windows"); part of the sample order
    interleave: int = 1
    doc_boundaries: bool = False
    num_workers: int = 0
    # "shard": whole shards, sha256-checked; "range": each sample's bytes (on an object store the blocks of
    # storage.block_size that hold them), no sha256 (docs/data.md, "Reading"); the same samples either way
    read: Literal["shard", "range"] = "shard"
    # global sample numbers never trained on, as [first, end) pairs (data_pipeline/skips.py); a loss-spike
    # rollback adds its range to the data state itself, so this is for skipping data by hand
    skip_samples: list[list[int]] = dataclasses.field(default_factory=list)
    mixture_change: bool = False

    def __post_init__(self) -> None:
        if self.task is not None and self.train:
            raise ValueError("task: set either data.train (shards) or data.task (a synthetic task), not both")
        check_range("seq_len", self.seq_len, low=2)
        check_range("shuffle_buffer", self.shuffle_buffer, low=1)
        if not 1 <= self.interleave <= 1 << 16 or self.interleave & (self.interleave - 1):
            raise ValueError(f"interleave: must be a power of two from 1 to 65536, got {self.interleave}")
        check_range("num_workers", self.num_workers, low=0)
        for i, pair in enumerate(self.skip_samples):
            if len(pair) != 2 or not 0 <= pair[0] < pair[1]:
                raise ValueError(
                    f"skip_samples: item {i} must be [first, end) global sample numbers with 0 <= first < end, "
                    f"got {short(pair)}"
                )


@dataclasses.dataclass
class SpikeSection:
    """Loss-spike rollback (pretrain/resilience/spike.py): a step whose global mean loss exceeds `factor` times the
    median of the `window` finite losses before it is a spike; the run restores the newest checkpoint
    from before it and skips the samples read since, at most `max_rollbacks` times in any
    `rollback_window` steps. docs/training.md, "Loss spikes", gives the reason
    for each default."""

    window: int = 50
    factor: float = 2.0
    max_rollbacks: int = 3  # per rollback_window steps; 0 turns the detector off; one more stops the run (exit 4)
    rollback_window: int = 1000  # the steps over which max_rollbacks counts (the spikes' steps)

    def __post_init__(self) -> None:
        check_range("window", self.window, low=1)
        check_range("factor", self.factor, low=1, low_open=True)
        check_range("max_rollbacks", self.max_rollbacks, low=0, note=" (0 turns spike rollback off)")
        check_range("rollback_window", self.rollback_window, low=1, note=" (steps)")


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
    # false; true (the backward recomputes each block's forward but its scans); "elementwise" (it also keeps
    # every matmul's output and recomputes only the elementwise work): model/blocks.py, docs/training.md
    activation_checkpointing: bool | Literal["elementwise"] = False
    # torch.compile: false, "blocks" (each block's forward), "model" (the whole training module) or true
    # (the default mode, "blocks"): pretrain/distributed/compiling.py
    compile: bool | Literal["blocks", "model"] = False
    carry_state: bool = False  # truncated BPTT: each batch row continues its text (pretrain/carry.py)
    log_every: int = 10
    max_runtime: float | None = None
    # the hang watchdog's deadline for each phase of a step (pretrain/resilience/watchdog.py); null: derived from
    # the measured step time, at least HANG_FLOOR_S
    hang_timeout_s: float | None = None
    # a rank whose time per step outside communication exceeds this many times the median rank's is
    # named at each log step (pretrain/resilience/straggler.py)
    straggler_factor: float = 1.5
    # requeues in a row that find no checkpoint newer than the job before's, after which the batch script
    # stops the job (exit 5) instead of requeueing it again (pretrain/resilience/requeue.py)
    max_no_progress_requeues: int = 2
    spike: SpikeSection = dataclasses.field(default_factory=SpikeSection)

    def __post_init__(self) -> None:
        for key in ("steps", "global_batch", "micro_batch", "log_every"):
            check_range(key, getattr(self, key), low=1)
        check_range("lr", self.lr, low=0, low_open=True)
        check_range("min_lr_ratio", self.min_lr_ratio, low=0, high=1)
        check_range("warmup_steps", self.warmup_steps, low=0)
        check_range("decay_fraction", self.decay_fraction, low=0, high=1, low_open=True)
        check_range("weight_decay", self.weight_decay, low=0)
        for key in ("beta1", "beta2"):
            check_range(key, getattr(self, key), low=0, high=1, high_open=True)
        check_range("eps", self.eps, low=0, high=1, low_open=True, high_open=True)
        check_range("grad_clip", self.grad_clip, low=0, note=" (0 disables clipping)")
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch: {self.global_batch} is not a multiple of micro_batch={self.micro_batch}"
            )
        if self.max_runtime is not None and self.max_runtime <= 0:
            raise ValueError(f"max_runtime: must be > 0 seconds or null, got {self.max_runtime}")
        check_hang_timeout(self.hang_timeout_s)
        check_range("straggler_factor", self.straggler_factor, low=1, low_open=True)
        check_range("max_no_progress_requeues", self.max_no_progress_requeues, low=0)


@dataclasses.dataclass
class EngineSection:
    """Which distributed engine runs the step."""

    kind: Literal["single", "deepspeed", "fsdp"] = "single"
    zero_stage: int = 2
    offload_optimizer: bool = False
    precision: Literal["fp32", "bf16"] = "fp32"
    # every process group's timeout; above the hang watchdog's first-step allowance (3 x 300 s) with room to
    # spare, since the watchdog's derived deadlines stay below 0.9 of it (docs/training.md, "Deadlines")
    dist_timeout_s: float = 1800.0
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        check_range("sequence_parallel", self.sequence_parallel, low=1, note=" (ranks per sequence)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {self.zero_stage}")
        check_range("dist_timeout_s", self.dist_timeout_s, low=0, low_open=True)


@dataclasses.dataclass
class CheckpointSection:
    """When and where checkpoints are written, and how a run resumes."""

    dir: str | None = None
    every: int = 50
    keep_last: int = 2
    milestone_every: int = 0
    async_save: bool = True
    resume: str = "auto"
    hang_timeout_s: float | None = None  # the watchdog's deadline for a save or restore; null: derived

    def __post_init__(self) -> None:
        check_range("every", self.every, low=0, note=" (0 disables periodic saves)")
        check_range("keep_last", self.keep_last, low=1)
        check_range("milestone_every", self.milestone_every, low=0)
        check_hang_timeout(self.hang_timeout_s)


@dataclasses.dataclass
class InitSection:
    """Where a fresh run's weights come from (YAML key `init.from`): a run directory, a checkpoint
    (step) directory or an export directory. Weights only: the optimizer, step counter and data
    stream start fresh, so seq_len, data mixture, engine and world size may all differ. A run that
    resumes from its own checkpoint ignores it."""

    from_: str | None = dataclasses.field(default=None, metadata={"yaml": "from"})

    def __post_init__(self) -> None:
        if self.from_ is not None and not self.from_.strip():
            raise ValueError("from: must name a run, checkpoint or export directory, or be null")


@dataclasses.dataclass
class EvalSection:
    """Periodic held-out evaluation."""

    every: int = 0
    contexts: list[int] = dataclasses.field(default_factory=lambda: [256])
    max_tokens: int = 65536
    tasks: list[str] = dataclasses.field(default_factory=list)
    task_len: int = 512
    task_examples: int = 16
    haystack: str | None = None
    hang_timeout_s: float | None = None  # the watchdog's deadline for one evaluation; null: derived

    def __post_init__(self) -> None:
        check_hang_timeout(self.hang_timeout_s)
        unknown = sorted(set(self.tasks) - set(synthetic.TASKS))
        if unknown:
            raise ValueError(f"tasks: unknown {unknown}; known: {', '.join(sorted(synthetic.TASKS))}")
        if self.task_len < synthetic.MIN_TASK_LEN:
            raise ValueError(
                f"task_len: must be >= {synthetic.MIN_TASK_LEN} tokens (room for the tasks' prompts), "
                f"got {self.task_len}"
            )
        check_range("task_examples", self.task_examples, low=1)
        if any(synthetic.TASKS[t].needs_haystack for t in self.tasks) and not self.haystack:
            raise ValueError("haystack: the needle task needs a text file to hide the needle in")
        check_range("every", self.every, low=0, note=" (0 disables evaluation)")
        if not self.contexts or min(self.contexts) < 2:
            raise ValueError(f"contexts: must be a non-empty list of lengths >= 2, got {self.contexts}")
        check_range("max_tokens", self.max_tokens, low=2)


@dataclasses.dataclass
class LogSection:
    """Metric sinks."""

    wandb: bool = True
    wandb_project: str = "recurrent-pretrain"
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops: must be > 0 or null (measure at start-up), got {self.peak_tflops}")


StorageSection = StorageSettings
"""The `storage` section: data_pipeline.storage.StorageSettings, the one home of the object-storage
settings that the command-line tools (data_pipeline.build, pretrain.export) take too."""


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
    init: InitSection = dataclasses.field(default_factory=InitSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)
    storage: StorageSection = dataclasses.field(default_factory=StorageSection)


def config_from_dict(tree: dict, sources: dict[str, str] | None = None) -> RunConfig:
    """Validate a plain nested dict (e.g. a resolved config read back from a run directory)."""
    sources = sources if sources is not None else {}
    config = build_config(RunConfig, tree, sources)
    problem = sequence_parallel_problem(config)
    if problem:
        key = "engine.sequence_parallel"
        source = sources.get(key, sources.get("engine", "<defaults>"))
        raise ConfigError(f"{source}: {key}={config.engine.sequence_parallel}: {problem}")
    problem = doc_boundaries_problem(config)
    if problem:
        source = sources.get("data.doc_boundaries", sources.get("data", "<defaults>"))
        raise ConfigError(f"{source}: data.doc_boundaries=true: {problem}")
    for key in ("train.hang_timeout_s", "eval.hang_timeout_s", "checkpoint.hang_timeout_s"):
        section, field = key.split(".")
        value = getattr(getattr(config, section), field)
        if value is not None and value >= config.engine.dist_timeout_s:
            raise ConfigError(
                f"{sources.get(key, '<defaults>')}: {key}={value}: must be below engine.dist_timeout_s="
                f"{config.engine.dist_timeout_s}, or a collective times out (exit 1, no requeue) before the "
                "hang watchdog fires"
            )
    return config


def doc_boundaries_problem(cfg: RunConfig) -> str | None:
    """Why this config cannot reset its models at document starts (None if it can, or does not ask to)."""
    if not cfg.data.doc_boundaries:
        return None
    return family(cfg.model.kind).doc_boundaries_problem(cfg.model, cfg.engine.sequence_parallel)


def sequence_parallel_problem(cfg: RunConfig) -> str | None:
    """Why this config cannot split its sequences over `engine.sequence_parallel` ranks (None if it can).
    The engine and the world size are checked at start-up (pretrain.preflight)."""
    n, seq_len = cfg.engine.sequence_parallel, cfg.data.seq_len
    if n == 1:
        return None
    if seq_len % n:
        return f"data.seq_len={seq_len} must be a multiple of it (each rank holds seq_len/sequence_parallel tokens)"
    problem = family(cfg.model.kind).sequence_parallel_problem(cfg.model, seq_len // n)
    if problem:
        return problem
    if cfg.train.carry_state:
        return ("train.carry_state=true is not supported with sequence parallelism yet (the last rank's state "
                "would have to reach the first rank of the next window); use one of the two")
    return None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read `path` (following `extends`), apply dotted overrides, and validate everything."""
    return config_from_dict(*read_tree(path, overrides))


def read_saved_config(path: str | Path) -> dict[str, Any]:
    """A resolved config this project wrote (a run directory's or a checkpoint's config.yaml) as plain
    data, its model section as the model was trained (model.config.as_trained: the keys it predates
    get the values that reproduce the saved model, not today's defaults)."""
    tree = read_mapping(Path(path))
    if isinstance(tree.get("model"), dict):
        tree["model"] = as_trained(tree["model"])
    return tree


def config_to_dict(config: Any) -> dict:
    """The resolved config as plain data (for run directories, checkpoints and exports), with the
    YAML key names (`init.from`)."""
    return to_plain(config)


def config_text(config: RunConfig) -> str:
    """The resolved config as YAML text (run directories, checkpoints); load_config reads it back."""
    return dump_yaml(config_to_dict(config))


def dump_config(config: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML; reading it back with load_config gives the same config."""
    Path(path).write_text(config_text(config))
