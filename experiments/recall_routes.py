"""Does a recall query reach the memory slot its pair wrote? The routing hit rate of PMNet's memory.

A pair's value is stored where the value token writes: on its own read path under
`write_address: current`, on its predecessor's (the key's) under `previous`. A query is answerable
from the memory only if its read path ends at that leaf (`hit`), and answerable without
interference only if no other token wrote there before the query (`clean`). The memory-alone
harness (experiments/pmnet_recall.py) and the full-model recall experiments (experiments/mqar.py,
experiments/recall_beyond.py) both score routing with `query_hits`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from data_pipeline import synthetic
from model import CausalLM
from model.pmnet import PMNet


def write_leaves(read_leaf: torch.Tensor, write_address: str) -> torch.Tensor:
    """The leaf each token [B, T] writes to, from the read leaves: its own, or its predecessor's
    (-1 for the first token, whose write on the path of zero phases is not counted)."""
    if write_address == "current":
        return read_leaf
    return torch.cat((torch.full_like(read_leaf[:, :1], -1), read_leaf[:, :-1]), dim=1)


def query_hits(
    read_leaf: torch.Tensor, write_address: str, query_at: torch.Tensor, value_at: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hit, clean) bool [B, Q] and the count of other writers [B, Q] (tokens before the query, its
    pair's value apart, that wrote on the leaf it reads) of the queries at positions query_at [B, Q]
    whose pairs' values sit at value_at [B, Q] (each before its query), from every token's read
    leaf [B, T]."""
    write_leaf = write_leaves(read_leaf, write_address)
    read = read_leaf.gather(1, query_at)
    hit = write_leaf.gather(1, value_at) == read
    before = torch.arange(read_leaf.shape[1], device=read_leaf.device)[None, None, :] < query_at[:, :, None]
    others = ((write_leaf[:, None, :] == read[..., None]) & before).sum(-1) - hit.long()
    return hit, hit & (others == 0), others


@torch.inference_mode()
def model_hit_rates(model: CausalLM, examples: Sequence[synthetic.Example], batch_size: int = 16) -> dict[str, float]:
    """Per memory block b, `routing_hit/block<b>` and `routing_clean/block<b>` over the queries of
    `examples` (each with `query_at` and `value_at` in its meta), their mean over the blocks
    (`routing_hit`, `routing_clean`), `routing_hit_any`, the share of queries some block routes to
    their pair's slot, `routing_other_writers/block<b>`, the mean count of other tokens that wrote on
    a query's leaf before it, and the last batch's `level<l>/entropy` and `level<l>/slots_used`; nothing
    for a model without a phasor memory."""
    if not isinstance(model, PMNet) or not model.memories():
        return {}
    model.eval()
    modes = [m.write_address for m in model.memories()]
    hits: list[torch.Tensor] = []  # per batch [blocks, 3, B * Q]: hit, clean, other writers
    model.record_routes(True)
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            model(synthetic.collate(chunk, pad_id=0)["input_ids"])
            leaves = model.take_routes()[0][..., -1]  # [blocks, B, T]
            query = torch.tensor([e.meta["query_at"] for e in chunk])
            value = torch.tensor([e.meta["value_at"] for e in chunk])
            per_block = [
                torch.stack([t.float() for t in query_hits(leaves[b], mode, query, value)])
                for b, mode in enumerate(modes)
            ]
            hits.append(torch.stack(per_block).flatten(2))
    finally:
        model.record_routes(False)
    rates = torch.cat(hits, dim=2)  # [blocks, 3, queries]
    out = {
        f"routing_{key}/block{b}": float(rates[b, i].mean())
        for b in range(len(modes))
        for i, key in enumerate(("hit", "clean", "other_writers"))
    }
    out.update(
        routing_hit=float(rates[:, 0].mean()),
        routing_clean=float(rates[:, 1].mean()),
        routing_hit_any=float(rates[:, 0].amax(0).mean()),
    )
    # the per-level use of the last batch (model.stats(): entropy and share of slots written)
    out.update({k.removeprefix("pmnet/"): float(v) for k, v in model.stats().items() if "/level" in k})
    return out
