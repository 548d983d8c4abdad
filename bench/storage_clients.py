"""Which S3 client the trace store uses: obstore vs boto3 vs s3fs, side by side on one server.

Measured against SeaweedFS ``weed mini`` on loopback (what the tests use), for what the store
does: put a 35 MB trace (the HTA ``control`` fixture, decompressed: uploads may be plain JSON)
from a file, stream it back in 1 MiB reads (a worker parsing it), and
a batch of small puts+gets (the latency of many small traces); plus the import time each
client adds to a worker. Every client runs the same operations on the same objects, in
alternating rounds, and the median is printed with the ratio to the fastest.

    .venv/bin/python bench/storage_clients.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests")]

from support.s3 import ACCESS_KEY, SECRET_KEY, S3Server, running_weed  # noqa: E402

BIG = REPO / "tests" / "fixtures" / "traces" / "hta" / "trace_diff" / "control" / "control.json.gz"
SMALL_COUNT = 50
SMALL_BYTES = 100_000
CHUNK = 1 << 20


class Obstore:
    name = "obstore"
    module = "obstore"

    def __init__(self, server: S3Server) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            server.bucket,
            config={
                "endpoint": server.endpoint,
                "access_key_id": ACCESS_KEY,
                "secret_access_key": SECRET_KEY,
                "region": "us-east-1",
            },
            client_options={"allow_http": True},
        )

    def put_file(self, key: str, path: Path) -> None:
        import obstore

        obstore.put(self.store, key, path)

    def put(self, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.store, key, data)

    def stream(self, key: str) -> int:
        import obstore

        total = 0
        for chunk in obstore.get(self.store, key).stream(min_chunk_size=CHUNK):  # one streamed GET
            total += len(chunk)
        return total

    def get(self, key: str) -> bytes:
        import obstore

        return bytes(obstore.get(self.store, key).bytes())


class Boto3:
    name = "boto3"
    module = "boto3"

    def __init__(self, server: S3Server) -> None:
        import boto3

        self.bucket = server.bucket
        self.client = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def put_file(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, key)

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def stream(self, key: str) -> int:
        body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        total = 0
        while chunk := body.read(CHUNK):
            total += len(chunk)
        return total

    def get(self, key: str) -> bytes:
        return bytes(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())


class S3fs:
    name = "s3fs"
    module = "s3fs"

    def __init__(self, server: S3Server) -> None:
        import s3fs

        self.bucket = server.bucket
        self.fs = s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            client_kwargs={"endpoint_url": server.endpoint, "region_name": "us-east-1"},
            use_listings_cache=False,
        )

    def put_file(self, key: str, path: Path) -> None:
        self.fs.put_file(str(path), f"{self.bucket}/{key}")

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.bucket}/{key}", data)

    def stream(self, key: str) -> int:
        total = 0
        with self.fs.open(f"{self.bucket}/{key}", "rb", block_size=CHUNK) as fh:
            while chunk := fh.read(CHUNK):
                total += len(chunk)
        return total

    def get(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(f"{self.bucket}/{key}"))


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def import_seconds(module: str) -> float:
    """Fresh-interpreter import time of the client (what each worker process pays)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    small = [bytes([i % 251]) * SMALL_BYTES for i in range(SMALL_COUNT)]
    with tempfile.TemporaryDirectory() as tmp, running_weed(Path(tmp)) as server:
        big = Path(tmp) / "control.json"
        big.write_bytes(gzip.decompress(BIG.read_bytes()))
        size = big.stat().st_size
        if isinstance(server, str):
            print(f"cannot run: {server}")
            return 1
        clients: list[Any] = []
        for cls in (Obstore, Boto3, S3fs):
            try:
                clients.append(cls(server))
            except ImportError as exc:
                print(f"{cls.name}: not installed ({exc}); skipped")
        results: dict[str, dict[str, list[float]]] = {c.name: {} for c in clients}
        for r in range(args.rounds):
            for client in clients if r % 2 == 0 else reversed(clients):
                key = f"{client.name}/r{r}/big.json.gz"
                res = results[client.name]
                res.setdefault("put 35 MB", []).append(_timed(lambda c=client, k=key: c.put_file(k, big)))
                res.setdefault("stream 35 MB", []).append(_timed(lambda c=client, k=key: c.stream(k)))

                def small_round(c: Any = client, r: int = r) -> None:
                    for i, data in enumerate(small):
                        c.put(f"{c.name}/r{r}/s{i}", data)
                    for i in range(len(small)):
                        assert len(c.get(f"{c.name}/r{r}/s{i}")) == SMALL_BYTES

                res.setdefault(f"{SMALL_COUNT}x100 kB put+get", []).append(_timed(small_round))
        for client in clients:
            results[client.name]["import"] = [import_seconds(client.module) for _ in range(3)]
    ops = ["put 35 MB", "stream 35 MB", f"{SMALL_COUNT}x100 kB put+get", "import"]
    print(f"S3 clients on SeaweedFS (loopback), {args.rounds} rounds, median seconds (ratio to fastest)")
    print(f"{'operation':<22}" + "".join(f"{c.name:>20}" for c in clients))
    for op in ops:
        medians = {c.name: statistics.median(results[c.name][op]) for c in clients}
        best = min(medians.values())
        cells = "".join(f"{medians[c.name]:>11.3f} ({medians[c.name] / best:4.2f}x)" for c in clients)
        print(f"{op:<22}{cells}")
    for c in clients:
        rate = size / statistics.median(results[c.name]["stream 35 MB"]) / 2**20
        print(f"{c.name}: streams at {rate:,.0f} MiB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
