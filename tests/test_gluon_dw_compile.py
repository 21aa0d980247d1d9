"""Ahead-of-time compile checks of the Gluon weight-gradient kernel (megamoe/backends/triton/kernels/gluon_dw.py),
on CPU, and a model of its barrier protocol.

The kernel compiles without a GPU the way tests/test_gluon_rows_compile.py compiles the row-block GEMMs: a
GluonASTSource through triton.compile for GPUTarget("cuda", 90, 32), with the tensor-descriptor signatures the
launcher produces (mangle_type of host-side Gluon TensorDescriptors over CPU tensors). Every config of
gluon_dw.CONFIGS is compiled with the launcher's constexprs; the assertions are about what an H200 would run:

  * wgmma: exactly 2 x (rows per warpgroup / 64) x (BLOCK_K / 16) wgmma.mma_async m64n{BLOCK_N}k16 per row step,
    every one with both operands MN-major from shared memory (imm-trans-a = imm-trans-b = 1: the row-major
    [rows, M] / [rows, N] tiles consumed as A^T and B), accumulating (scale-d true), kept in flight across
    steps (wait_group 1); the same count of HGMMA ... .tnspA.tnspB in the SASS. The production Triton kernel
    (tma_gemm.dw_tma_kernel with the TMA table's tile) compiles to the same instruction form, which is what
    the bitwise equality rests on;
  * TMA: the a and b tiles by 2-D cp.async.bulk.tensor completing on an mbarrier (one message per 128-byte
    swizzle width: (BLOCK_M + BLOCK_N) / 64), the outputs by 3-D TMA stores (one per consumer warpgroup), no
    cp.async;
  * mbarriers: 2 x STAGES + 2 x TILE_SLOTS (the tile ring) initialised (+ 2 order barriers for pingpong),
    try_wait.parity, expect_tx, arrive;
  * warp specialization: 12 warps, setmaxnreg 232 (consumers) / 40 (producer);
  * ptxas -v: no spills, no stack frame, no wgmma serialisation (C7510); no local memory in the SASS (one
    release's exceptions: compile_checks.KNOWN_SPILLS); shared memory within the 227 KB of an SM and at least
    the ring + epilogue buffers.

The protocol model runs the kernel's three partitions (producer, two consumers) of every CTA of a small grid as
Python generators with the same index arithmetic (the tiles dealt round-robin, then claimed from one counter
shared by the CTAs, a claim a tile ahead, the gathering producer's a tile further ahead with its row sources
loaded a step ahead; the tile ring; slot counters, parities, the pingpong skip and order barrier) over mbarriers
that behave like the hardware's (a parity wait passes when the phase of that parity is the last completed one),
interleaved at random, with asynchronous TMA completions, on tile lists with empty experts. It checks that every
tile is run by exactly one CTA, that no wait passes on a phase that has not completed (the aliasing that crashed
the prototype's pingpong), that every step reads the (tile, row step) the producer filled into its slot and every
tile entry the one published for it, that a gathered step uses its own rows' sources, that no slot or entry is
refilled before its readers are done, and that nothing deadlocks.

Run: pytest tests/test_gluon_dw_compile.py -s  (prints registers, shared memory and instruction counts).
"""

from __future__ import annotations

import os
import random
import re

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile checks need compiled (not interpreted) kernels", allow_module_level=True)

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
import torch  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from megamoe.backends.triton.configs import _SM90_TMA  # noqa: E402
from megamoe.backends.triton.kernels import gluon_dw as G  # noqa: E402
from megamoe.backends.triton.kernels.gluon_common import NUM_CONSUMERS  # noqa: E402
from megamoe.backends.triton.kernels import tma_gemm  # noqa: E402
from compile_checks import (  # noqa: E402
    KNOWN_SPILLS, SMEM_LIMIT, assert_no_spills_or_serialisation, assert_register_split, compile_gluon, compile_triton,
    count, divisible_by_16, int32_arg, kernel_signature, pointers, tensordesc, warp_specialized_report,
    wgmma_operand_types,
)
# A qwen3-30b-a3b-like dw_down: the descriptors' block shapes and layouts are what matters, not the sizes.
R, M, N, E = 2048, 2048, 768, 4
T = 256  # tokens of the gathered operand (R / top_k)
WGMMA_RE = r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+, (%p\d+), (\d), (\d), (\d), (\d);"


def _compile_gluon(cfg, gather: bool = False, skip_padding: bool = True, dtype=torch.bfloat16):
    """gather: the producer gathers b (its descriptor over the tokens [T, N], as the launcher builds it);
    skip_padding: an expert's last row step of padding skipped (what the one-GPU path runs); dtype: the
    operands' (bf16, or fp16, which the Hopper table runs on the same kernel)."""
    a = torch.empty(R, M, dtype=dtype)
    b = torch.empty(T if gather else R, N, dtype=dtype)
    dw = torch.empty(E, M, N, dtype=dtype)
    descs = dict(zip(("a_desc", "b_desc", "dw_desc"), G.descriptors(a, b, dw, cfg)))
    fn = G.dw_ws_kernel
    consts = G.constexprs(cfg, gather, skip_padding)
    src_type = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    arg_type = lambda name: src_type if name == "src_ptr" else _arg_type(name)  # noqa: E731
    signature = kernel_signature(fn, consts, {name: mangle_type(d) for name, d in descs.items()}, arg_type)
    return compile_gluon(fn, signature, consts, divisible_by_16(fn, pointers(fn)))


def _arg_type(name: str) -> str:
    """src_ptr: the gathered tokens (bf16); the other pointers int32, the scalars int32."""
    assert name.endswith("_ptr") or name in ("num_experts", "top_k"), name
    return "*bf16" if name == "src_ptr" else int32_arg(name)


def _compile_production():
    """tma_gemm.dw_tma_kernel as the TMA table runs it (weight_grad._launch with config.tma)."""
    cfg = _SM90_TMA.dw_down
    fn = tma_gemm.dw_tma_kernel
    blocks = {"a_desc": [cfg.block_k, cfg.block_m], "b_desc": [cfg.block_k, cfg.block_n], "dw_desc": [1, cfg.block_m, cfg.block_n]}
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten)
    signature = kernel_signature(fn, consts, {name: tensordesc(b) for name, b in blocks.items()}, int32_arg)
    attrs = divisible_by_16(fn, {name for name in fn.arg_names if signature[name].startswith("*") or name in ("M", "N")})
    return compile_triton(fn, signature, consts, attrs, cfg.num_warps, cfg.num_stages)


def _wgmma_forms(ptx: str) -> list:
    """[(shape, scale-d always true, imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b)] of every wgmma."""
    true_preds = set(re.findall(r"mov\.pred\s+(%p\d+), -1;", ptx))
    return [(shape, pred in true_preds, sa, sb, ta, tb) for shape, pred, sa, sb, ta, tb in re.findall(WGMMA_RE, ptx)]


_CACHE: dict = {}


def _report(name: str) -> dict:
    """Compile once per config; what the assertions (and the printed summary) look at."""
    if name not in _CACHE:
        cfg = G.CONFIGS[name]
        r = warp_specialized_report(_compile_gluon(cfg))
        ptx, sass = r["ptx"], r["sass"]
        _CACHE[name] = dict(
            r, cfg=cfg, forms=_wgmma_forms(ptx),
            wgmma=count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.block_n}k16\.f32\.bf16\.bf16", ptx),
            tma_load_other=count(r"cp\.async\.bulk\.tensor\.[13-5]d\.shared::(?:cluster|cta)\.global", ptx),
            tma_store_3d=count(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group", ptx),
            hgmma=count(rf"HGMMA\.64x{cfg.block_n}x16\.F32\.BF16 \S+, gdesc\[UR\d+\]\.tnspA\.tnspB", sass),
            hgmma_any=count(r"HGMMA\.", sass),
            utmaldg_2d=count(r"UTMALDG\.2D", sass),
            utmastg_3d=count(r"UTMASTG\.3D", sass),
        )
    return _CACHE[name]


def _wgmma_per_step(cfg) -> int:
    return NUM_CONSUMERS * (cfg.store_m // G.WGMMA_M) * (cfg.block_k // 16)


@pytest.mark.parametrize("name", list(G.CONFIGS))
def test_gluon_dw_kernel_sm90a(name):
    r = _report(name)
    cfg, meta, px = r["cfg"], r["compiled"].metadata, r["ptxas"]
    print(f"\ngluon-dw {name} {cfg}: {meta.num_warps} warps, {px['registers']} registers/thread (kernel max), "
          f"setmaxnreg {r['setmaxnreg']}, shared {meta.shared} B, spills {px['spill_stores']}/{px['spill_loads']} B, "
          f"stack {px['stack']} B; PTX: {r['wgmma']} wgmma m64n{cfg.block_n}k16 {sorted(set(r['forms']))}, wait_group "
          f"{r['wait_groups']}, TMA loads 2d {r['tma_load_2d']}, TMA stores 3d {r['tma_store_3d']}, mbarrier init "
          f"{r['mbar_init']} / try_wait {r['mbar_wait']} / expect_tx {r['mbar_expect']} / arrive {r['mbar_arrive']}; "
          f"SASS: {r['hgmma']} HGMMA .tnspA.tnspB, UTMALDG.2D {r['utmaldg_2d']}, UTMASTG.3D {r['utmastg_3d']}, "
          f"local {r['local']}")
    # wgmma: per row step (rows per warpgroup / 64) x (BLOCK_K / 16) m64nNk16 per consumer, both operands
    # MN-major (transposed) from shared memory, always accumulating.
    assert r["wgmma"] == r["wgmma_any"] == _wgmma_per_step(cfg), f"{name}: wgmma {r['wgmma']}/{r['wgmma_any']}"
    assert len(r["forms"]) == r["wgmma_any"] and set(r["forms"]) == {(f"m64n{cfg.block_n}k16", True, "1", "1", "1", "1")}, (
        f"{name}: wgmma forms {r['forms']}")
    assert r["hgmma"] == r["hgmma_any"] == _wgmma_per_step(cfg), f"{name}: {r['hgmma']}/{r['hgmma_any']} HGMMA"
    assert 1 in r["wait_groups"], f"{name}: wgmma not kept in flight across row steps ({r['wait_groups']})"
    # TMA: both operand tiles by 2-D bulk tensor copies (split at the 128-byte swizzle width), the outputs by
    # 3-D bulk tensor stores clipped per expert.
    assert r["tma_load_2d"] == (cfg.block_m + cfg.block_n) // 64 and r["tma_load_other"] == 0, (
        f"{name}: TMA loads 2d {r['tma_load_2d']}, other {r['tma_load_other']}")
    assert r["tma_store_3d"] == NUM_CONSUMERS, f"{name}: {r['tma_store_3d']} TMA stores"
    assert r["cp_async"] == 0, f"{name}: cp.async copies besides TMA"
    assert r["utmaldg_2d"] >= 2 and r["utmastg_3d"] >= NUM_CONSUMERS
    # mbarriers: ready + empty per stage (+ the order pair); waits in the producer and both consumers; the
    # producer's expect; the consumers' releases (in the loop and after the last step, + the order arrives).
    assert r["mbar_init"] == 2 * cfg.stages + 2 * G.TILE_SLOTS + (2 if cfg.pingpong else 0), (
        f"{name}: {r['mbar_init']} mbarrier.init")
    assert r["mbar_wait"] >= 1 + NUM_CONSUMERS * (2 if cfg.pingpong else 1), f"{name}: {r['mbar_wait']} waits"
    assert r["mbar_expect"] >= 1 and r["mbar_arrive"] >= NUM_CONSUMERS * (3 if cfg.pingpong else 2)
    # Warp specialization and its register split.
    assert meta.num_warps == cfg.num_warps, f"{name}: {meta.num_warps} warps"
    assert_register_split(name, r, cfg.producer_regs, cfg.consumer_regs)
    # No spills, nothing serialised, shared memory within the SM.
    assert_no_spills_or_serialisation(name, r)
    assert cfg.smem_bytes() <= meta.shared <= SMEM_LIMIT, f"{name}: shared {meta.shared} B (ring + epilogue {cfg.smem_bytes()})"


def _inner_loop_bounds_per_tile(ttgir: str) -> list[bool]:
    """For every row-step loop nested in a tile loop (an scf.while over the claimed tiles): whether its trip
    count changes from tile to tile, i.e. is one of the tile loop's carried values or is computed inside its
    body (not a value fixed before the loop)."""
    lines = ttgir.splitlines()
    found = []
    for i, line in enumerate(lines):
        outer = re.search(r"scf\.while \(([^)]*)\)", line)
        if not outer:
            continue
        carried = set(re.findall(r"(%[\w]+) = ", outer.group(1)))
        for inner in lines[i + 1:]:
            bound = re.search(r"scf\.for %ki = %[\w]+ to (%[\w]+)", inner)
            if bound:
                body = "\n".join(lines[i + 1:lines.index(inner)])
                name = bound.group(1)
                found.append(name in carried or re.search(rf"^\s*{name}(:\d+)? = ", body, re.M) is not None)
                break
    return found


@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathering"])
def test_every_partition_recomputes_the_row_steps_per_tile(gather):
    """Each partition's row-step loop runs the steps of its own tile's expert (SKIP_PADDING's trimmed count): a
    trip count fixed before the tile loop makes the producer and the consumers disagree -- the deadlock a
    loop-carried prefetch of the producer's (start, steps) compiled to under Triton 3.6, which carried only
    start across the tile loop."""
    ttgir = _compile_gluon(G.CONFIGS["coop"], gather=gather).asm["ttgir"]
    per_tile = _inner_loop_bounds_per_tile(ttgir)
    assert len(per_tile) == 3 and all(per_tile), f"row-step loops per partition (bound varies per tile): {per_tile}"


def test_gluon_dw_kernel_gathering_b_sm90a():
    """The gathering variant (MoEConfig.recompute's dw_gate_up on the production tile): the same wgmma as
    "coop", the a tile by TMA, the b tile by cp.async from a 4-warp producer (16-byte copies: BLOCK_K x BLOCK_N
    / 8 elements over 128 threads) completing on the ready mbarrier (cp.async.mbarrier.arrive.noinc), the
    consumers fencing the generic-proxy writes before wgmma reads them; 12 warps, the same register split, no
    spills."""
    cfg = G.CONFIGS["coop"]
    r = warp_specialized_report(_compile_gluon(cfg, gather=True))
    ptx, meta = r["ptx"], r["compiled"].metadata
    print(f"\ngluon-dw coop gathering b: {r['ptxas']['registers']} registers/thread (kernel max), setmaxnreg "
          f"{r['setmaxnreg']}, shared {meta.shared} B, cp.async {r['cp_async']}, TMA loads 2d {r['tma_load_2d']}")
    forms = _wgmma_forms(ptx)
    assert len(forms) == r["wgmma_any"] == _wgmma_per_step(cfg), f"wgmma {r['wgmma_any']}"
    assert set(forms) == {(f"m64n{cfg.block_n}k16", True, "1", "1", "1", "1")}, forms
    assert r["cp_async"] == cfg.block_k * cfg.block_n // 8 // (G.GATHER_WARPS * 32), f"{r['cp_async']} cp.async"
    assert count(r"cp\.async\.mbarrier\.arrive\.noinc\.shared", ptx) == 1
    assert count(r"fence\.proxy\.async", ptx) >= 1 + NUM_CONSUMERS  # the barriers' init + each consumer's
    # The a tile (BLOCK_M wide) by TMA, issued by one thread of the producer warpgroup per 128-byte box.
    assert r["tma_load_2d"] >= 1
    assert r["mbar_init"] == 2 * cfg.stages + 2 * G.TILE_SLOTS
    assert meta.num_warps == cfg.num_warps
    assert_register_split("coop-gather", r, cfg.producer_regs, cfg.consumer_regs)
    assert_no_spills_or_serialisation("coop-gather", r, **KNOWN_SPILLS.get("dw coop-gather", {}))
    assert cfg.smem_bytes() <= meta.shared <= SMEM_LIMIT


def test_production_kernel_uses_the_same_wgmma_form():
    """The Triton kernel the Gluon one replaces: m64n256k16, fp32 accumulation, both operands MN-major, always
    accumulating into a zero-initialised accumulator; "coop" issues exactly this instruction (the same
    m64 x k16 chunks in the same row order), the pingpong configs the same with another N width."""
    ptx = _compile_production().asm["ptx"]
    cfg = _SM90_TMA.dw_down
    forms = _wgmma_forms(ptx)
    assert len(forms) == len(re.findall(r"wgmma\.mma_async", ptx)) > 0, forms
    assert set(forms) == {(f"m64n{cfg.block_n}k16", True, "1", "1", "1", "1")}, forms
    coop = G.CONFIGS["coop"]
    assert (coop.block_m, coop.block_n, coop.block_k) == (cfg.block_m, cfg.block_n, cfg.block_k)
    assert (coop.block_m, coop.block_n, coop.block_k) == (_SM90_TMA.dw_gate_up.block_m, _SM90_TMA.dw_gate_up.block_n,
                                                          _SM90_TMA.dw_gate_up.block_k)
    assert all(c.block_k == cfg.block_k and c.group_m == cfg.group_m for c in G.CONFIGS.values())


# ----------------------------------------------------------------------------------------------------
# A model of the barrier protocol (the kernel's index arithmetic, in Python)


class _MBarrier:
    """An mbarrier: `count` arrivals complete a phase; a parity wait passes when the last completed phase has
    that parity (a fresh barrier counts the phase before phase 0, parity 1, as completed)."""

    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, count, 0

    def passes(self, parity: int) -> bool:
        return (self.completed & 1) != parity

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.completed += 1
            self.pending = self.count


def _tile_of(tile, num_m, num_n, group_m):
    per_expert = num_m * num_n
    expert, in_expert = divmod(tile, per_expert)
    per_group = group_m * num_n
    first_m = in_expert // per_group * group_m
    size_m = min(num_m - first_m, group_m)
    in_group = in_expert % per_group
    return expert, first_m + in_group % size_m, in_group // size_m


def _expert_rows(offsets, expert, block_k, padded_last):
    """The kernel's _expert_rows; padded_last: the experts whose last row step holds padding rows only."""
    start, end = offsets[expert], offsets[expert + 1]
    steps = max(-(-(end - start) // block_k), 0)
    return start, steps - (steps > 0 and expert in padded_last)


def _publish(st, j, entry):
    """The kernel's _publish: entry j of the tile ring, once both consumers gave back entry j - TILE_SLOTS."""
    t = j % G.TILE_SLOTS
    yield ("wait", st["tile_empty"][t], ((j // G.TILE_SLOTS) & 1) ^ 1, j // G.TILE_SLOTS - 1)
    if st["tile_data"][t] is not None:
        previous, readers = st["tile_data"][t]
        assert readers == {0, 1}, f"tile entry {previous[0]} rewritten after only {readers} read it"
    st["tile_data"][t] = ((j, entry), set())
    st["tile_ready"][t].arrive()


def _take(st, wg, j):
    """The kernel's _take: entry j of the tile ring (a generator returning it)."""
    t = j % G.TILE_SLOTS
    yield ("wait", st["tile_ready"][t], (j // G.TILE_SLOTS) & 1, j // G.TILE_SLOTS)
    (index, entry), readers = st["tile_data"][t]
    assert index == j, f"wg {wg} read tile entry {index} for {j}"
    readers.add(wg)
    st["tile_empty"][t].arrive()
    return entry


def _producer(st, shared, p_id, nprog, num_m, num_n, num_experts, offsets, padded_last, cfg, gather):
    """Yields ("wait", barrier, parity, phase it must have completed) or ("do", action). Tiles: p_id, p_id +
    nprog, ... below the kernel's _static_end, then static_end + the counter's value at each claim, a claim
    issued a tile before its value is used (gather: _producer_gather's order, the tile after next known a tile
    ahead, and its row sources loaded a step ahead: `src` the row whose sources it holds)."""
    stages, p, j = cfg.stages, 0, 0
    num_tiles = num_experts * num_m * num_n
    static_end = max(num_tiles // nprog * G.STATIC_QUARTERS // 4, 1) * nprog

    def claim(tile):  # the kernel's _claim: the counter bumped only where the next dealt tile is past static_end
        if tile + nprog < static_end:
            return 0  # (the masked atomic's value)
        shared["counter"] += 1
        return shared["counter"] - 1

    def next_tile(tile, claimed):  # the kernel's _next_tile
        return tile + nprog if tile + nprog < static_end else static_end + claimed

    tile = p_id
    if gather:
        following, src, src_row = next_tile(tile, claim(tile)), None, -1
    else:
        pending = claim(tile)
    while tile < num_tiles:
        if gather:
            pending = claim(following)
        expert, _, _ = _tile_of(tile, num_m, num_n, cfg.group_m)
        start, k_steps = _expert_rows(offsets, expert, cfg.block_k, padded_last)
        yield from _publish(st, j, (tile, k_steps))
        shared["claimed"].append(tile)
        if gather:
            next_start, next_steps = _expert_rows(offsets, _tile_of(min(following, num_tiles - 1), num_m, num_n,
                                                                    cfg.group_m)[0], cfg.block_k, padded_last)
            next_ok = following < num_tiles and next_steps > 0
            if src_row != start and k_steps > 0:
                src = start
        for ki in range(k_steps):
            if gather:
                row = start + ki * cfg.block_k
                assert src == row, f"tile {tile} step {ki} gathered with the row sources of row {src}, not {row}"
                ahead = row + cfg.block_k if ki + 1 < k_steps else next_start
                src = src_row = ahead if ki + 1 < k_steps or next_ok else -1
            s = p % stages
            yield ("wait", st["empty"][s], ((p // stages) & 1) ^ 1, p // stages - 1)
            assert not st["holders"][s], f"slot {s} refilled while read by {st['holders'][s]}"
            st["in_flight"].append((s, (tile, ki)))  # the TMA copies land later (the scheduler decides when)
            p += 1
            yield ("do", None)
        if gather:
            tile, following = following, next_tile(following, pending)
        else:
            tile = next_tile(tile, pending)
            pending = claim(tile)
        j += 1
        yield ("do", None)
    yield from _publish(st, j, (num_tiles, 0))


def _consumer(st, wg, num_m, num_n, num_experts, cfg, reads):
    stages, c, turn, j = cfg.stages, 0, 0, 0
    num_tiles = num_experts * num_m * num_n
    tile, k_steps = yield from _take(st, wg, 0)
    while tile < num_tiles:
        if not cfg.pingpong or j % 2 == wg:
            if cfg.pingpong:
                yield ("wait", st["order"][wg], (turn & 1) ^ (1 - wg), turn - (1 - wg))
            for ki in range(k_steps):
                s = c % stages
                yield ("wait", st["ready"][s], (c // stages) & 1, c // stages)
                assert st["data"][s] == (tile, ki), f"wg {wg} read {st['data'][s]} for {(tile, ki)}"
                st["holders"][s].add(wg)
                reads.append((tile, ki, wg, j))
                if ki > 0:
                    prev = (c + stages - 1) % stages
                    st["holders"][prev].discard(wg)
                    st["empty"][prev].arrive()
                c += 1
                yield ("do", None)
            if cfg.pingpong:
                st["order"][1 - wg].arrive()
                turn += 1
            if k_steps > 0:
                prev = (c + stages - 1) % stages
                st["holders"][prev].discard(wg)
                st["empty"][prev].arrive()
        else:
            c += k_steps
        j += 1
        tile, k_steps = yield from _take(st, wg, j)


def _simulate(cfg, offsets, padded_last, num_m, num_n, nprog, seed, gather=False):
    """Run the three partitions of each of nprog CTAs (gather: with the gathering producer), claiming tiles
    from one counter, in a random interleaving; returns the tiles each CTA published and the (tile, step, wg,
    CTA-local tile) reads of each."""
    rng = random.Random(seed)
    num_experts = len(offsets) - 1
    shared = dict(counter=0)
    ctas, agents = [], []
    for p_id in range(nprog):
        st = dict(ready=[_MBarrier(1) for _ in range(cfg.stages)],
                  empty=[_MBarrier(1 if cfg.pingpong else 2) for _ in range(cfg.stages)],
                  order=[_MBarrier(1) for _ in range(2)], holders=[set() for _ in range(cfg.stages)],
                  data=[None] * cfg.stages, in_flight=[],
                  tile_ready=[_MBarrier(1) for _ in range(G.TILE_SLOTS)],
                  tile_empty=[_MBarrier(2) for _ in range(G.TILE_SLOTS)], tile_data=[None] * G.TILE_SLOTS)
        cta = dict(st=st, claimed=[], reads=[])
        view = _SharedCounter(shared, cta["claimed"])
        agents.append(_producer(st, view, p_id, nprog, num_m, num_n, num_experts, offsets, padded_last, cfg,
                                gather))
        agents += [_consumer(st, wg, num_m, num_n, num_experts, cfg, cta["reads"]) for wg in range(2)]
        ctas.append(cta)
    blocked = {i: None for i in range(len(agents))}  # agent -> the wait it is blocked on
    live = set(blocked)
    while live or any(c["st"]["in_flight"] for c in ctas):
        runnable = [i for i in live if blocked[i] is None or blocked[i][1].passes(blocked[i][2])]
        choices = runnable + [("tma", k) for k, c in enumerate(ctas) if c["st"]["in_flight"]]
        assert choices, f"deadlock: {[(i, blocked[i]) for i in live]}"
        pick = rng.choice(choices)
        if isinstance(pick, tuple):  # a CTA's oldest copies land: the slot's data, then its ready barrier's phase
            st = ctas[pick[1]]["st"]
            s, tag = st["in_flight"].pop(0)
            st["data"][s] = tag
            st["ready"][s].arrive()
            continue
        if blocked[pick] is not None:  # a wait passes: the phase it means must really have completed
            _, bar, _, phase = blocked[pick]
            assert bar.completed >= phase + 1, f"agent {pick} passed a wait for phase {phase} at {bar.completed} (aliased)"
            blocked[pick] = None
        try:
            step = next(agents[pick])
        except StopIteration:
            live.discard(pick)
            continue
        if step[0] == "wait":
            blocked[pick] = step
    return [(c["claimed"], c["reads"]) for c in ctas]


class _SharedCounter(dict):
    """One CTA's view of the tile counter all CTAs claim from (the producer reads and bumps "counter") and
    the list of the tiles it published ("claimed")."""

    def __init__(self, shared: dict, claimed: list):
        super().__init__(claimed=claimed)
        self._shared = shared

    def __getitem__(self, key):
        return self._shared["counter"] if key == "counter" else super().__getitem__(key)

    def __setitem__(self, key, value):
        if key == "counter":
            self._shared["counter"] = value
        else:
            super().__setitem__(key, value)


def _random_offsets(rng, num_experts, block_k, max_steps):
    counts = [rng.choice([0, 1, max_steps, rng.randint(0, max_steps)]) * block_k for _ in range(num_experts)]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    return offsets


@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathering"])
@pytest.mark.parametrize("name", list(G.CONFIGS))
def test_barrier_protocol_model(name, gather):
    cfg = G.CONFIGS[name]
    rng = random.Random(0)
    for trial in range(60):
        num_experts = rng.randint(1, 5)
        offsets = _random_offsets(rng, num_experts, cfg.block_k, max_steps=rng.choice([1, 3, cfg.stages + 2, 12]))
        padded_last = {e for e in range(num_experts) if rng.random() < 0.5}  # SKIP_PADDING's trimmed experts
        num_m, num_n = rng.randint(1, 3), rng.randint(1, 3)
        nprog = min(rng.randint(1, 4) if trial % 2 else rng.randint(1, 2), num_experts * num_m * num_n)  # <= tiles
        ctas = _simulate(cfg, offsets, padded_last, num_m, num_n, nprog, seed=trial, gather=gather)
        # Every tile published by exactly one CTA (claims neither lose nor repeat one).
        claimed = sorted(t for tiles, _ in ctas for t in tiles)
        assert claimed == list(range(num_experts * num_m * num_n)), (name, gather, trial, claimed)
        # Every (tile, row step) of a CTA read by its consumers: both (coop) or the tile's warpgroup.
        for tiles, reads in ctas:
            want = []
            for j, tile in enumerate(tiles):
                expert, _, _ = _tile_of(tile, num_m, num_n, cfg.group_m)
                readers = [j % 2] if cfg.pingpong else [0, 1]
                steps = _expert_rows(offsets, expert, cfg.block_k, padded_last)[1]
                want += [(tile, ki, wg, j) for ki in range(steps) for wg in readers]
            assert sorted(reads) == sorted(want), (name, gather, trial)


@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathering"])
def test_gluon_dw_kernel_fp16_sm90a(gather):
    """fp16 operands run the same kernel on Hopper (configs.tma_kernel_configs takes float16): the production tile,
    on rows and gathering b (MoEConfig.recompute), must issue fp16 wgmma without spills or local memory."""
    r = warp_specialized_report(_compile_gluon(G.CONFIGS[G.DEFAULT_CONFIG], gather=gather, dtype=torch.float16))
    forms = wgmma_operand_types(r["ptx"])
    assert forms == {("f16", "f16")}, f"dw fp16: wgmma forms {forms}"
    name = f"dw fp16 {'gathering' if gather else 'rows'}"
    assert_no_spills_or_serialisation(name, r, **KNOWN_SPILLS.get(name, {}))
