"""The Triton kernels against the sequential reference, run by the Triton interpreter on CPU tensors.

tests/conftest.py sets TRITON_INTERPRET for the whole test process, before any kernel is decorated.
Shapes are small and fp32: the interpreter is slow and computes bf16 tl.dot wrongly. On a CUDA machine
the bf16 test runs as well.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kernels import phasor_scan, soe_scan
from kernels.testing import angle_err, phasor_inputs, phasor_run, rel_err, resets, soe_inputs, soe_run

pytest.importorskip("triton")

import triton
import triton.language as tl

from kernels.phasor.triton import _tf32_pieces
from kernels.span import wrap_phase

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FWD_TOL, GRAD_TOL = 1e-4, 1e-3


def _check_soe(inputs, chunk_size, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL, dtype=torch.float32):
    outs, grads = soe_run(inputs, "triton", dtype=dtype, device=DEVICE, chunk_size=chunk_size)
    ref_outs, ref_grads = soe_run(inputs, "reference", dtype=torch.float64)
    for name, got, want in zip(("o", "z", "G", "b"), outs, ref_outs):
        assert got.shape == want.shape
        assert rel_err(got, want) <= fwd_tol, (name, rel_err(got, want))
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) <= grad_tol, (name, rel_err(grads[name], ref_grads[name]))


def _check_phasor(inputs, n_slots):
    """The Triton phasor scan's reads, final phases and gradients against the float64 reference."""
    (read, final), grads = phasor_run(inputs, n_slots, "triton", device=DEVICE)
    (ref_read, ref_final), ref_grads = phasor_run(inputs, n_slots, "reference", dtype=torch.float64)
    assert angle_err(read, ref_read) <= FWD_TOL * 2 * math.pi
    assert angle_err(final, ref_final) <= FWD_TOL * 2 * math.pi
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) <= GRAD_TOL, name
    return read


@pytest.mark.parametrize(
    ("batch", "seq_len", "heads", "feat", "dim_v", "n_terms", "chunk_size", "with_state"),
    [
        (1, 1, 1, 3, 2, 1, 16, False),
        (2, 37, 2, 5, 7, 3, 16, True),
        (1, 64, 1, 16, 16, 2, 64, True),
        (1, 70, 2, 4, 20, 1, 32, False),
        (1, 40, 1, 4, 70, 2, 16, True),  # two value blocks: the normaliser rides with the first only
    ],
)
def test_soe_triton_matches_reference(batch, seq_len, heads, feat, dim_v, n_terms, chunk_size, with_state):
    _check_soe(soe_inputs(batch, seq_len, heads, feat, dim_v, n_terms, with_state, seed=seq_len), chunk_size)


def _spans_of(monkeypatch, batch, seq_len, heads, chunk, chunks_per_span, n_terms, feat, width):
    """Patch the span sizing so that a scan of these sizes walks spans of ``chunks_per_span`` chunks (the
    launches ask for MIN_PROGRAMS programs of the smallest walks, one per span x batch x head x column
    block of the interpreter's (A100) tiles)."""
    import kernels.soe.gpu.launches as launches

    n_chunks = math.ceil(seq_len / chunk)
    values = math.ceil(width / launches.TILES[False].block)
    blocks = min(values, math.ceil(feat / launches.feature_block(n_terms, feat, 80)))
    monkeypatch.setattr(launches, "MIN_PROGRAMS", batch * heads * blocks * math.ceil(n_chunks / chunks_per_span))
    # spans of any whole number of chunks: the forward then reads chunks of 16 or 32 tokens (forward_chunk)
    monkeypatch.setattr(launches, "whole_forward_chunks", lambda span, _chunk, _n_chunks: span)
    assert launches.walk_span(batch, seq_len, heads, n_terms, feat, width, chunk, 80) == chunks_per_span
    return math.ceil(n_chunks / chunks_per_span)


@pytest.mark.parametrize(
    ("seq_len", "chunk_size", "batch", "heads", "feat", "dim_v", "per_span"),
    [(150, 16, 1, 1, 4, 5, 3), (150, 16, 1, 1, 12, 5, 1), (70, 16, 2, 2, 12, 20, 2), (150, 16, 1, 1, 4, 5, 10)],
)
def test_soe_triton_spans_match_reference(monkeypatch, seq_len, chunk_size, batch, heads, feat, dim_v, per_span):
    """Many spans of whole chunks, a short last span and a short last chunk (150 tokens: nine chunks of 16
    and one of 6, in spans of 3, so the last span is that chunk alone; spans of one chunk; one span), with
    several value and feature blocks, an initial state, a term that decays fast, and every gradient (q, k,
    v, coef, log_lam, G0, b0). The walks run one program per span x batch x head x column block."""
    from kernels.soe.triton import soe_launches

    n_spans = _spans_of(monkeypatch, batch, seq_len, heads, chunk_size, per_span, 2, feat, dim_v)
    chunk, launches = soe_launches(batch, seq_len, heads, 2, feat, dim_v, chunk_size, torch.float32, 80)
    assert chunk == chunk_size
    blocks = {name: launches[name].constexprs.get("BD") or launches[name].constexprs.get("BC") for name in launches}
    for name in ("bwd_states", "bwd_values"):
        assert launches[name].grid[0] == n_spans * batch * heads * math.ceil(dim_v / blocks[name]), name
    assert launches["bwd_queries"].grid[0] == n_spans * batch * heads * math.ceil(feat / blocks["bwd_queries"])
    # the forward: a state walk per batch x head x term (x state block), outputs per chunk x batch x head,
    # its chunks (16 or 32 tokens here, 64 for one span) tiling the spans
    fc = launches["fwd"].constexprs["BT"]
    assert (per_span * chunk) % fc == 0 or per_span * chunk >= seq_len  # one span: chunks of 64
    assert launches["fwd_states"].constexprs["BT"] == fc
    states = launches["fwd_states"].constexprs  # blocks of the state, as small as filling the GPU needs
    state_blocks = math.ceil(feat / states["BF"]) * math.ceil(dim_v / states["BD"])
    assert launches["fwd_states"].grid[0] == batch * heads * 2 * state_blocks
    assert launches["fwd"].grid[0] == math.ceil(seq_len / fc) * batch * heads
    # the normalisers' walk is one more column block of the key-gradient launch
    assert launches["bwd_keys"].grid[0] == n_spans * batch * heads * (math.ceil(feat / blocks["bwd_keys"]) + 1)
    inputs = soe_inputs(batch, seq_len, heads, feat, dim_v, 2, True, seed=7)
    inputs["log_lam"] = torch.tensor([[-0.01, -3.0]] * heads, dtype=torch.float64)
    _check_soe(inputs, chunk_size)


def test_soe_triton_backward_in_phases_matches_reference(monkeypatch):
    """The key and value walks (which make the coefficient gradient's shares) and the coefficient kernel
    run over a few spans at a time when the shares of the whole sequence would be large: with the budget cut to
    two spans' shares, 150 tokens in spans of 2 chunks run as three phases of 2, 2 and 1 span, and every
    gradient still matches."""
    import kernels.soe.gpu.launches as launches

    n_spans = _spans_of(monkeypatch, 1, 150, 1, 16, 2, 2, 12, 5)
    assert n_spans == 5
    monkeypatch.setattr(launches, "SHARES_BYTES", 2 * (2 * 32 * 2 * 4))  # 2 spans x parts x tokens x S x 4
    assert launches.phase_spans(1, 1, 2, 2, 32, n_spans) == 2
    inputs = soe_inputs(1, 150, 1, 12, 5, 2, True, seed=8)
    inputs["reset"] = resets(150, [[40, 64, 97]])
    _check_soe(inputs, 16)


@pytest.mark.parametrize("n_terms", [3, 5, 11, 18])
def test_soe_triton_term_groups_match_reference(monkeypatch, n_terms):
    """The terms split in two power-of-two groups (3 = 2 + 1, 5 = 4 + 1, 11 = 8 + 4 with one padded term,
    18 = 16 + 2), over three spans with resets: outputs, final state and every gradient."""
    from kernels.soe.gpu.launches import term_groups

    groups = term_groups(n_terms)
    assert groups[0] + groups[1] >= n_terms > groups[0] and groups[2]
    _spans_of(monkeypatch, 1, 70, 1, 16, 2, n_terms, 6, 9)
    inputs = soe_inputs(1, 70, 1, 6, 9, n_terms, True, seed=n_terms)
    inputs["reset"] = resets(70, RESET_ROWS[:1])
    _check_soe(inputs, 16)


@pytest.mark.parametrize(("per_span", "target", "phased"), [(1, 80, 0), (2, 80, 1), (1, 80, 2), (4, 80, 0),
                                                             (4, 90, 0)])  # fmt: skip
def test_soe_triton_without_a_decay_gradient(monkeypatch, per_span, target, phased):
    """Decays that are buffers (VORT's): the chunk-parallel backward returns None for log_lam, every other
    gradient matches the reference, and two runs are bitwise equal. 18 terms, resets, an initial state and
    the final state's gradient, at forward chunks of 16, 32 and 64 tokens (spans of 1, 2 and 4 chunks of
    16; 70 tokens, so the last chunk is short), with an A100's launches and an H100's (register caps,
    stages); ``phased``: the per-chunk states budget cut to that many spans' (one span is one forward
    chunk here), so the forward and the backward run the chunks in phases: three of one span (chunks of
    32; the last of 6 tokens), or one span then two phases of two (chunks of 16): the short phase first,
    the last phase's states kept by the forward and the earlier ones walked again by the backward."""
    import kernels.soe.gpu.function as function
    import kernels.soe.gpu.launches as launches
    from kernels.soe.triton import soe_launches

    monkeypatch.setattr(function, "device_capability", lambda _x: target)
    if phased:  # a span's per-chunk states: B x H x S rows of F x (D + 1) fp32 values
        monkeypatch.setattr(launches, "READS_BYTES", phased * 2 * 2 * 18 * 6 * 10 * 4)
        monkeypatch.setattr(launches, "KEPT_BYTES", 0)
    names = soe_launches(2, 70, 2, 18, 6, 9, 16, torch.float32, target, decay_grad=False)[1].keys()
    made = {"bwd_chunk_keys_values", "bwd_chunk_coefs"} if target >= 90 else {"bwd_chunk_keys", "bwd_chunk_values",
                                                                               "bwd_chunk_coefs"}
    assert made <= names

    if per_span < 4:
        _spans_of(monkeypatch, 2, 70, 2, 16, per_span, 18, 6, 9)
    else:  # one span over the sequence: chunks of 64 (the last of 6 tokens)
        monkeypatch.setattr(launches, "MIN_PROGRAMS", 1)
    assert soe_launches(2, 70, 2, 18, 6, 9, 16, torch.float32, 80)[1]["fwd"].constexprs["BT"] == 16 * per_span
    fwd = soe_launches(2, 70, 2, 18, 6, 9, 16, torch.float32, target, decay_grad=False)[1]["fwd"]
    assert fwd.grid[0] == (phased or math.ceil(70 / (16 * per_span))) * 2 * 2
    inputs = soe_inputs(2, 70, 2, 6, 9, 18, True, seed=3)
    inputs["reset"] = resets(70, RESET_ROWS)
    runs = []
    for backend, dtype in (("triton", torch.float32), ("triton", torch.float32), ("reference", torch.float64)):
        x = {n: t.to(dtype).requires_grad_(n != "log_lam") for n, t in inputs.items() if t.is_floating_point()}
        o, z, (g, b) = soe_scan(x["q"], x["k"], x["v"], x["coef"], x["log_lam"], (x["g0"], x["b0"]), True, 16,
                                backend, reset=inputs["reset"])  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, z, g, b)]
        sum((t.double() * w).sum() for t, w in zip((o, z, g, b), weights)).backward()
        runs.append({n: t.grad for n, t in x.items()})
    got, again, want = runs
    assert got.pop("log_lam") is None and want.pop("log_lam") is None and again.pop("log_lam") is None
    for name in want:
        assert rel_err(got[name], want[name]) <= GRAD_TOL, name
        assert torch.equal(got[name], again[name]), name


def test_fast_terms_are_cut_into_pieces_only_where_the_walks_crowd():
    """`fast_pieces`: vort-350m's 16 heads x 18 terms (288 walks, past TARGET_PROGRAMS) cut their 4 fast
    terms' walks in 16 pieces of a 170-chunk phase, at least 4 warm-ups long each; vort-125m's 216 walks fit
    whole; no fast terms, split state blocks, or slow walks that do not fit on their own: no pieces."""
    from kernels.soe import FAST_REACH, fast_term_count
    from kernels.soe.gpu.launches import TARGET_PROGRAMS, fast_pieces

    assert 12 * 18 <= 16 * 14 <= TARGET_PROGRAMS < 16 * 18
    assert fast_pieces(16, 18, 4, 1, True, 170, 1) == (4, 16)
    assert fast_pieces(16, 18, 4, 1, True, 20, 1) == (4, 5)
    assert fast_pieces(16, 18, 4, 1, True, 20, 4) == (4, 1)
    assert fast_pieces(12, 18, 4, 1, True, 170, 1) == (0, 1)
    assert fast_pieces(16, 18, 0, 1, True, 170, 1) == (0, 1)
    assert fast_pieces(16, 18, 4, 1, False, 170, 1) == (0, 1)
    assert fast_pieces(16, 18, 1, 1, True, 170, 1) == (0, 1)  # 272 slow walks
    lam = torch.tensor([[-7.0, -2.5, -0.9, -0.33, -0.1, -0.001], [-7.0, -2.5, -0.3, -0.33, -0.1, -0.001]])
    assert FAST_REACH * 0.33 >= 30 * math.log(2) > FAST_REACH * 0.3
    assert fast_term_count(lam) == 2 and fast_term_count(lam[:1]) == 4 and fast_term_count(-lam) == 0


@pytest.mark.parametrize(("per_span", "target", "phased"), [(1, 80, 0), (1, 80, 2), (4, 90, 0)])
def test_soe_triton_walks_fast_terms_in_pieces(monkeypatch, per_span, target, phased):
    """The chunk state walks with the 4 fast terms of 18 cut into 3 pieces each (the slow terms' 56 walks
    fit TARGET_PROGRAMS, all 72 do not): every output, the final state and every gradient match the
    reference, and the walks without pieces to fp32 rounding (a piece walks from zero 64 tokens before its
    first chunk, over which those terms decay below 2^-30); two runs bitwise equal. Resets, an initial state,
    a short last chunk; forward chunks of 16 tokens (pieces of 3 chunks, their warm-up of 4 reaching back past
    the phase's start for the second) in one phase or in phases of two spans (pieces starting mid-phase), and
    of 64 on an H100's launches (pieces of one chunk after a warm-up of one)."""
    import kernels.soe.gpu.function as function
    import kernels.soe.gpu.launches as launches
    from kernels.soe import fast_term_count
    from kernels.soe.triton import soe_launches

    seq_len = 134
    monkeypatch.setattr(function, "device_capability", lambda _x: target)
    if phased:
        monkeypatch.setattr(launches, "READS_BYTES", phased * 2 * 2 * 18 * 6 * 10 * 4)
        monkeypatch.setattr(launches, "KEPT_BYTES", 0)
    if per_span < 4:
        _spans_of(monkeypatch, 2, seq_len, 2, 16, per_span, 18, 6, 9)
    else:
        monkeypatch.setattr(launches, "MIN_PROGRAMS", 1)
    monkeypatch.setattr(launches, "TARGET_PROGRAMS", 2 * 2 * 14)
    monkeypatch.setattr(launches, "fast_pieces", lambda *a: (4, 3) if a[2] else (0, 1))
    walk = soe_launches(2, seq_len, 2, 18, 6, 9, 16, torch.float32, target, decay_grad=False, fast_terms=4)[1]
    assert walk["fwd_states"].grid[0] == 2 * 2 * (14 + 4 * 3) == walk["bwd_chunk_states"].grid[0]
    assert walk["fwd_states"].constexprs["WARM"] == 64 // (16 * per_span)
    inputs = soe_inputs(2, seq_len, 2, 6, 9, 18, True, seed=5)
    inputs["log_lam"][:, :4] = torch.tensor([-7.0, -2.5, -0.9, -0.33])
    assert fast_term_count(inputs["log_lam"]) >= 4
    inputs["reset"] = resets(seq_len, [[0, 5, 16, 17, 32, 33, 34, 64, 69, 100, 127], [15, 48, 90]])
    runs = []
    for backend, dtype, fast in (("triton", torch.float32, 4), ("triton", torch.float32, 4),
                                 ("triton", torch.float32, 0), ("reference", torch.float64, 0)):  # fmt: skip
        x = {n: t.to(dtype).requires_grad_(n != "log_lam") for n, t in inputs.items() if t.is_floating_point()}
        o, z, (g, b) = soe_scan(x["q"], x["k"], x["v"], x["coef"], x["log_lam"], (x["g0"], x["b0"]), True, 16,
                                backend, reset=inputs["reset"], fast_terms=fast)  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, z, g, b)]
        sum((t.double() * w).sum() for t, w in zip((o, z, g, b), weights)).backward()
        runs.append({"o": o, "z": z, "G": g, "b": b} | {f"d{n}": t.grad for n, t in x.items() if n != "log_lam"})
    got, again, whole, want = runs
    for name in want:
        assert rel_err(got[name], want[name]) <= (FWD_TOL if name in "oGzb" else GRAD_TOL), name
        assert rel_err(got[name], whole[name]) <= 1e-6, (name, rel_err(got[name], whole[name]))
        assert torch.equal(got[name], again[name]), name


@pytest.mark.parametrize("decay_grad", [False, True])
def test_soe_triton_gradients_when_the_final_state_goes_unused(decay_grad):
    """Training without a carried state: the loss reads o and z only, so the final state gets no gradient and
    the backward starts from a zero state gradient of its own: every gradient matches the reference's, with
    and without the decays' (the two backward paths)."""
    inputs = soe_inputs(2, 70, 2, 6, 9, 5, True, seed=4)
    runs = []
    for backend, dtype in (("triton", torch.float32), ("reference", torch.float64)):
        x = {n: t.to(dtype).requires_grad_(decay_grad or n != "log_lam") for n, t in inputs.items()
             if t.is_floating_point()}
        o, z, _final = soe_scan(x["q"], x["k"], x["v"], x["coef"], x["log_lam"], (x["g0"], x["b0"]), True, 16,
                                backend)
        gen = torch.Generator().manual_seed(0)
        ((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
         + (z.double() * torch.randn(z.shape, generator=gen, dtype=torch.float64)).sum()).backward()
        runs.append({n: t.grad for n, t in x.items()})
    got, want = runs
    assert (got["log_lam"] is None) == (not decay_grad)
    for name in want:
        if want[name] is not None:
            assert rel_err(got[name], want[name]) <= GRAD_TOL, name


@pytest.mark.parametrize("phased", [False, True])
def test_soe_forward_keeps_its_last_phase_chunk_states_for_the_backward(monkeypatch, phased):
    """The forward keeps the state entering every chunk of its last phase, and the chunk-parallel backward,
    which starts there, reads them: with one phase (the sequence's per-chunk states within
    launches.KEPT_BYTES) no second walk of the chunks; with several, a second walk of every phase but the
    last (the launches captured on meta tensors, as an H100 would get them; the values are checked against
    the reference by the test above)."""
    import kernels.soe.gpu.launches as launches
    from kernels._common import capture_launches
    from kernels.soe.gpu.function import SoeScanTriton

    if phased:
        monkeypatch.setattr(launches, "READS_BYTES", 1)
        monkeypatch.setattr(launches, "KEPT_BYTES", 0)
    meta = {"device": "meta", "dtype": torch.bfloat16}
    q, k = (torch.zeros(1, 4096, 2, 64, **meta, requires_grad=True) for _ in range(2))
    v = torch.zeros(1, 4096, 2, 64, **meta, requires_grad=True)
    coef = torch.zeros(1, 4096, 2, 18, **meta, requires_grad=True)
    log_lam = torch.zeros(2, 18, device="meta")  # a buffer, as VORT's: the chunk-parallel backward
    g0, b0 = torch.zeros(1, 2, 18, 64, 64, device="meta"), torch.zeros(1, 2, 18, 64, device="meta")
    with capture_launches(90) as made:
        o, z, _g, _b = SoeScanTriton.apply(q, k, v, coef, log_lam, g0, b0, 16, None)
        forward = len(made)
        torch.autograd.backward((o, z), (torch.zeros_like(o), torch.zeros_like(z)))
    walks = [launch.constexprs["BORDERS"] for launch, _args in made if launch.kernel.__name__ == "chunk_states_kernel"]
    phases = sum(walks)  # the forward's walks, one a phase, store the span borders; the backward's do not
    assert phases == (1 if not phased else forward // 2) and phases > (1 if phased else 0)
    assert walks.count(False) == phases - 1


@pytest.mark.parametrize("with_reset", [False, True])
def test_soe_chunk_kernels_read_document_numbers_only_with_resets(with_reset):
    """A scan without document starts runs the chunk-parallel kernels without RESETS (they read no document
    numbers, and no [B, T] zeros are made for them); with starts, with (the values of both paths are checked
    against the reference by the tests above, which run with and without resets)."""
    from kernels._common import capture_launches
    from kernels.soe.gpu.function import SoeScanTriton

    meta = {"device": "meta", "dtype": torch.bfloat16, "requires_grad": True}
    q, k, v = (torch.zeros(1, 1024, 2, 64, **meta) for _ in range(3))
    coef = torch.zeros(1, 1024, 2, 18, **meta)
    log_lam = torch.zeros(2, 18, device="meta")
    g0, b0 = torch.zeros(1, 2, 18, 64, 64, device="meta"), torch.zeros(1, 2, 18, 64, device="meta")
    reset = torch.zeros(1, 1024, dtype=torch.bool, device="meta") if with_reset else None
    with capture_launches(90) as made:
        o, z, _g, _b = SoeScanTriton.apply(q, k, v, coef, log_lam, g0, b0, 16, reset)
        torch.autograd.backward((o, z), (torch.zeros_like(o), torch.zeros_like(z)))
    chunked = [(launch, args) for launch, args in made if launch.kernel.__name__.startswith("chunk_")]
    assert len(chunked) >= 6 and {launch.constexprs["RESETS"] for launch, _args in chunked} == {with_reset}
    docs = {args[launch.kernel.arg_names.index("docs")].numel() for launch, args in chunked}
    assert docs == ({1024} if with_reset else {0})


@pytest.mark.parametrize(("target", "spans"), [(1, 1), (4, 5)])
def test_phasor_triton_spans_match_reference(monkeypatch, target, spans):
    """The phasor scan in one span and in five (two chunks each, the last one 6 tokens), with an initial
    state: reads, final phases, and the gradients of the increments and of the initial state."""
    import kernels.span
    from kernels.phasor.triton import phasor_launches

    monkeypatch.setattr(kernels.span, "TARGET_PROGRAMS", target)
    inputs, n_slots = phasor_inputs(1, 150, 3, 5, 2, True, seed=11)
    span, launches = phasor_launches(1, 150, 3, 5, n_slots, torch.float32, 80)
    assert launches["fwd"].grid[2] == spans == math.ceil(150 / span)
    _check_phasor(inputs, n_slots)


# Document starts in two rows of 70 tokens (chunks of 16): row 0 at the first token, inside chunks, on chunk
# and span edges (16, 32, 64), back to back and on the last token; row 1 in chunks 0 and 3 only, so chunks
# (and spans) without a reset lie between ones with a reset.
RESET_ROWS = [[0, 5, 16, 17, 32, 33, 34, 64, 69], [15, 48]]


@pytest.mark.parametrize(("chunk_size", "dim_v", "per_span"), [(16, 5, 2), (16, 5, 1), (16, 20, 3)])
def test_soe_triton_resets_match_reference(monkeypatch, chunk_size, dim_v, per_span):
    """Resets in the Triton SOE scan inside chunks, on chunk borders and on span borders (spans of two
    chunks of 16: borders at 32 and 64; spans of one chunk; spans of three with several value blocks), an
    initial state and a fast-decaying term: outputs, final state and every gradient."""
    _spans_of(monkeypatch, 2, 70, 1, chunk_size, per_span, 2, 4, dim_v)
    inputs = soe_inputs(2, 70, 1, 4, dim_v, 2, True, seed=9)
    inputs["log_lam"] = torch.tensor([[-0.01, -3.0]], dtype=torch.float64)
    inputs["reset"] = resets(70, RESET_ROWS)
    _check_soe(inputs, chunk_size)


def test_soe_triton_forward_chunks_of_64_match_reference(monkeypatch):
    """Spans sized for 5 chunks of 16 are rounded down to 4, so the forward reads chunks of 64 tokens (150
    tokens: two whole and one of 22) and stores the backward's span states at their borders; with resets
    inside those chunks, on their borders and on the last token, an initial state and a fast term."""
    import kernels.soe.gpu.launches as launches

    monkeypatch.setattr(launches, "MIN_PROGRAMS", 2 * 1 * 1 * 2)
    assert launches.span_size(2, 150, 1, 16, 1) == 5
    assert launches.walk_span(2, 150, 1, 2, 4, 5, 16, 80) == 4
    assert launches.soe_launches(2, 150, 1, 2, 4, 5, 16, torch.float32, 80)[1]["fwd"].constexprs["BT"] == 64
    inputs = soe_inputs(2, 150, 1, 4, 5, 2, True, seed=11)
    inputs["log_lam"] = torch.tensor([[-0.01, -3.0]], dtype=torch.float64)
    inputs["reset"] = resets(150, [[0, 5, 63, 64, 65, 127, 128, 149], [40, 100]])
    _check_soe(inputs, 16)


def test_soe_triton_runs_are_bitwise_equal(monkeypatch):
    """Two runs of the Triton SOE scan (resets, an initial state, several spans and value and feature
    blocks, so the coefficient gradient's shares and the decay gradient's partials are summed) give
    bitwise-equal outputs and gradients."""
    _spans_of(monkeypatch, 2, 70, 2, 16, 2, 3, 12, 20)
    inputs = soe_inputs(2, 70, 2, 12, 20, 3, True, seed=4)
    inputs["reset"] = resets(70, RESET_ROWS)
    first, second = (soe_run(inputs, "triton", device=DEVICE, chunk_size=16) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first[0], second[0], strict=True))
    assert first[1].keys() == second[1].keys()
    assert all(torch.equal(first[1][n], second[1][n]) for n in first[1])


def test_scan_kernels_have_no_atomics():
    """No Triton source of the scans (the SOE chunk kernels, the phasor kernels, the shared sequence
    pass) calls an atomic (tl.atomic_add, tl.atomic_cas, ...): every reduction is a fixed-order sum of
    partials."""
    import re
    from pathlib import Path

    import kernels

    root = Path(kernels.__file__).parent
    sources = [*sorted((root / "soe").rglob("*.py")), *sorted((root / "phasor").rglob("*.py")), root / "span.py"]
    assert any(p.parent.name == "gpu" for p in sources)
    for path in sources:
        assert not re.search(r"atomic_\w+\s*\(", path.read_text()), path


def test_soe_grids_fit_at_a_million_tokens():
    """At 1M tokens per rank and the vort-125m sizes (12 heads, 18 terms, 64-wide features and values,
    chunk 64), every SOE launch keeps grid axes 1 and 2 within 65,535 (the long axis is axis 0), the chunk
    walk's grid does not grow with the length (the chunks it walks do), and the chunk-parallel launches
    run a phase of chunks x heads whose per-chunk states stay within READS_BYTES."""
    from kernels.soe.gpu.launches import SHARES_BYTES, walk_span
    from kernels.soe.triton import entering_launches, soe_launches

    for capability in (80, 90):
        chunk, launches = soe_launches(1, 1 << 20, 12, 18, 64, 64, 64, torch.bfloat16, capability)
        short = soe_launches(1, 1 << 16, 12, 18, 64, 64, 64, torch.bfloat16, capability)[1]
        assert launches["fwd_states"].grid == short["fwd_states"].grid  # the chunk walk's grid: heads x terms
        # the chunk-parallel launches run a phase of chunks at a time, their states within READS_BYTES
        from kernels.soe.gpu.launches import READS_BYTES

        phase = launches["fwd"].grid[0] // 12
        assert phase * 12 == launches["fwd"].grid[0] and phase < (1 << 20) // 64
        assert phase * 12 * 18 * 64 * 65 * 2 <= READS_BYTES
        # the key and value walks and the coefficient kernel run phases of spans whose shares stay within 1 GiB
        values = 64 // launches["bwd_values"].constexprs["BD"]
        phase = launches["bwd_values"].grid[0] // (12 * values)  # spans whose shares are made at once
        span_tokens = walk_span(1, 1 << 20, 12, 18, 64, 64, chunk, capability) * chunk
        assert 0 < (values + 1) * phase * span_tokens * 12 * 18 * 4 <= SHARES_BYTES
        launches |= {f"entering_{n}": x for n, x in entering_launches(1, 1 << 20, 12, 18, 64, 64, torch.bfloat16,
                                                                        capability).items()}  # fmt: skip
        for launch in launches.values():
            assert max(launch.grid[1:], default=1) <= 65_535 and launch.grid[0] < 2**31
        assert launches["bwd_coef"].grid[0] < (1 << 20) // chunk * 12


@pytest.mark.parametrize(("target", "spans"), [(1, 1), (264, 5)])
def test_phasor_triton_resets_match_reference(monkeypatch, target, spans):
    """Resets in the Triton phasor scan as one span and as one chunk per span, with an initial state (a
    reset restarts from it): reads, final phases and both gradients."""
    import kernels.span
    from kernels.phasor.triton import phasor_launches

    monkeypatch.setattr(kernels.span, "TARGET_PROGRAMS", target)
    inputs, n_slots = phasor_inputs(2, 70, 3, 5, 2, True, seed=13)
    span, launches = phasor_launches(2, 70, 3, 5, n_slots, torch.float32, 80)
    assert launches["fwd"].grid[2] == spans == math.ceil(70 / span)
    inputs["reset"] = resets(70, RESET_ROWS)
    _check_phasor(inputs, n_slots)


@pytest.mark.parametrize(("slot_block", "levels", "branching"), [(16, 4, 3), (None, 5, 4)])
def test_phasor_triton_slot_blocks_match_reference(monkeypatch, slot_block, levels, branching):
    """A tree wider than one slot block, with resets, an initial state and several spans: 40 slots in
    blocks of 16 (three blocks, the last one part full; levels 0-2 in the first block only, level 3
    across all three) and the 341 slots of depth 4 in the shipped blocks (128: three blocks). Reads,
    final phases and both gradients; each entry's read and gradient come from the one program whose
    block holds its slot."""
    import kernels.phasor.triton as phasor_triton
    import kernels.span

    if slot_block is None:
        slot_block = phasor_triton._TABLE[False][2]
    else:
        monkeypatch.setattr(phasor_triton, "_TABLE", {wide: (16, 16, slot_block, 8, 2) for wide in (False, True)})
    n_blocks = math.ceil(sum(branching**i for i in range(levels)) / slot_block)
    monkeypatch.setattr(kernels.span, "TARGET_PROGRAMS", 2 * 3 * n_blocks)  # 3 spans of each row
    inputs, n_slots = phasor_inputs(2, 70, levels, 5, branching, True, seed=17)
    span, launches = phasor_triton.phasor_launches(2, 70, levels, 5, n_slots, torch.float32, 80)
    assert launches["fwd"].grid[1] == math.ceil(n_slots / slot_block) >= 2
    assert launches["fwd"].constexprs["BN"] == slot_block
    assert launches["fwd"].grid[2] == math.ceil(70 / span) > 1
    inputs["reset"] = resets(70, RESET_ROWS)
    _check_phasor(inputs, n_slots)


@pytest.mark.slow
def test_phasor_triton_depth5_tree_matches_reference():
    """pmnet-119m-copy's tree as the scan sees it on the path: 6 levels, 1,365 slots in 11 blocks of
    128, 64 phase columns (4 column blocks), resets and an initial state (about 20 s interpreted)."""
    inputs, n_slots = phasor_inputs(1, 48, 6, 64, 4, True, seed=5)
    inputs["reset"] = resets(48, [[0, 20, 33]])
    assert n_slots == 1365
    _check_phasor(inputs, n_slots)


def test_h100_spans_fill_whole_waves():
    """On an H100 the SOE walks' span count is chosen for whole waves of one program per SM: at batch 1
    and 12 heads (vort-125m) every walk then launches a multiple of 132 programs (11 spans, where the
    fewest that fill the GPU, 3, leave the value walks' second wave a tenth full), and the walking time
    (waves x chunks per span, summed over the walks) is below the fewest spans'. The A100's tiles keep
    the fewest spans, no longer than a phase of the chunk kernels."""
    from kernels.soe.gpu import launches

    walks = (4, 4, 8, 9)  # the backward's walks: state and value gradients, queries, keys

    def walking(n_chunks: int, chunks: int) -> int:
        spans = math.ceil(n_chunks / chunks)
        return sum(math.ceil(12 * spans * w / 132) for w in walks) * chunks

    for seq_len in (16_384, 65_536):
        n_chunks = seq_len // 16
        span = launches.walk_span(1, seq_len, 12, 18, 64, 64, 16, 90)
        fewest = launches.span_size(1, seq_len, 12, 16, 4)
        assert math.ceil(n_chunks / span) == 11
        assert all(12 * 11 * w % 132 == 0 for w in walks)
        assert walking(n_chunks, span) < walking(n_chunks, fewest)
        # the A100 keeps the fewest spans, at most a phase of the chunk kernels long (whole 64-token chunks)
        phase = launches.READS_BYTES // (12 * 18 * 64 * 65 * 2) * 4
        assert launches.walk_span(1, seq_len, 12, 18, 64, 64, 16, 80) == min(launches.span_size(1, seq_len, 12, 16, 8),
                                                                               phase) // 4 * 4  # fmt: skip


def test_span_sizes_fill_the_gpu():
    """Spans give the per-span kernels TARGET_PROGRAMS programs when the sequence has enough chunks (one
    chunk per span otherwise), and the span pass launches MIN_PROGRAMS programs for states of 264
    elements or more (the tiny configs' states hold 1,088-11,968)."""
    from kernels.span import MIN_PROGRAMS, TARGET_PROGRAMS, span_chunks, span_pass_launch

    for seq_len, chunk, per_span in [(65_536, 16, 4), (65_536, 32, 216), (65_536, 16, 300), (100, 16, 4)]:
        chunks = span_chunks(seq_len, chunk, per_span)
        n_spans = math.ceil(seq_len / (chunks * chunk))
        if math.ceil(seq_len / chunk) >= TARGET_PROGRAMS / per_span:
            assert n_spans * per_span >= TARGET_PROGRAMS
        else:
            assert chunks == 1
    for n in (264, 1_088, 1_360, 11_968, 10**6):
        launch = span_pass_launch(n, reverse=False, decay=True, wrap=False)
        assert launch.programs >= MIN_PROGRAMS and launch.programs * launch.constexprs["BLOCK"] >= n


def _soe_in_pieces(inputs, bounds):
    x = {n: t.float().to(DEVICE).requires_grad_() for n, t in inputs.items()}
    state, outs = (x["g0"], x["b0"]), []
    for lo, hi in itertools.pairwise(bounds):
        piece = [x[n][:, lo:hi] for n in ("q", "k", "v", "coef")]
        o, z, state = soe_scan(*piece, x["log_lam"], state, True, 16, "triton")
        outs.append(o * z[..., None])
    out = torch.cat(outs, 1)
    gen = torch.Generator().manual_seed(0)
    ((out * torch.randn(out.shape, generator=gen).to(DEVICE)).sum() + state[0].sum() + state[1].sum()).backward()
    return [out.detach(), state[0].detach(), state[1].detach()], {n: t.grad for n, t in x.items()}


def test_soe_triton_carried_state_equals_one_pass():
    inputs = soe_inputs(1, 50, 1, 4, 4, 2, True, seed=1)
    whole, whole_grads = _soe_in_pieces(inputs, [0, 50])
    split, split_grads = _soe_in_pieces(inputs, [0, 19, 50])
    for a, b in zip(split, whole):
        assert rel_err(a, b) <= FWD_TOL
    for name in whole_grads:
        assert rel_err(split_grads[name], whole_grads[name]) <= GRAD_TOL, name


def test_phasor_triton_carried_state_equals_one_pass():
    inputs, n_slots = phasor_inputs(1, 40, 2, 3, 2, True, seed=3)
    results = []
    for bounds in ([0, 40], [0, 13, 40]):
        delta = inputs["delta"].float().to(DEVICE).requires_grad_()
        state = init = inputs["init"].float().to(DEVICE).requires_grad_()
        reads = []
        for lo, hi in itertools.pairwise(bounds):
            read, state = phasor_scan(
                delta[:, lo:hi], inputs["slots"][:, lo:hi].to(DEVICE), n_slots, state, True, "triton"
            )
            reads.append(read)
        read = torch.cat(reads, 1)
        gen = torch.Generator().manual_seed(0)
        ((read * torch.randn(read.shape, generator=gen).to(DEVICE)).sum() + 2 * state.sum()).backward()
        results.append((read.detach(), state.detach(), delta.grad, init.grad))
    (r1, f1, gd1, gi1), (r2, f2, gd2, gi2) = results
    assert angle_err(r1, r2) <= 1e-5 and angle_err(f1, f2) <= 1e-5
    assert rel_err(gd2, gd1) <= GRAD_TOL and rel_err(gi2, gi1) <= GRAD_TOL


@pytest.mark.parametrize(
    ("batch", "seq_len", "levels", "width", "branching", "with_state"),
    [(1, 1, 1, 1, 1, False), (2, 50, 3, 5, 3, True), (1, 70, 2, 20, 4, False), (1, 40, 4, 3, 2, True)],
)
def test_phasor_triton_matches_reference(batch, seq_len, levels, width, branching, with_state):
    inputs, n_slots = phasor_inputs(batch, seq_len, levels, width, branching, with_state, seed=seq_len)
    read = _check_phasor(inputs, n_slots)
    assert read.min() >= 0 and read.max() < 2 * math.pi


@triton.jit
def _split_tf32(x, out, N: tl.constexpr):
    """Stores the three tf32 pieces of N fp32 values."""
    offs = tl.arange(0, N)
    hi, mid, lo = _tf32_pieces(tl.load(x + offs))
    tl.store(out + offs, hi)
    tl.store(out + N + offs, mid)
    tl.store(out + 2 * N + offs, lo)


def test_phasor_tf32_pieces_are_exact():
    """The phasor kernels' tensor-core split of fp32 values (kernels.phasor.triton._tf32_pieces), run by
    the interpreter: three pieces whose low 13 mantissa bits are zero (so a tf32 tensor core reads them
    unrounded) and whose sum is the value exactly, over signs, zero and a wide range of exponents."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=gen) * torch.logspace(-20, 20, 1024)
    x[:3] = torch.tensor([0.0, 2 * math.pi, -math.pi])
    pieces = torch.empty(3, x.numel())
    _split_tf32[(1,)](x, pieces, x.numel())
    assert torch.all(pieces.view(torch.int32) & 0x1FFF == 0)
    assert torch.equal(pieces.double().sum(0), x.double())
    assert torch.all(pieces[1].abs() <= x.abs() * 2.0**-10) and torch.all(pieces[2].abs() <= x.abs() * 2.0**-21)


@triton.jit
def _wrapped(x, out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out + offs, wrap_phase(tl.load(x + offs)))


def test_wrap_phase_subtracts_two_pi_without_bias():
    """A phase one turn past 2*pi (what the phasor kernels wrap after each chunk). Subtracting 2*pi
    rounded to fp32 alone takes 1.75e-7 rad too much at every turn, which a phase that keeps rotating
    adds up. wrap_phase's second part puts most of it back: what remains is where the fp32 result cannot
    hold the correction (below half an ulp, phases above 4 rad), about 5e-8 rad per turn on average."""
    gen = torch.Generator().manual_seed(0)
    x = (2 * math.pi + torch.rand(1 << 14, generator=gen, dtype=torch.float64) * 2 * math.pi).float()
    y = torch.empty_like(x)
    _wrapped[(1,)](x, y, x.numel())
    exact = torch.remainder(x.double(), 2 * math.pi)
    assert y.min() >= 0 and y.max() < 2 * math.pi
    err = y.double() - exact
    assert err.abs().max() <= 2.0**-21  # half an ulp of values below 2*pi, plus the correction lost
    assert abs(err.mean().item()) < 8e-8, err.mean().item()  # a constant 2*pi in fp32 gives -1.75e-7


def test_phasor_triton_final_state_gradient_only():
    inputs, n_slots = phasor_inputs(1, 30, 2, 3, 2, True, seed=0)
    delta = inputs["delta"].float().to(DEVICE).requires_grad_()
    _, final = phasor_scan(delta, inputs["slots"].to(DEVICE), n_slots, None, True, backend="triton")
    final.sum().backward()
    assert torch.equal(delta.grad.cpu(), torch.ones_like(delta.grad.cpu()))


def test_triton_rejects_float64():
    inputs = soe_inputs(1, 4, 1, 2, 2, 1, False, seed=0)
    with pytest.raises(ValueError, match="float64"):
        soe_scan(*(t.to(DEVICE) for t in inputs.values()), backend="triton")


def test_gpu_script_check_runs_under_the_interpreter():
    """The GPU script's correctness step (resets, initial states, the entering read), at small fp32 tiles,
    on whatever device is here."""
    from benchmarks.gpu_checks import check_production

    tiles = {"heads": 1, "terms": 2, "feat": 16, "width": 16}
    results = check_production(DEVICE, seq_len=40, tiles=tiles, dtypes=(torch.float32,))
    assert [(r["case"], r["dtype"]) for r in results] == [
        ("soe", "float32"),
        ("phasor", "float32"),
        ("soe_entering", "float32"),
        ("features", "float32"),
        ("rms_norm", "float32"),
        ("swiglu", "float32"),
        ("order", "float32"),
    ]
    assert all(r["passed"] for r in results), results


def test_gpu_script_timing_row_runs_under_the_interpreter():
    from benchmarks.gpu_kernels import COLUMNS, parse_args, time_row

    calls = []

    def count(fn):
        fn()
        calls.append(1)
        return 1.0

    args = parse_args(["--H", "1", "--F", "16", "--D", "16", "--S", "2"])
    row = time_row(args, 32, DEVICE, torch.float32, count)
    assert set(row) == {"T", *COLUMNS}
    timed = [c for c in COLUMNS if not math.isnan(row[c])]
    assert len(calls) == len(timed)
    assert set(COLUMNS) - set(timed) <= {"fla_fwd", "fla_fwdbwd"}  # fla is optional


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is only right on a GPU")
def test_soe_triton_bf16_on_cuda():
    inputs = soe_inputs(2, 300, 2, 32, 32, 8, True, seed=3)
    _check_soe(inputs, 64, fwd_tol=3e-2, grad_tol=6e-2, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("seq_len", "width", "log_lam"),
    [
        (150, 7, [[-0.02, -0.3, -2.0], [0.0, -0.05, -45.0]]),  # three chunks of 64; a term flushed to 0 at once
        (33, 70, [[-0.01, -0.1, -1.0], [-0.2, -0.002, -5.0]]),  # two value blocks in the forward
    ],
)
def test_soe_entering_read_triton_matches_the_torch_form(seq_len, width, log_lam):
    """The Triton entering-state read of sequence parallelism against kernels.parallel's PyTorch form:
    outputs and the gradients of q, log_lam and the entering state; a second run is bitwise equal."""
    from kernels.parallel import _SoeStateCorrection
    from kernels.soe.triton import SoeEnteringTriton

    gen = torch.Generator().manual_seed(seq_len)
    B, H, S, F = 2, 2, 3, 5
    q = torch.randn(B, seq_len, H, F, generator=gen)
    g_in, b_in = torch.randn(B, H, S, F, width, generator=gen), torch.randn(B, H, S, F, generator=gen)
    ll = torch.tensor(log_lam)
    w_o, w_z = torch.randn(B, seq_len, H, width, generator=gen), torch.randn(B, seq_len, H, generator=gen)
    results = []
    for form, dev in (
        (lambda *x: SoeEnteringTriton.apply(*x), DEVICE),
        (lambda *x: _SoeStateCorrection.apply(*x, 16), "cpu"),
    ):
        inputs = [x.to(dev).requires_grad_() for x in (q, ll, g_in, b_in)]
        o, z = form(*inputs)
        loss = (o * w_o.to(dev)).sum() + (z * w_z.to(dev)).sum()
        results.append([o, z, *torch.autograd.grad(loss, inputs)])
    inputs = [x.to(DEVICE).requires_grad_() for x in (q, ll, g_in, b_in)]
    o, z = SoeEnteringTriton.apply(*inputs)
    loss = (o * w_o.to(DEVICE)).sum() + (z * w_z.to(DEVICE)).sum()
    again = [o, z, *torch.autograd.grad(loss, inputs)]
    assert all(torch.equal(a, b) for a, b in zip(again, results[0], strict=True))  # bitwise repeatable
    for name, got, want in zip(("o", "z", "dq", "dlog_lam", "dg", "db"), *results, strict=True):
        tol = GRAD_TOL if name.startswith("d") else FWD_TOL
        assert rel_err(got.cpu(), want) <= tol, (name, rel_err(got.cpu(), want))


def test_sequence_parallel_soe_on_one_rank_uses_the_triton_read(tmp_path):
    """One gloo rank with an initial state: the Triton backend's scan plus its entering-state read equal
    the reference scan from that state, outputs, final state and gradients."""
    import torch.distributed as dist

    from kernels import soe_scan_sequence_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        inputs = soe_inputs(1, 40, 2, 4, 5, 2, True, seed=5)
        results = []
        for backend in ("triton", "reference"):
            x = {n: t.float().to(DEVICE).requires_grad_() for n, t in inputs.items()}
            piece = [x[n] for n in ("q", "k", "v", "coef", "log_lam")]
            if backend == "triton":
                o, z, (g, b) = soe_scan_sequence_parallel(*piece, None, (x["g0"], x["b0"]), True, 16, backend)
            else:
                o, z, (g, b) = soe_scan(*piece, (x["g0"], x["b0"]), True, 16, backend)
            gen = torch.Generator().manual_seed(0)
            loss = sum((t * torch.randn(t.shape, generator=gen).to(DEVICE)).sum() for t in (o, z, g, b))
            results.append([o, z, g, b, *torch.autograd.grad(loss, list(x.values()))])
    finally:
        dist.destroy_process_group()
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        assert rel_err(got, want) <= (FWD_TOL if i < 4 else GRAD_TOL), i
