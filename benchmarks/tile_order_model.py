"""A model of the DRAM bytes a one-GPU row-block GEMM reads, per tile order: no GPU, seconds on a CPU.

Usage: python benchmarks/tile_order_model.py [--workload NAME ...] [--routing balanced|skewed] [--l2-mib 30]
    [--group-m 8] [--sms 132]

The row GEMMs (gate_up_fwd, down_fwd, down_dgrad, gate_up_dgrad) read, per tile and K step, a box of the A rows
[128, 64] and a box of the expert's weight [64, block_n] (gate_up_fwd: a gate and an up box). The model runs the
tiles in a tile order on `sms` CTAs in lockstep (a wave of `sms` consecutive tiles, each K step of every tile of
the wave in turn) through an LRU cache of `l2_mib` MiB standing for the L2, and counts the bytes it misses. Two
orders: "experts" (the kernels' order, _common.expert_tile_coords: groups of group_m row blocks inside one
expert) and "across" (_common.tile_coords over the whole range: groups run across expert boundaries, the order
before). The routing is the benchmarks' (megamoe.bench.routing, drawn on the CPU with the seed the benchmarks use,
so the same statistics, not the same draw as a GPU run).

What it is for: the tile order's share of the weights' re-reads. It reproduced ncu's balanced DRAM reads at
gpt-oss-120b on an H100 within 2-7% (docs/perf-notes.md, forty-eighth session) but not the growth under skewed
routing there (it depends on timing the lockstep leaves out). Not counted: the epilogue's reads (down_dgrad's saved
gate_up rows), writes, the weight-grad kernels.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import torch

from megamoe.bench.routing import ROUTINGS, expert_load_E, route
from megamoe.bench.workloads import WORKLOADS, Workload, comma_names

BLOCK_M, BLOCK_K, ELEM = 128, 64, 2  # the Hopper tiles' rows, K step and bf16 bytes
ORDERS = ("experts", "across")


@dataclasses.dataclass(frozen=True)
class RowGemm:
    """A row GEMM's tile space: K, output columns in column blocks of block_n, weight bytes per K step."""

    name: str
    k: int
    n: int
    block_n: int
    w_step_bytes: int


def row_gemms(w: Workload) -> list[RowGemm]:
    """The four row GEMMs at the Hopper tile table's tiles (configs._SM90_TMA): gate_up_fwd 128 gate + 128 up
    columns, down_fwd and gate_up_dgrad 256, down_dgrad 128."""
    h, i = w.hidden, w.intermediate
    return [RowGemm("gate_up_fwd", h, i, 128, 2 * 128 * BLOCK_K * ELEM),
            RowGemm("down_fwd", i, h, 256, 256 * BLOCK_K * ELEM),
            RowGemm("down_dgrad", h, i, 128, 128 * BLOCK_K * ELEM),
            RowGemm("gate_up_dgrad", 2 * i, h, 256, 256 * BLOCK_K * ELEM)]


def expert_loads(w: Workload, routing: str) -> list[int]:
    """Pairs per expert of the workload's one-GPU problem (its one-GPU experts, T tokens per GPU, seed 1)."""
    experts = w.one_gpu_experts or w.num_experts
    ids, _ = route(routing, w.tokens_per_gpu, experts, w.top_k, torch.Generator().manual_seed(1))
    return expert_load_E(ids, experts).tolist()


def block_experts(loads: list[int]) -> list[int]:
    """The expert of each 128-row block (segments padded to whole blocks, as the schedule pads them)."""
    return [e for e, n in enumerate(loads) for _ in range(-(-n // BLOCK_M))]


def tile_order(block_expert: list[int], num_n: int, group_m: int, order: str) -> list[tuple[int, int]]:
    """Every (row block, column block) in the order's sequence."""
    num_m = len(block_expert)
    if order == "across":
        groups = [(s, min(group_m, num_m - s)) for s in range(0, num_m, group_m)]
    elif order == "experts":
        groups, start = [], 0
        while start < num_m:
            end = start
            while end < num_m and block_expert[end] == block_expert[start]:
                end += 1
            groups += [(s, min(group_m, end - s)) for s in range(start, end, group_m)]
            start = end
    else:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return [(s + i, n) for s, size in groups for n in range(num_n) for i in range(size)]


def modelled_reads(block_expert: list[int], gemm: RowGemm, order: str, l2_bytes: int, group_m: int = 8,
                   sms: int = 132) -> int:
    """Bytes missed by an LRU cache of l2_bytes over the tiles' A and weight boxes, the order's tiles in waves of
    `sms`, every tile of a wave taking its K steps in lockstep."""
    tiles = tile_order(block_expert, -(-gemm.n // gemm.block_n), group_m, order)
    steps = -(-gemm.k // BLOCK_K)
    a_bytes = BLOCK_M * BLOCK_K * ELEM
    cache: collections.OrderedDict = collections.OrderedDict()
    held = missed = 0
    for first in range(0, len(tiles), sms):
        wave = tiles[first:first + sms]
        for k in range(steps):
            for m, n in wave:
                for key, size in ((("a", m, k), a_bytes), (("w", block_expert[m], n, k), gemm.w_step_bytes)):
                    if key in cache:
                        cache.move_to_end(key)
                        continue
                    missed += size
                    cache[key] = size
                    held += size
                    while held > l2_bytes:
                        held -= cache.popitem(last=False)[1]
    return missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=comma_names(WORKLOADS), default=["gpt-oss-120b"])
    parser.add_argument("--routing", choices=ROUTINGS, default="balanced")
    parser.add_argument("--l2-mib", type=float, default=30.0)
    parser.add_argument("--group-m", type=int, default=8)
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args()
    if args.group_m < 1 or args.sms < 1 or args.l2_mib <= 0:
        parser.error(f"--group-m and --sms must be >= 1 and --l2-mib > 0, got {args.group_m}, {args.sms}, "
                     f"{args.l2_mib}")
    print(f"{'workload':16} {'gemm':14} {'experts GB':>10} {'across GB':>10} {'ratio':>6}")
    for name in args.workload:
        w = WORKLOADS[name]
        be = block_experts(expert_loads(w, args.routing))
        for gemm in row_gemms(w):
            got = {o: modelled_reads(be, gemm, o, int(args.l2_mib * 2**20), args.group_m, args.sms) for o in ORDERS}
            print(f"{name:16} {gemm.name:14} {got['experts'] / 1e9:10.2f} {got['across'] / 1e9:10.2f} "
                  f"{got['experts'] / got['across']:6.3f}")


if __name__ == "__main__":
    main()
