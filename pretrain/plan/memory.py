"""Per-rank memory plan of a run: can it start, and will it fit, training and evaluation?

    python -m pretrain.plan --config configs/vort-125m-128k.yaml [--world 64] [--gpu-mem 80GiB] [--measure]
        [--most-tokens]

First the trainer's own start-up rules (pretrain.preflight.check_start) at this world size: a config
that cannot start exits with their message. Then weights and optimizer state from the engine's
sharding, activations of training and of the periodic evaluation measured on this CPU in the run's
precision and extrapolated to the rank's length, scan states and sequence-parallel buffers from
their shapes, the GPU scan's own buffers counted on the meta device; with --most-tokens, the longest rank
length whose plan fits. docs/sequence_parallel.md,
"Memory plan", explains the method and its limits.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from model import CausalLM, build_model
from pretrain.config import ConfigError, RunConfig, load_config
from pretrain.engines import TrainModule, engine_class, eval_loss
from pretrain.preflight import check_start
from pretrain.telemetry.progress import Pace, announce
from pretrain.validate import eval_piece_tokens, streamed_loss

GIB = 2**30
PROBE_TOKENS = 2048
MODES = ("train", "eval")


@dataclass
class Plan:
    """Bytes per rank by category; activations of a training step and of the periodic evaluation,
    which run one after the other, so the peak holds the larger of the two."""

    params: float
    grads: float
    optimizer: float
    activations: float
    eval_activations: float
    states: float
    buffers: float
    reduce_bucket: float
    scan_buffers: float

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + max(self.activations, self.eval_activations)
                + self.states + self.buffers + self.reduce_bucket + self.scan_buffers)


def parse_bytes(text: str) -> float:
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", text)
    if not match:
        raise ValueError(f"--gpu-mem: expected a size like 80GiB or 80GB, got {text!r}")
    unit = match.group(2) or "B"
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    return float(match.group(1)) * scale


def extrapolate(short: float, long: float, probe: int, tokens: int) -> float:
    """Bytes at `tokens` on the line through the measurements at `probe` and 2 x `probe` tokens: the
    per-token growth plus what does not grow with length (the loss's chunk of logits, workspaces)."""
    per_token = max(long - short, 0.0) / probe
    return max(short + per_token * (tokens - probe), 0.0)


def parameter_plan(cfg: RunConfig, world: int, model: CausalLM) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) in bytes per rank, as the engine holds and shards them."""
    n_params = sum(p.numel() for p in model.parameters())
    engine = engine_class(cfg)
    held = engine.parameter_bytes(cfg)
    stage = engine.sharding_stage(cfg)
    params = n_params * held.weights / (world if stage >= 3 else 1)
    if stage >= 3:  # one block gathered at a time, in the compute dtype
        params += sum(p.numel() for p in model.blocks[0].parameters()) * (2 if cfg.engine.precision == "bf16" else 4)
    grads = n_params * held.grads / (world if stage >= 2 else 1)
    optimizer = n_params * held.optimizer / (world if stage >= 1 else 1)
    return params, grads, optimizer


@dataclass
class Measured:
    """What a plan is made of before a rank's length is chosen: the parts that do not grow with it (bytes
    per rank) and the activation probes (bytes at ``probe`` and 2 x ``probe`` tokens), from which
    ``plan_at`` builds the plan at any length."""

    params: float
    grads: float
    optimizer: float
    states: float
    buffers: float
    reduce_bucket: float
    probe: int
    train: dict[bool, tuple[float, float]]  # activation checkpointing -> the two training probes
    evaluation: tuple[float, float] | None  # the two evaluation probes (no periodic evaluation: None)


def checkpoint_mode(cfg: RunConfig) -> bool | str:
    """The activation checkpointing a plan's "checkpointing" column runs: the config's mode (true or
    "elementwise"), true where the config trains without."""
    return cfg.train.activation_checkpointing or True


def measure_plan(cfg: RunConfig, world: int, model: CausalLM, probe: int, progress: bool) -> Measured:
    """The parts of ``cfg``'s plan at ``world`` ranks, its probes measured on this CPU (each in a fresh
    process, announced on stderr with ``progress``)."""
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = 2 if cfg.engine.precision == "bf16" else 4  # the dtype the model computes in
    params, grads, optimizer = parameter_plan(cfg, world, model)
    bucket = engine_class(cfg).comm_buffer_bytes(cfg, n_params, weight_bytes)
    probes = Probes(4 + (2 if cfg.eval.every else 0), progress)
    evaluation = None
    if cfg.eval.every:
        evaluation = tuple(probes.measure(cfg, False, probe * k, 1, "eval") for k in (1, 2))
    states, buffers = model.state_bytes(cfg.train.micro_batch, cfg.engine.sequence_parallel)
    train = {flag: tuple(probes.measure(cfg, checkpoint_mode(cfg) if flag else False, probe * k, 1) for k in (1, 2))
             for flag in (False, True)}
    return Measured(params, grads, optimizer, states, buffers, bucket, probe, train, evaluation)  # type: ignore[arg-type]


def cached_parts(path: Path, key: dict[str, Any], measure: Callable[[], Measured]) -> Measured:
    """The parts of a plan from ``path`` if it holds them for ``key`` (config, overrides, world, probe
    length), else ``measure()``, written there: the probes are what takes minutes, and the same CPU
    probes serve plans that differ in what the CPU does not run (the GPU scan's buffers)."""
    if path.exists():
        saved = json.loads(path.read_text())
        if saved["key"] != key:
            raise ValueError(f"--probes {path}: measured for {saved['key']}, not {key}")
        parts = saved["parts"]
        parts["train"] = {flag == "true": tuple(pair) for flag, pair in parts["train"].items()}
        parts["evaluation"] = None if parts["evaluation"] is None else tuple(parts["evaluation"])
        return Measured(**parts)
    parts = measure()
    fields = dataclasses.asdict(parts) | {"train": {str(f).lower(): pair for f, pair in parts.train.items()}}
    path.write_text(json.dumps({"key": key, "parts": fields}, indent=1) + "\n")
    return parts


def plan_at(cfg: RunConfig, model: CausalLM, parts: Measured, row_tokens: int) -> tuple[Plan, Plan]:
    """(without, with) activation checkpointing, per rank, with ``row_tokens`` tokens per rank and batch
    row (seq_len / sequence_parallel; the config's other settings as they are): activations on the probes'
    line, the evaluation's pieces no longer than a row, the GPU scan's buffers counted at that length."""
    batch = cfg.train.micro_batch
    evaluation = 0.0
    if parts.evaluation is not None:
        piece = max(min(c, row_tokens) if model.streams_exactly else c for c in cfg.eval.contexts)
        evaluation = extrapolate(*parts.evaluation, parts.probe, piece)
    scans = model.scan_buffer_bytes(batch, row_tokens)
    fixed = (parts.params, parts.grads, parts.optimizer)
    plans = [
        Plan(*fixed, extrapolate(*parts.train[flag], parts.probe, batch * row_tokens), evaluation, parts.states,
             parts.buffers, parts.reduce_bucket, scans)
        for flag in (False, True)
    ]  # fmt: skip
    return plans[0], plans[1]


def plan(
    cfg: RunConfig, world: int, model: CausalLM | None = None, probe: int = PROBE_TOKENS, progress: bool = False
) -> tuple[Plan, Plan]:
    """(without, with) activation checkpointing, per rank, at `world` ranks; with `progress`, each
    memory probe (a fresh process, seconds to minutes at large sizes) is announced on stderr."""
    model = model if model is not None else build_model(cfg.model)
    parts = measure_plan(cfg, world, model, probe, progress)
    return plan_at(cfg, model, parts, cfg.data.seq_len // cfg.engine.sequence_parallel)


def most_tokens(cfg: RunConfig, model: CausalLM, parts: Measured, capacity: float, step: int = 1024) -> tuple[int, int]:
    """The most tokens per rank (micro_batch x tokens per row, rows a multiple of ``step``) whose plan
    fits in ``capacity`` bytes, without and with activation checkpointing (0: not even ``step``)."""
    return tuple(cfg.train.micro_batch * step * _longest(  # type: ignore[return-value]
        lambda rows, which=which: plan_at(cfg, model, parts, rows * step)[which].total <= capacity)
        for which in (0, 1))  # fmt: skip


def _longest(fits: Callable[[int], bool], limit: int = 2**20) -> int:
    """The largest n < ``limit`` with fits(n), 0 if none, for ``fits`` true up to some n and false after
    (a plan grows with its length): doubling, then bisection, a few dozen plans."""
    low, high = 0, 1
    while high < limit and fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _resident_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (high-water mark) of this process, in KiB, from Linux's /proc."""
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}: the activation probe needs Linux")
    return int(match.group(1))


def _model_step(
    cfg: RunConfig, checkpointing: bool | str, tokens: int, batch: int, mode: str, context: int
) -> Callable[[], None]:
    """Build and warm the model (one-time allocations out of the way); return the step to measure."""
    torch.manual_seed(0)
    model = build_model(cfg.model)
    if cfg.engine.precision == "bf16":  # as DeepSpeed and FSDP2 run it: what the model keeps in fp32 stays fp32
        model = model.to(torch.bfloat16)
    model.activation_checkpointing = checkpointing
    warm = torch.randint(0, cfg.model.vocab_size, (1, 257))
    model.loss(warm[:, :-1], warm[:, 1:])[0].backward()
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, context + 1))

    def train_step() -> None:
        loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()

    def evaluation() -> None:  # the trainer's periodic evaluation of one sequence, through the engine's wrapper
        module = TrainModule(model)
        streamed_loss(functools.partial(eval_loss, module), model, ids[:, :-1], ids[:, 1:], tokens)

    return train_step if mode == "train" else evaluation


def _peak_child(setup: Callable[..., Callable[[], None]], args: tuple[Any, ...], out: Connection) -> None:
    step = setup(*args)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the high-water mark to the current resident size: the setup drops out
    before = _resident_kib("VmRSS")
    step()
    out.send((_resident_kib("VmHWM") - before) * 1024)


# In the probe, every allocation from 64 KiB up gets pages of its own and returns them when freed, so the
# resident size follows the live tensors (as a GPU allocator's count does) instead of what glibc's heap
# happens to reuse: without it the same probe twice gave per-token slopes 1.5x apart.
PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10), "THP_MEM_ALLOC_ENABLE": "0"}


def peak_growth(setup: Callable[..., Callable[[], None]], *args: Any, what: str) -> float:
    """Peak resident growth (bytes) of the step that `setup(*args)` returns, run in a fresh process and
    read exactly from the kernel's high-water mark (reset after the setup); `what` names the probe in
    the error raised when the process dies before reporting."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_peak_child, args=(setup, args, send))
    saved = {key: os.environ.get(key) for key in PROBE_ENV}
    os.environ.update(PROBE_ENV)  # the spawned interpreter's glibc reads these at its start
    try:
        child.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    send.close()
    try:
        result = receive.recv()
    except EOFError:  # the child died before sending: its traceback is on stderr
        child.join()
        raise RuntimeError(f"{what} exited with code {child.exitcode} before reporting") from None
    child.join()
    return float(result)


def measure(
    cfg: RunConfig, checkpointing: bool | str, tokens: int, batch: int, mode: str = "train", context: int | None = None
) -> float:
    """Peak resident growth (bytes) on this CPU, in the run's precision: mode "train", one
    forward+backward of batch x tokens (gradients included); mode "eval", the periodic evaluation of
    one sequence of `context` tokens (default: `tokens`) streamed `tokens` at a time."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    context = tokens if context is None else context
    what = f"the memory probe of {batch} x {tokens} tokens ({mode}, activation checkpointing {checkpointing})"
    return peak_growth(_model_step, cfg, checkpointing, tokens, batch, mode, context, what=what)


class Probes:
    """`measure` for a command that runs `total` probes: with `progress`, each one is announced on
    stderr (which, how many are done, elapsed time and time left), and the end of the last."""

    def __init__(self, total: int, progress: bool) -> None:
        self.pace = Pace(total) if progress else None
        self.done = 0

    def measure(
        self, cfg: RunConfig, checkpointing: bool | str, tokens: int, batch: int, mode: str = "train",
        context: int | None = None,
    ) -> float:
        if self.pace is not None:
            what = f"memory probe: {mode}, {batch} x {context or tokens} tokens" + (
                f" in pieces of {tokens}" if context else f", activation checkpointing {checkpointing}")
            announce(self.pace, self.done, what)
        result = measure(cfg, checkpointing, tokens, batch, mode, context)
        self.done += 1
        if self.pace is not None and self.done == self.pace.total:
            announce(self.pace, self.done, "probes done")
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world", type=int, default=None, help="ranks (default: engine.sequence_parallel)")
    parser.add_argument("--gpu-mem", default="80GiB", help="memory per accelerator, e.g. 80GiB")
    parser.add_argument("--measure", action="store_true",
                        help="also measure, on this CPU, one training step at the rank's length and the "
                             "evaluation of the longest eval.contexts")
    parser.add_argument("--most-tokens", action="store_true",
                        help="also print the most tokens per rank that fit in --gpu-mem (rows of whole 1024s, "
                             "every other setting as configured)")
    parser.add_argument("--probes", type=Path, default=None,
                        help="read the probes' measurements from this JSON file if it holds them for the same "
                             "config, overrides, world and --probe-tokens; else measure and write them there")
    parser.add_argument("--probe-tokens", type=int, default=PROBE_TOKENS,
                        help="activations per token from fwd+bwd at this length and twice it")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.seq_len=262144")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        world = cfg.engine.sequence_parallel if args.world is None else args.world
        if world < 1:
            raise ValueError(f"--world: must be >= 1 ranks, got {world}")
        dims, gas = check_start(cfg, world)
        capacity = parse_bytes(args.gpu_mem)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = build_model(cfg.model)
    measured = functools.partial(measure_plan, cfg, world, model, args.probe_tokens, progress=True)
    key = {"config": args.config, "overrides": args.overrides, "world": world, "probe": args.probe_tokens}
    parts = measured() if args.probes is None else cached_parts(args.probes, key, measured)
    plain, checkpointed = plan_at(cfg, model, parts, cfg.data.seq_len // cfg.engine.sequence_parallel)
    n = cfg.engine.sequence_parallel
    engine = engine_class(cfg).describe(cfg)
    longest = max(cfg.eval.contexts)
    piece = eval_piece_tokens(cfg, model, longest)
    print(f"{args.config}: {cfg.model.kind}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"seq_len {cfg.data.seq_len} over {n} rank(s) = {cfg.data.seq_len // n} tokens per rank, "
          f"micro_batch {cfg.train.micro_batch}, {engine}, {cfg.engine.precision}, world {world} "
          f"(data-parallel {dims.data_parallel}, {gas} micro-batch(es) per step, "
          f"{cfg.train.global_batch * cfg.data.seq_len:,} tokens per step)")
    if cfg.eval.every:
        print(f"evaluation every {cfg.eval.every} steps at contexts {cfg.eval.contexts}, in pieces of {piece} tokens")
    mode = checkpoint_mode(cfg)
    print(f"{'GiB per rank':<28}{'no checkpointing':>18}{'checkpointing':>16}"
          + ("" if mode is True else f"  (checkpointing: {mode})"))
    fields = ("params", "grads", "optimizer", "activations", "eval_activations", "states", "buffers",
              "reduce_bucket", "scan_buffers", "total")
    for field in fields:
        print(f"{field:<28}{getattr(plain, field) / GIB:>18.2f}{getattr(checkpointed, field) / GIB:>16.2f}")
    fits = ["fits" if p.total <= capacity else "does NOT fit" for p in (plain, checkpointed)]
    print(f"{'in ' + args.gpu_mem:<28}{fits[0]:>18}{fits[1]:>16}")
    if args.most_tokens:
        most = most_tokens(cfg, model, parts, capacity)
        print(f"{'most tokens per rank':<28}{most[0]:>18,}{most[1]:>16,}")
    if args.measure:
        probes = Probes(2 + (1 if cfg.eval.every else 0), progress=True)
        for label, chosen, flag in (("no checkpointing", plain, False), ("checkpointing", checkpointed, mode)):
            measured = probes.measure(cfg, flag, cfg.data.seq_len // n, cfg.train.micro_batch)
            print(f"measured on this CPU, training ({label}): activations predicted "
                  f"{chosen.activations / GIB:.3f} GiB, peak growth {measured / GIB:.3f} GiB, "
                  f"error {chosen.activations / max(measured, 1) - 1:+.0%}")
        if cfg.eval.every:
            measured = probes.measure(cfg, False, piece, 1, "eval", context=longest)
            predicted = plain.eval_activations
            print(f"measured on this CPU, evaluation of {longest} tokens in pieces of {piece}: predicted "
                  f"{predicted / GIB:.3f} GiB, peak growth {measured / GIB:.3f} GiB, "
                  f"error {predicted / max(measured, 1) - 1:+.0%}")
    return 0

