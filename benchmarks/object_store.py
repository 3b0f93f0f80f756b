"""Object storage against local disk: the data loader's tokens/s per rank and a checkpoint's save and
load time, each from a local S3 endpoint (moto's server on loopback, benchmarks/local_s3.py) beside the
same thing on local disk in the same run. Results and commands: docs/data.md, "Object storage".

``python -m benchmarks.object_store loader --input <files/globs> --workdir <dir> [--ranks 8]``
(also ``python -m benchmarks.data_loader s3 ...``)
    builds byte-level shards on disk, lists them ``--repeat`` times in the manifest (a corpus that many
    times larger, larger than any cache of the reader, without storing it that many times), copies
    them to a bucket, and streams rank 0's share (of ``--ranks``) from each, ``--runs`` times in
    alternation: whole shards with sha256 and prefetch, and byte ranges (on the store in blocks of each
    ``--block-mib``, and with ``--latency-ms`` once more through a proxy that adds that round trip to
    each request, as a remote store would); all of them for each ``--interleave`` (the stream's
    shuffle windows read side by side, which lays a rank's samples together in the shards).
    tokens/s per rank, from a cold start to the last sample (the stream ends there).

``python -m benchmarks.object_store checkpoint --model configs/model/vort-125m.yaml --workdir <dir>``
    saves and restores the state of that model with AdamW moments (engine.kind=single's payload)
    through the Checkpointer to a local root and to the bucket. Seconds and MB/s.

``--endpoint URL`` measures an S3 endpoint already running instead (credentials from the AWS
variables); without it a local server is started and stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from statistics import median
from typing import Any

import fsspec
import torch

from benchmarks.local_s3 import LocalS3
from data_pipeline import storage
from data_pipeline.build import build_shards
from data_pipeline.shards import Manifest, load_manifest, save_manifest
from data_pipeline.stream import PackedStream

_server_endpoint: str | None = None


@contextlib.contextmanager
def bucket(endpoint: str | None, workdir: Path) -> Iterator[str]:
    """An s3:// bucket URL on `endpoint`, or on a local server started for the block."""
    server = None
    if endpoint is None:
        server = LocalS3(workdir / "moto.log")
        endpoint = server.endpoint
        for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            os.environ.setdefault(key, value)
    global _server_endpoint
    _server_endpoint = endpoint
    storage.configure(storage.RetryPolicy(), endpoint_url=endpoint)
    try:
        name = server.new_bucket() if server else f"bench-{os.getpid()}"
        if server is None:
            fsspec.filesystem("s3").mkdir(name)
        yield f"s3://{name}"
    finally:
        if server is not None:
            server.stop()


def stream_rate(source: str, seq_len: int, samples: int, ranks: int, read: str,
                block_size: int | None = None, interleave: int = 1) -> dict[str, Any]:
    """tokens/s of rank 0's stream of `ranks` over `samples` samples, from a cold start (the stream
    made, its first sample read and all the rest). The stream ends there (`max_samples`, as a run's
    data would), so that its read-ahead fetches nothing past the last sample."""
    t0 = time.perf_counter()
    stream = PackedStream([(source, 1.0)], seq_len=seq_len, seed=0, rank=0, world_size=ranks, shuffle_buffer=256,
                          verify=read == "shard", read=read, block_size=block_size, interleave=interleave,
                          max_samples=samples * ranks)
    it = iter(stream)
    next(it)
    first = time.perf_counter() - t0
    for _ in range(samples - 1):
        next(it)
    elapsed = time.perf_counter() - t0
    stream.close(wait=True)  # no read ahead of this stream goes on into the next row's time
    stats = stream.stats()  # with the bytes of every read it started (whole shards read ahead included)
    return {"read": read, "interleave": interleave, "seq_len": seq_len, "samples": samples,
            "tokens_per_s": samples * seq_len / elapsed,
            "first_sample_s": first, "mb_read": stats["shard_bytes_read"] / 1e6, "read_retries": stats["read_retries"],
            "load_avg_1m": os.getloadavg()[0]}


def repeat_manifest(directory: str, times: int) -> Manifest:
    """List the shards of the manifest in `directory` `times` times over (rewritten in place): a
    corpus `times` times larger to the reader, which reads and caches each listed shard apart."""
    m = load_manifest(directory)
    m.shards = [dict(s) for _ in range(times) for s in m.shards]
    save_manifest(m, directory)
    return load_manifest(directory)


def loader(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    local = str(work / "shards")
    build_shards(args.input, local, shard_tokens=args.shard_tokens, overwrite=True)
    m = repeat_manifest(local, args.repeat)
    rows, proxy = [], None
    with bucket(args.endpoint, work) as root:
        remote = f"{root}/shards"
        fsspec.filesystem("s3").put(local + "/", remote + "/", recursive=True)
        runs = []
        for c in args.interleave:
            runs += [("shard", "local disk", local, None, c), ("shard", "s3 (loopback)", remote, None, c),
                     ("range", "local disk", local, None, c)]
            runs += [("range", "s3 (loopback)", remote, mib, c) for mib in args.block_mib]
            if args.latency_ms:
                runs += [("range", f"s3 (+{args.latency_ms:g} ms)", remote, mib, c) for mib in args.block_mib]
        for run in range(args.runs):
            for read, where, source, mib, c in runs:
                if "ms)" in where and proxy is None:
                    proxy = delayed(args.latency_ms / 1000)
                    warm(remote)
                elif "ms)" not in where and proxy is not None:
                    proxy.close()
                    proxy = None
                    storage.configure(storage.RetryPolicy(), endpoint_url=_server_endpoint)
                    warm(remote)
                block = None if mib is None else int(mib * (1 << 20))
                row = {"run": run, "where": where, "ranks": args.ranks, "shards": len(m.shards), "block_mib": mib,
                       **stream_rate(source, args.seq_len, args.samples, args.ranks, read, block, c)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if proxy is not None:
        proxy.close()
    return rows


def warm(url: str) -> None:
    """Make this process's s3:// filesystem (a new one after `storage.configure`) and its first
    connection, as the rows before it found them: its set-up (botocore's models, a session) is the
    process's start, not the stream's."""
    fsspec.filesystem("s3").cat_file(f"{url}/manifest.json")


def delayed(delay_s: float) -> Any:
    """Route new s3:// filesystems of this process through a proxy that holds each request back
    `delay_s` (tests/fault_proxy.py, without faults): a remote store's round trip on loopback."""
    from tests.fault_proxy import FaultProxy

    host, port = str(_server_endpoint).rsplit("//", 1)[1].split(":")
    proxy = FaultProxy((host, int(port)), delay_s=delay_s)
    storage.configure(storage.RetryPolicy(), endpoint_url=proxy.endpoint)
    return proxy


class _Payload:
    """engine.kind=single's checkpoint payload of a model and its AdamW (the Engine protocol's half)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def save(self, path: str) -> None:
        from pretrain.checkpoint.torch_format import save_torch_state

        save_torch_state(path, self.model, self.optimizer)

    def load(self, path: str, scratch: Path) -> None:
        from pretrain.checkpoint.torch_format import load_torch_state

        load_torch_state(path, self.model, self.optimizer)


def checkpoint(args: argparse.Namespace) -> list[dict[str, Any]]:
    from model import build_model
    from model.config import load_model_config
    from pretrain.checkpoint.checkpointer import Checkpointer

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(load_model_config(args.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the moments exist, as in a checkpoint of a run
    payload = _Payload(model, optimizer)
    rows = []
    with bucket(args.endpoint, work) as root:
        for where, ckpt_root in (("local disk", str(work / "ckpt")), ("s3 (loopback)", f"{root}/ckpt")):
            shutil.rmtree(work / "ckpt", ignore_errors=True)
            saver = Checkpointer(ckpt_root, work / "stage", 2, 0, False)
            t = time.perf_counter()
            saver.save(1, payload, {"trainer": {"step": 1}, "data": {}}, "run: {}\n")
            save_s = time.perf_counter() - t
            size = _size(f"{ckpt_root}/step_00000001")
            t = time.perf_counter()
            Checkpointer(ckpt_root, work / "stage", 2, 0, False).resume("auto", payload)
            load_s = time.perf_counter() - t
            row = {"where": where, "model": Path(args.model).stem, "parameters": sum(p.numel() for p in
                   model.parameters()), "mb": size / 1e6, "save_s": save_s, "load_s": load_s,
                   "save_mb_per_s": size / 1e6 / save_s, "load_mb_per_s": size / 1e6 / load_s,
                   "retries": saver.retries}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _size(url: str) -> int:
    """Bytes under a directory or prefix."""
    fs, path = fsspec.core.url_to_fs(url)
    return sum(fs.du(path, total=False).values())


def _cell(value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}"


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(v) for v in row.values()) + " |")
    return "\n".join(lines)


def loader_summary(rows: list[dict[str, Any]]) -> str:
    """One line per row kind: the median tokens/s per rank over the runs, their range, the median of
    each run's ratio to local disk with the same read mode and interleave in the same run, and the
    same against local whole shards of the plain order (interleave 1)."""
    local = {(r["run"], r["read"], r["interleave"]): r["tokens_per_s"] for r in rows if r["where"] == "local disk"}
    kinds: dict[tuple[str, str, Any, int], list[dict[str, Any]]] = {}
    for r in rows:
        kinds.setdefault((r["where"], r["read"], r["block_mib"], r["interleave"]), []).append(r)
    lines = ["| where | read | block MiB | interleave | tokens/s per rank (median, min-max) | vs local disk, same read "
             "and interleave (median, min-max) | vs local whole shards, interleave 1 | first sample s | MB read |",
             "|---|---|---|---|---|---|---|---|---|"]

    def spread(values: list[float]) -> str:
        values = sorted(values)
        return f"{median(values):.2f}x ({values[0]:.2f}-{values[-1]:.2f})"

    for (where, read, mib, c), group in kinds.items():
        rates = sorted(r["tokens_per_s"] for r in group)
        same = [r["tokens_per_s"] / local[(r["run"], read, c)] for r in group]
        plain = [r["tokens_per_s"] / local[(r["run"], "shard", 1)] for r in group if (r["run"], "shard", 1) in local]
        lines.append(
            f"| {where} | {read} | {mib if mib is not None else '-'} | {c} | {median(rates) / 1e6:.2f}M "
            f"({rates[0] / 1e6:.2f}-{rates[-1] / 1e6:.2f}) | {spread(same)} | {spread(plain) if plain else '-'} | "
            f"{median(r['first_sample_s'] for r in group):.3f} | {median(r['mb_read'] for r in group):.1f} |"
        )
    return "\n".join(lines)


def add_loader_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True)
    parser.add_argument("--shard-tokens", type=int, default=1 << 22)
    parser.add_argument("--repeat", type=int, default=8, help="times the manifest lists the built shards")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks; rank 0's share is read")
    parser.add_argument("--block-mib", type=float, nargs="+", default=[storage.DEFAULT_BLOCK_SIZE / (1 << 20)],
                        help="block sizes of range reads on the store, MiB (one s3 range row each)")
    parser.add_argument("--latency-ms", type=float, default=0,
                        help="also read ranges through a proxy adding this round trip to each request")
    parser.add_argument("--runs", type=int, default=1, help="times every row is measured, in alternation")
    parser.add_argument("--interleave", type=int, nargs="+", default=[1],
                        help="the stream's interleave (shuffle windows read side by side); every row for each")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.object_store", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ld = sub.add_parser("loader")
    add_loader_arguments(ld)
    ck = sub.add_parser("checkpoint")
    ck.add_argument("--model", default="configs/model/vort-125m.yaml")
    for p in (ld, ck):
        p.add_argument("--workdir", required=True)
        p.add_argument("--endpoint", default=None, help="an S3 endpoint already running (default: start one)")
        p.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = loader(args) if args.command == "loader" else checkpoint(args)
    print(table(rows))
    if args.command == "loader":
        print(loader_summary(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
