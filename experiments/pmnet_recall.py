"""Recall through PMNet's phasor memory alone: does its routing store a pair where the query reads?

No attention: a token embedding, the memory (the only path from one token to another), an MLP and
the head. A sequence is `pairs` pairs [key][value] with distinct keys, then the same keys again in a
random order, each followed by its value; the score is the share of those values predicted at
their query. The same task is trained with the model's own routing and with oracle routing (every
token's path ends at the leaf numbered by its token id, each write following the model's write
rule, so a value is written at its key's leaf under `write_address: previous`); the acceptance test
(tests/test_pmnet_routing.py) asks learned routing to come within 5 points of oracle routing.

Besides the accuracy, a run reports per level the entropy of the slots' use and the share of slots
used, and for the queries how often their leaf is the one their pair's value was written to (`hit`)
and how often no other token of the sequence wrote there before the query (`clean`).

    python -m experiments.pmnet_recall --steps 500 --seeds 3 --oracle --json docs/results/pmnet_recall.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.recall_routes import query_hits
from model.blocks import RMSNorm, ShortConvolution, SwiGLU
from model.config import PMNetConfig, load_model_config
from model.pmnet import usage_entropy
from model.pmnet_memory import PhasorMemory


@dataclasses.dataclass
class Task:
    """The recall task: `keys` key tokens (ids 0..keys-1), `values` value tokens after them."""

    pairs: int = 8
    keys: int = 32
    values: int = 16

    @property
    def vocab(self) -> int:
        return self.keys + self.values

    @property
    def seq_len(self) -> int:
        return 4 * self.pairs

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, 4P], labels [B, 4P]: the value after each query key, -100 elsewhere)."""
        keys = torch.rand(size, self.keys, generator=generator).argsort(dim=1)[:, : self.pairs]
        values = torch.randint(self.keys, self.vocab, (size, self.pairs), generator=generator)
        order = torch.rand(size, self.pairs, generator=generator).argsort(dim=1)
        first = torch.stack((keys, values), dim=2).flatten(1)
        again = torch.stack((keys.gather(1, order), values.gather(1, order)), dim=2).flatten(1)
        tokens = torch.cat((first, again), dim=1)
        labels = torch.full_like(tokens, -100)
        labels[:, 2 * self.pairs :: 2] = again[:, 1::2]
        return tokens, labels


class OracleMemory(PhasorMemory):
    """The memory with every token's path ending at the leaf numbered by its token id (`leaves`,
    set before each call); a write of its own (`write_address: previous`) takes the previous token's.
    Under `record_routes` the read paths are kept, with zero margins (PhasorMemory.route's diagnostics)."""

    leaves: torch.Tensor | None = None

    def _routes(
        self, phase: torch.Tensor, keys: torch.Tensor, writes: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        leaf = self.leaves
        if writes:  # the previous token's leaf (the first token's write goes to leaf 0's path)
            leaf = torch.cat((torch.zeros_like(leaf[:, :1]), leaf[:, :-1]), dim=1)
        N = self.branching
        path, children = [torch.zeros_like(leaf)], []
        for level in range(1, self.n_levels):
            node = leaf // N ** (self.depth - level)
            parent = node // N
            children.append(self.level_offsets[level] + parent[..., None] * N + torch.arange(N))
            path.append(self.level_offsets[level] + node)
        path_t, children_t = torch.stack(path, dim=-1), torch.stack(children, dim=2)
        weights = (children_t == path_t[:, :, 1:, None]).float()
        if self.record_routes and not writes:
            self.recorded.append((path_t, torch.zeros(*path_t.shape[:2], self.depth)))
        return path_t, children_t, weights


class RecallModel(nn.Module):
    """Embedding, RMSNorm, the phasor memory (residual), then an RMS-normed SwiGLU MLP and the head.
    With `short_conv` K the normed input also passes a causal convolution over K tokens, whose output
    routes the writes under `write_address: conv` (the memory itself reads the normed input)."""

    def __init__(self, task: Task, d_model: int, memory: PMNetConfig, oracle: bool, short_conv: int = 0):
        super().__init__()
        self.embed = nn.Embedding(task.vocab, d_model)
        self.norm = RMSNorm(d_model)
        self.conv = ShortConvolution(d_model, short_conv) if short_conv else None
        self.memory = (OracleMemory if oracle else PhasorMemory)(d_model, memory)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, 2.0)
        self.head_norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, task.vocab, bias=False)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.memory.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.memory, OracleMemory):
            self.memory.leaves = tokens
        x = self.embed(tokens)
        h = self.norm(x)
        address = None if self.conv is None else self.conv(h, None)[0]
        read, _ = self.memory(h, self.memory.init_state(tokens.shape[0], tokens.device), 0, address_input=address)
        x = x + read
        x = x + self.mlp(self.mlp_norm(x))
        return self.head(self.head_norm(x))


def optimizer(model: RecallModel, lr: float, weight_decay: float, decay_routing: bool) -> torch.optim.Optimizer:
    """AdamW; matrices decay except, with `decay_routing` false, the memory's anchors and write projection."""
    spared = set() if decay_routing else {f"memory.{n}" for n in model.memory.routing_parameters()}
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n and n not in spared]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n and n not in spared)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))


def routing_report(memory: PhasorMemory, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Per level entropy and share of slots used by the writes, and the queries' hit and clean rates
    (from the routes recorded in the last forward; under `write_address: previous` the first
    token's write, on the path of zero phases, is not among the writers counted)."""
    out: dict[str, float] = {}
    writes = memory.slot_writes.cpu()
    for level in range(1, memory.n_levels):
        start, width = int(memory.level_offsets[level]), memory.branching**level
        used = writes[start : start + width]
        out[f"level{level}/entropy"] = usage_entropy(used)
        out[f"level{level}/slots_used"] = float((used > 0).float().mean())
    path = memory.recorded[-1][0] if memory.recorded else None
    if path is not None and memory.write_address != "conv":  # a conv address's write leaves are not recorded
        P = tokens.shape[1] // 4
        query = torch.arange(2 * P, 4 * P, 2).expand(tokens.shape[0], P)
        # the pair's value is at position 2i+1 of the first half, for the key queried at 2P + 2j
        match = tokens[:, query[0], None] == tokens[:, None, 0 : 2 * P : 2]  # [B, P, P]
        hit, clean, _ = query_hits(path[..., -1], memory.write_address, query, 2 * match.long().argmax(-1) + 1)
        out["hit"], out["clean"] = float(hit.float().mean()), float(clean.float().mean())
    return out


@dataclasses.dataclass
class Result:
    """One training run: final held-out accuracy, its routing report, and the seconds it took."""

    accuracy: float
    routing: dict[str, float]
    seconds: float
    curve: list[tuple[int, float]]


def evaluate(model: RecallModel, task: Task, generator: torch.Generator, batches: int = 4) -> tuple[float, dict]:
    """Accuracy over the queries of `batches` fresh batches of 256, and the routing report of the last."""
    model.eval()
    model.memory.record_routes = True
    correct = total = 0
    with torch.no_grad():
        for _ in range(batches):
            tokens, labels = task.batch(256, generator)
            model.memory.recorded = []
            predicted = model(tokens).argmax(-1)
            scored = labels != -100
            correct += int((predicted[scored] == labels[scored]).sum())
            total += int(scored.sum())
            report = routing_report(model.memory, tokens, labels)
    model.memory.record_routes, model.memory.recorded = False, []
    model.train()
    return correct / total, report


def train(
    task: Task, memory: PMNetConfig, oracle: bool = False, steps: int = 400, batch: int = 64, d_model: int = 64,
    lr: float = 3e-3, weight_decay: float = 0.1, seed: int = 0, eval_every: int = 0, short_conv: int = 0,
) -> Result:
    """Train the recall model for `steps` AdamW steps (warm-up 10%, then constant) and score it."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    held_out = torch.Generator().manual_seed(10_000 + seed)
    model = RecallModel(task, d_model, memory, oracle, short_conv)
    opt = optimizer(model, lr, weight_decay, memory.decay_routing)
    warmup = max(1, steps // 10)
    start, curve = time.time(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        tokens, labels = task.batch(batch, generator)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        if memory.balance_loss > 0:
            loss = loss + memory.balance_loss * model.memory.balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if eval_every and (step + 1) % eval_every == 0:
            curve.append((step + 1, evaluate(model, task, held_out, batches=1)[0]))
    accuracy, report = evaluate(model, task, held_out)
    return Result(accuracy, report, time.time() - start, curve)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--keys", type=int, default=32)
    parser.add_argument("--values", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--short-conv", type=int, default=0,
                        help="a causal convolution over K tokens whose output routes writes under write_address=conv")
    parser.add_argument("--oracle", action="store_true", help="also train with oracle routing")
    parser.add_argument("--memory", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model.pmnet fields, e.g. routing=hash write_address=previous balance_loss=0.01")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


ROUTING_KEYS = ("routing", "write_address", "balance_loss", "decay_routing", "route_temperature")
"""The model.pmnet fields that decide routing: the harness takes them from the shipped config."""

SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "model" / "pmnet-tiny.yaml"


def memory_config(overrides: list[str]) -> PMNetConfig:
    """The harness's memory: 4-ary depth 3 (64 leaves), memory_dim 16, the routing of the shipped
    configs/model/pmnet-tiny.yaml, then `overrides` (key=value)."""
    shipped = load_model_config(SHIPPED).pmnet
    fields: dict[str, Any] = {"memory_dim": 16, "segment_len": 4096, "scan_backend": "torch",
                              **{key: getattr(shipped, key) for key in ROUTING_KEYS}}
    types = {f.name: f.type for f in dataclasses.fields(PMNetConfig)}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"--memory: unknown model.pmnet key {key!r}")
        default = getattr(PMNetConfig(), key)
        if isinstance(default, bool):
            fields[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, (int, float)):
            fields[key] = type(default)(value)
        else:
            fields[key] = value
    return PMNetConfig(**fields)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    task, memory = Task(args.pairs, args.keys, args.values), memory_config(args.memory)
    runs: dict[str, list[dict[str, Any]]] = {"learned": []}
    if args.oracle:
        runs["oracle"] = []
    for seed in range(args.seeds):
        for name in runs:
            result = train(task, memory, oracle=name == "oracle", steps=args.steps, d_model=args.d_model,
                           lr=args.lr, seed=seed, eval_every=args.eval_every, short_conv=args.short_conv)
            runs[name].append(dataclasses.asdict(result))
            print(f"{name} seed {seed}: accuracy {result.accuracy:.3f} ({result.seconds:.0f} s) "
                  + " ".join(f"{k}={v:.2f}" for k, v in result.routing.items()), flush=True)
    summary = {name: sum(r["accuracy"] for r in rs) / len(rs) for name, rs in runs.items()}
    print(json.dumps(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {"task": dataclasses.asdict(task), "memory": dataclasses.asdict(memory), "steps": args.steps,
                  "d_model": args.d_model, "lr": args.lr, "short_conv": args.short_conv}
        args.json.write_text(json.dumps({"config": config, "summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
