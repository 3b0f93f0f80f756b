"""No tensor-to-host read from model or kernel code inside a training step (issue #32 point 5): VORT and
PMNet, one process and two gloo ranks of sequence parallelism, with and without document boundaries.

The spy is the one of tests/test_throughput_settings.py (every way a tensor's value reaches the host,
recorded when the caller is watched code), widened to the reads that hide in other calls: ``nonzero``
and ``torch.equal``, and indexing with a boolean mask (its result's size is read on the host). On a GPU
each of them waits for all the work queued before it. ``.numpy()`` alone is let through: it refuses a
CUDA tensor, so what is read through it (the numba scans' operands, the CPU correction's decays) is
host memory on any machine, never a device's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import build_model
from model.config import ModelConfig, PMNetConfig, VortConfig
from tests.launchers import REPO, free_port
from tests.test_throughput_settings import HOST_READS

WATCHED = (str(REPO / "model") + os.sep, str(REPO / "kernels") + os.sep)
TENSOR_READS = (*(r for r in HOST_READS if r != "numpy"), "nonzero")
TORCH_READS = ("equal", "nonzero", "is_nonzero", "unique")
MODELS = {
    "vort": ModelConfig(kind="vort", d_model=32, n_layers=2, n_heads=2, max_seq_len=256, short_conv=4,
                        vort=VortConfig(n_features=8, n_banks=2, soe_horizon=256, chunk_size=16)),
    "pmnet": ModelConfig(kind="pmnet", d_model=32, n_layers=2, n_heads=2, max_seq_len=256,
                         pmnet=PMNetConfig(window=8, memory_dim=8, depth=2, segment_len=16)),
}
MODELS["pmnet-segment"] = dataclasses.replace(
    MODELS["pmnet"], pmnet=dataclasses.replace(MODELS["pmnet"].pmnet, collision_scope="segment"))
# the shipped routing (a router of its own, previous-token writes) with the balance loss on (summed over the
# pieces under SP; its weights from the router of the detached input)
MODELS["pmnet-routing"] = dataclasses.replace(
    MODELS["pmnet"], pmnet=dataclasses.replace(MODELS["pmnet"].pmnet, routing="router", write_address="previous",
                                               balance_loss=0.3, decay_routing=False))
LENGTH = 64
DOC_STARTS = [[10, 32, 45], [3, 33, 34, 60]]  # on a piece's edge (32 of 2 pieces) and inside pieces
# (model, document boundaries); PMNet's segment scope does not run sequence-parallel with documents
CASES = [("vort", False), ("vort", True), ("pmnet", False), ("pmnet", True), ("pmnet-segment", False),
         ("pmnet-routing", True)]
ONE_PROCESS_CASES = [*CASES, ("pmnet-segment", True)]
STEPS = 2


class HostReadSpy:
    """Records (what, file:line) for every host read whose caller is in model/ or kernels/ while on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on, self.reads = False, []
        for name in TENSOR_READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        for name in TORCH_READS:
            monkeypatch.setattr(torch, name, self._wrap(getattr(torch, name), f"torch.{name}"))
        getitem = torch.Tensor.__getitem__

        def masked(tensor, index):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self._record("boolean-mask index")
            return getitem(tensor, index)
        monkeypatch.setattr(torch.Tensor, "__getitem__", masked)

    def _record(self, what: str) -> None:
        caller = sys._getframe(2)
        where = caller.f_code.co_filename
        if self.on and where.startswith(WATCHED):
            self.reads.append(f"{what} at {Path(where).relative_to(REPO)}:{caller.f_lineno}")

    def _wrap(self, original, what: str):
        def spy(*args, **kwargs):
            self._record(what)
            return original(*args, **kwargs)
        return spy


def _documents() -> torch.Tensor:
    doc_start = torch.zeros(2, LENGTH, dtype=torch.bool)
    for row, starts in enumerate(DOC_STARTS):
        doc_start[row, starts] = True
    return doc_start


def _train(spy: HostReadSpy, cases: list[tuple[str, bool]], sp=None) -> dict[str, list[str]]:
    """STEPS optimizer steps of each case, the spy on from the forward to the optimizer's step."""
    from pretrain.distributed.parallel_dims import local_slice, sequence_parallel_loss

    reads = {}
    for kind, documents in cases:
        torch.manual_seed(0)
        model = build_model(MODELS[kind])
        for memory in getattr(model, "memories", list)():  # wake PMNet's memory: it writes and is read
            torch.nn.init.normal_(memory.out.weight, std=0.1)
            torch.nn.init.ones_(memory.write_gain)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 258, (2, LENGTH + 1), generator=torch.Generator().manual_seed(1))
        inputs, labels, doc_start = ids[:, :-1], ids[:, 1:], _documents() if documents else None
        spy.reads = []
        for _ in range(STEPS):
            spy.on = True
            if sp is None:
                loss, _ = model.loss(inputs, labels, doc_start=doc_start)
            else:
                loss = sequence_parallel_loss(model, local_slice(inputs, sp), local_slice(labels, sp), sp,
                                              None if doc_start is None else local_slice(doc_start, sp))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            spy.on = False
        assert torch.isfinite(loss.detach()).all()
        reads[f"{kind}{' documents' if documents else ''}"] = spy.reads
    return reads


def test_one_process_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _train(HostReadSpy(monkeypatch), ONE_PROCESS_CASES)
    assert len(reads) == len(ONE_PROCESS_CASES)
    assert not any(reads.values()), {case: r for case, r in reads.items() if r}


def _worker(rank: int, port: int, out: str) -> None:
    from pretrain.distributed.parallel_dims import ParallelDims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            reads = _train(HostReadSpy(monkeypatch), CASES, ParallelDims(2, 2).build(rank, LENGTH))
        Path(out, f"rank{rank}.json").write_text(json.dumps(reads))
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_reads_nothing_on_the_host(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        reads = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(reads) == len(CASES)
        assert not any(reads.values()), (rank, {case: r for case, r in reads.items() if r})


def test_the_spy_sees_a_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spy is not blind: watched code that reads a tensor on the host is recorded, each kind once."""
    from kernels import _common

    spy = HostReadSpy(monkeypatch)
    x = torch.tensor([1.0, 0.0])
    probe = compile("int(x[0]); bool(x.any()); x.nonzero(); torch.equal(x, x); x[x > 0]",
                    _common.__file__, "exec")
    spy.on = True
    exec(probe, {"x": x, "torch": torch})
    assert [r.split(" at ")[0] for r in spy.reads] == [
        "__int__", "__bool__", "nonzero", "torch.equal", "boolean-mask index"]
