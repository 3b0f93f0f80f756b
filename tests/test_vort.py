"""VORT layer and family: scan paths agree, streaming, causality, router gradients, kernel limits, training."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model import build_model
from model.config import ModelConfig, VortConfig
from model.config_loader import ConfigError
from model.entity_labels import capitalised_word_mask
from model.soe import gl_weights
from model.summary import load_model_config
from model.summary import main as summary_main
from model.vort import VORT_KINDS, VortLayer, VortLM

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"

# Small enough for 2 CPU cores; the certified SOE horizon 256 takes ~1 s and is cached per process.
TINY = ModelConfig(
    kind="vort", vocab_size=32, d_model=32, n_layers=2, n_heads=2, max_seq_len=256,
    vort=VortConfig(n_features=8, n_banks=4, soe_horizon=256, chunk_size=8, probe_rank=4, probe_classes=16),
)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(kind: str, **vort: object) -> ModelConfig:
    return dataclasses.replace(TINY, kind=kind, vort=dataclasses.replace(TINY.vort, **vort))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of a against the reference b."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_layer(kind: str, seed: int = 0, n_heads: int = TINY.n_heads, **vort: object) -> VortLayer:
    torch.manual_seed(seed)
    layer = VortLayer(dataclasses.replace(tiny(kind, **vort), n_heads=n_heads), layer_index=0)
    for p in layer.parameters():  # the stack's small init would hide errors in tiny outputs
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return layer


def reference_copy(layer: VortLayer) -> VortLayer:
    ref = copy.deepcopy(layer).double()
    ref.backend = "reference"
    return ref


@pytest.mark.parametrize("kind", VORT_KINDS)
@settings(max_examples=5, deadline=None, derandomize=True)
@given(
    batch=st.integers(1, 2),
    seq_len=st.integers(1, 27),
    chunk=st.sampled_from([4, 8, 16]),
    n_heads=st.sampled_from([1, 2, 4]),
    n_features=st.sampled_from([4, 8]),
    prefix=st.integers(0, 9),
)
def test_chunked_equals_float64_reference(
    kind: str, batch: int, seq_len: int, chunk: int, n_heads: int, n_features: int, prefix: int
) -> None:
    """Random shapes (T rarely a multiple of the chunk), with and without a carried state."""
    layer = make_layer(kind, seed=seq_len, n_heads=n_heads, chunk_size=chunk, n_features=n_features)
    assert_matches_float64_reference(layer, batch, seq_len, prefix)


# The options for long contexts (docs/vort.md): learned per-head temperatures, the gated read, both
# together with a tempered kernel.
LONG_CONTEXT_OPTIONS = {
    "learned-temperature": {"learn_temperature": True},
    "norm-gate": {"readout": "norm_gate"},
    "both-tempered": {"learn_temperature": True, "readout": "norm_gate", "temper": 64},
}


@pytest.mark.parametrize("options", LONG_CONTEXT_OPTIONS.values(), ids=LONG_CONTEXT_OPTIONS.keys())
def test_long_context_options_equal_float64_reference(options: dict[str, object]) -> None:
    """Outputs, carried state and every gradient (the temperatures' and the gate's included)."""
    layer = make_layer("vort", seed=3, chunk_size=8, **options)
    if layer.log_temperature is not None:  # heads apart, one of them above the cap
        with torch.no_grad():
            layer.log_temperature.copy_(torch.tensor([0.2, 2.5]))  # e^2.5 > 8
    assert_matches_float64_reference(layer, batch=2, seq_len=19, prefix=5)


def assert_matches_float64_reference(layer: VortLayer, batch: int, seq_len: int, prefix: int) -> None:
    """The chunked fp32 layer against its float64 token-by-token copy, continuing from a carried
    state of `prefix` tokens (none if 0): outputs, final state, gradients of the input and of every
    parameter, to 1e-5 relative."""
    layer.backend = "torch"
    ref = reference_copy(layer)
    gen = torch.Generator().manual_seed(seq_len)
    x = torch.randn(batch, seq_len, 32, generator=gen)
    weight = torch.randn(batch, seq_len, 32, generator=gen)
    state = ref_state = None
    if prefix:  # a carried state from an earlier piece, with gradients flowing into it
        earlier = torch.randn(batch, prefix, 32, generator=gen)
        _, state = layer(earlier)
        _, ref_state = ref(earlier.double())
    x64 = x.double().requires_grad_()
    x = x.requires_grad_()
    y, new_state = layer(x, state)
    y_ref, new_ref_state = ref(x64, ref_state)
    assert rel_err(y, y_ref) < 1e-5
    assert rel_err(new_state.G, new_ref_state.G) < 1e-5 and new_state.offset == new_ref_state.offset
    ((y * weight).sum() + new_state.G.sum()).backward()
    ((y_ref * weight.double()).sum() + new_ref_state.G.sum()).backward()
    assert rel_err(x.grad, x64.grad) < 1e-5
    named_ref = dict(ref.named_parameters())
    # A gradient far below the rest sits at fp32's noise floor (at T = 1 the router acts on the
    # output only through eps): compare it absolutely, against the whole gradient's size.
    floor = 1e-6 * torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    for name, p in layer.named_parameters():
        assert p.grad is not None and named_ref[name].grad is not None, name
        g, g_ref = p.grad.double(), named_ref[name].grad
        assert (g - g_ref).norm() <= 1e-5 * g_ref.norm() + floor, name


def causal_direct(layer: VortLayer, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The layer's output from the design's formula, with an explicit [B, H, T, T] kernel matrix."""
    B, T, _ = x.shape
    q, k, v = layer.qkv(x).view(B, T, 3, layer.n_heads, layer.head_dim).unbind(2)
    assert not layer.rotary
    scale, weight = math.sqrt(layer.temperature()), layer.features.weight.to(q.dtype)

    def phi(x: torch.Tensor) -> torch.Tensor:  # positive random features of the normalised, scaled vector
        y = torch.nn.functional.normalize(x, dim=-1) * scale
        proj = torch.einsum("bthd,hfd->bthf", y, weight)
        return torch.exp(proj - 0.5 * y.square().sum(-1, keepdim=True)) / math.sqrt(weight.shape[1])

    fq, fk = phi(q), phi(k)
    scores = torch.einsum("bthf,bjhf->bhtj", fq, fk) * weights
    num = torch.einsum("bhtj,bjhd->bthd", scores, v)
    den = scores.sum(-1).transpose(1, 2)
    return layer.out((num / (den[..., None] + layer.eps)).reshape(B, T, -1))


def test_pl_alpha_one_is_plain_running_sum_linear_attention() -> None:
    layer = reference_copy(make_layer("pl", pl_alpha=1.0, rotary=False))
    assert layer.memory.n_terms == 1
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    T = x.shape[1]
    ones = torch.ones(T, T, dtype=torch.float64).tril()
    y, _ = layer(x)
    assert rel_err(y, causal_direct(layer, x, ones)) < 1e-12
    layer.float().backend = "torch"
    assert rel_err(layer(x.float())[0], y) < 1e-5


def gl_kernel_matrix(alpha: torch.Tensor, banks: np.ndarray) -> torch.Tensor:
    """[B, H, T, T]: exact GL weights of the writer's order, blended between its two banks as the layer does."""
    a = alpha.double().numpy()  # [B, T, H]
    T = a.shape[1]
    idx = np.clip(np.searchsorted(banks, a, side="right"), 1, banks.size - 1)
    theta = (a - banks[idx - 1]) / (banks[idx] - banks[idx - 1])
    lag = np.arange(T)[:, None] - np.arange(T)[None, :]  # [t, j]
    lag_ok = np.maximum(lag, 0)[None, None]
    left = gl_weights(lag_ok, banks[idx - 1].transpose(0, 2, 1)[:, :, None, :])
    right = gl_weights(lag_ok, banks[idx].transpose(0, 2, 1)[:, :, None, :])
    th = theta.transpose(0, 2, 1)[:, :, None, :]
    w = ((1 - th) * left + th * right) * (lag >= 0)
    return torch.from_numpy(w)


@pytest.mark.parametrize("router_bias", [None, -40.0, 40.0])
def test_vort_layer_matches_direct_power_law_attention(router_bias: float | None) -> None:
    """Free routing, alpha -> delta and alpha -> 1: the layer equals the GL-weighted formula up to the SOE error."""
    layer = reference_copy(make_layer("vort", rotary=False))
    if router_bias is not None:
        layer.memory.router.bias.data.fill_(router_bias)
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    alpha = layer.memory.router(x)[0].detach()
    banks = layer.memory.banks.double().numpy()
    if router_bias == -40.0:
        assert torch.allclose(alpha, torch.full_like(alpha, TINY.vort.delta), atol=1e-12)
    if router_bias == 40.0:
        assert torch.allclose(alpha, torch.ones_like(alpha), atol=1e-12)
    y, _ = layer(x)
    expected = causal_direct(layer, x, gl_kernel_matrix(alpha, banks))
    # The SOE kernel is certified to 1e-3 relative error per weight; a ratio of two such sums moves less.
    assert rel_err(y, expected) < 2e-3
    if router_bias == 40.0:  # alpha = 1 is exact in the SOE form
        assert rel_err(y, expected) < 1e-10


@pytest.mark.parametrize("kind", ["vort", "pl"])
def test_temper_multiplies_the_kernel_by_an_exponential(kind: str) -> None:
    """model.vort.temper=tau: the layer equals the GL-weighted formula times exp(-lag/tau)."""
    layer = reference_copy(make_layer(kind, rotary=False, temper=16, pl_alpha=1.0))
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    lag = (torch.arange(40)[:, None] - torch.arange(40)[None, :]).double()
    taper = torch.exp(-lag.clamp(min=0) / 16)
    if kind == "vort":
        alpha = layer.memory.router(x)[0].detach()
        weights = gl_kernel_matrix(alpha, layer.memory.banks.double().numpy()) * taper
    else:
        weights = torch.ones(40, 40, dtype=torch.float64).tril() * taper
    y, _ = layer(x)
    assert rel_err(y, causal_direct(layer, x, weights)) < 2e-3
    untempered = reference_copy(make_layer(kind, rotary=False, pl_alpha=1.0))
    assert rel_err(untempered(x)[0], y) > 1e-2


def test_low_order_contracts_towards_current_token() -> None:
    """As alpha -> delta the kernel concentrates on lag 0: the read is closer to v_t than at alpha = 1."""
    layer = reference_copy(make_layer("vort", rotary=False, delta=0.05))
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    B, T, _ = x.shape
    v = layer.qkv(x).view(B, T, 3, layer.n_heads, layer.head_dim)[:, :, 2].reshape(B, T, -1)
    distances = []
    for bias in (-40.0, 40.0):
        layer.memory.router.bias.data.fill_(bias)
        y, _ = layer(x)
        own = layer.out(v)
        distances.append(rel_err(y, own))
    assert distances[0] < 0.5 * distances[1]


@pytest.mark.parametrize(("kind", "options"), [*((k, {}) for k in (*VORT_KINDS, "transformer")),
                                               *(("vort", o) for o in LONG_CONTEXT_OPTIONS.values()),
                                               ("exp", {"learn_temperature": True, "readout": "norm_gate"})])
def test_model_pieces_equal_whole(kind: str, options: dict[str, object]) -> None:
    """Streaming (generate, pretrain.evaluate): pieces with the carried state give the whole sequence's logits."""
    torch.manual_seed(0)
    model = build_model(tiny(kind, **options)).eval()
    ids = torch.randint(0, 32, (2, 29))
    whole = model(ids).logits
    state = model.init_state(2)
    pieces = []
    for start, end in ((0, 5), (5, 6), (6, 21), (21, 29)):
        out = model(ids[:, start:end], state)
        pieces.append(out.logits)
        state = out.state
    if kind == "transformer":  # no KV cache by design: only each piece's first window matches
        assert torch.allclose(pieces[0], whole[:, :5], atol=1e-6)
        return
    assert rel_err(torch.cat(pieces, 1), whole) < 1e-5


@pytest.mark.parametrize("kind", VORT_KINDS)
def test_model_is_causal(kind: str) -> None:
    torch.manual_seed(1)
    model = build_model(tiny(kind)).eval()
    ids = torch.randint(0, 32, (2, 24))
    changed = ids.clone()
    changed[:, 11:] = torch.randint(0, 32, (2, 13))
    a, b = model(ids).logits, model(changed).logits
    assert torch.allclose(a[:, :11], b[:, :11], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 11:], b[:, 11:], atol=1e-3)


def test_gradients_reach_the_router() -> None:
    torch.manual_seed(2)
    model = build_model(tiny("vort"))
    ids = torch.randint(0, 32, (2, 24))
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    for i, block in enumerate(model.blocks):
        for name, p in block.mixer.memory.router.named_parameters():
            assert p.grad is not None and p.grad.abs().max() > 0, f"layer {i} router.{name} got no gradient"


def test_router_products_take_the_run_dtype_and_its_order_fp32() -> None:
    """Under bf16 the probes' products run on bf16 operands (the tensor cores' dtype), not on an fp32 copy of the
    layer input; the softmax, entropy and gates after them, and the order they give, are fp32."""
    from benchmarks.predict.ops import capture_ops

    router = make_layer("vort").memory.router.to("meta", torch.bfloat16)
    x = torch.zeros(2, 24, TINY.d_model, dtype=torch.bfloat16, device="meta")
    out: list[torch.Tensor] = []
    ops = capture_ops(lambda: out.extend(router(x)))
    products = [op for op in ops if op.kind == "gemm" or op.name.startswith(("aten.mv.", "aten.dot."))]
    assert len(products) >= 3  # the two probe factors and the entity probe
    assert {dtype for op in products for _shape, dtype in op.inputs} == {"bf16"}
    assert not any(op.name.startswith("aten._to_copy") and op.inputs[0] == ((2, 24, TINY.d_model), "bf16")
                   for op in ops)  # no fp32 copy of x
    assert [t.dtype for t in out] == [torch.float32] * 3


def test_learned_temperature_starts_at_temperature_trains_and_stops_at_its_cap() -> None:
    torch.manual_seed(2)
    model = build_model(tiny("vort", learn_temperature=True, temperature=3.0, temperature_max=6.0))
    layers = [block.mixer for block in model.blocks]
    for layer in layers:
        torch.testing.assert_close(layer.temperature(), torch.full((TINY.n_heads,), 3.0))
        with torch.no_grad():
            layer.log_temperature[0] = math.log(50.0)
        assert layer.temperature()[0].item() == pytest.approx(6.0)  # capped
    ids = torch.randint(0, 32, (2, 24))
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    for i, layer in enumerate(layers):
        grad = layer.log_temperature.grad
        assert grad[0] == 0 and (grad[1:].abs() > 0).all(), f"layer {i}: {grad}"


def test_long_context_options_add_only_their_parameters() -> None:
    """A fixed temperature and the num/den read keep the state dict of checkpoints made before the
    options existed; the learned temperature adds H per layer, the gated read a d x d gate and a
    head-dim norm weight per layer."""
    plain = build_model(tiny("vort"))
    assert not any(n in k for k in plain.state_dict() for n in ("log_temperature", "mixer.gate", "mixer.read_norm"))
    d, H, L = TINY.d_model, TINY.n_heads, TINY.n_layers
    learned = build_model(tiny("vort", learn_temperature=True))
    gated = build_model(tiny("vort", readout="norm_gate"))
    assert learned.num_parameters() == plain.num_parameters() + L * H
    assert gated.num_parameters() == plain.num_parameters() + L * (d * d + TINY.head_dim)
    assert gated.matmul_params() == plain.matmul_params() + L * (d * d + TINY.head_dim)
    both = build_model(tiny("vort", learn_temperature=True, readout="norm_gate"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in both.parameters():
            p.add_(0.1 * torch.randn_like(p))
    again = build_model(tiny("vort", learn_temperature=True, readout="norm_gate"))
    again.load_state_dict(both.state_dict())  # strict: the checkpoint holds every new parameter
    ids = torch.randint(0, 32, (2, 16))
    assert torch.equal(again.eval()(ids).logits, both.eval()(ids).logits)


def test_weak_entity_labels_mark_capitalised_words_inside_sentences() -> None:
    text = b'Then Catherine said. She saw Mr. Tilney and I went to Bath, said "Henry'
    mask = capitalised_word_mask(torch.tensor(list(text))[None])[0]
    marked = "".join(chr(c) if m else "_" for c, m in zip(text, mask.tolist()))
    assert [w for w in marked.split("_") if w] == ["Catherine", "Mr", "Bath", "Henry"]


def test_entity_aux_loss_is_added_in_training_only() -> None:
    """weight x mean-over-layers BCE(entity probe, weak labels) on top of the LM loss, in train mode."""
    torch.manual_seed(2)
    model = build_model(dataclasses.replace(tiny("vort", entity_aux_weight=0.5), vocab_size=258))
    ids = torch.tensor(list(b"At Bath she met Henry Tilney and Eleanor. They walked."))[None]
    inputs, labels = ids[:, :-1], ids[:, 1:]
    model.eval()
    lm_loss, _ = model.loss(inputs, labels)
    model.train()
    total, _ = model.loss(inputs, labels)
    target = capitalised_word_mask(inputs)
    assert 0 < target.sum() < target.numel()
    bce = [torch.nn.functional.binary_cross_entropy(b.mixer.memory.entity_score, target) for b in model.blocks]
    torch.testing.assert_close(total, lm_loss + 0.5 * torch.stack(bce).mean())


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(6)
    model = build_model(tiny("vort"))
    ids = torch.randint(0, 32, (2, 20))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.activation_checkpointing = checkpointing
        model.loss(ids[:, :-1], ids[:, 1:])[0].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert rel_err(grads[1], grads[0]) < 1e-6


def test_stats_describe_the_last_forward() -> None:
    torch.manual_seed(3)
    model = build_model(tiny("vort"))
    assert model.stats() == {}
    model(torch.randint(0, 32, (3, 10)))
    stats = model.stats()
    for i in range(TINY.n_layers):
        hist = stats[f"vort/layer{i}/alpha_hist"]
        assert hist.shape == (TINY.vort.alpha_bins,) and hist.sum() == 3 * 10 * TINY.n_heads
        assert hist[: int(TINY.vort.delta * TINY.vort.alpha_bins)].sum() == 0  # alpha >= delta
        share = stats[f"vort/layer{i}/bank_share"]
        assert share.shape == (TINY.vort.n_banks,) and abs(share.sum().item() - 1) < 1e-6
        assert 0 < stats[f"vort/layer{i}/entity_score"] < 1
        assert TINY.vort.delta <= stats[f"vort/layer{i}/alpha_mean"] <= 1


def test_fixed_features_are_reproducible_buffers_and_learned_ones_train() -> None:
    a, b = VortLM(tiny("pl")), VortLM(tiny("pl"))
    wa, wb = a.blocks[0].mixer.features.weight, b.blocks[0].mixer.features.weight
    assert torch.equal(wa, wb) and not torch.equal(wa, a.blocks[1].mixer.features.weight)
    assert "blocks.0.mixer.features.weight" in a.state_dict() and not isinstance(wa, torch.nn.Parameter)
    learned = VortLM(tiny("pl", feature_map="learned"))
    assert isinstance(learned.blocks[0].mixer.features.weight, torch.nn.Parameter)
    assert learned.num_parameters() == a.num_parameters() + TINY.n_layers * TINY.n_heads * 8 * TINY.head_dim


def test_random_features_are_positive_and_unbiased_for_the_exponential_kernel() -> None:
    """phi > 0, and averaging independent draws converges to exp(q.k) (a biased draw would plateau)."""
    from model.vort import PositiveRandomFeatures

    cfg = dataclasses.replace(TINY.vort, n_features=4096)
    torch.manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(1, 64, 1, 16), dim=-1)
    exact = torch.exp(x[0, :, 0] @ x[0, :, 0].T)
    draws = []
    for seed in range(8):
        phi = PositiveRandomFeatures(1, 16, cfg, layer_index=seed)(x, 1.0)
        assert (phi > 0).all()
        draws.append(torch.einsum("bthf,bjhf->tj", phi, phi))
    single, averaged = rel_err(draws[0], exact), rel_err(torch.stack(draws).mean(0), exact)
    assert single < 0.1 and averaged < 0.03 and averaged < 0.5 * single


@pytest.mark.parametrize("kind", ["vort", "m5"])
def test_bf16_cast_keeps_kernel_tables_fp32(kind: str) -> None:
    torch.manual_seed(5)
    model = build_model(tiny(kind)).eval()
    ids = torch.randint(0, 32, (2, 12))
    reference = model(ids).logits
    model.bfloat16()
    mixer = model.blocks[0].mixer
    assert mixer.qkv.weight.dtype == torch.bfloat16
    assert mixer.memory.log_lambda.dtype == torch.float32 and mixer.features.weight.dtype == torch.float32
    assert torch.equal(mixer.features.weight, build_model(tiny(kind)).blocks[0].mixer.features.weight)
    logits = model(ids).logits
    assert logits.dtype == torch.bfloat16 and rel_err(logits, reference) < 0.05


def test_the_scan_is_told_the_fast_terms_of_the_fixed_decays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory counts its fast terms (lam^64 <= 2^-30) once from its fixed decays, and the layer passes
    the count to the scan: 4 of vort-350m's 18 terms, none of a learned decay's."""
    import kernels

    cfg = load_model_config(CONFIGS / "vort-350m.yaml")
    memory = build_model(dataclasses.replace(cfg, n_layers=1)).blocks[0].mixer.memory
    assert memory.fast_terms == kernels.fast_term_count(memory.log_lambda) == 4
    assert build_model(tiny("exp")).blocks[0].mixer.memory.fast_terms == 0
    seen = []
    scan = kernels.soe_scan
    monkeypatch.setattr(kernels, "soe_scan", lambda *a, **k: seen.append(k["fast_terms"]) or scan(*a, **k))
    model = build_model(tiny("vort"))
    model(torch.randint(0, 32, (1, 12)))
    fast = model.blocks[0].mixer.memory.fast_terms
    assert fast > 0 and seen == [fast] * len(model.blocks)
    # a checkpoint's decays are counted again: its first term slowed down, no term is fast
    state = model.state_dict()
    state["blocks.0.mixer.memory.log_lambda"][0] = -1e-3
    model.load_state_dict(state)
    assert model.blocks[0].mixer.memory.fast_terms == 0 and model.blocks[1].mixer.memory.fast_terms == fast


@pytest.mark.parametrize("kind", [*VORT_KINDS, "transformer"])
def test_family_builds_from_config_and_learns_a_repetitive_sequence(kind: str) -> None:
    config = load_model_config(CONFIGS / f"{kind}-tiny.yaml")
    assert config.kind == kind
    torch.manual_seed(4)
    model = build_model(config)
    pattern = torch.tensor([5, 17, 99, 3, 42, 8, 200, 61])
    ids = pattern.repeat(2, 6)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_flops_and_summary_command(capsys: pytest.CaptureFixture[str]) -> None:
    paths = [str(CONFIGS / f"{kind}-tiny.yaml") for kind in ("vort", "exp")]
    assert summary_main(paths) == 0
    out = capsys.readouterr().out
    assert "| vort-tiny | vort |" in out and "| exp-tiny | exp |" in out
    vort, exp = build_model(load_model_config(paths[0])), build_model(load_model_config(paths[1]))
    # Both count 6 x parameters; vort's scan has S > 1 terms, so its per-token work is larger.
    assert vort.flops_per_token(512) > 6 * vort.matmul_params()
    assert vort.flops_per_token(512) - 6 * vort.matmul_params() > exp.flops_per_token(512) - 6 * exp.matmul_params()
    assert vort.flops_per_token(512) == vort.flops_per_token(65536)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="delta"):
        VortConfig(delta=0.0)
    with pytest.raises(ValueError, match="pl_alpha"):
        VortConfig(delta=0.3, pl_alpha=0.2)
    with pytest.raises(ValueError, match="n_banks"):
        VortConfig(n_banks=1)
    with pytest.raises(ValueError, match="m5_timescales"):
        VortConfig(m5_timescales=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"temperature: must be <= temperature_max=8\.0"):
        VortConfig(temperature=9.0)
    with pytest.raises(ValueError, match=r"temperature: must be <= temperature_max=3\.0"):
        VortConfig(temperature=4.0, temperature_max=3.0, learn_temperature=True)
    with pytest.raises(ValueError, match="readout"):
        VortConfig(readout="gate")


def test_config_file_names_a_bad_long_context_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    for line, key in (("readout: gate", "model.vort.readout"), ("temperature: 12.0", "temperature"),
                      ("learn_temperature: maybe", "model.vort.learn_temperature")):
        path.write_text(f"model:\n  kind: vort\n  vort:\n    {line}\n")
        with pytest.raises((ConfigError, ValueError), match=key):
            load_model_config(path)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["125m", "350m"])
def test_sized_configs_match_their_names_and_each_other(size: str) -> None:
    """Every family at a size has about the nominal parameter count and within 1% of the Transformer's."""
    nominal = {"125m": 125e6, "350m": 350e6}[size]
    counts = {}
    for kind in (*VORT_KINDS, "transformer"):
        model = build_model(load_model_config(CONFIGS / f"{kind}-{size}.yaml"))
        counts[kind] = model.num_parameters()
        assert model.flops_per_token(4096) > 6 * model.num_parameters(exclude_embeddings=True)
    for kind, count in counts.items():
        assert 0.9 * nominal < count < 1.1 * nominal, (kind, count)
        assert abs(count / counts["transformer"] - 1) < 0.01, (kind, count)


TRITON_CHECK = """
import json, torch
from tests.test_vort import make_layer, reference_copy, rel_err
layer = make_layer("vort", seed=0)
layer.backend = "triton"
ref = reference_copy(layer)
x = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(0))
(y, state), (y_ref, state_ref) = layer(x), ref(x.double())
y.square().sum().backward()
y_ref.square().sum().backward()
named = dict(ref.named_parameters())
grads = max(rel_err(p.grad, named[n].grad) for n, p in layer.named_parameters())
print(json.dumps({"out": rel_err(y, y_ref), "state": rel_err(state.G, state_ref.G), "grads": grads}))
"""


def test_layer_on_the_triton_path_matches_the_reference() -> None:
    """The GPU path of the whole layer, run by the Triton interpreter (it must be set before import)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("documents", [False, True])
def test_rotary_tables_are_made_once_a_call_and_change_nothing(monkeypatch: pytest.MonkeyPatch,
                                                               documents: bool) -> None:
    """VortLM makes the rotary tables once for all its layers (one cos and one sin a forward, not one a layer);
    the logits are those of layers that each make their own, with and without document starts, and carried
    across two calls."""
    from benchmarks.predict.ops import capture_ops
    from model.vort import VortLM

    torch.manual_seed(3)
    model = build_model(tiny("vort"))
    assert len(model.blocks) > 1 and model.config.vort.rotary
    ids = torch.randint(0, 32, (2, 24))
    doc_start = (torch.arange(24) % 10 == 3).expand(2, 24).clone() if documents else None

    def two_calls() -> torch.Tensor:
        first = model(ids[:, :13], doc_start=None if doc_start is None else doc_start[:, :13])
        second = model(ids[:, 13:], first.state, doc_start=None if doc_start is None else doc_start[:, 13:])
        return torch.cat([first.logits, second.logits], 1)

    ops = capture_ops(lambda: model(ids, doc_start=doc_start))
    assert sum(op.name.startswith("aten.cos") for op in ops) == 1
    shared = two_calls()
    monkeypatch.setattr(VortLM, "block_inputs", lambda self, *args: {})
    assert torch.equal(shared, two_calls())
