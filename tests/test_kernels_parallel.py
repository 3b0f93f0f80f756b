"""Sequence-parallel scans: a sequence split over 2 or 4 gloo ranks equals one scan, forward and backward,
with and without document resets (the Triton backend's scan and entering-state read under the interpreter:
tests/conftest.py sets TRITON_INTERPRET, which the spawned ranks inherit)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels import phasor_scan, phasor_scan_sequence_parallel, soe_scan, soe_scan_sequence_parallel
from kernels._common import decay
from kernels.parallel import _piece_lengths, _SoeStateCorrection, exchange_with_neighbours, sum_over_ranks
from kernels.testing import angle_err, phasor_inputs, rel_err, resets, soe_inputs
from tests.launchers import free_port

SPLIT = (30, 41)  # uneven pieces, neither a multiple of the chunk
WORLD = len(SPLIT)


def _weights(shapes: list[torch.Size]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _soe_inputs(seq_len: int = sum(SPLIT), heads: int = 2, n_terms: int = 3) -> dict[str, torch.Tensor]:
    inputs = soe_inputs(2, seq_len, heads, 5, 4, n_terms, with_state=True, seed=11)
    return {name: x.float() for name, x in inputs.items()}


def _soe_loss(o, z, g, b, weights) -> torch.Tensor:
    w_o, w_z, w_g, w_b = weights
    loss = (o.double() * w_o).sum() + (z.double() * w_z).sum()
    return loss if g is None else loss + (g.double() * w_g).sum() + (b.double() * w_b).sum()


def _phasor_loss(read, final, weights) -> torch.Tensor:
    w_read, w_final = weights
    loss = (torch.sin(read.double()) * w_read).sum()
    return loss if final is None else loss + (torch.sin(final.double()) * w_final).sum()


def _seeded(seed: int) -> torch.Tensor:
    """A [2, 3] tensor every process can rebuild: a rank's part (seed 20 + rank) or loss weight (40 + rank)."""
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        lo, hi = sum(SPLIT[:rank]), sum(SPLIT[: rank + 1])
        last = rank == WORLD - 1

        x = _soe_inputs()
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        piece = [leaves[n][:, lo:hi] for n in ("q", "k", "v", "coef")]
        init = (leaves["g0"], leaves["b0"])
        o, z, (g, b) = soe_scan_sequence_parallel(*piece, leaves["log_lam"], None, init, True, chunk_size=8,
                                                  piece_lengths=SPLIT)
        weights = _weights([x["v"].shape, x["q"].shape[:3], x["g0"].shape, x["b0"].shape])
        loss = _soe_loss(o, z, g if last else None, b, [weights[0][:, lo:hi], weights[1][:, lo:hi], *weights[2:]])
        loss.backward()
        soe = {"o": o.detach(), "z": z.detach(), "g": g.detach(), "b": b.detach()}
        soe.update({f"d_{n}": t.grad for n, t in leaves.items()})

        p_inputs, n_slots = phasor_inputs(2, sum(SPLIT), 3, 4, 3, True, seed=5)
        delta = p_inputs["delta"].float().requires_grad_()
        p_init = p_inputs["init"].float().requires_grad_()
        read, final = phasor_scan_sequence_parallel(
            delta[:, lo:hi], p_inputs["slots"][:, lo:hi], n_slots, None, p_init, True
        )
        p_weights = _weights([delta.shape, p_init.shape])
        _phasor_loss(read, final if last else None, [p_weights[0][:, lo:hi], p_weights[1]]).backward()
        phasor = {"read": read.detach(), "final": final.detach(), "d_delta": delta.grad, "d_init": p_init.grad}

        part = _seeded(20 + rank).requires_grad_()
        total = sum_over_ranks(part, None)
        (total * _seeded(40 + rank)).sum().backward()
        summed = {"total": total.detach(), "d_part": part.grad}

        mine = _seeded(60 + rank).requires_grad_()
        kept, previous = exchange_with_neighbours(mine, None)
        loss = (kept * _seeded(80 + rank)).sum()
        if previous is not None:
            loss = loss + (previous * _seeded(100 + rank)).sum()
        loss.backward()
        exchanged = {"kept": kept.detach(), "previous": previous.detach() if previous is not None else torch.zeros(0),
                     "d_mine": mine.grad}  # fmt: skip
        torch.save({"soe": soe, "phasor": phasor, "summed": summed, "exchanged": exchanged},
                   os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("sp")
    mp.spawn(_worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_soe_pieces_equal_one_scan(ranks):
    x = _soe_inputs()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, z, (g, b) = soe_scan(
        leaves["q"], leaves["k"], leaves["v"], leaves["coef"], leaves["log_lam"], (leaves["g0"], leaves["b0"]), True,
        chunk_size=8,
    )  # fmt: skip
    weights = _weights([x["v"].shape, x["q"].shape[:3], x["g0"].shape, x["b0"].shape])
    _soe_loss(o, z, g, b, weights).backward()
    got = [r["soe"] for r in ranks]
    assert rel_err(torch.cat([r["o"] for r in got], 1), o.detach()) < 1e-5
    assert rel_err(torch.cat([r["z"] for r in got], 1), z.detach()) < 1e-5
    assert rel_err(got[-1]["g"], g.detach()) < 1e-5 and rel_err(got[-1]["b"], b.detach()) < 1e-5
    for name in ("q", "k", "v", "coef", "log_lam", "g0", "b0"):
        # pieces' gradients are zero outside the piece; replicated inputs' shares add up over ranks
        total = sum(r[f"d_{name}"] for r in got)
        assert rel_err(total, leaves[name].grad) < 1e-4, name


def test_sum_over_ranks_gives_every_rank_the_sum_and_every_loss_gradient(ranks):
    """Each rank holds the sum of all ranks' parts, and a loss computed from it on each rank sends every
    part the gradient of all ranks' losses (what PMNet's sequence-parallel balance loss relies on)."""
    total = sum(_seeded(20 + r) for r in range(WORLD))
    weight = sum(_seeded(40 + r) for r in range(WORLD))
    for r in ranks:
        torch.testing.assert_close(r["summed"]["total"], total)
        torch.testing.assert_close(r["summed"]["d_part"], weight)


def test_neighbour_exchange_sends_forward_and_gradients_back(ranks):
    """Each rank keeps its tensor and receives the previous rank's (the first none); each tensor's gradient
    is its own loss weight plus the next rank's weight on the copy it received."""
    for rank, r in enumerate(ranks):
        got = r["exchanged"]
        torch.testing.assert_close(got["kept"], _seeded(60 + rank))
        if rank:
            torch.testing.assert_close(got["previous"], _seeded(60 + rank - 1))
        else:
            assert got["previous"].numel() == 0
        expected = _seeded(80 + rank) + (_seeded(100 + rank + 1) if rank + 1 < WORLD else 0)
        torch.testing.assert_close(got["d_mine"], expected)


def test_phasor_pieces_equal_one_scan(ranks):
    p_inputs, n_slots = phasor_inputs(2, sum(SPLIT), 3, 4, 3, True, seed=5)
    delta = p_inputs["delta"].float().requires_grad_()
    p_init = p_inputs["init"].float().requires_grad_()
    read, final = phasor_scan(delta, p_inputs["slots"], n_slots, p_init, True)
    _phasor_loss(read, final, _weights([delta.shape, p_init.shape])).backward()
    got = [r["phasor"] for r in ranks]
    assert angle_err(torch.cat([r["read"] for r in got], 1), read.detach()) < 1e-5
    assert angle_err(got[-1]["final"], final.detach()) < 1e-5
    assert rel_err(sum(r["d_delta"] for r in got), delta.grad) < 1e-4
    assert rel_err(sum(r["d_init"] for r in got), p_init.grad) < 1e-4


@pytest.mark.parametrize("log_lam", [
    [[-45.0, -3.0, -0.3, 0.0], [-50.0, -2.0, -0.5, -0.01]],  # one term dead from the start, one dies mid-piece
    [[-45.0, -3.0, -1.5, -4.0], [-50.0, -2.0, -5.0, -1.5]],  # every term dead before the piece ends
])
def test_state_correction_leaves_out_only_terms_that_decayed_to_zero(log_lam: list[list[float]]) -> None:
    """The entering state's correction skips, per chunk, the terms whose decay is already flushed to 0
    (on the CPU, where the decays are read without a sync); outputs and every gradient equal the dense
    sum over all terms and tokens."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, S, F, D = 2, 40, 2, 4, 3, 5
    q = torch.randn(B, T, H, F, generator=gen).requires_grad_()
    g_in = torch.randn(B, H, S, F, D, generator=gen).requires_grad_()
    b_in = torch.randn(B, H, S, F, generator=gen).requires_grad_()
    ll = torch.tensor(log_lam).requires_grad_()
    w_o, w_z = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, generator=gen)
    inputs = (q, ll, g_in, b_in)

    o, z = _SoeStateCorrection.apply(q, ll, g_in, b_in, 8)
    got = [o, z, *torch.autograd.grad((o * w_o).sum() + (z * w_z).sum(), inputs)]

    scale = decay(torch.arange(1, T + 1.0)[None, :, None] * ll[:, None, :])  # [H, T, S]
    o_ref = torch.einsum("bthf,hts,bhsfd->bthd", q, scale, g_in)
    z_ref = torch.einsum("bthf,hts,bhsf->bth", q, scale, b_in)
    want = [o_ref, z_ref, *torch.autograd.grad((o_ref * w_o).sum() + (z_ref * w_z).sum(), inputs)]
    for name, a, b in zip(("o", "z", "dq", "dlog_lam", "dg", "db"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_piece_lengths_are_static_and_checked() -> None:
    """Equal pieces unless told; given lengths must name every rank and agree with this rank's piece."""
    assert _piece_lengths(None, 16, 1, 3) == [16, 16, 16]
    assert _piece_lengths((30, 41), 41, 1, 2) == [30, 41]
    with pytest.raises(ValueError, match=r"piece_lengths=\[30, 40\] does not fit 2 ranks whose rank 1 holds 41"):
        _piece_lengths((30, 40), 41, 1, 2)
    with pytest.raises(ValueError, match="piece_lengths"):
        _piece_lengths((30, 41, 5), 41, 1, 2)


# ----------------------------------------------------------------------------- document resets

# world size -> (piece lengths, reset positions per batch row). Two ranks: row 0 resets inside piece 0, on
# piece 1's first token and inside piece 1; row 1 only inside piece 1. Four ranks ([0, 9), [9, 21), [21, 28),
# [28, 40)): row 0 resets in piece 0, on piece 2's first token and in piece 3, with piece 1 (no reset) between;
# row 1 on the first token (the initial state is dropped) and twice in a row in piece 1, then two pieces
# without one.
RESET_CASES = {2: ((19, 21), ([5, 19, 25], [33])), 4: ((9, 12, 7, 12), ([3, 21, 30], [0, 10, 11]))}
BACKENDS = ("torch", "triton")
RESET_SOE = {"heads": 1, "n_terms": 2}  # small: the Triton interpreter runs every program in Python


def _reset_worker(rank: int, port: int, out_dir: str, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        split, rows = RESET_CASES[world]
        seq_len = sum(split)
        lo, hi = sum(split[:rank]), sum(split[: rank + 1])
        last = rank == world - 1
        reset = resets(seq_len, rows)[:, lo:hi]
        results = {}
        for backend in BACKENDS:
            x = _soe_inputs(seq_len, **RESET_SOE)
            leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
            piece = [leaves[n][:, lo:hi] for n in ("q", "k", "v", "coef")]
            o, z, (g, b) = soe_scan_sequence_parallel(
                *piece, leaves["log_lam"], None, (leaves["g0"], leaves["b0"]), True, 16, backend, reset=reset,
                piece_lengths=split,
            )
            weights = _weights([x["v"].shape, x["q"].shape[:3], x["g0"].shape, x["b0"].shape])
            loss = _soe_loss(o, z, g if last else None, b, [weights[0][:, lo:hi], weights[1][:, lo:hi], *weights[2:]])
            loss.backward()
            soe = {"o": o.detach(), "z": z.detach(), "g": g.detach(), "b": b.detach()}
            soe.update({f"d_{n}": t.grad for n, t in leaves.items()})

            p_inputs, n_slots = phasor_inputs(2, seq_len, 3, 4, 3, True, seed=5)
            delta = p_inputs["delta"].float().requires_grad_()
            p_init = p_inputs["init"].float().requires_grad_()
            read, final = phasor_scan_sequence_parallel(
                delta[:, lo:hi], p_inputs["slots"][:, lo:hi], n_slots, None, p_init, True, backend, reset=reset
            )
            p_weights = _weights([delta.shape, p_init.shape])
            _phasor_loss(read, final if last else None, [p_weights[0][:, lo:hi], p_weights[1]]).backward()
            phasor = {"read": read.detach(), "final": final.detach(), "d_delta": delta.grad, "d_init": p_init.grad}
            results[backend] = {"soe": soe, "phasor": phasor}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=sorted(RESET_CASES))
def reset_ranks(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"sp_reset{world}")
    mp.spawn(_reset_worker, args=(free_port(), str(out_dir), world), nprocs=world, join=True)
    return world, [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_soe_pieces_with_resets_equal_one_scan(reset_ranks, backend):
    """Outputs, the final state and every gradient against the float64 reference scan of the whole
    sequence with the same resets."""
    world, ranks = reset_ranks
    split, rows = RESET_CASES[world]
    x = {n: t.double().requires_grad_() for n, t in _soe_inputs(sum(split), **RESET_SOE).items()}
    o, z, (g, b) = soe_scan(
        x["q"], x["k"], x["v"], x["coef"], x["log_lam"], (x["g0"], x["b0"]), True, backend="reference",
        reset=resets(sum(split), rows),
    )  # fmt: skip
    weights = _weights([x["v"].shape, x["q"].shape[:3], x["g0"].shape, x["b0"].shape])
    _soe_loss(o, z, g, b, weights).backward()
    got = [r[backend]["soe"] for r in ranks]
    assert rel_err(torch.cat([r["o"] for r in got], 1), o.detach()) < 1e-5
    assert rel_err(torch.cat([r["z"] for r in got], 1), z.detach()) < 1e-5
    assert rel_err(got[-1]["g"], g.detach()) < 1e-5 and rel_err(got[-1]["b"], b.detach()) < 1e-5
    for name, leaf in x.items():
        assert rel_err(sum(r[f"d_{name}"] for r in got), leaf.grad) < 1e-4, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_phasor_pieces_with_resets_equal_one_scan(reset_ranks, backend):
    world, ranks = reset_ranks
    split, rows = RESET_CASES[world]
    p_inputs, n_slots = phasor_inputs(2, sum(split), 3, 4, 3, True, seed=5)
    delta = p_inputs["delta"].float().double().requires_grad_()
    p_init = p_inputs["init"].float().double().requires_grad_()
    read, final = phasor_scan(
        delta, p_inputs["slots"], n_slots, p_init, True, "reference", reset=resets(sum(split), rows)
    )
    _phasor_loss(read, final, _weights([delta.shape, p_init.shape])).backward()
    got = [r[backend]["phasor"] for r in ranks]
    assert angle_err(torch.cat([r["read"] for r in got], 1), read.detach()) < 1e-5
    assert angle_err(got[-1]["final"], final.detach()) < 1e-5
    assert rel_err(sum(r["d_delta"] for r in got), delta.grad) < 1e-4
    assert rel_err(sum(r["d_init"] for r in got), p_init.grad) < 1e-4
