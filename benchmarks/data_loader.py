"""Benchmarks for the data pipeline; the results and the commands that produced them are in docs/data.md.

``python -m benchmarks.data_loader throughput --input <corpus files/globs> --workdir <dir>``
    tokens/s of one data-loader worker, from raw text through shards to training tensors.

``python -m benchmarks.data_loader build --input <corpus files/globs> --workdir <dir> [--workers 1 2]``
    shard-build speed for bytes and for a 32k sentencepiece model (trained on the input unless
    ``--sp-model`` names one): tokens/s and tokens per CPU-second (one core's rate, since the parts
    of a build are independent), and the hours that rate gives for ``--target-tokens`` on ``--cores``.

``python -m benchmarks.data_loader s3 --input <corpus files/globs> --workdir <dir> [--ranks 8]``
    tokens/s per rank from a local S3 server (moto on loopback) beside local disk in the same run, whole
    shards and byte ranges: ``benchmarks.object_store loader`` (its docstring says how).

``python -m benchmarks.data_loader scale --shards 10000 --shard-tokens 1880000 --workdir <dir>``
    start-up time and peak memory for a very large manifest, against a small one, to show that
    neither grows with the size of the dataset. docs/data.md, "Measurements", says how each is set up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_pipeline.build import build_shards
from data_pipeline.shards import Manifest, encode_shard, save_manifest, sha256_hex
from data_pipeline.sources import expand_inputs, iter_documents
from data_pipeline.stream import PackedStream
from data_pipeline.tokenizer import byte_tokenizer, train_sentencepiece


def measure_stream(
    source: str, seq_len: int, epochs: float, shuffle_buffer: int, verify: bool, read: str = "shard"
) -> dict:
    """Tokens/s of one in-process stream over ``epochs`` epochs from a cold start."""
    t0 = time.perf_counter()
    stream = PackedStream(
        [(source, 1.0)], seq_len=seq_len, seed=0, shuffle_buffer=shuffle_buffer, verify=verify, read=read
    )
    n = int(stream.samples_per_epoch()[0] * epochs)
    it = iter(stream)
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(n):
        next(it)
    t2, c2 = time.perf_counter(), time.process_time()
    return {
        "seq_len": seq_len,
        "samples": n,
        "tokens_per_s": n * seq_len / (t2 - t1),
        "tokens_per_cpu_s": n * seq_len / (c2 - c1),
        "load_avg_1m": os.getloadavg()[0],
        "startup_s": t1 - t0,
        **stream.stats(),
    }


def throughput(args: argparse.Namespace) -> list[dict]:
    """Build both shard kinds from ``args.input`` and measure them (see module docstring)."""
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    byte_dir, sp_dir, sp_prefix = str(work / "bytes"), str(work / "sp"), str(work / "sp_tok")
    t = time.perf_counter()
    mb = build_shards(args.input, byte_dir, shard_tokens=args.shard_tokens, workers=args.workers, overwrite=True)
    build_bytes_s = time.perf_counter() - t
    train_sentencepiece(args.input, args.vocab_size, sp_prefix, sample_bytes=args.sp_sample_bytes)
    t = time.perf_counter()
    ms = build_shards(
        args.input, sp_dir, tokenizer=sp_prefix + ".model", shard_tokens=args.shard_tokens, workers=args.workers,
        overwrite=True,
    )
    build_sp_s = time.perf_counter() - t
    rows = []
    for kind, path, m, build_s in (("bytes", byte_dir, mb, build_bytes_s), ("sentencepiece", sp_dir, ms, build_sp_s)):
        for seq_len in args.seq_len:
            for verify, read in ((True, "shard"), (False, "shard"), (False, "range")):
                row = measure_stream(path, seq_len, args.epochs, args.shuffle_buffer, verify, read)
                row.update(
                    kind=kind,
                    verify=verify,
                    read=read,
                    dtype=m.dtype,
                    shards=len(m.shards),
                    corpus_tokens=m.total_tokens,
                    build_tokens_per_s=m.total_tokens / build_s,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (the tokenizer worker processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def write_web_like_parquet(inputs: list[str], path: Path, doc_bytes: int) -> int:
    """Re-cut the inputs' text at paragraph breaks into documents of about ``doc_bytes`` (the size of a
    web page, as in FineWeb) and write them as one parquet file of 1,000-row groups; returns the count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs: list[str] = []
    current: list[str] = []
    size = 0
    for doc in iter_documents(expand_inputs(inputs)):
        for paragraph in doc.data.decode("utf-8", errors="replace").split("\n\n"):
            current.append(paragraph)
            size += len(paragraph)
            if size >= doc_bytes:
                docs.append("\n\n".join(current))
                current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    pq.write_table(pa.table({"text": docs}), path, row_group_size=1000)
    return len(docs)


def build_speed(args: argparse.Namespace) -> list[dict]:
    """Time full builds of ``args.input`` per tokenizer and worker count, from the files as given and
    from a parquet copy cut into web-page-sized documents (see module docstring)."""
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    web = work / "web_like.parquet"
    write_web_like_parquet(args.input, web, args.doc_bytes)
    sp_model = args.sp_model
    if sp_model is None:
        t = time.perf_counter()
        sp = train_sentencepiece(args.input, args.vocab_size, str(work / "sp"), sample_bytes=args.sp_sample_bytes)
        sp_model = str(work / "sp.model")
        print(json.dumps({"trained": sp_model, "vocab_size": sp.vocab_size, "train_s": time.perf_counter() - t}))
    rows = []
    inputs = {"files": args.input, f"parquet, ~{args.doc_bytes} B docs": [str(web)]}
    for (kind, tokenizer), (data, paths), workers in itertools.product(
        (("bytes", "bytes"), ("sentencepiece", sp_model)), inputs.items(), args.workers
    ):
        runs = []  # (cpu, wall) of each repeat; the least-disturbed one (least CPU) is reported
        for _ in range(args.repeat):
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            t, cpu = time.perf_counter(), _cpu_seconds()
            m = build_shards(paths, str(out), tokenizer, shard_tokens=args.shard_tokens, workers=workers)
            runs.append((_cpu_seconds() - cpu, time.perf_counter() - t))
        cpu, wall = min(runs)
        per_cpu = m.total_tokens / cpu
        row = {
            "kind": kind,
            "input": data,
            "vocab_size": m.tokenizer["vocab_size"],
            "workers": workers,
            "tokens": m.total_tokens,
            "documents": m.total_documents,
            "wall_s": wall,
            "cpu_s": cpu,
            "tokens_per_s": m.total_tokens / wall,
            "tokens_per_cpu_s": per_cpu,
            "load_avg_1m": os.getloadavg()[0],
            "projected_hours": args.target_tokens / (per_cpu * args.cores) / 3600,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n| tokenizer | input | workers | tokens | wall s | tokens/s | CPU s | tokens per CPU-s | "
        f"{args.target_tokens / 1e9:g}B tokens on {args.cores} cores |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kind']} ({r['vocab_size']}) | {r['input']} | {r['workers']} | {r['tokens']:,} | "
            f"{r['wall_s']:.1f} | "
            f"{r['tokens_per_s'] / 1e6:.2f}M | {r['cpu_s']:.1f} | {r['tokens_per_cpu_s'] / 1e6:.2f}M | "
            f"{r['projected_hours']:.2f} h |"
        )
    return rows


def write_scale_dataset(root: Path, shards: int, shard_tokens: int, doc_tokens: int) -> None:
    """One real shard of random bytes, hard-linked ``shards`` times, plus its manifest."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=shard_tokens, dtype=np.uint8)
    lengths = np.full(shard_tokens // doc_tokens, doc_tokens, dtype=np.uint32)
    lengths[-1] += shard_tokens - int(lengths.sum())
    payload = encode_shard("shard", tokens, lengths)
    first = root / "shard-0000000.tar"
    first.write_bytes(payload)
    digest = sha256_hex(payload)
    entries = []
    for i in range(shards):
        name = f"shard-{i:07d}.tar"
        if i and not (root / name).exists():
            os.link(first, root / name)
        entries.append(
            {
                "path": name,
                "tokens": shard_tokens,
                "documents": int(lengths.size),
                "bytes": len(payload),
                "sha256": digest,
            }
        )
    tok = byte_tokenizer()
    manifest = Manifest(tokenizer=tok.identity(), dtype="uint8", shards=entries, build={"synthetic": True})
    save_manifest(manifest, str(root))


def _startup_child(source: str, seq_len: int, resume_tokens: int) -> None:
    """Runs in a fresh process: prints start-up time and peak RSS as JSON."""
    t0 = time.perf_counter()
    stream = PackedStream([(source, 1.0)], seq_len=seq_len, seed=0, rank=3, world_size=8)
    state = stream.state_dict()
    state["consumed"] = resume_tokens // seq_len
    stream.load_state_dict(state)
    t1 = time.perf_counter()
    sample = next(iter(stream))
    t2 = time.perf_counter()
    print(
        json.dumps(
            {
                "construct_and_resume_s": t1 - t0,
                "first_sample_s": t2 - t1,
                "startup_total_s": t2 - t0,
                "resumed_at_sample": int(sample["index"]),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "samples_per_epoch": stream.samples_per_epoch()[0],
            }
        )
    )


def scale(args: argparse.Namespace) -> list[dict]:
    """Build the big and the small synthetic manifests and measure each in a fresh process."""
    rows = []
    for shards in (100, args.shards):
        root = Path(args.workdir) / f"scale_{shards}"
        t = time.perf_counter()
        write_scale_dataset(root, shards, args.shard_tokens, args.doc_tokens)
        write_s = time.perf_counter() - t
        resume = int(0.85 * shards * args.shard_tokens)
        cmd = [sys.executable, "-m", "benchmarks.data_loader", "_startup", str(root), str(args.seq_len), str(resume)]
        t = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        wall = time.perf_counter() - t
        row = {
            "shards": shards,
            "manifest_tokens": shards * args.shard_tokens,
            "manifest_bytes": (root / "manifest.json").stat().st_size,
            "write_s": write_s,
            "process_wall_s": wall,
            **json.loads(out),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``throughput``, ``build`` or ``scale`` (see module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_loader", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tp = sub.add_parser("throughput")
    tp.add_argument("--input", nargs="+", required=True)
    tp.add_argument("--workdir", required=True)
    tp.add_argument("--seq-len", type=int, nargs="+", default=[512, 2048, 8192])
    tp.add_argument("--shard-tokens", type=int, default=1 << 20)
    tp.add_argument("--shuffle-buffer", type=int, default=256)
    tp.add_argument("--epochs", type=float, default=2.0)
    tp.add_argument("--vocab-size", type=int, default=8000)
    tp.add_argument("--sp-sample-bytes", type=int, default=20_000_000)
    tp.add_argument("--workers", type=int, default=1)
    bs = sub.add_parser("build")
    bs.add_argument("--input", nargs="+", required=True)
    bs.add_argument("--workdir", required=True)
    bs.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    bs.add_argument("--shard-tokens", type=int, default=1 << 22)
    bs.add_argument("--sp-model", default=None, help="a sentencepiece model; default: train one on the input")
    bs.add_argument("--vocab-size", type=int, default=32000)
    bs.add_argument("--sp-sample-bytes", type=int, default=20_000_000)
    bs.add_argument("--repeat", type=int, default=3, help="builds per row; the one with least CPU time is kept")
    bs.add_argument("--doc-bytes", type=int, default=3000, help="document size of the parquet copy")
    bs.add_argument("--target-tokens", type=float, default=18.8e9)
    bs.add_argument("--cores", type=int, default=64)
    sc = sub.add_parser("scale")
    sc.add_argument("--workdir", required=True)
    sc.add_argument("--shards", type=int, default=10_000)
    sc.add_argument("--shard-tokens", type=int, default=1_880_000)
    sc.add_argument("--doc-tokens", type=int, default=10_000)
    sc.add_argument("--seq-len", type=int, default=4096)
    s3 = sub.add_parser("s3", help="tokens/s per rank from a local S3 server beside local disk")
    from benchmarks import object_store

    object_store.add_loader_arguments(s3)
    s3.add_argument("--workdir", required=True)
    s3.add_argument("--endpoint", default=None, help="an S3 endpoint already running (default: start one)")
    s3.add_argument("--json", default=None, help="also write the rows here")
    child = sub.add_parser("_startup")
    child.add_argument("source")
    child.add_argument("seq_len", type=int)
    child.add_argument("resume_tokens", type=int)
    args = parser.parse_args(argv)
    if args.command == "throughput":
        throughput(args)
    elif args.command == "build":
        build_speed(args)
    elif args.command == "scale":
        scale(args)
    elif args.command == "s3":
        from benchmarks import object_store

        rows = object_store.loader(args)
        print(object_store.table(rows))
        print(object_store.loader_summary(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    else:
        _startup_child(args.source, args.seq_len, args.resume_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
