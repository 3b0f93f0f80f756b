"""Launch records of the SOE span kernels: block sizes per GPU target, grids, argument types.

The autograd Functions (kernels/soe/gpu/function.py) launch exactly these, and the compile gate
(benchmarks/kernel_compile.py) compiles them ahead of time: one description of what runs.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from kernels._common import Launch, triton_type
from kernels.soe import FAST_REACH
from kernels.soe.gpu.backward import (
    coef_grads_kernel,
    key_grads_kernel,
    query_grads_kernel,
    state_grads_kernel,
    value_grads_kernel,
)
from kernels.soe.gpu.chunk_grads import (
    chunk_key_value_grads_kernel,
    chunk_query_grads_kernel,
    chunk_state_grads_kernel,
)
from kernels.soe.gpu.forward import chunk_output_kernel, chunk_states_kernel
from kernels.span import MIN_PROGRAMS, TARGET_PROGRAMS, span_pass_launch


def precision(dtype: torch.dtype) -> str:
    """tl.dot precision: full IEEE fp32 for fp32 inputs (TF32 would cost ~1e-3 relative error); 16-bit
    operands go to the tensor cores as they are, with fp32 accumulation (the fp32 products of the decay
    table with the coefficients run as tf32 there)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclasses.dataclass(frozen=True)
class Shape:
    """How one chunk kernel launches: warps, software-pipelining stages and ptxas's register cap per
    thread (None: no cap)."""

    warps: int
    stages: int = 1
    registers: int | None = None


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One target's tiling.

    The span walks (decays with a gradient): the largest chunk of the backward's walks, the state's column
    block (value columns for the state- and value-gradient walks, feature columns for the query and key
    walks), their warps and stages, and the warps of the chunk-parallel coefficient kernel.

    The chunk kernels (VORT's decays, which need no gradient), each its own Shape: the three state walks
    (the forward's and its rerun in the backward without the span borders in ``states_walk``, the
    state-gradient walk in ``grads_walk``) when their programs hold the whole state and number at most
    TARGET_PROGRAMS (two an H100 SM), all three in ``crowded_walk`` when there are more (the state-gradient
    walk of a scan without document starts in ``crowded_grads_walk``), in ``split_walk`` when they hold a
    block of the state (`walk_shape`); the outputs, and the chunk-parallel dq, dk, dv and dcoef
    (``key_value_grads``: the gradients each launch makes and its Shape with and without document starts; on
    sm_90 dcoef takes 128 registers without them, 0.26 against 0.33 ms a vort-125m layer, and 168 with them,
    where 128 spilled 16 bytes at vort-350m; dk and dv in one
    launch, which reads the state gradients and makes the pairs' common factors once for both: 0.38 ms a
    vort-125m layer at 16,384 tokens against 0.25 + 0.25; dcoef with them took 0.88; on sm_80 a launch each,
    which spilled 16-144 bytes in one or two). ``norms_by_product``: whether
    the two walks add the normalisers (and their gradient) by a product with ones (with dz) on the tensor
    cores rather than a sum across the threads (on sm_80 the forward walk spilled 120 bytes at 128
    registers).

    On sm_90 each Shape is the fastest that spills nothing on the compile gate, as the launch model of
    benchmarks.predict prices them (`python -m benchmarks.predict.shapes`, docs/kernels.md). The walks are
    latency-bound: a program's time is its walk, so what matters is that they all run in one wave. Up to
    two an SM, the forward's walk spreads a chunk's work over 16 warps in 64 registers (vort-125m's 216
    walks: 0.43 ms at 16,384 tokens, 0.61 at 8 warps in 80 registers) and the state-gradient walk over 16
    warps, 2 stages in 64 (0.49 against 0.61 ms at 8 warps, 2 stages in 128); more walks than that take
    8 warps in 80 registers, three an SM, one wave for vort-350m's 288 (its forward walk 0.40 against 0.53
    ms at 65,536 tokens, where 16 warps take a second wave for the last 24; its state-gradient walk 0.50
    ms, and 0.41 with 2 stages, which spilled 32 bytes at 80 registers; without document numbers to read
    it fits 2 stages in 80, and spilled 48 bytes at 1). Since the fast terms' walks run in pieces
    (`fast_pieces`), vort-350m's slow walks fit two an SM at batch 1; the crowded shapes serve runs whose
    slow walks alone exceed TARGET_PROGRAMS (a batch of several sequences). The chunk-parallel kernels run 4
    warps, capped where that keeps three or four programs an SM."""

    chunk: int
    block: int
    feature_block: int
    warps: int
    stages: int
    coef_warps: int
    states_walk: Shape
    grads_walk: Shape
    crowded_walk: Shape
    crowded_grads_walk: Shape
    outputs: Shape
    query_grads: Shape
    key_value_grads: tuple[tuple[tuple[str, ...], Shape, Shape], ...]
    split_walk: Shape
    norms_by_product: bool = False


# Per target (sm_90 or newer). The compile gate (benchmarks.kernel_compile) checks every shipped config
# against these; docs/kernels.md has the sizes tried and why these.
_SM80_GRADS = Shape(8, 1)
TILES = {False: Tiles(chunk=16, block=8, feature_block=8, warps=8, stages=1, coef_warps=4,
                      states_walk=Shape(8, 1, 128), grads_walk=Shape(8, 1, 128), crowded_walk=Shape(8, 1, 128),
                      crowded_grads_walk=Shape(8, 1, 128),
                      outputs=Shape(4, 2), query_grads=_SM80_GRADS,
                      key_value_grads=tuple(((p,), _SM80_GRADS, _SM80_GRADS) for p in ("KEYS", "VALUES", "COEFS")),
                      split_walk=Shape(8, 1, 128)),
         True: Tiles(chunk=16, block=16, feature_block=8, warps=8, stages=1, coef_warps=4,
                     states_walk=Shape(16, 1, 64), grads_walk=Shape(16, 2, 64), crowded_walk=Shape(8, 1, 80),
                     crowded_grads_walk=Shape(8, 2, 80),
                     outputs=Shape(4, 2), query_grads=Shape(4, 2, 168),
                     key_value_grads=((("KEYS", "VALUES"), Shape(4, 2), Shape(4, 2)),
                                      (("COEFS",), Shape(4, 2, 168), Shape(4, 2, 128))),
                     split_walk=Shape(8, 1, 128),
                     norms_by_product=True)}  # fmt: skip
INTS = ("seq_len", "BH", "H", "S", "F", "DV", "W", "SPAN")
FORWARD_CHUNKS = (64, 32, 16)  # the forward's chunk: the largest of these that divides the backward's span

SHARES_BYTES = 2**30  # the most the coefficient gradient's fp32 shares of one phase of the backward take
READS_BYTES = 2**29  # the most one phase's per-chunk states (or state gradients) take
# The most per-chunk states of a whole sequence run as one phase (the forward keeps its last phase's for
# the backward, so these are then all of them): 1.25 GiB keeps vort-350m's at 32,768 tokens (1.23 GB a
# layer, the 256k recipe's per-rank length) but not vort-125m's at 65,536 (1.84 GB), which would take
# one call past issue 46's 40 kB per token and layer.
KEPT_BYTES = 5 * 2**28


def chunk_block(chunk_size: int, capability: int) -> int:
    """The chunk the kernels use for a requested ``chunk_size``: a power of two, at least 16 (tl.dot's
    minimum), at most the target's chunk. It changes how work is split, not the result."""
    return min(TILES[capability >= 90].chunk, max(16, triton.next_power_of_2(chunk_size)))


def term_groups(n_terms: int) -> tuple[int, int, bool, int]:
    """(GA, GB, HAS_B, GN): the S terms as two power-of-two groups GA >= GB (the second padded to a power
    of two, absent when S is one), and the normalisers' padded width GN >= 16 (tl.dot's minimum)."""
    first = 1 << (n_terms.bit_length() - 1)
    rest = n_terms - first
    second = triton.next_power_of_2(rest) if rest else 1
    return first, second, rest > 0, max(16, triton.next_power_of_2(n_terms))


def span_size(batch: int, seq_len: int, heads: int, chunk: int, blocks: int) -> int:
    """Chunks per span: the fewest spans that give the smallest walks (``blocks`` column programs per
    span x batch x head) MIN_PROGRAMS programs, so every walk fills an H100 (one span when the batch
    does). Every span adds a state slot that the passes read and write, so no more spans than that."""
    n_chunks = triton.cdiv(seq_len, chunk)
    return triton.cdiv(n_chunks, min(n_chunks, triton.cdiv(MIN_PROGRAMS, batch * heads * blocks)))


def feature_block(n_terms: int, feat: int, capability: int) -> int:
    """The feature walks' column block: the target's, widened so that the smaller term group's state rows
    (terms x block) reach 16, tl.dot's minimum, and at most the padded feature width."""
    ga, gb, has_b, _gn = term_groups(n_terms)
    smallest = gb if has_b else ga
    return min(max(16, triton.next_power_of_2(feat)), max(TILES[capability >= 90].feature_block, 16 // smallest))


def walk_span(batch: int, seq_len: int, heads: int, n_terms: int, feat: int, width: int, chunk: int,
              capability: int) -> int:  # fmt: skip
    """``span_size`` of a scan of these sizes on a GPU of compute capability ``capability``: its smallest
    walks are the value-block ones or the feature-block ones, whichever have fewer blocks; no longer than
    a phase of the chunk kernels may be (READS_BYTES of per-chunk states), in whole 64-token chunks. On
    an H100 (sm_90) the span count is then chosen for whole waves (`wave_spans`)."""
    values = triton.cdiv(width, TILES[capability >= 90].block)
    features = triton.cdiv(feat, feature_block(n_terms, feat, capability))
    n_chunks = triton.cdiv(seq_len, chunk)
    per = max(1, FORWARD_CHUNKS[0] // chunk)
    # a span's per-chunk states within READS_BYTES in bf16 (the runs' operands; fp32 ones take twice that):
    # the chunk kernels' phases are whole spans
    most = max(1, READS_BYTES // (batch * heads * n_terms * feat * (width + 1) * 2)) * per
    span = min(span_size(batch, seq_len, heads, chunk, min(values, features)), most)
    span = whole_forward_chunks(span, chunk, n_chunks)
    if capability >= 90:
        walks = (values, values, features, features + 1)  # programs per span, batch and head
        span = wave_spans(batch * heads, n_chunks, span, walks, per)
    return span


def whole_forward_chunks(span: int, chunk: int, n_chunks: int) -> int:
    """``span`` rounded down to whole chunks of the forward's largest chunk (FORWARD_CHUNKS[0] tokens), so
    that the forward reads 64-token chunks and stores the backward's span states on its way (down: more
    spans, so the walks keep their programs); a span shorter than one such chunk, or covering the
    sequence, stays as it is."""
    per = max(1, FORWARD_CHUNKS[0] // chunk)
    return span if span >= n_chunks or span < per else span // per * per


def state_blocks(rows: int, feat: int, width: int) -> tuple[int, int]:
    """(BF, BD): the state block of the chunk state walks' programs for ``rows`` = batch x heads x terms and
    padded state sides ``feat`` x ``width``: the whole state, halved (values first) down to 16 x 16 until
    the walk has MIN_PROGRAMS programs (exp's one term per head needs 16 blocks of 16 x 16 at 12 heads)."""
    bf, bd = feat, width
    while rows * (feat // bf) * (width // bd) < MIN_PROGRAMS and max(bf, bd) > 16:
        if bd >= bf:
            bd //= 2
        else:
            bf //= 2
    return bf, bd


def chunk_phase(rows: int, width: int, itemsize: int, stride: int, n_chunks: int) -> int:
    """Chunks per phase of the chunk-parallel kernels: the whole sequence when its states, one [rows, width]
    slot of ``itemsize`` bytes per chunk, stay within KEPT_BYTES (the forward then keeps them all for the
    backward); else whole spans (``stride`` chunks each) whose states stay within READS_BYTES (at least
    one span), the spans shared out evenly over the fewest phases (so that no last phase of a chunk or
    two leaves the GPU idle; the one phase with fewer spans runs first, function._phases). One phase up to
    32,768 tokens at vort-125m and vort-350m; 4 and 6 at 65,536."""
    if n_chunks * rows * width * itemsize <= KEPT_BYTES:
        return n_chunks
    most = max(1, READS_BYTES // (stride * rows * width * itemsize))  # spans per phase at most
    n_spans = triton.cdiv(n_chunks, stride)
    return min(triton.cdiv(n_spans, triton.cdiv(n_spans, most)) * stride, n_chunks)


def forward_chunk(span: int, chunk: int, n_chunks: int) -> int:
    """The forward's chunk in tokens for backward spans of ``span`` of the ``n_chunks`` chunks of ``chunk``
    tokens: the largest of FORWARD_CHUNKS dividing the span's tokens (16 always does), so the span borders
    are chunk borders; the largest when one span covers the sequence."""
    return next(c for c in FORWARD_CHUNKS if (span * chunk) % c == 0 or span >= n_chunks)


def wave_spans(rows: int, n_chunks: int, span: int, walks: tuple[int, ...], step: int = 1) -> int:
    """Chunks per span for walks of ``walks`` column programs per span and row (batch x head), from
    ``span`` chunks (the fewest spans that fill the GPU) down to a quarter of it: the one with the least
    walking time, each walk's programs running one per SM (their registers allow no more) in waves
    over MIN_PROGRAMS SMs, a wave as long as a span; the longest span on a tie. At vort-125m's 12 heads
    and batch 1 this is 11 spans (every walk a whole number of waves) where the fewest is 3 (the value
    walks' 144 programs take two waves, the second a tenth full): the launch model of benchmarks/predict
    priced the step's scans 1.45x faster by it, when the forward still walked spans too (docs/kernels.md,
    "Predicted GPU times"). Only spans of whole ``step`` chunks are considered (besides
    ``span`` itself), so that the forward's 64-token chunks tile them."""

    def waves_times_span(chunks: int) -> tuple[int, int]:
        spans = triton.cdiv(n_chunks, chunks)
        return sum(triton.cdiv(rows * spans * w, MIN_PROGRAMS) for w in walks) * chunks, -chunks

    return min((c for c in range(max(1, span // 4), span + 1) if c % step == 0 or c == span), key=waves_times_span)


def phase_spans(batch: int, heads: int, n_terms: int, parts: int, span_tokens: int, n_spans: int) -> int:
    """Spans per phase of the reverse walks that make the coefficient gradient's shares and of the
    coefficient kernel: the backward runs them over this many spans at a time, so that the fp32 shares,
    [parts, B x phase tokens x H, S], stay within SHARES_BYTES (one phase for the whole sequence up to
    about 250k tokens at vort-125m on an H100)."""
    per_span = parts * batch * span_tokens * heads * n_terms * 4
    return max(1, min(n_spans, SHARES_BYTES // per_span))


def soe_launches(
    batch: int,
    seq_len: int,
    heads: int,
    n_terms: int,
    feat: int,
    width: int,
    chunk_size: int,
    dtype: torch.dtype,
    capability: int,
    decay_grad: bool = True,
    fast_terms: int = 0,
    resets: bool = True,
) -> tuple[int, dict[str, Launch]]:
    """(chunk length of the backward's walks, launches) of one scan for q, k, v, coef of ``dtype`` and value
    width ``width`` on a GPU of compute capability ``capability``, in the order they run. The backward
    cuts the sequence into spans of ``walk_span`` chunks; the forward reads chunks of ``forward_chunk``
    tokens, whose borders include the spans'. Forward: "fwd_states" (a walk per term and value block
    storing the state entering every chunk, and the fp32 states at span borders), "fwd" (o and z, one
    program per chunk). Backward: "bwd_states" and "bwd_pass" (each span's own share of the state
    gradient, then the gradients entering every span, in reverse), then "bwd_queries" (dq, from the
    forward's span states), "bwd_keys" (dk, and the normalisers' share of the coefficient gradient),
    "bwd_values" (dv and the value blocks' shares) and "bwd_coef" (dcoef, chunk parallel), the last three
    over ``phase_spans`` spans at a time (their grids here those of a full phase). ``decay_grad``:
    whether the backward makes the decays' gradient (not for decays that are buffers, as VORT's: the key
    launch then adds the pairs inside each chunk to the normalisers' share, and the coefficient kernel
    only sums the shares). ``fast_terms``: the leading terms known to be fast (kernels.soe_scan), whose chunk
    walks may run in pieces (`fast_pieces`). ``resets``: whether the scan has document starts (without, the
    chunk-parallel kernels read no document numbers: RESETS)."""
    tiles = TILES[capability >= 90]
    bt = chunk_block(chunk_size, capability)
    bf, bv = max(16, triton.next_power_of_2(feat)), max(16, triton.next_power_of_2(width))
    span = walk_span(batch, seq_len, heads, n_terms, feat, width, bt, capability)
    n_spans = triton.cdiv(triton.cdiv(seq_len, bt), span)
    ga, gb, has_b, gn = term_groups(n_terms)
    groups = {"GA": ga, "GB": gb, "HAS_B": has_b, "GN": gn, "PRECISION": precision(dtype)}
    operand = triton_type(dtype)
    ints = dict.fromkeys(INTS, "i32")
    base = {"coef": operand, "log_lam": "fp32", "docs": "i32"}
    qkv = dict.fromkeys(("q", "k", "v"), operand)
    grads_in = {"d_out": operand, "d_z": "fp32"}
    n_values = triton.cdiv(width, tiles.block)
    value_grid = (n_spans * batch * heads * n_values, 1, 1)
    fblock = feature_block(n_terms, feat, capability)
    n_features = triton.cdiv(feat, fblock)
    feature_grid = (n_spans * batch * heads * n_features, 1, 1)
    phase = phase_spans(batch, heads, n_terms, n_values + 1, span * bt, n_spans)
    by_value = {"BT": bt, "BF": bf, "BD": tiles.block}
    by_feature = {"BT": bt, "BC": fblock, "BV": bv}

    def walk(kernel, pointers, scalars, constexprs, grid) -> Launch:
        constexprs |= {k: v for k, v in groups.items() if k in kernel.arg_names}
        return Launch(kernel, pointers, scalars, constexprs, grid, tiles.warps, tiles.stages,
                      wide=frozenset(pointers) - {"docs", "log_lam"})  # fmt: skip

    fc = forward_chunk(span, bt, triton.cdiv(seq_len, bt))
    sbf, sbd = state_blocks(batch * heads * n_terms, bf, bv)
    stride = triton.cdiv(span * bt, fc)
    per_phase = chunk_phase(batch * heads * n_terms, feat * (width + 1), dtype.itemsize, stride,
                            triton.cdiv(seq_len, fc))  # fmt: skip
    blocks = triton.cdiv(feat, sbf) * triton.cdiv(width, sbd)
    warm = triton.cdiv(FAST_REACH, fc)
    fast, parts = fast_pieces(batch * heads, n_terms, fast_terms, blocks, (sbf, sbd) == (bf, bv), per_phase, warm)
    slow = batch * heads * (n_terms - fast) * blocks
    walks = slow + batch * heads * fast * parts * blocks
    walk_shaped = _shaped(walk_shape(tiles, tiles.states_walk, (sbf, sbd), (bf, bv), slow))
    # the chunk kernels take the shape as constants: masks and address arithmetic fold at compile time
    shape = {"H": heads, "F": feat, "DV": width, "W": feat * (width + 1)}
    forward = {"BT": fc, "BF": bf, "PRECISION": precision(dtype), "RESETS": resets} | shape
    fwd_ints = {"seq_len": "i32", "BH": "i32", "S": "i32"}
    d_state_in = qkv | base | {"d_states": "fp32", "d_out": operand}
    launches = {
        "fwd_states": Launch(
            chunk_states_kernel, {"k": operand, "v": operand} | base | {"reads": operand, "states": "fp32"},
            fwd_ints | {"STRIDE": "i32", "C0": "i32", "N": "i32"},
            forward | {"BF": sbf, "BD": sbd, "BORDERS": True, "NORMS_BY_PRODUCT": tiles.norms_by_product,
                       "FAST": fast, "PARTS": parts, "WARM": warm},
            (walks, 1, 1), **walk_shaped,
            wide=frozenset(("k", "v", "coef", "reads", "states")),
        ),
        "fwd": Launch(
            chunk_output_kernel, qkv | base | {"reads": operand, "out": operand, "z": operand},
            fwd_ints | {"C0": "i32"},
            forward | {"BD": bv, "GN": gn}, (per_phase * batch * heads, 1, 1), **_shaped(tiles.outputs),
            wide=frozenset(("q", "k", "v", "coef", "reads", "out", "z")),
        ),
    }  # fmt: skip
    if not decay_grad:
        chunked = forward | {"BD": bv, "GN": gn}
        return bt, launches | _chunk_backward(launches, operand, fwd_ints | {"C0": "i32"}, chunked, tiles, slow)
    launches |= {
        "bwd_states": walk(state_grads_kernel, {"q": operand, "d_out": operand, "d_z": "fp32", "log_lam": "fp32",
                                                "docs": "i32", "states": "fp32"}, ints, dict(by_value), value_grid),
        "bwd_keys": walk(key_grads_kernel, d_state_in | {"d_z": "fp32", "dk": operand, "shares": "fp32"},
                         ints | {"SPAN0": "i32", "PHASE_T": "i32", "NORM_SHARE": "i32"},
                         by_feature | {"BF": bf, "PAIRS": False},
                         (phase * batch * heads * (n_features + 1), 1, 1)),
        "bwd_values": walk(value_grads_kernel, d_state_in | {"dv": operand, "shares": "fp32"},
                           ints | {"SPAN0": "i32", "PHASE_T": "i32"}, by_value,
                           (phase * batch * heads * n_values, 1, 1)),
        "bwd_queries": walk(query_grads_kernel, qkv | base | {"states": "fp32"} | grads_in
                            | {"dq": operand, "dll": "fp32"}, ints | {"centre": "fp32"},
                            by_feature | {"NEED_DLL": decay_grad}, feature_grid),
    }  # fmt: skip
    coef_in = qkv | base | grads_in | {"shares": "fp32", "dcoef": operand, "dll": "fp32"}
    launches["bwd_coef"] = Launch(
        coef_grads_kernel, coef_in,
        dict.fromkeys(("seq_len", "BH", "H", "S", "F", "DV", "PARTS", "C0", "PHASE_T"), "i32") | {"centre": "fp32"},
        {"BT": bt, "BF": bf, "BV": bv, "GN": gn, "NEED_DLL": decay_grad, "PRECISION": precision(dtype)},
        (min(phase * span, triton.cdiv(seq_len, bt)) * batch * heads, 1, 1), tiles.coef_warps, tiles.stages,
        wide=frozenset(coef_in) - {"docs", "log_lam"},
    )  # fmt: skip
    n_state = batch * heads * n_terms * feat * (width + 1)
    launches["bwd_pass"] = span_pass_launch(n_state, reverse=True, decay=True, wrap=False)
    order = ("fwd_states", "fwd", "bwd_states", "bwd_pass", "bwd_queries", "bwd_keys", "bwd_values",
             "bwd_coef")  # fmt: skip
    return bt, {name: launches[name] for name in order}


def fast_pieces(rows: int, n_terms: int, fast_terms: int, blocks: int, whole: bool, chunks: int,
                warm: int) -> tuple[int, int]:  # fmt: skip
    """(FAST, PARTS) of the chunk state walks over ``rows`` = batch x heads, ``n_terms`` terms and ``blocks``
    state blocks a term, whose phases have ``chunks`` chunks: (0, 1) (every term walked whole) unless all
    the walks would take more than TARGET_PROGRAMS programs (two an H100 SM at the walks' shape) and the
    slow terms' fit in them; then the ``fast_terms`` fast terms' walks are cut into PARTS pieces (a program
    each, walked from ``warm`` chunks before its first) of at least 4 x warm chunks, at most 16: the slow
    walks run at their uncrowded shape in one wave, the pieces in the room around them. vort-350m's 16
    heads x 18 terms are 288 walks, which had to run at the crowded shape, three an SM; its 224 slow
    ones fit, and its 4 fast ones are cut in 16."""
    slow = rows * (n_terms - fast_terms) * blocks
    if not whole or fast_terms == 0 or rows * n_terms * blocks <= TARGET_PROGRAMS or slow > TARGET_PROGRAMS:
        return 0, 1
    return fast_terms, max(1, min(16, chunks // (4 * warm)))


def walk_shape(tiles: Tiles, shape: Shape, block: tuple[int, int], whole: tuple[int, int], programs: int,
               crowded: Shape | None = None) -> Shape:  # fmt: skip
    """A chunk state walk's shape: where its programs hold the whole padded state (``block`` == ``whole``,
    as at every 18-term config) of at least 8 elements a thread, ``shape`` for at most TARGET_PROGRAMS of
    them and ``crowded`` (by default ``tiles.crowded_walk``) for more; else ``tiles.split_walk``: the
    register caps were chosen for whole states of the 125m and 350m configs, and m5-125m's five terms,
    walked in 32 x 32 blocks to fill the GPU, spilled 48 bytes at 16 warps in 64 registers on sm_90, the
    tiny configs' 16 x 16 states 84 bytes in the state-gradient walk at 16 warps, 2 stages."""
    if block != whole or block[0] * block[1] < 8 * 32 * shape.warps:
        return tiles.split_walk
    return shape if programs <= TARGET_PROGRAMS else crowded or tiles.crowded_walk


def key_value_launches(launches: dict[str, Launch]) -> list[str]:
    """The names of the launches of ``launches`` that make dk, dv and dcoef (`Tiles.key_value_grads`), in
    order."""
    return [name for name, launch in launches.items() if launch.kernel is chunk_key_value_grads_kernel]


def _shaped(shape: Shape) -> dict[str, int | None]:
    """A Launch's fields for ``shape``: warps, stages and register cap."""
    return {"num_warps": shape.warps, "num_stages": shape.stages, "max_registers": shape.registers}


def _chunk_backward(forward: dict[str, Launch], operand: str, ints: dict[str, str], constexprs: dict,
                    tiles: Tiles, slow_walks: int) -> dict[str, Launch]:  # fmt: skip
    """The chunk-parallel backward (kernels/soe/gpu/chunk_grads.py), for decays that need no gradient:
    "bwd_reads" (the forward's chunk walk again, for the state entering every chunk), "bwd_chunk_states"
    (the reverse walk: the gradient of the state leaving every chunk), "bwd_chunk_queries" (dq) and
    dk, dv and dcoef in `Tiles.key_value_grads`' launches ("bwd_chunk_keys_values" and "bwd_chunk_coefs" on
    sm_90, "bwd_chunk_keys", "bwd_chunk_values" and "bwd_chunk_coefs" on sm_80), each one program per chunk x
    batch x head."""
    chunks = forward["fwd"].grid
    reads = dict.fromkeys(("q", "k", "v", "coef"), operand) | {"log_lam": "fp32", "docs": "i32"}
    grads_in = {"d_out": operand, "d_z": "fp32"}

    def chunk_launch(kernel, pointers: dict[str, str], shape: Shape, extra: dict | None = None) -> Launch:
        return Launch(kernel, pointers, ints, constexprs | (extra or {}), chunks, **_shaped(shape),
                      wide=frozenset(pointers) - {"log_lam", "docs"})  # fmt: skip

    state_in = {"q": operand, "d_out": operand, "d_z": "fp32", "log_lam": "fp32", "docs": "i32"}
    walk = forward["fwd_states"]  # the backward's walks have its programs (its rerun, its shape too)
    block, whole = (walk.constexprs["BF"], walk.constexprs["BD"]), (constexprs["BF"], constexprs["BD"])
    crowded = tiles.crowded_walk if constexprs["RESETS"] else tiles.crowded_grads_walk
    grads_shape = walk_shape(tiles, tiles.grads_walk, block, whole, slow_walks, crowded)
    out = {
        "bwd_reads": dataclasses.replace(walk, constexprs=walk.constexprs | {"BORDERS": False}),
        "bwd_chunk_states": Launch(chunk_state_grads_kernel, state_in | {"d_reads": operand, "d_edges": "fp32"},
                                   ints | {"N": "i32"},
                                   {k: walk.constexprs[k] for k in ("BT", "BF", "BD", "PRECISION", "NORMS_BY_PRODUCT",
                                                                    "H", "F", "DV", "W", "FAST", "PARTS", "WARM",
                                                                    "RESETS")},
                                   walk.grid, **_shaped(grads_shape),
                                   wide=frozenset(("q", "d_out", "d_z", "d_reads"))),
        "bwd_chunk_queries": chunk_launch(chunk_query_grads_kernel,
                                          reads | {"reads": operand} | grads_in | {"dq": operand}, tiles.query_grads),
    }  # fmt: skip
    key_value = reads | {"d_reads": operand} | grads_in | {"dk": operand, "dv": operand, "dcoef": operand}
    for made, with_resets, without in tiles.key_value_grads:
        out["bwd_chunk_" + "_".join(p.lower() for p in made)] = chunk_launch(
            chunk_key_value_grads_kernel, key_value, with_resets if constexprs["RESETS"] else without,
            {p: p in made for p in ("KEYS", "VALUES", "COEFS")},
        )
    return out
