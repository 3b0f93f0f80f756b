"""The chunked cross-entropy (model/interface.py) against the plain full-logits loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import model.interface as interface
from model import IGNORE_INDEX, build_model
from model.interface import chunked_cross_entropy, token_cross_entropy
from pretrain.config import load_config


def _plain_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("n_tokens", [1, 37, 96])
def test_value_and_gradients_equal_the_plain_loss(monkeypatch: pytest.MonkeyPatch, n_tokens: int) -> None:
    # 16 tokens per chunk at vocabulary 50: several chunks and a ragged last one
    monkeypatch.setattr(interface, "LOSS_CHUNK_ELEMENTS", 16 * 50)
    gen = torch.Generator().manual_seed(n_tokens)
    hidden = torch.randn(n_tokens, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (n_tokens,), generator=gen)
    labels[::5] = IGNORE_INDEX
    upstream = 0.7

    chunked = chunked_cross_entropy(hidden, weight, labels)
    grads = torch.autograd.grad(chunked * upstream, (hidden, weight))
    plain = _plain_sum(hidden.double(), weight.double(), labels).double()
    plain_grads = torch.autograd.grad(plain * upstream, (hidden, weight))

    # the chunked loss keeps its log-normalisers and sum in fp32, the reference in float64
    torch.testing.assert_close(chunked.double(), plain, rtol=1e-6, atol=1e-5)
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    per_token = token_cross_entropy(hidden, weight, labels)
    assert per_token.shape == labels.shape and bool((per_token[::5] == 0).all())
    torch.testing.assert_close(per_token.sum().double(), plain, rtol=1e-6, atol=1e-5)


def test_model_loss_equals_full_logits_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """CausalLM.loss (chunked) against cross-entropy of forward's logits, value and every gradient."""
    monkeypatch.setattr(interface, "LOSS_CHUNK_ELEMENTS", 40 * 256)
    cfg = load_config("configs/tiny-vort.yaml")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 65))
    labels = ids[:, 1:].clone()
    labels[0, :7] = IGNORE_INDEX

    loss, _ = model.loss(ids[:, :-1], labels)
    loss.backward()
    chunked_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    logits, _ = model(ids[:, :-1])
    plain = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    plain.backward()

    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
    assert chunked_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(chunked_grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_bf16_matches_plain_bf16_loss() -> None:
    """Under bf16 weights the chunked loss computes logits exactly as the plain path (a bf16 matmul,
    then fp32), so values agree to fp32 rounding of the sum and gradients to bf16 rounding."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 32, generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(300, 32, generator=gen) * 0.1).bfloat16().requires_grad_()
    labels = torch.randint(0, 300, (64,), generator=gen)
    chunked = chunked_cross_entropy(hidden, weight, labels)
    g_chunked = torch.autograd.grad(chunked, (hidden, weight))
    plain = _plain_sum(hidden, weight, labels)
    g_plain = torch.autograd.grad(plain, (hidden, weight))
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-4)
    for got, want in zip(g_chunked, g_plain, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


class _Products(TorchDispatchMode):
    """Counts the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.matmul)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("needs", ["both", "hidden", "weight"])
def test_gradient_made_in_the_forward_and_only_scaled_after(monkeypatch: pytest.MonkeyPatch, needs: str) -> None:
    """The chunks' products run once, in the forward (the head's logits and, for each input that needs a
    gradient, its product); the backward runs none, and each gradient still equals the plain loss's."""
    monkeypatch.setattr(interface, "LOSS_CHUNK_ELEMENTS", 16 * 50)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(70, 12, generator=gen, dtype=torch.float64, requires_grad=needs != "weight")
    weight = torch.randn(50, 12, generator=gen, dtype=torch.float64, requires_grad=needs != "hidden")
    labels = torch.randint(0, 50, (70,), generator=gen)
    wanted = [t for t in (hidden, weight) if t.requires_grad]
    chunks = 5  # 70 tokens in chunks of 16
    with _Products() as forward:
        loss = chunked_cross_entropy(hidden, weight, labels)
    with _Products() as backward:
        grads = torch.autograd.grad(loss * 0.3, wanted)
    assert forward.count == chunks * (1 + len(wanted))
    assert backward.count == 0
    plain = torch.autograd.grad(_plain_sum(hidden, weight, labels) * 0.3, wanted)
    for got, want in zip(grads, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with _Products() as no_grad, torch.no_grad():
        chunked_cross_entropy(hidden, weight, labels)
    assert no_grad.count == chunks  # evaluation makes no gradient
