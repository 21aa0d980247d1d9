"""Dispatch and combine alone over symmetric memory: GB/s of cross-GPU payload per direction.

Usage: torchrun --nproc-per-node=N benchmarks/comm_bench.py [--workload NAME] [--tokens T] [--sweep] [--json PATH]
Balanced routing. Each direction of each operation is timed twice, with CUDA events, median over
iterations of the max over ranks (megamoe.bench.measure.median_ms):
  exchange  as the library runs it: its maps, barriers, publish copy and result copy included;
  kernel    its row copy alone (the kernel and its per-call index maps), buffers published beforehand.
--sweep also times the kernel at every launch shape of SHAPES (programs per SM, bytes per step, warps).
Payload = rows that cross GPUs (source rank != destination rank) x H x 2 bytes, per rank; the
copy-engine-free ceiling on NV18 is ~367 GB/s one way by SM pull (measured on 2x H200 by an earlier
session, docs/perf-notes.md).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from megamoe.backends.triton.comm.exchange import (
    combine, dispatch, publish, pull_pairs, pull_rows, push_rows, push_tokens, receive_maps,
)
from megamoe.backends.triton.comm.workspace import get_workspace
from megamoe.backends.triton.kernels.row_copy import COPY_SHAPE, CopyShape
from megamoe.bench.measure import median_ms, run_facts
from megamoe.bench.workloads import WORKLOADS
from megamoe.schedule import build_schedule


SHAPES = [CopyShape(p, b, w) for p in (1, 2, 4, 8) for b in (8192, 16384, 32768) for w in (4, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="qwen3-30b-a3b", choices=list(WORKLOADS))
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time the kernels at every launch shape of SHAPES")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world, group = dist.get_world_size(), dist.group.WORLD
    w = WORKLOADS[args.workload]
    T, H, k, E = args.tokens or w.tokens_per_gpu, w.hidden, w.top_k, w.num_experts
    g = torch.Generator(device="cuda").manual_seed(rank)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    s = build_schedule(ids, E, group=group, block_m=128)
    ws = get_workspace(group, device="cuda", num_tokens=T, hidden_size=H, top_k=k, num_rows=s.num_rows, dtype=torch.bfloat16)
    rows = dispatch(ws, x, s, "pull")
    pairs_per_rank = T * k
    src_rank = torch.where(s.row_src >= 0, s.row_src // pairs_per_rank, rank)
    incoming = int((src_rank != rank).sum())  # rows this rank receives from peers (dispatch)
    outgoing = int(((s.dest_rank != rank) & (s.dest_row >= 0)).sum())  # rows it sends (dispatch)
    maps = receive_maps(s)
    pairs_out = x.new_empty(T * k, H)
    pulled = x.new_empty(s.num_rows, H)
    # The kernels alone read (pull) or overwrite (push) buffers published once (below); no rank reads a
    # buffer that peers push into while they are timed.
    kernels = {
        ("dispatch", "pull"): lambda shape: pull_rows(ws.tokens, maps, pulled, by_token=True, shape=shape),
        ("dispatch", "push"): lambda shape: push_tokens(ws, x, s, maps, shape),
        ("combine", "push"): lambda shape: push_rows(ws.pairs, rows, maps, shape),
        ("combine", "pull"): lambda shape: pull_pairs(ws, s, pairs_out, shape),
    }
    records = []
    device = torch.device("cuda", rank)
    facts = run_facts(device)

    def timed(fn) -> float:
        return median_ms(lambda i: fn(), iters=args.iters, warmup=2, device=device, group=group)

    for op, direction, fn, payload_rows in (
        ("dispatch", "pull", lambda: dispatch(ws, x, s, "pull"), incoming),
        ("dispatch", "push", lambda: dispatch(ws, x, s, "push"), outgoing),
        ("combine", "push", lambda: combine(ws, rows, s, "push"), incoming),
        ("combine", "pull", lambda: combine(ws, rows, s, "pull"), outgoing),
    ):
        moved = torch.tensor([payload_rows * H * 2], device="cuda", dtype=torch.float64)
        dist.all_reduce(moved, op=dist.ReduceOp.MIN)
        base = {"workload": args.workload, "ep": world, "tokens": T, "op": op, "direction": direction,
                "payload_bytes_per_rank": int(moved.item()), **facts}
        ms = timed(fn)
        records.append({**base, "what": "exchange", "ms": ms, "gbps": moved.item() / ms / 1e6})
        publish(ws, [(ws.tokens, x), (ws.rows_out, rows)], "dispatch")  # (the exchange above may have reused them)
        for shape in SHAPES if args.sweep else [COPY_SHAPE]:
            ms = timed(lambda shape=shape: kernels[op, direction](shape))
            records.append({**base, "what": "kernel", "shape": shape._asdict(), "default_shape": shape == COPY_SHAPE,
                            "ms": ms, "gbps": moved.item() / ms / 1e6})
        dist.barrier()
    if rank == 0:
        print(f"{'op':9} {'direction':9} {'what':8} {'shape (progs/SM, step B, warps)':32} {'ms':>7} {'MB/rank':>8} {'GB/s':>7}")
        for r in records:
            shape = "" if r["what"] == "exchange" else ", ".join(str(v) for v in r["shape"].values())
            print(f"{r['op']:9} {r['direction']:9} {r['what']:8} {shape:32} {r['ms']:7.3f} "
                  f"{r['payload_bytes_per_rank'] / 1e6:8.1f} {r['gbps']:7.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
