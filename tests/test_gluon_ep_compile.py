"""CPU checks of the expert-parallel path's Gluon kernels: gluon_ep.gate_up_fwd_pull_kernel (pulls, claimed tiles,
ready flags) and gluon_rows.row_gemm_ws_kernel with PUSH (down_fwd and gate_up_dgrad pushing their rows).

Compiled for sm_90a as the other Gluon kernels are (tests/compile_checks.py); the assertions are about the code an
H200 would run:
  * the pulling gate_up_fwd: the one-GPU kernel's GEMM (the same wgmma, TMA loads and stores, register split);
    the pull partition (2 warps beside the producer's, at its registers) copying 16-byte vectors (4 loads and 4
    stores a step: 2 rows x 1024 columns), its barrier over its own 64 threads, each unit counted on its
    group's flag by one release add at GPU scope; tiles and units claimed by relaxed atomics; the producer's
    acquire of a flag (an acquire load at GPU scope) followed by `fence.proxy.async.global` before its TMA
    copies; the bounded wait's trap; the claimed-tile ring's mbarriers (STAGES x 2 + 2 x 2 initialised);
  * the pushing row GEMMs: the same wgmma as without PUSH, no TMA store, the rows stored as 16-byte vectors
    (each consumer's 64 x 256 tile: 16 a thread);
  * no spills, no local memory, shared memory within the SM.
A Python model of the claimed-tile ring (one producer, two consumers, two slots, parity waits as the hardware's)
checks under random interleavings that every consumer sees every claimed tile in claim order, the end marker
last, and that no wait passes on a phase it does not mean.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile checks need compiled (not interpreted) kernels", allow_module_level=True)

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
import torch  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from megamoe.backends.triton import configs  # noqa: E402
from megamoe.backends.triton.kernels import gluon_ep, gluon_gate_up, gluon_rows  # noqa: E402
from compile_checks import (  # noqa: E402
    KNOWN_SPILLS, SMEM_LIMIT, MBarrier, assert_no_spills_or_serialisation, assert_register_split, compile_gluon, count, divisible_by_16,
    int32_arg, kernel_signature, pointers, warp_specialized_report,
)

R, H, I, E = 2048, 2048, 768, 4  # qwen3-30b-a3b-like operands
POINTER_TYPES = {"x_rows_ptr": "*bf16", "pull_table_ptr": "*i64", "push_table_ptr": "*i64"}


def _arg_type(name: str) -> str:
    return POINTER_TYPES.get(name) or int32_arg(name)


def _ep_configs(hidden: int, inter: int, monkeypatch):
    """The expert-parallel table on a Hopper GPU (configs._arch patched: there is none here)."""
    monkeypatch.setattr(configs, "_arch", lambda device: (9, 0))
    return configs.ep_tma_kernel_configs(hidden, inter, torch.bfloat16, torch.device("cpu"), 128)


def test_ep_table_runs_the_compiled_kernels(monkeypatch):
    """The expert-parallel table is the one-GPU Hopper table but for gate_up_fwd, which runs a pulling kernel's tile
    (x rows by TMA, 3 stages): where one GPU gathers x (H <= 2048), the consumers' epilogue beside two staging
    buffers (gluon_gate_up's "s3b2"); elsewhere the hand-off kernel's ("s3-handoff"), as on one GPU."""
    for hidden, inter, tile in ((2048, 768, "s3b2"), (4096, 1536, "s3-handoff"), (2880, 2880, "s3-handoff")):
        ep = _ep_configs(hidden, inter, monkeypatch)
        one_gpu = configs.tma_kernel_configs(hidden, inter, torch.bfloat16, torch.device("cpu"), 128)
        cfg = ep.gate_up_fwd
        assert cfg.gluon and not cfg.gather and gluon_gate_up.tile_of(cfg) == gluon_gate_up.TILES[tile], (hidden, cfg)
        assert dataclasses.replace(ep, gate_up_fwd=one_gpu.gate_up_fwd) == one_gpu


def _compile_pull(monkeypatch, hidden: int = H, inter: int = I):
    """The pulling kernel the EP table runs at (hidden, inter): H <= 2048 gate_up_fwd_pull_kernel, else the hand-off
    one."""
    config = _ep_configs(hidden, inter, monkeypatch).gate_up_fwd
    tile = gluon_gate_up.tile_of(config)
    x, w = torch.empty(R, hidden, dtype=torch.bfloat16), torch.empty(E, 2 * inter, hidden, dtype=torch.bfloat16)
    h, gate_up = torch.empty(R, inter, dtype=torch.bfloat16), torch.empty(R, 2 * inter, dtype=torch.bfloat16)
    descs = dict(zip(("x_desc", "w_desc", "h_desc", "gu_desc"), gluon_gate_up.descriptors(x, w, h, gate_up, tile)))
    fn = gluon_ep.gate_up_fwd_pull_handoff_kernel if tile.handoff else gluon_ep.gate_up_fwd_pull_kernel
    consts = gluon_ep.constexprs(config, 1)
    signature = kernel_signature(fn, consts, {name: mangle_type(d) for name, d in descs.items()}, _arg_type)
    return tile, warp_specialized_report(compile_gluon(fn, signature, consts, divisible_by_16(fn, pointers(fn) | {"H", "I"})))


def _compile_push(gemm: str):
    tile = gluon_rows.TILES["coop"]
    w_nk = gemm == "down_fwd"
    a = torch.empty(R, I if w_nk else 2 * I, dtype=torch.bfloat16)
    w = torch.empty(E, H, I, dtype=torch.bfloat16) if w_nk else torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
    out = torch.empty(tile.store_m, H, dtype=torch.bfloat16)  # what the launcher passes: the buffer's shape only
    descs = dict(zip(("a_desc", "w_desc", "out_desc"), gluon_rows.descriptors(a, w, out, w_nk, tile)))
    descs |= {"x_desc": descs["a_desc"], "x_rows_desc": descs["w_desc"]}
    fn = gluon_rows.row_gemm_ws_kernel
    consts = gluon_rows.constexprs(tile, w_nk, 1, push=True)
    signature = kernel_signature(fn, consts, {name: mangle_type(d) for name, d in descs.items()}, _arg_type)
    return tile, warp_specialized_report(compile_gluon(fn, signature, consts, divisible_by_16(fn, pointers(fn))))


def _assert_pulling_gemm(name: str, tile, r: dict, stores: int):
    """What both pulling gate_up_fwd kernels share: gluon_gate_up's GEMM (2 consumers x gate, up x 4 k16 steps a
    K step, kept in flight), x rows and weights by TMA (no cp.async), `stores` TMA stores of [128, 1, N] boxes; the
    pull loop's 16-byte copies (4 loads, 4 stores) and one release add per unit on its group's flag (an atom under
    Triton 3.6 or, its result unused, a red under 3.9); the producer's acquire and proxy fence; 12 warps, the
    tile's register split, no spills, shared memory within the SM."""
    ptx, meta = r["ptx"], r["compiled"].metadata
    print(f"\n{name}: {meta.num_warps} warps, {r['ptxas']['registers']} registers, shared {meta.shared} B, "
          f"setmaxnreg {r['setmaxnreg']}")
    assert r["wgmma_any"] == 16 and count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx) == 16
    assert 2 in r["wait_groups"]
    assert (r["tma_load_2d"], r["tma_load_3d"], r["cp_async"]) == (1, 2, 0)
    assert count(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group", ptx) == stores
    assert count(r"ld\.global\.v4", ptx) == 4 and count(r"st\.global\.v4", ptx) == 4
    assert count(r"(atom|red)\.global\.gpu\.release\.add", ptx) == 1
    assert count(r"ld\.global\.gpu\.acquire\.b32", ptx) >= 1
    assert count(r"fence\.proxy\.async\.global", ptx) == 1
    assert meta.num_warps == 12
    assert_register_split(name, r, tile.producer_regs, tile.consumer_regs)
    assert_no_spills_or_serialisation(name, r, **KNOWN_SPILLS.get(name, {}))
    assert tile.smem_bytes() <= meta.shared <= SMEM_LIMIT


def test_pulling_gate_up_fwd_sm90a(monkeypatch):
    tile, r = _compile_pull(monkeypatch)
    ptx, name = r["ptx"], "gate_up_fwd_pull"
    # The stores: g, u and h, 3 per consumer; the pull warps' barrier over their own 64 threads.
    _assert_pulling_gemm(name, tile, r, stores=6)
    assert count(r"bar\.sync\s+\d+, 64;", ptx) >= 1, "the pull warps' barrier is not their own"
    assert count(r"atom\.global\.gpu\.relaxed\.add", ptx) >= 3  # units (2 claim sites) and tiles
    assert count(r"\btrap;", ptx) == 1
    ring = 2 * tile.stages + 2 * 2  # ready/empty per stage, full/empty per claimed-tile slot
    assert r["mbar_init"] == ring, f"{name}: {r['mbar_init']} mbarrier.init"


def test_pulling_gate_up_fwd_handoff_sm90a(monkeypatch):
    """The hand-off kernel with pulls (qwen3-235b-a22b's shape): gluon_gate_up.gate_up_fwd_handoff_kernel's GEMM
    and stores (g, u and h, one [128, 1, 128] box each, from the epilogue warps), the same pull loop on one warp
    (a row a step: 4 16-byte copies a thread), claims, acquire and fence as gate_up_fwd_pull_kernel; the claimed-tile
    ring read by three partitions."""
    tile, r = _compile_pull(monkeypatch, 4096, 1536)
    assert tile.handoff
    _assert_pulling_gemm("gate_up_fwd_pull_handoff", tile, r, stores=3)
    # A one-warp partition's barrier is bar.warp.sync, which also orders the lanes' stores before lane 0's release.
    assert count(r"bar\.warp\.sync", r["ptx"]) >= 1, "the pull warp's barrier"
    assert r["mbar_init"] == 2 * tile.stages + 2 + 2 * 2  # ring, gu_ready / gu_free, the claimed-tile slots


@pytest.mark.parametrize("gemm", ["down_fwd", "gate_up_dgrad"])
def test_pushing_row_gemm_sm90a(gemm):
    tile, r = _compile_push(gemm)
    ptx, meta, name = r["ptx"], r["compiled"].metadata, f"{gemm} push"
    per_step = 2 * (tile.store_m // 64) * (tile.block_k // 16)
    assert r["wgmma_any"] == per_step
    assert count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.bulk_group", ptx) == 0, f"{name}: TMA stores"
    vectors = tile.store_m * tile.block_n * 2 // (128 * 16)  # 16-byte stores a thread of each consumer
    assert count(r"st\.global\.v4\.b32", ptx) == 2 * vectors and count(r"st\.global\.(?!v4)", ptx) == 0
    assert meta.num_warps == 12
    assert_register_split(name, r, tile.producer_regs, tile.consumer_regs)
    assert_no_spills_or_serialisation(name, r)
    assert meta.shared <= SMEM_LIMIT


# ----------------------------------------------------------------------------------------------------
# The claimed-tile ring, modelled


def _run_ring(tiles: list[int], end: int, rng: random.Random, readers: int = 2):
    """The producer publishes tiles + [end] as _publish_tile does, each reader (the two consumers; with the hand-off,
    the epilogue warps too) reads as _claimed_tile does, in a random interleaving of all of them. Returns what each
    reader read; fails on a deadlock or an aliased wait."""
    full = [MBarrier(f"id_full[{i}]", 1) for i in range(2)]
    empty = [MBarrier(f"id_empty[{i}]", readers) for i in range(2)]
    slots = [None, None]
    claims = tiles + [end]
    state = {"p": 0, "c": [0] * readers}
    read = [[] for _ in range(readers)]

    def producer_step():
        j = state["p"]
        if j == len(claims):
            return False
        slot, parity = j % 2, ((j // 2) & 1) ^ 1
        if not empty[slot].passes(parity):
            return False
        # the wait means phase j // 2 - 1 of empty[slot] (every reader read claim j - 2): exactly that phase done
        assert empty[slot].phase == j // 2, "producer's wait aliased"
        slots[slot] = claims[j]
        full[slot].arrive()
        state["p"] += 1
        return True

    def reader_step(wg):
        j = state["c"][wg]
        if read[wg] and read[wg][-1] == end:
            return False
        slot, parity = j % 2, (j // 2) & 1
        if not full[slot].passes(parity):
            return False
        assert full[slot].phase == j // 2 + 1, "reader's wait aliased"
        read[wg].append(slots[slot])
        empty[slot].arrive()
        state["c"][wg] += 1
        return True

    steps = [producer_step] + [lambda wg=wg: reader_step(wg) for wg in range(readers)]
    while not all(r and r[-1] == end for r in read):
        order = rng.sample(steps, len(steps))
        assert any(step() for step in order), "deadlock"
    return read


@pytest.mark.parametrize("readers", [2, 3], ids=["consumers", "consumers+epilogue"])
def test_claimed_tile_ring_model(readers):
    rng = random.Random(0)
    for _ in range(300):
        tiles = sorted(rng.sample(range(200), rng.randint(0, 12)))
        read = _run_ring(tiles, 200, rng, readers)
        assert all(r == tiles + [200] for r in read)
