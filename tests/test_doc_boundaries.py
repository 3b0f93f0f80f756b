"""data.doc_boundaries: a packed sequence of several documents gives, for every document, the logits and
the gradients that document gives run alone, in every family and every CPU scan path, in one call and
fed call by call with the carried state (tests/test_sequence_parallel.py has the sequence-parallel
pieces)."""

from __future__ import annotations

import itertools

import pytest
import torch

from model import build_model
from model.blocks import token_positions
from tests.test_short_conv import FAMILIES  # every family with a short convolution, at test size

# The Triton scans run under the interpreter (tests/conftest.py); VORT's costs minutes there (a launch per
# document and pass), so it is in the slow target; tests/test_kernels_triton.py checks its resets quickly.
CASES = [(kind, "torch") for kind in FAMILIES] + [(kind, "reference") for kind in ("vort", "pl", "exp", "m5")] + [
    pytest.param("vort", "triton", marks=pytest.mark.slow), ("pmnet", "triton")]

SEQ = 40
# Row 0 starts with a document; its others start inside a scan chunk / attention block of 8 (5, 29) and on
# an edge (16). Row 1 opens mid-document (its first tokens are a document of their own) and has a
# one-token document (24) on a chunk edge and another straight after it.
STARTS = [[0, 5, 16, 29], [11, 24, 25]]


def _doc_start() -> torch.Tensor:
    doc_start = torch.zeros(len(STARTS), SEQ, dtype=torch.bool)
    for row, starts in enumerate(STARTS):
        doc_start[row, starts] = True
    return doc_start


def _documents() -> list[tuple[int, int, int]]:
    """(row, first token, end) of every document of the packed batch."""
    return [(row, lo, hi) for row, starts in enumerate(STARTS) for lo, hi in itertools.pairwise([0, *starts, SEQ])
            if lo < hi]


def _model(kind: str, backend: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(FAMILIES[kind]).eval()
    for block in model.blocks:
        if hasattr(block, "mixer"):
            block.mixer.backend = backend
    for memory in getattr(model, "memories", list)():  # PMNet's read-out and write gain start at zero: wake
        torch.nn.init.normal_(memory.out.weight, std=0.1)  # them, so that the phases reach the logits
        torch.nn.init.ones_(memory.write_gain)
        memory.scan_backend = backend
    return model


def test_positions_restart_with_the_document() -> None:
    positions = token_positions(7, 6, torch.tensor([[False, False, True, False, True, True]]), torch.device("cpu"))
    assert positions.tolist() == [[7, 8, 0, 1, 0, 0]]


@pytest.mark.parametrize(("kind", "backend"), CASES)
def test_packed_documents_match_each_document_alone(kind: str, backend: str) -> None:
    model = _model(kind, backend)
    ids = torch.randint(0, 258, (len(STARTS), SEQ), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(len(STARTS), SEQ, 258, generator=torch.Generator().manual_seed(2))
    packed = model(ids, doc_start=_doc_start()).logits
    (packed * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0.0
    for row, lo, hi in _documents():
        alone = model(ids[row : row + 1, lo:hi]).logits
        torch.testing.assert_close(packed[row : row + 1, lo:hi], alone, atol=2e-5, rtol=1e-4, msg=f"{row} {lo}:{hi}")
        total = total + (alone * weights[row : row + 1, lo:hi]).sum()
    total.backward()
    assert packed_grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("kind", ["transformer", "vort", "pmnet"])
def test_without_boundaries_documents_read_each_other(kind: str) -> None:
    """The comparison above has something to detect: without doc_start a later document's logits change."""
    model = _model(kind, "torch")
    ids = torch.randint(0, 258, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mixed = model(ids).logits[:, 16:29]
        alone = model(ids[:, 16:29]).logits
    assert (mixed - alone).abs().max() > 1e-3


# Calls of the stream: cut inside documents, on document starts (16, 24, 25 and 29 start documents in one row
# or the other) and one of a single token.
CALLS = [0, 7, 16, 24, 25, 33, 40]


def _streamed(model: torch.nn.Module, ids: torch.Tensor, doc_start: torch.Tensor | None, cuts: list[int]
              ) -> torch.Tensor:
    """Logits of ids fed in the calls between `cuts`, the state carried from call to call."""
    state, logits = model.init_state(ids.shape[0]), []
    for lo, hi in itertools.pairwise(cuts):
        out = model(ids[:, lo:hi], state=state, doc_start=None if doc_start is None else doc_start[:, lo:hi])
        logits.append(out.logits)
        state = out.state
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize(("kind", "backend"), [(kind, "torch") for kind in FAMILIES] + [("vort", "reference")])
def test_a_stream_in_calls_gives_each_document_its_own_run(kind: str, backend: str) -> None:
    """A packed stream fed call by call with the carried state (streaming evaluation, train.carry_state) gives
    every document the logits and gradients of that document alone, fed through the same call borders: a call
    that continues a document continues its positions, cache, window, convolution tail and memory, and a start
    inside a call drops them. For the recurrent families a document alone in calls is the document in one call
    (tests/test_short_conv.py, test_pmnet.py); the Transformer forgets at every call border by design."""
    model = _model(kind, backend)
    ids = torch.randint(0, 258, (len(STARTS), SEQ), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(len(STARTS), SEQ, 258, generator=torch.Generator().manual_seed(2))
    packed = _streamed(model, ids, _doc_start(), CALLS)
    (packed * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0.0
    for row, lo, hi in _documents():
        cuts = [lo, *(c for c in CALLS if lo < c < hi), hi]
        alone = _streamed(model, ids[row : row + 1, lo:hi], None, [c - lo for c in cuts])
        torch.testing.assert_close(packed[row : row + 1, lo:hi], alone, atol=2e-5, rtol=1e-4, msg=f"{row} {lo}:{hi}")
        total = total + (alone * weights[row : row + 1, lo:hi]).sum()
    total.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_loss_takes_doc_start_and_checks_it() -> None:
    model = _model("vort", "torch")
    ids = torch.randint(0, 258, (len(STARTS), SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss, _ = model.loss(ids[:, :-1], ids[:, 1:], doc_start=_doc_start()[:, :-1])
        plain, _ = model.loss(ids[:, :-1], ids[:, 1:])
    assert torch.isfinite(loss) and loss != plain
    with pytest.raises(ValueError, match="doc_start must be bool"):
        model(ids, doc_start=_doc_start().long())


@pytest.mark.parametrize("kind", ["vort", "pmnet"])
def test_activation_checkpointing_passes_doc_start(kind: str) -> None:
    model = _model(kind, "torch").train()
    ids = torch.randint(0, 258, (len(STARTS), SEQ), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointed in (False, True):
        model.activation_checkpointing = checkpointed
        model.zero_grad()
        model.loss(ids[:, :-1], ids[:, 1:], doc_start=_doc_start()[:, :-1])[0].backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed, plain)
