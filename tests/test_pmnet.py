"""PMNet: sliding-window attention, the phasor memory, and the model's contracts (docs/pmnet.md)."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import build_model
from model.attention_window import SlidingWindowAttention
from model.blocks import apply_rotary, rotary_tables
from model.config import ModelConfig, PMNetConfig, load_model_config
from model.pmnet import PMNet
from model.pmnet_collisions import SequenceCollisions, collision_counts, normalise_collisions
from model.pmnet_memory import MemoryState, PhasorMemory

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**pmnet: object) -> ModelConfig:
    fields = {"window": 4, "segment_len": 8, "memory_dim": 8, **pmnet}
    return ModelConfig(kind="pmnet", d_model=32, n_layers=2, n_heads=2, mlp_ratio=2.0, pmnet=PMNetConfig(**fields))


def wake(memory: PhasorMemory, read_std: float = 0.1) -> None:
    """What training does to a new memory after its first steps: a random read-out instead of zeros,
    writes switched on (gain 1 instead of 0), so that the tests of its contracts are not vacuous."""
    torch.nn.init.normal_(memory.out.weight, std=read_std)
    torch.nn.init.ones_(memory.write_gain)


def make_model(seed: int = 0, awake: bool = True, **pmnet: object) -> PMNet:
    """The tiny PMNet, `awake` (see wake) unless asked for as initialised."""
    torch.manual_seed(seed)
    model = build_model(tiny(**pmnet))
    assert isinstance(model, PMNet)
    if awake:
        for memory in model.memories():
            wake(memory)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize(("window", "seq_len"), [(1, 7), (4, 13), (5, 5), (8, 3), (6, 40)])
def test_window_attention_matches_dense_band_and_streams(window: int, seq_len: int) -> None:
    torch.manual_seed(window * 100 + seq_len)
    attn = SlidingWindowAttention(16, 2, window, 10000.0)
    x = torch.randn(2, seq_len, 16)
    y, _, _ = attn(x, None, None, 0)

    q, k, v = attn.qkv(x).view(2, seq_len, 3, 2, 8).unbind(2)
    cos, sin = rotary_tables(torch.arange(seq_len), 8, 10000.0)
    q, k = apply_rotary(q, cos, sin).transpose(1, 2), apply_rotary(k, cos, sin).transpose(1, 2)
    i = torch.arange(seq_len)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    dense = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=band)
    torch.testing.assert_close(y, attn.out(dense.transpose(1, 2).reshape(2, seq_len, 16)), rtol=1e-5, atol=1e-6)

    pieces, cache_k, cache_v, offset = [], None, None, 0
    for n in (1, 3, 2, seq_len):
        n = min(n, seq_len - offset)
        if n == 0:
            break
        out, cache_k, cache_v = attn(x[:, offset : offset + n], cache_k, cache_v, offset)
        assert cache_k.shape[2] <= window - 1
        pieces.append(out)
        offset += n
    torch.testing.assert_close(torch.cat(pieces, dim=1), y, rtol=1e-5, atol=1e-6)


def run_reference_and_fast(backend: str, scope: str) -> None:
    """Token-by-token routing with the sequential reference scan == the fast path (one scan call)."""
    ids = torch.randint(0, 258, (2, 21), generator=torch.Generator().manual_seed(1))
    results = []
    for reference in (True, False):
        model = make_model(seed=3, scan_backend=backend, collision_scope=scope)
        for memory in model.memories():
            memory.reference = reference  # token-by-token routing and the sequential scan
        logits, _ = model(ids)
        (logits.float().pow(2).mean() + logits[:, -1].sum()).backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref_logits, ref_grads), (fast_logits, fast_grads) = results
    assert rel_err(fast_logits, ref_logits) < 1e-5
    for name, grad in ref_grads.items():
        assert rel_err(fast_grads[name], grad) < 1e-5, name
    assert ref_grads["blocks.0.memory.write.weight"].abs().sum() > 0
    assert ref_grads["blocks.0.memory.anchors"].abs().sum() > 0


@pytest.mark.parametrize("scope", ["sequence", "segment"])
def test_reference_equals_fast_path_forward_and_gradients(scope: str) -> None:
    run_reference_and_fast("torch", scope)


@pytest.mark.slow
def test_reference_equals_triton_path_under_the_interpreter() -> None:
    """The CUDA path of the scan inside the model, run by Triton's CPU interpreter (~15 s).

    In a fresh process: TRITON_INTERPRET must be set before any Triton kernel is first built.
    """
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import torch; torch.set_num_threads(1); "
    code += "from test_pmnet import run_reference_and_fast; run_reference_and_fast('triton', 'sequence')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_memory_starts_as_a_no_op() -> None:
    """At initialisation the read-out is zero (and so is the write gain): logits with memory updates on
    equal, bit for bit, those with updates off (training and inference), and still do once the
    memory writes, as long as the read-out is zero."""
    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(11))
    updating, frozen = make_model(seed=12, awake=False), make_model(seed=12, awake=False, update_memory_train=False,
                                                                     update_memory_eval=False)
    for memory in updating.memories():
        assert float(memory.out.weight.detach().abs().max()) == 0.0
        assert float(memory.write_gain.detach().abs().max()) == 0.0
        assert float(memory.query.weight.detach().std()) > 0.1  # its own init survived StackedLM's, which comes first
    for writing in (False, True):
        if writing:
            for memory in updating.memories():
                torch.nn.init.ones_(memory.write_gain)
        for mode in ("train", "eval"):
            a, a_state = getattr(updating, mode)()(ids)
            b, b_state = getattr(frozen, mode)()(ids)
            assert torch.equal(a, b), (writing, mode)
            assert all((float(s.memory.memory.abs().max()) > 0) == writing for s in a_state)
            assert all(float(s.memory.memory.abs().max()) == 0 for s in b_state)


def test_writes_are_bounded_for_huge_inputs() -> None:
    torch.manual_seed(13)
    memory = PhasorMemory(16, PMNetConfig(memory_dim=8))
    wake(memory)
    h = torch.randn(2, 50, 16) * 1e6
    h[0, 0] = float("1e30")
    h.requires_grad_(True)
    increments = memory.write_increments(h)
    assert increments.dtype == torch.float32 and torch.isfinite(increments).all()
    assert float(increments.abs().max()) <= float(torch.tensor(math.pi))  # pi rounded to fp32 (above pi by 9e-8)
    assert float(increments.abs().max()) > 3.0  # saturated: the bound is what holds it, not small inputs
    increments.sum().backward()
    assert torch.isfinite(h.grad).all()


def test_routing_learns_from_the_children_not_picked() -> None:
    """The backward sees every sibling's read: an initial phase of a slot no token visits gets a gradient
    when its parent is on a path, and none otherwise; with updates or not, the forward is the hard path's."""
    torch.manual_seed(14)
    config = PMNetConfig(memory_dim=4, branching=3, depth=2, scan_backend="torch")
    memory = PhasorMemory(8, config)
    memory.init_weights()
    wake(memory, read_std=0.5)
    h = torch.randn(1, 2, 8)  # two paths leave at least one level-1 node, and its children, unvisited
    initial = (torch.rand(1, config.n_slots, 4) * 6).requires_grad_(True)
    memory.record_routes = True
    out, _ = memory(h, MemoryState(initial), 0)
    out.pow(2).sum().backward()
    path = memory.recorded[0][0][0]  # [T, L]
    visited = set(path.flatten().tolist())
    parents = set(path[:, :-1].flatten().tolist())
    siblings = {p * 3 + 1 + c for p in parents for c in range(3)} - visited  # slot ids: children of p are 3p+1..3p+3
    not_near = set(range(config.n_slots)) - visited - siblings
    assert siblings and not_near
    per_slot = initial.grad[0].abs().sum(-1)
    assert all(float(per_slot[s]) > 0 for s in siblings)
    assert all(float(per_slot[s]) == 0 for s in not_near)
    assert float(memory.anchors.grad[sorted(siblings)].abs().sum(-1).min()) > 0
    assert float(memory.query.weight.grad.abs().sum()) > 0
    with torch.no_grad():
        hard, _ = memory(h, MemoryState(initial), 0)  # no gradients wanted: only the path is scanned
    assert torch.equal(out, hard)


def test_inference_equals_the_hard_path_exactly() -> None:
    """Training mode (sibling reads in the scan, the mixture in the graph) and inference (the path only)
    give the same logits bit for bit."""
    ids = torch.randint(0, 258, (2, 30), generator=torch.Generator().manual_seed(15))
    model = make_model(seed=16)
    trained = model.train()(ids).logits
    with torch.no_grad():
        inferred = model.eval()(ids).logits
    assert torch.equal(trained, inferred)


def test_routing_depends_on_the_anchors_not_on_the_state() -> None:
    """Routes are the same from any memory state; they change when the anchors do."""
    torch.manual_seed(17)
    memory = PhasorMemory(16, PMNetConfig(memory_dim=8, scan_backend="torch"))
    memory.init_weights()
    memory.record_routes = True
    h = torch.randn(2, 40, 16)
    with torch.no_grad():
        memory(h, memory.init_state(2), 0)
        memory(h, MemoryState(torch.rand(2, memory.n_slots, 8) * 6), 0)
        memory.anchors.mul_(-1)
        memory(h, memory.init_state(2), 0)
    (first, _), (other_state, _), (other_anchors, _) = memory.recorded
    assert torch.equal(first, other_state)
    assert not torch.equal(first, other_anchors)


@pytest.mark.parametrize("horizon", [0, 16])
def test_pieces_equal_whole(horizon: int) -> None:
    model = make_model(seed=4, memory_horizon=horizon).eval()
    ids = torch.randint(0, 258, (2, 75), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole, whole_state = model(ids)
        outs, state, start = [], model.init_state(2), 0
        for n in (1, 10, 7, 33, 24):
            out, state = model(ids[:, start : start + n], state)
            outs.append(out)
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=1e-5, atol=1e-5)
    for piece_block, whole_block in zip(state, whole_state):
        assert piece_block.position == whole_block.position == 75
        torch.testing.assert_close(piece_block.memory.memory, whole_block.memory.memory, rtol=1e-5, atol=1e-5)
        assert piece_block.keys.shape[2] == model.config.pmnet.window - 1


@pytest.mark.parametrize("backend", ["torch", "reference", "segmented"])
@pytest.mark.parametrize("write_address", ["current", "previous"])
def test_memory_horizon_restarts_the_phases(backend: str, write_address: str) -> None:
    """With memory_horizon H, the memory's read at each token equals the read of a fresh memory that
    has seen only the tokens since the last multiple of H (positions 24.., so periods end mid-call),
    and streaming the call in pieces of other sizes gives the same reads and final phases. Under
    `write_address: previous` the first token of a period writes on the zero route, as a fresh one."""
    torch.manual_seed(21)
    memory = PhasorMemory(16, PMNetConfig(memory_dim=8, memory_horizon=10, write_address=write_address))
    memory.reference, memory.scan_backend = backend == "reference", backend
    memory.init_weights()
    wake(memory)
    h, start = torch.randn(2, 37, 16), 24
    with torch.no_grad():
        whole, whole_state = memory(h, memory.init_state(2), start)
        bounds = [0, 6, 16, 26, 36, 37]  # positions 30, 40, 50, 60 start periods
        alone = [memory(h[:, a:b], memory.init_state(2), start + a)[0] for a, b in itertools.pairwise(bounds)]
        state, pieces, at = memory.init_state(2), [], 0
        for n in (5, 13, 1, 18):
            out, state = memory(h[:, at : at + n], state, start + at)
            pieces.append(out)
            at += n
    torch.testing.assert_close(whole, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.memory, whole_state.memory, rtol=1e-5, atol=1e-6)
    memory.horizon = 0
    with torch.no_grad():
        unbounded, _ = memory(h, memory.init_state(2), start)
    torch.testing.assert_close(unbounded[:, :6], whole[:, :6], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(unbounded[:, 6:], whole[:, 6:], atol=1e-3)


def test_memory_horizon_is_checked() -> None:
    with pytest.raises(ValueError, match="memory_horizon"):
        PMNetConfig(memory_horizon=-1)


def test_causality() -> None:
    model = make_model(seed=5).eval()
    ids = torch.randint(0, 258, (1, 40), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, 21:] = (changed[:, 21:] + 1) % 258
    with torch.no_grad():
        a, _ = model(ids)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :21], b[:, :21], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 21:], b[:, 21:])


def test_collision_normalisation_forward_exact_gradient_scaled() -> None:
    """Writers per slot in one segment: slot 0 by all 4 tokens, slot 1 by 1, slot 2 by 3 (s=3 checked too)."""
    slots = torch.tensor([[[0, 1], [0, 2], [0, 2], [0, 2]]])  # [B=1, T=4, L=2]
    s = torch.tensor([[[4, 1], [4, 3], [4, 3], [4, 3]]], dtype=torch.float32)
    counts, per_write = collision_counts(slots, 5)
    assert torch.equal(per_write, s)
    assert torch.equal(counts, torch.tensor([[4.0, 1.0, 3.0, 0.0, 0.0]]))

    delta = torch.randn(1, 4, 2, 3, requires_grad=True)
    upstream = torch.randn(1, 4, 2, 3)
    effective = normalise_collisions(delta, slots)
    assert torch.equal(effective, delta)  # forward: the full accumulation, bit for bit
    (effective * upstream).sum().backward()
    torch.testing.assert_close(delta.grad, upstream / s.sqrt()[..., None], rtol=1e-6, atol=0)
    assert torch.equal(delta.grad[:, :, 0], upstream[:, :, 0] / 2)  # s = 4: exactly a half


def test_collision_normalisation_over_the_sequence() -> None:
    """Two segments of one call: s counts the writers of both (slot 0: 4 + 3 = 7 writers, slot 2: 2)."""
    first = torch.tensor([[[0, 1], [0, 2], [0, 2], [0, 3]]])
    second = torch.tensor([[[0, 4], [0, 4], [0, 1]]])
    deltas = [torch.randn(1, 4, 2, 3, requires_grad=True), torch.randn(1, 3, 2, 3, requires_grad=True)]
    upstream = [torch.randn(1, 4, 2, 3), torch.randn(1, 3, 2, 3)]
    sequence = SequenceCollisions(5)
    outs = []
    for delta, slots in zip(deltas, (first, second)):
        out = delta * 1.0  # the model passes on a view of its increments; so does this
        sequence.add(out, slots)
        outs.append(out)
    sequence.finish()
    assert torch.equal(outs[0], deltas[0]) and torch.equal(outs[1], deltas[1])
    sum((o * u).sum() for o, u in zip(outs, upstream)).backward()
    s = [torch.tensor([[[7, 2], [7, 2], [7, 2], [7, 1]]]), torch.tensor([[[7, 2], [7, 2], [7, 2]]])]
    for delta, u, count in zip(deltas, upstream, s):
        torch.testing.assert_close(delta.grad, u / count.float().sqrt()[..., None], rtol=1e-6, atol=0)


def test_collision_scopes_agree_when_one_segment_spans_the_call() -> None:
    """The model-level hooks of the sequence scope give the gradient of the stop-gradient form."""
    ids = torch.randint(0, 258, (2, 30), generator=torch.Generator().manual_seed(6))

    def gradients(**pmnet: object) -> list[torch.Tensor]:
        model = make_model(seed=9, **{"collision_scope": "segment", **pmnet})
        model.loss(ids[:, :-1], ids[:, 1:])[0].backward()
        return [p.grad for p in model.parameters()]

    one_segment = zip(gradients(segment_len=64, collision_scope="sequence"), gradients(segment_len=64))
    for seq, seg in one_segment:
        torch.testing.assert_close(seq, seg, rtol=1e-6, atol=1e-9)
    several = zip(gradients(segment_len=8, collision_scope="sequence"), gradients(segment_len=8))
    assert max(rel_err(seq, seg) for seq, seg in several) > 1e-3


def test_collision_scope_none_drops_the_normalisation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scope none: the same forward, and the gradient of the sequence scope without its 1/sqrt(s) hooks."""
    ids = torch.randint(0, 258, (2, 30), generator=torch.Generator().manual_seed(6))

    def run(scope: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = make_model(seed=9, collision_scope=scope)
        logits = model(ids[:, :-1]).logits
        model.loss(ids[:, :-1], ids[:, 1:])[0].backward()
        return logits.detach(), [p.grad for p in model.parameters()]

    none_logits, none_grads = run("none")
    normalised_logits, normalised_grads = run("sequence")
    assert torch.equal(none_logits, normalised_logits)
    assert max(rel_err(a, b) for a, b in zip(none_grads, normalised_grads)) > 1e-3
    monkeypatch.setattr(SequenceCollisions, "finish", lambda self, *args: None)
    for a, b in zip(none_grads, run("sequence")[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_activation_checkpointing_gives_the_same_gradients_and_stats() -> None:
    """Recomputation must not register the sequence-scope hooks or the stats hook twice."""
    ids = torch.randint(0, 258, (2, 30), generator=torch.Generator().manual_seed(7))
    runs = []
    for checkpointing in (False, True):
        model = make_model(seed=2)
        model.activation_checkpointing = checkpointing
        model.loss(ids[:, :-1], ids[:, 1:])[0].backward()
        runs.append(([p.grad for p in model.parameters()], model.stats()["pmnet/memory_write_grad_norm"]))
    (plain, plain_norm), (recomputed, recomputed_norm) = runs
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert plain_norm == pytest.approx(recomputed_norm, rel=1e-6)


@pytest.mark.parametrize("seq_len", [1, 1000, 20000])
def test_state_is_unit_phasor_at_any_length(seq_len: int) -> None:
    torch.manual_seed(6)
    memory = PhasorMemory(16, PMNetConfig(memory_dim=8, segment_len=4096, scan_backend="torch"))
    wake(memory)
    torch.nn.init.normal_(memory.write.weight, std=3.0)  # large increments: many wraps
    state = memory.init_state(1)
    with torch.no_grad():
        for start in range(0, seq_len, 4096):
            _, state = memory(torch.randn(1, min(4096, seq_len - start), 16), state, start)
    phases = state.memory
    assert phases.dtype == torch.float32 and torch.isfinite(phases).all()
    assert phases.min() >= 0 and phases.max() < 2 * math.pi
    modulus = torch.complex(phases.cos(), phases.sin()).abs()
    torch.testing.assert_close(modulus, torch.ones_like(modulus), rtol=0, atol=2e-7)


def test_memory_update_switches_and_swa_only() -> None:
    ids = torch.randint(0, 258, (1, 30), generator=torch.Generator().manual_seed(4))
    frozen = make_model(update_memory_train=False)
    _, state = frozen.train()(ids)
    assert all(float(b.memory.memory.abs().max()) == 0 for b in state)
    frozen.eval()
    with torch.no_grad():
        _, state = frozen(ids)
    assert all(float(b.memory.memory.abs().max()) > 0 for b in state)

    eval_frozen = make_model(update_memory_eval=False).eval()
    with torch.no_grad():
        _, state = eval_frozen(ids)
    assert all(float(b.memory.memory.abs().max()) == 0 for b in state)

    swa = make_model(memory_every=0)
    assert swa.memories() == [] and swa.stats() == {}
    logits, state = swa(ids)
    assert logits.shape == (1, 30, 258) and all(b.memory is None for b in state)
    assert swa.num_parameters() < make_model().num_parameters()


def test_stats_after_forward_backward() -> None:
    model = make_model(seed=7)
    ids = torch.randint(0, 258, (2, 41), generator=torch.Generator().manual_seed(5))
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    stats = model.stats()
    n_slots = model.config.pmnet.n_slots
    assert stats["pmnet/slot_usage"].shape == (n_slots,) and stats["pmnet/collisions"].shape == (n_slots,)
    assert stats["pmnet/slot_usage"][0] == 1.0  # every token's path starts at the root
    leaves = stats["pmnet/slot_usage"][-64:]
    torch.testing.assert_close(leaves.sum(), torch.tensor(1.0))
    assert 0 < stats["pmnet/leaf_entropy"] <= 1
    assert stats["pmnet/memory_write_grad_norm"] > 0
    assert stats["pmnet/collisions"][0] == 8.0  # the root is written by the 8 tokens of every full segment


def test_flops_per_token() -> None:
    model = make_model()
    n = model.matmul_params()
    assert model.flops_per_token(1) > 6 * (n - sum(m.anchors.numel() for m in model.memories()))
    assert model.flops_per_token(2) < model.flops_per_token(4)
    assert model.flops_per_token(4096) <= model.flops_per_token(8192) < model.flops_per_token(4096) * 1.001  # O(W)


def test_summary_reports_the_memory_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    from model.summary import main, summarize

    config = load_model_config(CONFIGS / "pmnet-tiny.yaml")
    model = build_model(config)
    expected = sum(p.numel() for m in model.memories() for p in m.parameters())
    assert summarize(config)["params_memory"] == expected > 0
    assert summarize(load_model_config(CONFIGS / "pmnet-swa-119m.yaml"))["params_memory"] == 0
    assert main([str(CONFIGS / "pmnet-tiny.yaml"), "--seq-len", "16", "--fwd-bwd"]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith(f"| pmnet-tiny | pmnet | {model.num_parameters():,} |") and f"| {expected:,} |" in row


@pytest.mark.parametrize("name", ["pmnet-tiny", "pmnet-119m", "pmnet-swa-119m"])
def test_configs_load_through_the_run_config(name: str) -> None:
    from pretrain.config import load_config

    config = load_config(CONFIGS / f"{name}.yaml").model
    assert config == load_model_config(CONFIGS / f"{name}.yaml")
    assert config.kind == "pmnet"
    if name.startswith("pmnet-119m"):
        with torch.device("meta"):
            model = build_model(config)
        assert 117e6 < model.num_parameters() < 122e6


def memory_grad_norm(seq_len: int) -> float:
    """Gradient norm of all memory parameters for mean next-byte loss on a structured byte stream.

    The read-out gets the generic N(0, 0.02^2) init instead of its zeros and the write gain 1 instead
    of 0: as initialised no gradient reaches the writes, whose accumulation over the sequence this
    measures."""
    torch.manual_seed(8)
    model = build_model(load_model_config(CONFIGS / "pmnet-tiny.yaml"))
    for memory in model.memories():
        wake(memory, read_std=0.02)
    gen = torch.Generator().manual_seed(9)
    motif = torch.randint(0, 256, (300,), generator=gen)
    stream = motif.repeat(seq_len // 300 + 2)[: seq_len + 1].clone()
    noise = torch.rand(seq_len + 1, generator=gen) < 0.1
    stream[noise] = torch.randint(0, 256, (int(noise.sum()),), generator=gen)
    loss, _ = model.loss(stream[None, :-1], stream[None, 1:])
    loss.backward()
    grads = [p.grad for m in model.memories() for p in m.parameters()]
    return float(torch.stack([g.norm() for g in grads]).norm())


@pytest.mark.slow
def test_memory_gradient_norm_bounded_between_1k_and_16k() -> None:
    short, long = memory_grad_norm(1024), memory_grad_norm(16384)
    factor = max(short, long) / min(short, long)
    print(f"memory-path gradient norm: T=1024 {short:.4f}, T=16384 {long:.4f}, factor {factor:.2f}")
    assert factor < 5.0, (short, long)


@pytest.mark.slow
def test_119m_forward_backward_on_cpu_at_4096(one_thread: int) -> None:
    torch.set_num_threads(one_thread)
    torch.manual_seed(0)
    model = build_model(load_model_config(CONFIGS / "pmnet-119m.yaml"))
    ids = torch.randint(0, 258, (1, 4097))
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
