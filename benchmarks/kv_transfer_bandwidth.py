"""KV transfer bandwidth: Mooncake reads between two processes (kvmesh's P/D path) against a plain
memory copy of the same bytes in one process.

    python benchmarks/kv_transfer_bandwidth.py [--blocks 256] [--block-kib 32] [--run 16]
                                               [--regions 60] [--reps 5] [--protocol tcp]

A "producer" process registers a KV-cache-shaped buffer (--regions regions of --blocks blocks of
--block-kib KiB: the built-in model's 30 layers x K/V, one block of 16 tokens is 3 heads x 64 x
16 x 4 bytes = 12 KiB in float32) with Mooncake; the "consumer" registers its own and reads every
block with one MooncakeTransfer.read batch, one read per run of --run contiguous blocks per
region (as kv_transfer/layout.plan_reads plans them), exactly as a decode engine does. Two
baselines move the same ranges: a memory copy with numpy within one process, and a loopback copy
(another process sends the ranges over one plain TCP connection on 127.0.0.1, received in place
with recv_into: the bytes crossing the loopback interface as any socket copy would, with no
transfer engine). Best of --reps, GB/s = 1e9 B/s.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.engine.kv_transfer.layout import KVLayout, plan_reads  # noqa: E402
from kvmesh.engine.kv_transfer.mooncake import MooncakeTransfer  # noqa: E402


def _producer(nbytes: int, protocol: str, ready, done) -> None:
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    t = MooncakeTransfer("127.0.0.1", protocol)
    t.register(buf.ctypes.data, nbytes)
    ready.put((t.rpc_addr, buf.ctypes.data))
    done.wait()


def _sender(nbytes: int, ranges: list[tuple[int, int]], reps: int, port_q, done) -> None:
    """Send the ranges of the producer's bytes `reps` times over one TCP connection."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    view = memoryview(src)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            for _ in range(reps):
                if conn.recv(1) != b"g":       # the receiver's go: one timed pass each
                    return
                for off, n in ranges:
                    conn.sendall(view[off:off + n])
    done.wait()


def loopback_copy(nbytes: int, ranges: list[tuple[int, int]], reps: int) -> float:
    """Best seconds to receive the ranges over loopback TCP, each into its place in a buffer."""
    port_q, done = mp.Queue(), mp.Event()
    proc = mp.Process(target=_sender, args=(nbytes, ranges, reps, port_q, done), daemon=True)
    proc.start()
    dst = np.zeros(nbytes, dtype=np.uint8)
    view = memoryview(dst)
    best = float("inf")
    try:
        with socket.create_connection(("127.0.0.1", port_q.get(timeout=60))) as conn:
            for _ in range(reps):
                t0 = time.perf_counter()
                conn.sendall(b"g")
                for off, n in ranges:
                    got = 0
                    while got < n:
                        got += conn.recv_into(view[off + got:off + n], n - got)
                best = min(best, time.perf_counter() - t0)
    finally:
        done.set()
        proc.join(10)
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    for off, n in ranges:
        assert np.array_equal(dst[off:off + n], src[off:off + n]), "loopback bytes differ"
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=12)
    ap.add_argument("--run", type=int, default=16, help="contiguous blocks per read")
    ap.add_argument("--regions", type=int, default=60, help="layers x 2 (K, V)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--protocol", default="tcp")
    args = ap.parse_args()
    block_bytes = args.block_kib * 1024
    nbytes = args.regions * args.blocks * block_bytes
    ready, done = mp.Queue(), mp.Event()
    proc = mp.Process(target=_producer, args=(nbytes, args.protocol, ready, done), daemon=True)
    proc.start()
    try:
        rpc, base = ready.get(timeout=60)
        local = np.zeros(nbytes, dtype=np.uint8)
        t = MooncakeTransfer("127.0.0.1", args.protocol)
        t.register(local.ctypes.data, nbytes)
        lay_l = KVLayout(local.ctypes.data, args.regions, args.blocks, block_bytes, "uint8")
        lay_r = KVLayout(base, args.regions, args.blocks, block_bytes, "uint8")
        ids = list(range(args.blocks))
        # NOTE: runs of --run blocks: the remote runs in reverse order, so only blocks within a
        # run are contiguous on both sides (a producer's blocks are rarely one run)
        starts = list(range(0, args.blocks, args.run))
        order = [i for r in reversed(starts) for i in range(r, min(r + args.run, args.blocks))]
        laddrs, raddrs, lengths = plan_reads(lay_l, lay_r, ids, order)
        best_read = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            assert t.read(rpc, laddrs, raddrs, lengths), "Mooncake read failed"
            best_read = min(best_read, time.perf_counter() - t0)
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)   # the producer's
        for la, ra, n in zip(laddrs, raddrs, lengths):
            lo, ro = la - lay_l.base_addr, ra - base
            assert np.array_equal(local[lo:lo + n], src[ro:ro + n]), "read bytes differ"
        dst = np.zeros(nbytes, dtype=np.uint8)
        offs = [a - lay_l.base_addr for a in laddrs]
        best_copy = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for o, n in zip(offs, lengths):
                dst[o:o + n] = src[o:o + n]
            best_copy = min(best_copy, time.perf_counter() - t0)
        best_loop = loopback_copy(nbytes, [(ra - base, n) for ra, n in zip(raddrs, lengths)],
                                  args.reps)
        moved = sum(lengths)
        print(f"{moved / 2**20:.1f} MiB in {len(lengths)} reads ({args.regions} regions, runs of "
              f"{args.run} x {args.block_kib} KiB blocks), {args.protocol}")
        print(f"mooncake read : {moved / best_read / 1e9:6.2f} GB/s ({best_read * 1e3:.1f} ms)")
        print(f"memory copy   : {moved / best_copy / 1e9:6.2f} GB/s ({best_copy * 1e3:.1f} ms)")
        print(f"loopback copy : {moved / best_loop / 1e9:6.2f} GB/s ({best_loop * 1e3:.1f} ms, "
              f"one TCP connection on 127.0.0.1)")
        print(f"ratio         : {best_copy / best_read:6.2f} of the memory copy's bandwidth, "
              f"{best_loop / best_read:.2f} of the loopback copy's")
    finally:
        done.set()
        proc.join(10)


if __name__ == "__main__":
    main()
