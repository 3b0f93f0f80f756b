"""What may change when a run is resumed, and what refuses the start.

A run directory belongs to one run. Its `config.yaml` and every checkpoint's `config.yaml` record the
resolved config the run was started and saved with; a new start in the directory is compared with them,
key by key, before anything is written (pretrain/run/directory.py). Each key falls under the longest entry of
RULES that prefixes it:

- a change that the saved state can continue from (more steps, the cadences, the learning-rate
  schedule, wandb...) is allowed and logged as a diff;
- a change that would not continue the saved run (the model, the tokenizer, data.seq_len, the seed...)
  refuses the start with the keys, their old and new values and the reason, and the ways forward.

docs/training.md, "What may change on resume", is this table in prose; tests/test_run_dir.py checks
that every config key has a rule and that the docs list every rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model.config_loader import short
from pretrain.config import RunConfig, config_to_dict


@dataclass(frozen=True)
class Rule:
    """Whether keys under one prefix may change on resume (`allows(new config)`), as the docs say it
    (`when`), and why."""

    allows: Callable[[RunConfig], bool]
    when: str
    why: str


def _always(_: RunConfig) -> bool:
    return True


def _never(_: RunConfig) -> bool:
    return False


ALWAYS, NEVER = "yes", "no"
MIXTURE = "with data.mixture_change=true, not under train.carry_state"
NOT_CARRIED = "yes, but not under train.carry_state"
OPTIMIZER = "restored with the optimizer's state, so a new value would not apply"

RULES: dict[str, Rule] = {
    "run.name": Rule(_always, ALWAYS, "a label for logs and wandb"),
    "run.dir": Rule(_always, ALWAYS, "the directory itself, which may have been moved"),
    "run.seed": Rule(_never, NEVER, "it seeds the sample order and every rank's random streams"),
    "model": Rule(_never, NEVER, "the weights and the optimizer state are this model's"),
    "model.vort.scan_backend": Rule(_always, ALWAYS, "which kernel computes the same scan"),
    "model.pmnet.scan_backend": Rule(_always, ALWAYS, "which kernel computes the same scan"),
    "model.vort.chunk_size": Rule(_always, ALWAYS, "the scan's tile length: the same function, other rounding"),
    "data.train": Rule(
        lambda cfg: cfg.data.mixture_change and not cfg.train.carry_state, MIXTURE,
        "they define the sample order; data.mixture_change=true declares a change, which applies from the saved "
        "position: each earlier source continues where it stopped, a new or rebuilt one starts at its first sample",
    ),
    "data.mixture_change": Rule(_always, ALWAYS, "the declaration itself"),
    "data.task": Rule(_never, NEVER, "the synthetic task is the data"),
    "data.valid": Rule(_always, ALWAYS, "evaluation only"),
    "data.tokenizer": Rule(_never, NEVER, "the token ids the model learned"),
    "data.seq_len": Rule(_never, NEVER, "the saved data position and the length trained at; init.from starts a "
                                        "longer run"),
    "data.shuffle_buffer": Rule(_never, NEVER, "it defines the sample order"),
    "data.interleave": Rule(_never, NEVER, "it defines the sample order"),
    "data.doc_boundaries": Rule(_never, NEVER, "it changes what the model computes (resets at document starts)"),
    "data.num_workers": Rule(_always, ALWAYS, "how the same samples are read"),
    "data.read": Rule(_always, ALWAYS, "how the same samples are read"),
    "data.skip_samples": Rule(_always, ALWAYS, "samples never trained on: a resume may skip more by hand (a "
                                               "loss-spike rollback keeps its own in the data state)"),
    "train": Rule(_always, ALWAYS, "the schedule and the loop's settings are read from the config every step"),
    "train.global_batch": Rule(
        lambda cfg: not cfg.train.carry_state, NOT_CARRIED,
        "the data position is a count of samples, valid at any batch; the carried lanes are laid out by it",
    ),
    "train.carry_state": Rule(_never, NEVER, "the data layout and the carried states"),
    "train.weight_decay": Rule(_never, NEVER, OPTIMIZER),
    "train.beta1": Rule(_never, NEVER, OPTIMIZER),
    "train.beta2": Rule(_never, NEVER, OPTIMIZER),
    "train.eps": Rule(_never, NEVER, OPTIMIZER),
    "engine": Rule(_always, ALWAYS, "how the same step runs"),
    "engine.kind": Rule(_never, NEVER, "each engine writes its own checkpoint format"),
    "engine.precision": Rule(_never, NEVER, "the saved weights and optimizer state are laid out for it"),
    "engine.offload_optimizer": Rule(_never, NEVER, "where DeepSpeed keeps the optimizer state; not tested across "
                                                    "a resume"),
    "engine.zero_stage": Rule(_always, "between 1 and 2 (the engine checks the checkpoint)",
                              "DeepSpeed converts between ZeRO-1 and ZeRO-2 and refuses other changes"),
    "checkpoint": Rule(_always, ALWAYS, "when and how checkpoints are written"),
    "checkpoint.dir": Rule(_never, NEVER, "the run's checkpoints are there; another root would start over"),
    "eval": Rule(_always, ALWAYS, "evaluation only"),
    "init": Rule(_always, ALWAYS, "read by a fresh start only; a resume loads its own checkpoint"),
    "log": Rule(_always, ALWAYS, "where metrics go"),
    "storage": Rule(_always, ALWAYS, "how the object store is reached, not what it holds"),
}


def rule_for(key: str) -> tuple[str, Rule]:
    """The longest entry of RULES that is `key` or a section above it (KeyError when none is)."""
    probe = key
    while probe not in RULES:
        if "." not in probe:
            raise KeyError(f"no resume rule covers {key!r}: add one to pretrain/run/resume_rules.RULES")
        probe = probe.rsplit(".", 1)[0]
    return probe, RULES[probe]


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as {dotted key: value}; lists and scalars are values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


@dataclass(frozen=True)
class Change:
    """One key whose value differs between the saved config and this start's."""

    key: str
    old: Any
    new: Any
    rule: str

    def __str__(self) -> str:
        return f"{self.key} {short(self.old)} -> {short(self.new)}"


def compare(saved: dict[str, Any], cfg: RunConfig) -> tuple[list[Change], list[Change]]:
    """(refused, allowed) changes from `saved` (a resolved config as plain data, read from a run
    directory or a checkpoint) to `cfg`. A key the saved config lacks (written before the key existed)
    counts as its default (pretrain.config.read_saved_config has already set the keys whose default
    changed to the values the run was trained with); one it has that this code no longer knows (a
    removed key) is not compared."""
    defaults = flatten(config_to_dict(RunConfig()))
    old, new = {**defaults, **flatten(saved)}, flatten(config_to_dict(cfg))

    def known(key: str) -> bool:  # in this config, or below a key of it (data.task.name under data.task: null)
        return key in new or any(key.startswith(k + ".") for k in new)

    refused, allowed = [], []
    for key in sorted(set(new) | {k for k in old if known(k)}):
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        prefix, rule = rule_for(key)
        (allowed if rule.allows(cfg) else refused).append(Change(key, before, after, prefix))
    return refused, allowed


def describe(changes: list[Change], shown: int = 6) -> str:
    """The changes in one line, `shown` of them at most, grouped by rule with its reason:
    `a 1 -> 2, b 'x' -> 'y' (why); c 3 -> 4 (why) and 2 more`."""
    groups: dict[str, list[Change]] = {}
    for change in changes[:shown]:
        groups.setdefault(change.rule, []).append(change)
    text = "; ".join(f"{', '.join(map(str, group))} ({RULES[prefix].why})" for prefix, group in groups.items())
    return text + (f" and {len(changes) - shown} more" if len(changes) > shown else "")
