"""Streaming data: time to first batch, peak memory and read throughput of the TokenDataset.

Generates, in a temporary directory, a token corpus of ``--gb`` GB (int32 ``list``
rows of varied lengths, row groups of about ``--row-group-mb`` MB) and a small one
of ``--small-mb`` MB, then measures, with the dataset alone (no Ray, no model), each
case in a fresh subprocess so its peak RSS (VmHWM) is the reader's own:

  stream      TokenDataset.open + sample, read_ahead_mb ``--read-ahead-mb``, in the
              run's order (``data_order``: full permutation where the corpus fits the read-ahead,
              else blocks of 16 mixed as widely as it holds row groups), prefetching the next step
  in-memory   the old way: the whole small corpus read into one int64 array and sliced
              (``--baseline-big``: the large one too)

Per case: time to open, time to the first global batch (from before open), samples/s
over ``--steps`` steps of global batch ``--batch`` at ``--seq-len`` (after the first),
peak RSS, the interpreter's RSS before any data was read, and the reader's cache peak.
The corpus is deleted afterwards (``--keep`` to keep it). Run on a quiet machine:

    python benchmarks/data.py                       # 2 GB and 64 MB corpora, 300 steps
    python benchmarks/data.py --gb 0.25 --steps 50  # smoke
    python benchmarks/data.py --out results.json

``--train`` also trains a small GPT (dp=1 x pp=2, local Ray cluster) on each corpus, in a
fresh process per run, ``--train-rounds`` times alternating: time from ``fit()`` to the first
step, each worker's peak RSS, and steady tokens/s (``benchmarks/_data_train.py``). The small
corpus fits in the read-ahead, so after its first pass it is read from memory.

``--s3`` also puts both corpora on a local S3 server (moto on 127.0.0.1, in this process, with
its credentials enforced: ``tests/s3_server.py``) and streams them from there, the reader alone
and, with ``--train``, the trainer: the same cases against local disk, side by side.

    python benchmarks/data.py --gb 0.5 --file-mb 16 --s3 --train

(moto reads a whole object for every ranged GET: py-spy puts 61% of the server's time in
``FakeKey.value`` reading the object's spooled file, against 256 MB files; with 16 MB files
that cost is the server's, not the reader's, only in part.)

Prints a markdown table; ``--out FILE`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS_MEAN = 600  # tokens per row (document) on average; lengths vary from 1 to ~6000


def rss_mib(key: str = "VmHWM", pid: int | str = "self") -> float | None:
    """VmHWM (the most resident memory a process has had) or VmRSS (now) of ``pid``, MiB;
    None where /proc does not have it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    if pid != "self":
        return None
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def generate(out: Path, gb: float, row_group_mb: float, seed: int, file_mb: float = 256.0,
             vocab: int = 8192) -> dict:
    """Write ~``gb`` GB of int32 token rows; returns what was written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    total = int(gb * 1e9) // 4
    per_file = int(file_mb * (1 << 20)) // 4
    rows_per_group = max(1, int(row_group_mb * (1 << 20)) // 4 // ROWS_MEAN)
    written, files, rows, t0 = 0, 0, 0, time.perf_counter()
    while written < total:
        n = min(per_file, total - written)
        lengths = np.clip(rng.lognormal(np.log(ROWS_MEAN) - 0.5, 1.0, n // ROWS_MEAN * 2 + 16), 1, 10 * ROWS_MEAN)
        lengths = lengths.astype(np.int64)
        cut = int(np.searchsorted(np.cumsum(lengths), n))
        lengths = lengths[: cut + 1]
        lengths[-1] -= int(lengths.sum()) - n
        lengths = lengths[lengths > 0]
        tokens = rng.integers(0, vocab, n, dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
        pq.write_table(pa.table({"tokens": col}), out / f"part-{files:05d}.parquet", row_group_size=rows_per_group)
        written, files, rows = written + n, files + 1, rows + len(lengths)
        print(f"\r  {out.name}: {written * 4 / 1e9:.2f} / {total * 4 / 1e9:.2f} GB, {files} files, "
              f"{time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    on_disk = sum(f.stat().st_size for f in out.iterdir())
    return {"tokens": written, "rows": rows, "files": files, "bytes_on_disk": on_disk}


# -- one case, in its own process ------------------------------------------------
def run_case(kind: str, path: str, steps: int, batch: int, seq_len: int, read_ahead_mb: float) -> dict:
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from elastic_trainer.config import DataSection
    from elastic_trainer.data.dataset import TokenDataset
    from elastic_trainer.data.sampler import GlobalSampler
    from elastic_trainer.data.splits import data_order

    rss_base = rss_mib("VmRSS")  # the interpreter and its libraries, before any data

    t0 = time.perf_counter()
    if kind == "stream":
        ds = TokenDataset.open(DataSection(path=path, seq_len=seq_len, read_ahead_mb=read_ahead_mb))
        n, sample, prefetch = len(ds), ds.sample, ds.prefetch
    else:
        flat = pc.list_flatten(pq.read_table(path, columns=["tokens"]).column(0)).to_numpy().astype(np.int64)
        n = len(flat) // (seq_len + 1)
        rows = flat[: n * (seq_len + 1)].reshape(n, seq_len + 1)
        del flat
        ds = None

        def sample(idx):
            r = rows[idx]
            return r[:, :-1], r[:, 1:]

        def prefetch(idx):
            pass
    t_open = time.perf_counter() - t0
    if ds is not None:
        block, mix = data_order(DataSection(path=path, seq_len=seq_len, read_ahead_mb=read_ahead_mb), ds)
    else:
        block, mix = 1, n  # the in-memory baseline: a full permutation
    sampler = GlobalSampler(n, seed=0, block=block, mix=mix)
    x, _ = sample(sampler.rows(0, batch))
    prefetch(sampler.rows(batch, batch))
    t_first = time.perf_counter() - t0
    assert x.shape == (batch, seq_len)
    t1 = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = sample(sampler.rows(step * batch, batch))
        prefetch(sampler.rows((step + 1) * batch, batch))
        int(x[0, 0]) + int(y[-1, -1])  # touch the batch as a trainer would
    dt = time.perf_counter() - t1
    res = {"case": kind, "windows": n, "order": [block, mix], "open_s": t_open, "first_batch_s": t_first,
           "samples_per_s": steps * batch / dt, "step_ms": 1000 * dt / steps,
           "rss_base_mib": rss_base, "peak_rss_mib": rss_mib()}
    if ds is not None:
        res.update(cache_peak_mib=ds.peak_bytes / (1 << 20), read_ahead_mb=read_ahead_mb)
        ds.close()
    return res


def case_subprocess(kind: str, path: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--case", kind, "--path", str(path), "--steps", str(args.steps),
           "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--read-ahead-mb", str(args.read_ahead_mb)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| case | corpus | open s | first batch s | samples/s | step ms | peak RSS MiB | RSS before data MiB "
             "| cache peak MiB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cache = f"{r['cache_peak_mib']:.0f} (cap {r['read_ahead_mb']:.0f})" if "cache_peak_mib" in r else "-"
        lines.append(f"| {r['case']} | {r['corpus']} | {r['open_s']:.3f} | {r['first_batch_s']:.3f} | "
                     f"{r['samples_per_s']:,.0f} | {r['step_ms']:.2f} | {r['peak_rss_mib']:.0f} | "
                     f"{r['rss_base_mib']:.0f} | {cache} |")
    return "\n".join(lines)


def train_table(rows: list[dict]) -> str:
    lines = ["| training on | round | fit() to first step s | steady tokens/s | step ms | peak RSS per worker MiB |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        rss = ", ".join(f"rank {k}: {v:.0f}" for k, v in r["worker_peak_rss_mib"].items())
        lines.append(f"| {r['corpus']} | {r['round']} | {r['first_step_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['step_ms']:.1f} | {rss} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the large corpus in GB (default 2)")
    ap.add_argument("--small-mb", type=float, default=64.0, help="size of the small corpus in MB (default 64)")
    ap.add_argument("--row-group-mb", type=float, default=1.0, help="row group size, MB (default 1)")
    ap.add_argument("--file-mb", type=float, default=256.0,
                    help="Parquet file size, MB (default 256); with --s3 give 16: the local S3 server (moto) reads "
                         "a whole object for every ranged GET, which a real S3 does not")
    ap.add_argument("--steps", type=int, default=300, help="timed steps after the first batch (default 300)")
    ap.add_argument("--batch", type=int, default=64, help="global batch, windows (default 64)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192, help="token ids are drawn from range(vocab) (default 8192)")
    ap.add_argument("--read-ahead-mb", type=float, default=256.0, help="the streaming reader's cache cap")
    ap.add_argument("--dir", help="where to write the corpora (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpora")
    ap.add_argument("--baseline-big", action="store_true",
                    help="also load the large corpus in memory (needs ~4x --gb of RAM): the old reader's cost")
    ap.add_argument("--train", action="store_true", help="also train on each corpus (see the docstring)")
    ap.add_argument("--train-steps", type=int, default=150, help="--train: steps per run (default 150)")
    ap.add_argument("--train-rounds", type=int, default=2, help="--train: runs per corpus, alternating (default 2)")
    ap.add_argument("--only-train", action="store_true", help="skip the reader-only cases")
    ap.add_argument("--s3", action="store_true", help="also stream each corpus from a local S3 server")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--case", choices=["stream", "memory"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:  # the child: one measurement, one JSON line
        print(json.dumps(run_case(args.case, args.path, args.steps, args.batch, args.seq_len, args.read_ahead_mb)))
        return

    work = Path(tempfile.mkdtemp(prefix="et-bench-data-", dir=args.dir))
    doc = {"config": vars(args), "corpora": {}, "rows": []}
    try:
        print(f"generating corpora in {work}", file=sys.stderr)
        big, small = work / f"big-{args.gb:g}gb", work / f"small-{args.small_mb:g}mb"
        doc["corpora"]["big"] = generate(big, args.gb, args.row_group_mb, seed=1, file_mb=args.file_mb,
                                         vocab=args.vocab)
        doc["corpora"]["small"] = generate(small, args.small_mb / 1000, args.row_group_mb, seed=2,
                                           file_mb=args.file_mb, vocab=args.vocab)
        big_name, small_name = f"{args.gb:g} GB", f"{args.small_mb:g} MB"
        cases = [("stream", big, big_name), ("stream", small, small_name), ("memory", small, small_name)]
        trains = [(big, big_name), (small, small_name)]
        if args.s3:
            from tests.s3_server import S3Server

            server = S3Server()   # serves from this process's threads; the cases run in others
            bucket = server.bucket("bench-data")
            # The children (and the trainer's workers) find the credentials where users keep them.
            os.environ.update(AWS_ACCESS_KEY_ID=server.key, AWS_SECRET_ACCESS_KEY=server.secret,
                              AWS_EC2_METADATA_DISABLED="true")
            on_s3 = {}
            for path, name in trains:
                pafs.copy_files(str(path), f"{bucket}/{path.name}", source_filesystem=pafs.LocalFileSystem(),
                                destination_filesystem=server.fs())
                on_s3[name] = server.uri(bucket, path.name)
            cases += [("stream", on_s3[big_name], f"{big_name} on S3"),
                      ("stream", on_s3[small_name], f"{small_name} on S3")]
            trains += [(on_s3[big_name], f"{big_name} on S3"), (on_s3[small_name], f"{small_name} on S3")]
        for kind, path, name in ([] if args.only_train else
                                 cases + ([("memory", big, big_name)] if args.baseline_big else [])):
            print(f"  measuring {kind} on {name} ...", file=sys.stderr)
            r = case_subprocess(kind, path, args)
            r["case"] = "streaming" if kind == "stream" else "in-memory"
            r["corpus"] = name
            doc["rows"].append(r)
        if args.train:
            doc["train"] = []
            for rnd in range(args.train_rounds):
                for path, name in trains:
                    print(f"  training on {name}, round {rnd + 1} ...", file=sys.stderr)
                    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "_data_train.py"), str(path),
                                          str(args.train_steps), str(args.read_ahead_mb), str(args.vocab)],
                                         check=True, capture_output=True, text=True, cwd=ROOT)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    r.update(corpus=name, round=rnd + 1)
                    doc["train"].append(r)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if doc.get("train"):
        print(train_table(doc["train"]) + "\n")
    if args.s3 and doc.get("train"):
        rate = {}
        for r in doc["train"]:
            rate.setdefault(r["corpus"], []).append(r["tokens_per_s"])
        for name in (big_name, small_name):
            if f"{name} on S3" in rate:
                print(f"training on {name} from S3: {statistics.median(rate[name + ' on S3']):,.0f} tokens/s, "
                      f"{statistics.median(rate[name + ' on S3']) / statistics.median(rate[name]):.1%} of local "
                      f"disk's {statistics.median(rate[name]):,.0f}")
    if args.only_train:
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1, default=str))
        return
    print(table(doc["rows"]))
    st, mem = doc["rows"][0], doc["rows"][2]
    print(f"\nstreaming {big_name} reads at {st['samples_per_s'] / mem['samples_per_s']:.1%} of the in-memory "
          f"baseline's rate; its peak RSS is {st['peak_rss_mib'] - st['rss_base_mib']:.0f} MiB above the "
          f"interpreter's for a {doc['corpora']['big']['bytes_on_disk'] / (1 << 20):,.0f} MiB corpus")
    by = {r["corpus"]: r for r in doc["rows"] if r["case"] == "streaming"}
    for name in (big_name, small_name):
        if f"{name} on S3" in by:
            print(f"streaming {name} from S3 reads at {by[name + ' on S3']['samples_per_s'] / by[name]['samples_per_s']:.1%}"
                  " of local disk's rate")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main()
