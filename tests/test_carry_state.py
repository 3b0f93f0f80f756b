"""train.carry_state: lanes that continue their text, the carried state equal to one long pass
(forward, and gradients up to the truncation at the window start), checkpoints of the carried
state at any world size, and the settings it refuses."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from data_pipeline.lanes import LaneError, LaneStream
from data_pipeline.stream import PackedStream
from model import ModelConfig, build_model
from model.config import PMNetConfig, VortConfig
from pretrain.carry import StateCarrier
from pretrain.config import ConfigError, DataSource, RunConfig
from pretrain.engines import SingleEngine, TrainModule
from pretrain.preflight import check_carry

TINY_VORT = ModelConfig(
    kind="vort", d_model=32, n_layers=2, n_heads=2, max_seq_len=256,
    vort=VortConfig(n_features=8, n_banks=4, soe_horizon=256, chunk_size=8, probe_rank=4, probe_classes=8),
)
TINY_PMNET = ModelConfig(
    kind="pmnet", d_model=32, n_layers=2, n_heads=2, max_seq_len=4096,
    pmnet=PMNetConfig(window=8, branching=2, depth=2, memory_dim=8, segment_len=16),
)


def test_each_lane_continues_its_text_and_every_row_is_one_lane(demo_shards: dict[str, str]) -> None:
    world, micro, lanes_total, seq = 2, 2, 8, 32
    ranks = [LaneStream(demo_shards["train"], seq, lanes_total, micro, seed=3, rank=r, world_size=world)
             for r in range(world)]
    K = ranks[0].steps_per_epoch
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    resets = []
    for _ in range(K + 2):
        for stream in ranks:
            for batch in stream.next_step():
                resets.append(batch["reset"])
                for row, lane in enumerate(batch["lanes"]):
                    seen.setdefault(lane, []).append((batch["input_ids"][row], batch["labels"][row]))
    assert sorted(seen) == list(range(lanes_total))
    # the same epoch cut into windows of K * seq tokens: window `lane` is exactly the lane's text
    spans = PackedStream([(demo_shards["train"], 1.0)], seq_len=K * seq, seed=3, shuffle_buffer=1)
    for lane, windows in seen.items():
        span = spans.get(lane)
        assert torch.equal(torch.cat([w[0] for w in windows[:K]]), span["input_ids"]), lane
        assert torch.equal(torch.cat([w[1] for w in windows[:K]]), span["labels"]), lane
    per_step = len(resets) // (K + 2)
    assert all(resets[:per_step]) and all(resets[K * per_step : (K + 1) * per_step])
    assert not any(resets[per_step : K * per_step])


def long_pass_losses(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, L: int) -> list[torch.Tensor]:
    logits, _ = model(ids)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return [nll[:, k * L : (k + 1) * L].mean() for k in range(ids.shape[1] // L)]


@pytest.mark.parametrize("config", [TINY_VORT, TINY_PMNET, dataclasses.replace(TINY_VORT, short_conv=3),
                                    dataclasses.replace(TINY_PMNET, short_conv=3),
                                    dataclasses.replace(TINY_VORT, vort=dataclasses.replace(
                                        TINY_VORT.vort, learn_temperature=True, readout="norm_gate"))],
                         ids=["vort", "pmnet", "vort-conv", "pmnet-conv", "vort-long"])
def test_carried_state_equals_one_long_pass_forward_and_truncated_gradient(config: ModelConfig) -> None:
    torch.manual_seed(0)
    model = build_model(config)
    module = TrainModule(model)
    B, L, n = 2, 24, 3
    ids = torch.randint(0, 256, (B, n * L + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        expected = long_pass_losses(model, inputs, labels, L)

    state = model.init_state(B)
    for k in range(n):
        window = slice(k * L, (k + 1) * L)
        model.zero_grad()
        loss, new_state = module(inputs[:, window], labels[:, window], state)
        loss.backward()
        assert loss.item() == pytest.approx(expected[k].item(), rel=1e-5, abs=1e-6)
        carried = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]

        # reference: the long pass whose first k windows are a constant (no gradient through them)
        model.zero_grad()
        with torch.no_grad():
            _, prefix = model(inputs[:, : k * L]) if k else (None, None)
        logits, _ = model(inputs[:, window], prefix)
        torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, window]).backward()
        truncated = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        for a, b in zip(carried, truncated, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

        if k:  # and full backpropagation through the prefix gives another gradient: the cut is real
            model.zero_grad()
            long_losses = long_pass_losses(model, inputs[:, : (k + 1) * L], labels[:, : (k + 1) * L], L)
            long_losses[k].backward()
            full = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            assert max((a - b).abs().max().item() for a, b in zip(carried, full, strict=True)) > 1e-6
        state = new_state
        assert all(not t.requires_grad for t in _tensors(state))


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, (list, tuple)):
        for item in state:
            yield from _tensors(item)


def run_config(shards: dict[str, str], **train) -> RunConfig:
    cfg = RunConfig(model=TINY_VORT)
    cfg.data.train = [DataSource(path=shards["train"])]
    cfg.data.seq_len = 16
    cfg.train = dataclasses.replace(cfg.train, global_batch=4, micro_batch=2, carry_state=True, **train)
    return cfg


def test_engine_step_with_carried_state_scores_the_long_pass(demo_shards: dict[str, str]) -> None:
    """Through SingleEngine (lr 0 keeps the weights): each step's loss is the long pass's loss on
    the lane's text so far, and the state handed back continues it."""
    torch.manual_seed(0)
    cfg = run_config(demo_shards, lr=1e-30, weight_decay=0.0)
    model = build_model(cfg.model)
    engine = SingleEngine(cfg, TrainModule(model), gas=2)
    lanes = LaneStream(demo_shards["train"], 16, lanes=4, micro_batch=2, seed=1)
    carrier = StateCarrier(lanes, model, torch.device("cpu"))
    texts, losses = [], []
    for _ in range(3):
        micro_batches = carrier.next_step()
        texts.append([(b[0], b[1]) for b in micro_batches])
        info = engine.train_step(micro_batches, lr=0.0)
        carrier.update(info.states)
        losses.append(info.loss)
    with torch.no_grad():
        for step in range(3):
            per_micro = []
            for micro in range(2):
                ids = torch.cat([texts[s][micro][0] for s in range(step + 1)], dim=1)
                lab = torch.cat([texts[s][micro][1] for s in range(step + 1)], dim=1)
                per_micro.append(long_pass_losses(model, ids, lab, 16)[step])
            assert losses[step] == pytest.approx(torch.stack(per_micro).mean().item(), rel=1e-5)


def _carried_losses(cfg: RunConfig, shards: dict[str, str], steps: int) -> tuple[list[float], list[int]]:
    """Losses of ``steps`` carried steps through SingleEngine from seed 0, and the graphs dynamo has
    compiled after each (all zero in eager mode)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine = SingleEngine(cfg, TrainModule(model), gas=2)
    carrier = StateCarrier(LaneStream(shards["train"], 16, lanes=4, micro_batch=2, seed=1), model, torch.device("cpu"))
    losses, graphs, before = [], [], torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(steps):
        info = engine.train_step(carrier.next_step(), lr=1e-3)
        carrier.update(info.states)
        losses.append(info.loss)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    return losses, graphs


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("model_cfg", [TINY_VORT, TINY_PMNET], ids=["vort", "pmnet"])
def test_compiled_carried_steps_follow_eager_without_recompiling_each_step(demo_shards: dict[str, str],
                                                                          model_cfg: ModelConfig, backend: str,
                                                                          monkeypatch) -> None:
    """train.carry_state with train.compile: the carried positions are ints that grow every step; dynamo
    specialises on the first, recompiles once with them symbolic, and compiles nothing after that. The
    losses follow eager mode's. Whether a step recompiles is dynamo's decision, the same under any
    backend: the fast run compiles through AOTAutograd without code generation ("aot_eager", which runs
    under every ATEN_CPU_CAPABILITY of `make test-matrix`), the slow one with inductor, as a run does."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    cfg = run_config(demo_shards)
    cfg.model = model_cfg
    check_carry(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=True)))
    want, _ = _carried_losses(cfg, demo_shards, 6)
    cfg.train = dataclasses.replace(cfg.train, compile=True)
    got, graphs = _carried_losses(cfg, demo_shards, 6)
    torch._dynamo.reset()
    assert graphs[0] > 0 and graphs[2:] == [graphs[2]] * 4, graphs
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (got, want)


def test_carried_state_checkpoint_resumes_at_another_world_size(demo_shards: dict[str, str], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(TINY_VORT)
    module = TrainModule(model)
    saving = [StateCarrier(LaneStream(demo_shards["train"], 16, 8, 2, rank=r, world_size=2), model, torch.device("cpu"))
              for r in range(2)]
    by_lane = {}
    for rank, carrier in enumerate(saving):
        states = []
        for ids, labels, state in carrier.next_step():
            _, new_state = module(ids, labels, state)
            states.append(new_state)
        carrier.update(states)
        for micro, lanes in enumerate(carrier._lanes_of()):
            for row, lane in enumerate(lanes):
                by_lane[lane] = [(s.G[row], s.b[row], s.offset) for s in carrier.states[micro]]
        carrier.save(tmp_path, rank)

    loading = StateCarrier(LaneStream(demo_shards["train"], 16, 8, 4, rank=0, world_size=1), model, torch.device("cpu"))
    loading.load(tmp_path)
    assert sorted(loading.states) == [0, 1]
    for micro, lanes in enumerate(loading._lanes_of()):
        for row, lane in enumerate(lanes):
            for layer, (G, b, offset) in enumerate(by_lane[lane]):
                got = loading.states[micro][layer]
                assert torch.equal(got.G[row], G) and torch.equal(got.b[row], b) and got.offset == offset == 16


def test_lane_position_must_resume_with_the_same_layout(demo_shards: dict[str, str]) -> None:
    saved = LaneStream(demo_shards["train"], 16, 8, 2)
    saved.next_step()
    resumed = LaneStream(demo_shards["train"], 16, 8, 2)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.step == 1
    with pytest.raises(LaneError, match=r"train\.global_batch"):
        LaneStream(demo_shards["train"], 16, 4, 2).load_state_dict(saved.state_dict())
    with pytest.raises(LaneError, match="fewer than the"):
        LaneStream(demo_shards["train"], 4096, 1024, 2)
    with pytest.raises(LaneError, match="not a multiple"):
        LaneStream(demo_shards["train"], 16, 6, 4)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.data.train.append(DataSource(path="other")), r"exactly one data\.train source"),
        (lambda c: setattr(c, "model", ModelConfig(kind="transformer")), r"model\.kind=transformer"),
        (lambda c: setattr(c.data, "num_workers", 2), r"data\.num_workers=2"),
    ],
)
def test_settings_carry_state_cannot_use_are_refused(demo_shards: dict[str, str], change, message: str) -> None:
    cfg = run_config(demo_shards)
    check_carry(cfg)
    change(cfg)
    with pytest.raises(ConfigError, match=message):
        check_carry(cfg)
