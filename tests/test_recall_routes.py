"""experiments/recall_routes.py (does a query reach the slot its pair wrote) and the beyond-the-window
recall experiment's premise: no query sees any pair through the attention."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from experiments import EXPERIMENTS
from experiments.phasor import receptive_field
from experiments.recall_beyond import PMNET, SWA
from experiments.recall_routes import model_hit_rates, query_hits
from experiments.runner import Family, Run, eval_task
from model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_query_hits_follow_the_write_address() -> None:
    # tokens 0..5: a pair (key 0, value 1), another writer (2), filler (3, 4), the query at 5
    leaf = torch.tensor([[7, 3, 7, 9, 9, 7]])
    query, value = torch.tensor([[5]]), torch.tensor([[1]])
    # previous: the value writes on the key's leaf 7, as does token 3 (after token 2), so not clean
    hit, clean, others = query_hits(leaf, "previous", query, value)
    assert hit.tolist() == [[True]] and clean.tolist() == [[False]] and others.tolist() == [[1]]
    # current: the value writes on its own leaf 3, which the query does not read
    hit, clean, others = query_hits(leaf, "current", query, value)
    assert hit.tolist() == [[False]] and clean.tolist() == [[False]] and others.tolist() == [[2]]
    alone = torch.tensor([[7, 3, 5, 9, 9, 7]])
    assert [t.tolist() for t in query_hits(alone, "previous", query, value)] == [[[True]], [[True]], [[0]]]


def _run(family: Family, tmp_path: Path, *overrides: str) -> Run:
    experiment = EXPERIMENTS["recall-beyond"]
    family = Family(family.name, (*family.overrides, *overrides))
    run_dir, cfg = experiment.run_config(family, 0, tmp_path, quick=True)
    return Run(family, 0, run_dir, cfg)


@pytest.mark.parametrize(("conv", "expected_reach"), [(0, 30), (3, 34)])
def test_every_query_is_beyond_the_attentions_reach_and_only_the_memory_carries_its_pair(
    conv: int, expected_reach: int, tmp_path: Path
) -> None:
    """The gradient of a query's logits reaches the embeddings exactly `reach` tokens back through the
    attention and no further; the pairs it asks about lie further back, so SWA-only gets no gradient
    from them at all and PMNet (memory switched on by hand) does."""
    run = _run(SWA, tmp_path, f"model.short_conv={conv}")
    example = eval_task(run, quick=True).example(0)
    query = example.meta["query_at"][0]
    first_value = max(example.meta["value_at"])  # every pair ends at or before this place
    assert query - first_value > receptive_field(run) == expected_reach

    def embedding_grad(model: torch.nn.Module) -> torch.Tensor:
        torch.manual_seed(0)
        for p in model.parameters():  # generic non-zero weights: no path hidden by a zero init
            torch.nn.init.normal_(p, std=0.3)
        kept = []

        def keep(_module: torch.nn.Module, _inputs: object, out: torch.Tensor) -> None:
            out.retain_grad()
            kept.append(out)

        model.embed.register_forward_hook(keep)
        model(torch.from_numpy(example.input_ids)[None]).logits[0, query].sum().backward()
        return kept[0].grad[0].abs().sum(-1)

    grad = embedding_grad(build_model(run.config.model))
    assert grad[query - receptive_field(run)] > 0 and (grad[: query - receptive_field(run)] == 0).all()
    memory = embedding_grad(build_model(_run(PMNET, tmp_path, f"model.short_conv={conv}").config.model))
    assert (memory[: first_value + 1] > 0).all()


def test_hit_rates_of_a_collapsed_tree_and_of_a_model_without_memory(tmp_path: Path) -> None:
    """With every anchor alike each token takes the first child at every level: every query reads
    the leaf its pair wrote (hit 1) and so did every other token (clean 0). SWA-only has no routes."""
    run = _run(PMNET, tmp_path)
    examples = [eval_task(run, quick=True).example(i) for i in range(4)]
    model = build_model(run.config.model)
    for memory in model.memories():
        memory.anchors.data[:] = 1.0
    rates = model_hit_rates(model, examples)
    assert rates["routing_hit"] == rates["routing_hit_any"] == 1.0 and rates["routing_clean"] == 0.0
    # every token but the first writes there: all tokens before a query but its pair's value and one
    query_at = torch.tensor([e.meta["query_at"] for e in examples], dtype=torch.float)
    assert rates["routing_other_writers/block0"] == pytest.approx(float((query_at - 2).mean()))
    assert rates["level3/slots_used"] == 1 / 64 and rates["level3/entropy"] == 0.0
    assert model_hit_rates(build_model(_run(SWA, tmp_path).config.model), examples) == {}
    torch.manual_seed(0)  # spread anchors, routed by the token embedding (route_input: embedding, the default):
    spread = model_hit_rates(build_model(run.config.model), examples)  # a query reads its key's leaf in every
    assert spread["routing_hit"] == 1.0 and spread["routing_clean"] > 0.0  # block, which others mostly leave alone
    torch.manual_seed(0)  # routed by the memory's input, the second block's (mixed by attention) hits less often
    by_input = dataclasses.replace(run.config.model, pmnet=dataclasses.replace(run.config.model.pmnet,
                                                                                 route_input="memory"))
    assert 0.0 <= model_hit_rates(build_model(by_input), examples)["routing_hit"] < 1.0


def test_mqar_logs_the_routing_hit_rate_of_pmnet(tmp_path: Path) -> None:
    experiment = EXPERIMENTS["mqar"]
    family = next(f for f in experiment.families if f.name.startswith("pmnet-"))
    run_dir, cfg = experiment.run_config(family, 0, tmp_path, quick=True)
    scores = experiment.evaluate(build_model(cfg.model), Run(family, 0, run_dir, cfg), quick=True)
    assert {"routing_hit", "routing_clean", "routing_hit_any", "routing_hit/block0"} <= set(scores)
