"""PMNet's routing options (docs/pmnet.md, "Routing options"): each switch changes what the model
computes, streams exactly, keeps documents apart, and round-trips through the config; the
statistics; and the acceptance test of the memory alone (experiments/pmnet_recall.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from experiments.pmnet_recall import Task, memory_config, train
from model import build_model
from model.config import ModelConfig, PMNetConfig, model_config_from_dict
from model.pmnet import PMNet
from pretrain.optim import param_groups

ACCEPTANCE_STEPS = 500

OPTIONS = [
    {"routing": "hash"},
    {"routing": "router"},
    {"routing": "router", "write_address": "previous"},
    {"write_address": "previous"},
    {"write_address": "conv"},
    {"memory_input": "conv"},
    {"balance_loss": 0.1},
    {"routing": "hash", "write_address": "previous"},
    # the default routes from the token embedding; these from the block's input before the short
    # convolution and from the memory's input; then the shipped set (configs/model/pmnet-tiny.yaml)
    {"route_input": "pre_conv"},
    {"route_input": "memory"},
    {"route_input": "memory", "memory_input": "conv"},
    {"routing": "router", "write_address": "previous", "memory_input": "conv", "route_input": "pre_conv"},
    {"routing": "router", "write_address": "previous", "memory_input": "conv"},
]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(seed: int = 0, **pmnet: object) -> PMNet:
    """A tiny PMNet with its memories awake (random read-out, write gain 1), short convolution 3."""
    torch.manual_seed(seed)
    fields = {"window": 4, "segment_len": 8, "memory_dim": 8, "scan_backend": "torch", **pmnet}
    config = ModelConfig(kind="pmnet", d_model=32, n_layers=2, n_heads=2, mlp_ratio=2.0, short_conv=3,
                         pmnet=PMNetConfig(**fields))
    model = build_model(config)
    for memory in model.memories():
        torch.nn.init.normal_(memory.out.weight, std=0.1)
        torch.nn.init.ones_(memory.write_gain)
    return model


def ids(batch: int = 2, length: int = 40, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 258, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_option_changes_behaviour(options: dict) -> None:
    tokens = ids()
    base, changed = make_model(), make_model(**options)
    if "balance_loss" in options:  # same forward; the training loss gains the balance term
        base.train(), changed.train()
        changed.load_state_dict(base.state_dict())
        plain, _ = base.loss(tokens[:, :-1], tokens[:, 1:])
        balanced, _ = changed.loss(tokens[:, :-1], tokens[:, 1:])
        assert balanced > plain
        balanced.backward()
        assert changed.memories()[0].anchors.grad.abs().sum() > 0
        return
    with torch.no_grad():
        a, b = base(tokens).logits, changed(tokens).logits
    assert (a - b).abs().max() > 1e-4


def test_balance_loss_is_one_for_uniform_use_and_larger_when_collapsed() -> None:
    memory = make_model(balance_loss=0.1).memories()[0]
    N, L = memory.branching, memory.n_levels
    leaves = torch.arange(N ** (L - 1))[None]  # every leaf once
    path = torch.stack([memory.level_offsets[level] + leaves // N ** (L - 1 - level) for level in range(L)], -1)
    parents = [leaves // N ** (L - level) for level in range(1, L)]  # node above each level's choice
    children = torch.stack([memory.level_offsets[level] + parent[..., None] * N + torch.arange(N)
                            for level, parent in zip(range(1, L), parents)], 2)
    uniform = torch.full(children.shape, 1.0 / N)
    torch.testing.assert_close(memory.balance_loss(path, children, uniform), torch.tensor(1.0))
    one = torch.zeros_like(path) + path[:, :1]  # every token on the first path, with all the weight on it
    collapsed = memory.balance_loss(one, children[:, :1].expand_as(children),
                                    (children[:, :1] == one[:, :1, 1:, None]).float().expand_as(children))
    assert collapsed > 10


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_pieces_equal_whole(options: dict) -> None:
    model = make_model(**options).eval()
    tokens = ids(length=45)
    with torch.no_grad():
        whole, _ = model(tokens)
        outs, state, start = [], model.init_state(2), 0
        for n in (1, 10, 7, 27):
            out, state = model(tokens[:, start : start + n], state)
            outs.append(out)
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_documents_are_kept_apart(options: dict) -> None:
    model = make_model(**options).eval()
    first, second = ids(1, 13, seed=3), ids(1, 20, seed=4)
    doc_start = torch.zeros(1, 33, dtype=torch.bool)
    doc_start[0, 0] = doc_start[0, 13] = True
    with torch.no_grad():
        packed, _ = model(torch.cat((first, second), dim=1), doc_start=doc_start)
        alone, _ = model(second)
    torch.testing.assert_close(packed[:, 13:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [*OPTIONS, {"decay_routing": False}],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_config_round_trips(options: dict) -> None:
    config = make_model(**options).config
    assert model_config_from_dict(dataclasses.asdict(config)) == config


def test_hash_routing_has_no_learned_routing() -> None:
    model = make_model(routing="hash")
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith("anchors") for n in names)
    rebuilt = make_model(seed=9, routing="hash")
    rebuilt.load_state_dict(model.state_dict())  # the fixed projection and keys travel with the weights
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids()).logits, model(ids()).logits)


def test_decay_routing_false_spares_anchors_and_write_projection() -> None:
    for decay_routing in (True, False):
        model = make_model(decay_routing=decay_routing, routing="router")
        spared = {id(p) for p in param_groups(model, 0.1)[1]["params"]}
        memory = model.memories()[0]
        for routing in (memory.anchors, memory.write.weight, memory.router.weight):
            assert (id(routing) in spared) == (not decay_routing)
        assert id(memory.query.weight) not in spared


@pytest.mark.parametrize("routing", ["learned", "router"])
def test_balance_loss_moves_only_the_router_under_routing_router(routing: str) -> None:
    """The balance loss alone, backpropagated: under `routing: router` its gradient reaches the router
    and the anchors but neither the query projection nor anything below the memory (the embedding);
    under `routing: learned` the query routes, so it reaches the query and the embedding too."""
    model = make_model(routing=routing, balance_loss=0.3).train()
    model.loss(ids()[:, :-1], ids()[:, 1:])
    model.auxiliary_loss().backward()
    memory = model.memories()[0]
    assert memory.anchors.grad.abs().sum() > 0
    reached_below = model.embed.weight.grad is not None and bool(model.embed.weight.grad.abs().sum() > 0)
    reached_query = memory.query.weight.grad is not None and bool(memory.query.weight.grad.abs().sum() > 0)
    assert reached_below == reached_query == (routing == "learned")
    if routing == "router":
        assert memory.router.weight.grad.abs().sum() > 0


def test_conv_address_learns_and_leaves_the_value_unchanged() -> None:
    """`write_address: conv`: the address projection gets a gradient through the straight-through
    write mixture, whose forward value is the hard write's: training mode gives inference's logits."""
    model = make_model(write_address="conv", decay_routing=False)
    tokens = ids()
    loss, _ = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    for memory in model.memories():
        assert memory.address.weight.grad.abs().sum() > 0
    with torch.no_grad():
        inference = model.eval()(tokens).logits
    with torch.enable_grad():
        training = model.train()(tokens).logits
    assert torch.equal(training.detach(), inference)
    assert {f"blocks.{i}.memory.address.weight" for i in (0, 1)} <= model.no_weight_decay()


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="balance_loss"):
        PMNetConfig(routing="hash", balance_loss=0.1)
    with pytest.raises(ValueError, match="balance_loss"):
        PMNetConfig(balance_loss=-1.0)
    with pytest.raises(ValueError, match="short_conv >= 2"):
        ModelConfig(kind="pmnet", short_conv=0, pmnet=PMNetConfig(write_address="conv"))
    config = make_model(balance_loss=0.1).config  # the balance loss runs sequence-parallel (summed over pieces)
    assert PMNet.sequence_parallel_problem(config, 64) is None


def test_route_input_errors_name_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"route_input: must be one of 'pre_conv', 'embedding', 'memory', got 'conv'"):
        PMNetConfig(route_input="conv")
    with pytest.raises(ValueError, match=r"model\.pmnet\.route_input.*'pre_conv'"):
        model_config_from_dict({"kind": "pmnet", "pmnet": {"route_input": "token"}})


@pytest.mark.parametrize("route_input", ["pre_conv", "embedding", "memory"])
@pytest.mark.parametrize("memory_input", ["residual", "conv"])
def test_a_key_routes_alike_whatever_precedes_it(route_input: str, memory_input: str) -> None:
    """With short_conv 3, a token's route depends on the tokens before it when the memory's input
    routes (the convolution or attention mixes them in). Under `pre_conv` the first block's does not
    (the block's input is the token alone there) but the second's does (attention has mixed it);
    under `embedding` no block's does: a key reads where its pair's value was written."""
    model = make_model(route_input=route_input, memory_input=memory_input, routing="router",
                       write_address="previous").eval()
    tokens = ids(batch=1, length=12).repeat(8, 1)
    tokens[1:, :8] = ids(batch=7, length=8, seed=7)  # other tokens before position 8 in rows 1-7
    model.record_routes(True)
    with torch.no_grad():
        model(tokens)
    routes = model.take_routes()[0]  # [blocks, B, T, levels]
    same = [bool((block[:, 8] == block[:1, 8]).all()) for block in routes]
    assert same == {"pre_conv": [True, False], "embedding": [True, True], "memory": [False, False]}[route_input]


def test_per_level_statistics() -> None:
    model = make_model()
    loss, _ = model.loss(ids()[:, :-1], ids()[:, 1:])
    loss.backward()
    stats = model.stats()
    for level in (1, 2, 3):
        assert 0 < stats[f"pmnet/level{level}/entropy"] <= 1
        assert 0 < stats[f"pmnet/level{level}/slots_used"] <= 1
    assert stats["pmnet/level1/slots_used"] >= stats["pmnet/level3/slots_used"]


@pytest.mark.slow  # a trained acceptance run, over a minute on two cores: make test-long
def test_acceptance_learned_routing_recalls_as_well_as_oracle_routing() -> None:
    """The memory alone (no attention) with the routing the shipped configs use: within 5 points of
    the same memory routed by an oracle (python -m experiments.pmnet_recall --oracle; ~50 s)."""
    task, memory = Task(), memory_config([])
    learned = train(task, memory, steps=ACCEPTANCE_STEPS)
    oracle = train(task, memory, oracle=True, steps=ACCEPTANCE_STEPS)
    assert oracle.accuracy > 0.9  # the harness itself works: the memory stores and returns pairs
    assert learned.accuracy >= oracle.accuracy - 0.05, (learned, oracle.accuracy)
    assert learned.routing["level3/entropy"] > 0.5  # no collapse
