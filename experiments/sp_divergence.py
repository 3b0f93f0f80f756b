"""Where does a sequence-parallel run first leave the one-process run, and why?

Trains one model twice on the same batches with the same AdamW and clipping: once in one process,
once with each sequence split over N gloo ranks (`pretrain.distributed.parallel_dims.sequence_parallel_loss`,
gradients averaged over the ranks as the engines do). Every step it records the loss, the gradient
norm before clipping and, for PMNet, every routing decision of every memory layer with the score gap
between the chosen child and the runner-up. It prints, per step, how far the two runs are apart and
whether any routing decision differs, and at the first differing decision how close to a tie it was.

    python -m experiments.sp_divergence --text data/demo/long/prideprejudice.txt --ranks 2 --steps 8
    python -m experiments.sp_divergence --ranks 4 --seq-len 512 --json out.json

docs/sequence_parallel.md ("Why PMNet's runs drift apart") shows the output and reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import build_model
from model.config import ModelConfig, PMNetConfig, VortConfig
from pretrain.distributed.parallel_dims import ParallelDims, local_slice, sequence_parallel_loss

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO / "data" / "demo" / "long" / "prideprejudice.txt"


@dataclasses.dataclass(frozen=True)
class Setup:
    """One comparison: the model, the data and the optimiser of both runs."""

    model: ModelConfig
    text: str
    seq_len: int = 256
    batch: int = 2
    steps: int = 8
    lr: float = 3e-3
    clip: float = 1.0
    seed: int = 0
    perturbation: float = 0.0


def tiny_model(family: str, seq_len: int) -> ModelConfig:
    """The tiny PMNet or VORT of the sequence-parallel tests.

    One of the family branches left outside model/, on purpose: the investigation compares these two
    families at sizes it picks for each (a family's section of the config), so it names them."""
    common = {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": max(256, seq_len)}
    if family == "pmnet":
        return ModelConfig(kind="pmnet", pmnet=PMNetConfig(window=8, memory_dim=8, depth=2, segment_len=16), **common)
    if family == "vort":
        vort = VortConfig(n_features=8, n_banks=2, soe_horizon=max(256, seq_len), chunk_size=16)
        return ModelConfig(kind="vort", vort=vort, **common)
    raise ValueError(f"family must be pmnet or vort, got {family!r}")


def perturb(model: torch.nn.Module, relative: float, seed: int) -> None:
    """Multiply every weight by (1 + relative * N(0, 1)): a rounding-sized change of the starting point."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + relative * torch.randn(param.shape, generator=gen))


def batches(setup: Setup) -> list[torch.Tensor]:
    """`steps` batches of [batch, seq_len + 1] byte ids from random offsets of the text."""
    data = torch.frombuffer(bytearray(Path(setup.text).read_bytes()), dtype=torch.uint8).long()
    if data.numel() <= setup.seq_len + 1:
        raise ValueError(f"{setup.text}: {data.numel()} bytes, need more than seq_len + 1 = {setup.seq_len + 1}")
    gen = torch.Generator().manual_seed(setup.seed + 1)
    out = []
    for _ in range(setup.steps):
        starts = torch.randint(0, data.numel() - setup.seq_len - 1, (setup.batch,), generator=gen)
        out.append(torch.stack([data[s : s + setup.seq_len + 1] for s in starts.tolist()]))
    return out


def train(setup: Setup, sp=None) -> list[dict]:
    """Run the steps; each record holds loss, grad_norm and (PMNet) the routes of this rank's piece."""
    torch.manual_seed(setup.seed)
    model = build_model(setup.model)
    if setup.perturbation:
        perturb(model, setup.perturbation, setup.seed + 2)
    routed = hasattr(model, "record_routes")
    if routed:
        model.record_routes()
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.1)
    records = []
    for ids in batches(setup):
        inputs, labels = ids[:, :-1], ids[:, 1:]
        optimizer.zero_grad()
        if sp is None:
            loss, _ = model.loss(inputs, labels)
            loss.backward()
            loss_value = float(loss.detach())
        else:
            loss = sequence_parallel_loss(model, local_slice(inputs, sp), local_slice(labels, sp), sp)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            loss_value = float(total) / sp.size
            for param in model.parameters():  # the engines average over the ranks
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad /= sp.size
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        routes = model.take_routes() if routed else None
        optimizer.step()
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        records.append({"loss": loss_value, "grad_norm": norm, "routes": routes, "grads": grads, "weights": weights})
    return records


def _gather_routes(routes: tuple[torch.Tensor, torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pieces' routes joined along the sequence (dim 2), in rank order."""
    joined = []
    for tensor in routes:
        parts = [torch.empty_like(tensor) for _ in range(group_size)]
        dist.all_gather(parts, tensor.contiguous())
        joined.append(torch.cat(parts, dim=2))
    return joined[0], joined[1]


def _worker(rank: int, world: int, port: int, setup: Setup, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sp = ParallelDims(world, world).build(rank, setup.seq_len)
        records = train(setup, sp)
        for record in records:
            if record["routes"] is not None:
                record["routes"] = _gather_routes(record["routes"], world)
        if rank == 0:
            torch.save(records, Path(out) / "sp.pt")
    finally:
        dist.destroy_process_group()


def run_sequence_parallel(setup: Setup, ranks: int) -> list[dict]:
    """The N-rank run (spawned gloo processes); rank 0's records with the routes of the whole sequence."""
    from tests.launchers import free_port

    if setup.seq_len % ranks:
        raise ValueError(f"--seq-len {setup.seq_len} must be a multiple of --ranks {ranks}")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(ranks, free_port(), setup, out), nprocs=ranks)
        return torch.load(Path(out) / "sp.pt", weights_only=True)


def _largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], relative: bool) -> tuple[float, str]:
    """The largest elementwise gap over the tensors (relative to each tensor's largest entry, or
    absolute) and the name of the tensor it is in."""
    gaps = []
    for name, x in a.items():
        gap = (x - b[name]).abs().max()
        gaps.append((float(gap / x.abs().max().clamp_min(1e-30) if relative else gap), name))
    return max(gaps)


def compare(single: list[dict], parallel: list[dict]) -> list[dict]:
    """Per step: relative loss and gradient-norm gaps, differing routing decisions and their margins."""
    rows = []
    for step, (a, b) in enumerate(zip(single, parallel), start=1):
        row = {
            "step": step, "loss_single": a["loss"], "loss_sp": b["loss"],
            "loss_rel": abs(a["loss"] - b["loss"]) / abs(a["loss"]),
            "grad_norm_rel": abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"],
            "grad_gap": _largest_gap(a["grads"], b["grads"], relative=True),
            "weight_gap": _largest_gap(a["weights"], b["weights"], relative=False),
        }
        if a["routes"] is not None:
            (slots_a, margins_a), (slots_b, _) = a["routes"], b["routes"]
            differs = (slots_a != slots_b)[..., 1:]  # level 0 is the root: no choice there
            row["decisions"] = int(differs.numel())
            row["route_diffs"] = int(differs.sum())
            row["min_margin"] = float(margins_a.min())
            # A decision that differs at some level changes every level below it: the first one on a path
            # is where the runs disagreed; its margin is the one that matters.
            first = differs & ~torch.cat((torch.zeros_like(differs[..., :1]), differs[..., :-1].cumsum(-1) > 0), -1)
            row["flip_margins"] = sorted(float(m) for m in margins_a[first])[:5]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| step | loss (1 process) | loss (other) | loss rel. gap | grad-norm rel. gap | largest gradient gap "
             "| largest weight gap after the step | routes differing | smallest margin of a flipped decision "
             "| smallest margin of the step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        routes = f"{r['route_diffs']} of {r['decisions']}" if "decisions" in r else "-"
        flips = f"{r['flip_margins'][0]:.1e}" if r.get("flip_margins") else "-"
        lowest = f"{r['min_margin']:.1e}" if "min_margin" in r else "-"
        lines.append(f"| {r['step']} | {r['loss_single']:.6f} | {r['loss_sp']:.6f} | {r['loss_rel']:.1e} "
                     f"| {r['grad_norm_rel']:.1e} | {r['grad_gap'][0]:.1e} `{r['grad_gap'][1]}` "
                     f"| {r['weight_gap'][0]:.1e} `{r['weight_gap'][1]}` | {routes} | {flips} | {lowest} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="a text file (read as bytes)")
    parser.add_argument("--family", choices=("pmnet", "vort"), default="pmnet")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--against", choices=("sp", "perturbed"), default="sp",
                        help="sp: the --ranks sequence-parallel run; perturbed: one process whose starting weights "
                        "differ from the first run's by a relative 6e-8 (half an fp32 ulp), the control")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the per-step rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setup = Setup(tiny_model(args.family, args.seq_len), args.text, args.seq_len, args.batch, args.steps, args.lr,
                  seed=args.seed)
    if args.against == "sp":
        other, versus = run_sequence_parallel(setup, args.ranks), f"{args.ranks} sequence-parallel ranks"
    else:
        other, versus = train(dataclasses.replace(setup, perturbation=6e-8)), "1 process from weights perturbed by 6e-8"
    rows = compare(train(setup), other)
    print(f"tiny {args.family}, {Path(args.text).name}, {args.batch} x {args.seq_len} bytes, 1 process vs {versus}, "
          f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} thread(s)")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(math.isfinite(r["loss_sp"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
