"""Per-rank memory plan of a run: will it fit?

    python -m pretrain.plan --config configs/vort-125m-128k.yaml [--world 8] [--gpu-mem 80GiB] [--measure]

Weights and optimizer state are computed from the engine's sharding, activations measured on this
CPU and scaled to the rank's length, scan states and sequence-parallel buffers computed from their
shapes. docs/sequence_parallel.md, "Memory plan", explains the method and its limits.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from model import CausalLM, build_model
from model.vort import VORT_KINDS
from pretrain.config import ConfigError, RunConfig, load_config

GIB = 2**30
PROBE_TOKENS = 2048
# DeepSpeed's default reduce_bucket_size (elements; our generated config keeps it). ZeRO 1-3 allocate one
# gradient-reduction buffer of this many elements, in the weights' dtype, whatever the model's size.
DEEPSPEED_REDUCE_BUCKET = 500_000_000


@dataclass
class Plan:
    """Bytes per rank by category."""

    params: float
    grads: float
    optimizer: float
    activations: float
    states: float
    buffers: float
    reduce_bucket: float

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.states + self.buffers
                + self.reduce_bucket)


def parse_bytes(text: str) -> float:
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", text)
    if not match:
        raise ValueError(f"--gpu-mem: expected a size like 80GiB or 80GB, got {text!r}")
    unit = match.group(2) or "B"
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    return float(match.group(1)) * scale


def state_and_buffer_bytes(model: CausalLM, cfg: RunConfig) -> tuple[float, float]:
    """Per rank: the scan states of one micro-batch (all layers) and the sequence-parallel buffers."""
    n, batch, c = cfg.engine.sequence_parallel, cfg.train.micro_batch, cfg.model
    states = buffers = 0.0
    if c.kind == "pmnet":
        pm = c.pmnet
        memories = len(model.memories())
        states = memories * batch * pm.n_slots * pm.memory_dim * 4 * 2  # phases and segment phases
        if n > 1:
            halo = c.n_layers * 2 * batch * (pm.window - 1) * c.d_model * 4 * 2  # received + sent
            buffers = halo + memories * batch * pm.n_slots * pm.memory_dim * 4 * 2
    elif c.kind in VORT_KINDS:
        mixer = model.blocks[0].mixer
        per_layer = batch * c.n_heads * mixer.memory.n_terms * mixer.n_features * (c.head_dim + 1) * 4
        states = c.n_layers * per_layer
        if n > 1:
            buffers = c.n_layers * per_layer * (n + 2)  # the N gathered states, entering and corrected final
    return states, buffers


def plan(cfg: RunConfig, world: int, model: CausalLM | None = None, probe: int = PROBE_TOKENS) -> tuple[Plan, Plan]:
    """(without, with) activation checkpointing, per rank."""
    model = model if model is not None else build_model(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    bf16 = cfg.engine.precision == "bf16"
    weight_bytes = 2 if bf16 else 4
    master = 4 if bf16 else 0
    stage = 3 if cfg.engine.kind == "fsdp" else cfg.engine.zero_stage if cfg.engine.kind == "deepspeed" else 0
    shard = world if stage >= 1 else 1
    params = n_params * weight_bytes / (world if stage >= 3 else 1)
    if stage >= 3:  # one block gathered at a time
        params += sum(p.numel() for p in model.blocks[0].parameters()) * weight_bytes
    grads = n_params * weight_bytes / (world if stage >= 2 else 1)
    optimizer = n_params * (8 + master) / shard
    bucket = DEEPSPEED_REDUCE_BUCKET * weight_bytes if cfg.engine.kind == "deepspeed" and stage >= 1 else 0.0
    tokens = cfg.train.micro_batch * cfg.data.seq_len // cfg.engine.sequence_parallel
    states, buffers = state_and_buffer_bytes(model, cfg)
    scale = 0.5 if bf16 else 1.0  # activations are measured in fp32 on the CPU
    plans = []
    for checkpointing in (False, True):
        short, long = (measure(cfg, checkpointing, probe * k, batch=1) for k in (1, 2))
        per_token = max(long - short, 0.0) / probe
        plans.append(Plan(params, grads, optimizer, per_token * tokens * scale, states, buffers, bucket))
    return plans[0], plans[1]


def _resident_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (high-water mark) of this process, in KiB, from Linux's /proc."""
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}: the activation probe needs Linux")
    return int(match.group(1))


def _measure_in_child(cfg: RunConfig, checkpointing: bool, tokens: int, batch: int, out: Connection) -> None:
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.activation_checkpointing = checkpointing
    warm = torch.randint(0, cfg.model.vocab_size, (1, 257))  # one-time allocations first
    model.loss(warm[:, :-1], warm[:, 1:])[0].backward()
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, tokens + 1))
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the high-water mark to the current resident size: build and warm-up drop out
    before = _resident_kib("VmRSS")
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    out.send((_resident_kib("VmHWM") - before) * 1024)


# In the probe, every allocation from 64 KiB up gets pages of its own and returns them when freed, so the
# resident size follows the live tensors (as a GPU allocator's count does) instead of what glibc's heap
# happens to reuse: without it the same probe twice gave per-token slopes 1.5x apart.
PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10), "THP_MEM_ALLOC_ENABLE": "0"}


def measure(cfg: RunConfig, checkpointing: bool, tokens: int, batch: int) -> float:
    """Peak resident growth (bytes) of one fp32 forward+backward of batch x tokens on this CPU (gradients
    included), read exactly from the kernel's high-water mark in a fresh process."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_measure_in_child, args=(cfg, checkpointing, tokens, batch, send))
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
        raise RuntimeError(f"the memory probe of {batch} x {tokens} tokens (activation checkpointing "
                           f"{checkpointing}) exited with code {child.exitcode} before reporting") from None
    child.join()
    return float(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world", type=int, default=None, help="ranks (default: engine.sequence_parallel)")
    parser.add_argument("--gpu-mem", default="80GiB", help="memory per accelerator, e.g. 80GiB")
    parser.add_argument("--measure", action="store_true", help="also measure one fwd+bwd on this CPU")
    parser.add_argument("--probe-tokens", type=int, default=PROBE_TOKENS,
                        help="activations per token from fwd+bwd at this length and twice it")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.seq_len=262144")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        world = args.world or cfg.engine.sequence_parallel
        if world % cfg.engine.sequence_parallel:
            n = cfg.engine.sequence_parallel
            raise ConfigError(f"--world {world} is not a multiple of engine.sequence_parallel={n}")
        capacity = parse_bytes(args.gpu_mem)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = build_model(cfg.model)
    plain, checkpointed = plan(cfg, world, model, args.probe_tokens)
    n = cfg.engine.sequence_parallel
    engine = f"{cfg.engine.kind}" + (f" ZeRO-{cfg.engine.zero_stage}" if cfg.engine.kind == "deepspeed" else "")
    print(f"{args.config}: {cfg.model.kind}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"seq_len {cfg.data.seq_len} over {n} rank(s) = {cfg.data.seq_len // n} tokens per rank, "
          f"micro_batch {cfg.train.micro_batch}, {engine}, {cfg.engine.precision}, world {world}")
    print(f"{'GiB per rank':<28}{'no checkpointing':>18}{'checkpointing':>16}")
    for field in ("params", "grads", "optimizer", "activations", "states", "buffers", "reduce_bucket", "total"):
        print(f"{field:<28}{getattr(plain, field) / GIB:>18.2f}{getattr(checkpointed, field) / GIB:>16.2f}")
    fits = ["fits" if p.total <= capacity else "does NOT fit" for p in (plain, checkpointed)]
    print(f"{'in ' + args.gpu_mem:<28}{fits[0]:>18}{fits[1]:>16}")
    if args.measure:
        for label, chosen, flag in (("no checkpointing", plain, False), ("checkpointing", checkpointed, True)):
            predicted = chosen.activations / (0.5 if cfg.engine.precision == "bf16" else 1.0)
            measured = measure(cfg, flag, cfg.data.seq_len // n, cfg.train.micro_batch)
            print(f"measured on this CPU ({label}): activations predicted {predicted / GIB:.3f} GiB, "
                  f"peak growth {measured / GIB:.3f} GiB, error {predicted / max(measured, 1) - 1:+.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
