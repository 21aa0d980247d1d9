"""CPU checks of the Gluon row-block GEMMs (megamoe/backends/triton/kernels/gluon_rows.py): ahead-of-time
compiles for sm_90a, and a model of their barrier protocol.

Compiles. Gluon kernels compile without a GPU as Triton kernels do (tests/test_triton_compile.py; the helpers
both use are in tests/compile_checks.py): a GluonASTSource (triton.experimental.gluon._runtime) through
triton.compile for GPUTarget("cuda", 90, 32), with the tensor-descriptor signatures of the host-side Gluon
TensorDescriptors the launcher builds (made here on CPU tensors). Every tile of gluon_rows.TILES is compiled
for both GEMMs (down_fwd: B tiles K-major from w_down [E_l, H, I]; gate_up_dgrad: B tiles N-contiguous from
w_gate_up [E_l, 2I, H]), and the assertions are about the code an H200 would run:

  * wgmma: per K step, exactly 2 consumers x (rows per warpgroup / 64) x (BLOCK_K / 16) wgmma.mma_async
    m64n{BLOCK_N}k16.f32.bf16.bf16 (the same instruction, with the same B transposition flag, as the
    production Triton kernel of the GEMM: test_same_wgmma_as_the_triton_kernel), kept in flight across K
    steps (wgmma.wait_group 1); the same number of HGMMA in the SASS;
  * TMA: operands by cp.async.bulk.tensor completing on an mbarrier (a 2-D copy of the rows; the 3-D
    weight copy as one message for a K-major tile, BLOCK_N / 64 messages of 128-byte rows for an
    N-contiguous one), outputs by TMA stores (one per consumer warpgroup), no cp.async;
  * mbarriers: ready + empty per stage (+ the two order barriers of ping-pong), waits in the producer and
    both consumers (+ each consumer's turn wait in ping-pong), the producer's expect-tx, the releases
    (+ the turn hand-over);
  * warp specialization: 12 warps (two consumer warpgroups and the producer's), setmaxnreg to the tile's
    consumer / producer registers;
  * ptxas -v: no spills, no stack frame, no wgmma serialisation (C7510); no local memory in the SASS; shared
    memory within the 227 KB of an SM and at least the ring + epilogue buffers.

Protocol model. The producer's and consumers' loops in Python, with the kernel's counter arithmetic, over
mbarriers that behave like the hardware's (arrival counts, expect-tx byte counts, phases, and parity waits
that pass whenever the current phase's parity differs from the one asked for), run under random
interleavings of the warps and of the TMA completions. It checks what the module docstring claims: with the
order barrier every wait passes only once the phase it means has completed (no parity aliasing), nothing
deadlocks, every wgmma reads the slot of its own (tile, K step) and the producer refills no slot before its
readers released it; and without the order barrier (the prototype's ping-pong) the second warpgroup's waits
alias.

A second model does the same for gate_up_dgrad's spread warp (_spread_x): its two row buffers (a row in one part
or several), their barriers and the stores' read wait, under random schedules of the TMA loads and stores.

Run: pytest tests/test_gluon_rows_compile.py -s  (prints registers, shared memory and instruction counts).
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
from megamoe.backends.triton.kernels import gluon_rows, tma_gemm  # noqa: E402
from compile_checks import (  # noqa: E402
    SMEM_LIMIT, MBarrier, ProtocolError, assert_no_spills_or_serialisation, assert_register_split, compile_gluon,
    compile_triton, count, divisible_by_16, int32_arg, kernel_signature, pointers, tensordesc, warp_specialized_report,
    wgmma_operand_types,
)
SCHEDULE_BLOCK_M = 128
# qwen3-30b-a3b-like operands: the descriptors' block shapes and layouts are what matters, not the sizes.
R, H, I, E, T = 2048, 2048, 768, 4, 256
GEMMS = {"down_fwd": True, "gate_up_dgrad": False}  # name: W_NK (B tiles K-major)
WGMMA = re.compile(r"(wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16) \{[^}]*\}, [^,]+, [^,]+, [^,]+, "
                   r"(\d), (\d), (\d), (\d);")


def _operands(gemm: str, dtype=torch.bfloat16):
    """(a [R, K], w, out [R, N]) as the launcher gets them, on CPU."""
    if GEMMS[gemm]:
        return (torch.empty(R, I, dtype=dtype), torch.empty(E, H, I, dtype=dtype), torch.empty(R, H, dtype=dtype))
    return (torch.empty(R, 2 * I, dtype=dtype), torch.empty(E, 2 * I, H, dtype=dtype), torch.empty(R, H, dtype=dtype))


def _compile(gemm: str, tile, spread_h: int = 0, dtype=torch.bfloat16):
    """The kernel of one GEMM and tile; spread_h: gate_up_dgrad with SPREAD for x [T, spread_h] (0: without);
    dtype: the operands' (bf16, or fp16, which the Hopper table runs on the same kernels)."""
    w_nk = GEMMS[gemm]
    a, w, out = _operands(gemm, dtype)
    descs = dict(zip(("a_desc", "w_desc", "out_desc"), gluon_rows.descriptors(a, w, out, w_nk, tile)))
    if spread_h:
        x, x_rows = torch.empty(T, spread_h, dtype=dtype), torch.empty(R, spread_h, dtype=dtype)
        descs |= zip(("x_desc", "x_rows_desc"), gluon_rows.spread_descriptors(x, x_rows))
    else:  # unused without SPREAD: the launcher passes the operands' descriptors
        descs |= {"x_desc": descs["a_desc"], "x_rows_desc": descs["w_desc"]}
    fn = gluon_rows.row_gemm_ws_kernel
    consts = gluon_rows.constexprs(tile, w_nk, SCHEDULE_BLOCK_M // tile.block_m, spread=bool(spread_h))
    signature = kernel_signature(fn, consts, {name: mangle_type(d) for name, d in descs.items()}, int32_arg)
    return compile_gluon(fn, signature, consts, divisible_by_16(fn, pointers(fn)))


def _compile_triton(gemm: str):
    """The production kernel of the GEMM (tma_gemm.row_gemm_tma_kernel) with its tile of the TMA table."""
    cfg = getattr(_SM90_TMA, gemm)
    w_nk = GEMMS[gemm]
    m, n, k = cfg.block_m, cfg.block_n, cfg.block_k
    fn = tma_gemm.row_gemm_tma_kernel
    consts = dict(W_NK=w_nk, SPLIT=1, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten)
    blocks = {"a_desc": [m, k], "w_desc": [1, n, k] if w_nk else [1, k, n], "out_desc": [m, n]}
    signature = kernel_signature(fn, consts, {name: tensordesc(b) for name, b in blocks.items()}, int32_arg)
    attrs = divisible_by_16(fn, {name for name in fn.arg_names if signature[name] != "constexpr"})
    return compile_triton(fn, signature, consts, attrs, cfg.num_warps, cfg.num_stages), cfg


_CACHE: dict = {}


def _report(gemm: str, tile_name: str) -> dict:
    """Compile once per (GEMM, tile); what the assertions (and the printed summary) look at."""
    key = (gemm, tile_name)
    if key not in _CACHE:
        tile = gluon_rows.TILES[tile_name]
        r = warp_specialized_report(_compile(gemm, tile))
        ptx, sass = r["ptx"], r["sass"]
        _CACHE[key] = dict(
            r, tile=tile,
            wgmma=WGMMA.findall(ptx),
            tma_store=count(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.bulk_group", ptx),
            hgmma=count(rf"HGMMA\.64x{tile.block_n}x16\.F32\.BF16", sass),
            utmaldg_2d=count(r"UTMALDG\.2D", sass),
            utmaldg_3d=count(r"UTMALDG\.3D", sass),
            utmastg=count(r"UTMASTG\.2D", sass),
        )
    return _CACHE[key]


def _wgmma_per_k_step(tile) -> int:
    return 2 * (tile.store_m // 64) * (tile.block_k // 16)


@pytest.mark.parametrize("tile_name", list(gluon_rows.TILES))
@pytest.mark.parametrize("gemm", list(GEMMS))
def test_gluon_row_gemm_sm90a(gemm, tile_name):
    r = _report(gemm, tile_name)
    tile, meta, px = r["tile"], r["compiled"].metadata, r["ptxas"]
    name = f"{gemm}/{tile_name}"
    print(f"\n{name} {tile}: {meta.num_warps} warps, {px['registers']} registers/thread (kernel max), "
          f"setmaxnreg {r['setmaxnreg']}, shared {meta.shared} B, spills {px['spill_stores']}/{px['spill_loads']} B, "
          f"stack {px['stack']} B; PTX: {len(r['wgmma'])} wgmma m64n{tile.block_n}k16, wait_group {r['wait_groups']}, "
          f"TMA loads 2d/3d {r['tma_load_2d']}/{r['tma_load_3d']}, TMA stores {r['tma_store']}, mbarrier init "
          f"{r['mbar_init']} / try_wait {r['mbar_wait']} / expect_tx {r['mbar_expect']} / arrive {r['mbar_arrive']}; "
          f"SASS: {r['hgmma']} HGMMA, UTMALDG 2d/3d {r['utmaldg_2d']}/{r['utmaldg_3d']}, UTMASTG {r['utmastg']}, "
          f"local {r['local']}")
    # wgmma: one K step is (rows / 64) x (BLOCK_K / 16) m64nNk16 per consumer, B transposed for K-major tiles.
    per_step = _wgmma_per_k_step(tile)
    assert len(r["wgmma"]) == r["wgmma_any"] == per_step, f"{name}: wgmma {len(r['wgmma'])}/{r['wgmma_any']}"
    assert {int(n) for _, n, *_ in r["wgmma"]} == {tile.block_n}, f"{name}: {set(r['wgmma'])}"
    trans_b = {int(w[-1]) for w in r["wgmma"]}
    assert trans_b == {0 if GEMMS[gemm] else 1}, f"{name}: B transposition flags {trans_b}"
    assert r["hgmma"] == per_step, f"{name}: {r['hgmma']} HGMMA in the SASS"
    assert 1 in r["wait_groups"], f"{name}: wgmma not kept in flight across K steps ({r['wait_groups']})"
    # TMA: the operands by bulk tensor copies into the ring (an N-contiguous weight tile as 128-byte-wide
    # messages), the outputs by bulk tensor stores.
    weight_messages = 1 if GEMMS[gemm] else tile.block_n // 64
    assert (r["tma_load_2d"], r["tma_load_3d"]) == (1, weight_messages), (
        f"{name}: TMA loads {r['tma_load_2d']}/{r['tma_load_3d']}")
    assert r["tma_store"] == 2, f"{name}: {r['tma_store']} TMA stores for 2 consumers"
    assert r["cp_async"] == 0, f"{name}: cp.async copies besides TMA"
    assert r["utmaldg_2d"] >= 1 and r["utmaldg_3d"] >= weight_messages and r["utmastg"] >= 2
    # mbarriers: ready + empty per stage (+ the order pair); waits in the producer and both consumers (+ the
    # turn waits); the producer's expect; the releases in the K loop and after it (+ the turn hand-overs).
    order = 2 if tile.pingpong else 0
    assert r["mbar_init"] == 2 * tile.stages + order, f"{name}: {r['mbar_init']} mbarrier.init"
    assert r["mbar_wait"] == 3 + order, f"{name}: {r['mbar_wait']} mbarrier waits"
    assert r["mbar_expect"] == 1, f"{name}: {r['mbar_expect']} expect_tx"
    assert r["mbar_arrive"] == 4 + order, f"{name}: {r['mbar_arrive']} mbarrier arrives"
    # Warp specialization and its register split.
    assert meta.num_warps == 12, f"{name}: {meta.num_warps} warps"
    assert_register_split(name, r, tile.producer_regs, tile.consumer_regs)
    # No spills, nothing serialised, shared memory within the SM.
    assert_no_spills_or_serialisation(name, r)
    assert tile.smem_bytes() <= meta.shared <= SMEM_LIMIT, (
        f"{name}: shared {meta.shared} B (ring + epilogue {tile.smem_bytes()})")


@pytest.mark.parametrize("hidden", [2048, 2880, 4096, 7168])
def test_gate_up_dgrad_spreading_x_sm90a(hidden):
    """gate_up_dgrad with SPREAD (the table's coop tile): x's rows by one more warp beside the producer, at the
    producer's registers: a 3-D TMA load of a row (or of a 4096-column part of it at H = 7168) into one of two
    buffers (the prologue's and the loop's, each armed by its own expect on the buffer's barrier), a 3-D TMA
    store per receive row, the stores' reads awaited before a buffer is reloaded; the GEMM's code as without it;
    no spills; shared memory within the SM."""
    tile = gluon_rows.TILES["coop"]
    assert gluon_rows.spreads_x(tile, hidden)
    r = warp_specialized_report(_compile("gate_up_dgrad", tile, spread_h=hidden))
    plain = _report("gate_up_dgrad", "coop")
    meta, name = r["compiled"].metadata, f"gate_up_dgrad/coop/spread H={hidden}"
    weight_messages = tile.block_n // 64
    assert (r["tma_load_2d"], r["tma_load_3d"]) == (1, weight_messages + 2), (
        f"{name}: TMA loads {r['tma_load_2d']}/{r['tma_load_3d']}")
    assert count(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.bulk_group", r["ptx"]) == 1
    assert count(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.bulk_group", r["ptx"]) == 2
    assert r["mbar_init"] == plain["mbar_init"] + 2 and r["mbar_expect"] == plain["mbar_expect"] + 2
    assert r["mbar_wait"] == plain["mbar_wait"] + 1 and r["mbar_arrive"] == plain["mbar_arrive"]
    assert r["wgmma_any"] == plain["wgmma_any"] and r["wait_groups"] == plain["wait_groups"]
    assert meta.num_warps == 12, f"{name}: {meta.num_warps} warps"
    assert_register_split(name, r, tile.producer_regs, tile.consumer_regs)
    assert_no_spills_or_serialisation(name, r)
    row_bytes = min(triton.next_power_of_2(hidden // 64), 64) * 64 * 2  # a buffer: a row's box (or a part's)
    assert tile.smem_bytes() + 2 * row_bytes <= meta.shared <= SMEM_LIMIT, f"{name}: shared {meta.shared} B"


def test_spreads_x_only_where_the_rows_fit():
    """x spreads beside gate_up_dgrad's coop tile at every H of the benchmark workloads (7168 in two parts of a
    row), not at an H that is no multiple of 64."""
    tile = gluon_rows.TILES["coop"]
    fits = [h for h in (2048, 2880, 4096, 7168, 2052, 1040) if gluon_rows.spreads_x(tile, h)]
    assert fits == [2048, 2880, 4096, 7168], fits


def test_gate_up_dgrad_spreads_x_only_on_the_gluon_kernel_and_addressable_x():
    """The backward's choice (kernels.gate_up_dgrad_spreads_x): the table's Gluon gate_up_dgrad with an x TMA can
    copy; not the Triton kernel of the same tile, not an x whose base is off 16 bytes, not an H off 64."""
    from megamoe.backends.triton import kernels
    from megamoe.backends.triton.configs import triton_tile

    cfg = _SM90_TMA.gate_up_dgrad
    x = torch.empty(T, 2048 + 64, dtype=torch.bfloat16)
    assert kernels.gate_up_dgrad_spreads_x(cfg, x[:, :2048].contiguous())
    assert not kernels.gate_up_dgrad_spreads_x(triton_tile(cfg), x[:, :2048].contiguous())
    assert not kernels.gate_up_dgrad_spreads_x(cfg, x.view(-1)[1:1 + T * 2048].view(T, 2048))
    assert not kernels.gate_up_dgrad_spreads_x(cfg, torch.empty(T, 2052, dtype=torch.bfloat16))


@pytest.mark.parametrize("gemm", list(GEMMS))
def test_same_wgmma_as_the_triton_kernel(gemm):
    """The production kernel's tl.dot is the same chain of k16 wgmma per BLOCK_K step: the same instruction
    (fp32 accumulation of bf16 products), the same operand transpositions and scaling flags, the same
    BLOCK_K, so every output element sees the same sequence of operations (module docstring, Numerics)."""
    compiled, cfg = _compile_triton(gemm)
    theirs = _instruction_kinds(WGMMA.findall(compiled.asm["ptx"]))
    assert theirs, f"{gemm}: no wgmma in the Triton kernel"
    for tile_name, tile in gluon_rows.TILES.items():
        assert tile.block_k == cfg.block_k, f"{tile_name}: BLOCK_K {tile.block_k} against the Triton kernel's {cfg.block_k}"
        ours = _instruction_kinds(_report(gemm, tile_name)["wgmma"])
        assert ours == theirs, f"{gemm}/{tile_name}: {ours} against the Triton kernel's {theirs}"


def _instruction_kinds(wgmmas: list) -> set:
    """{(instruction with its N written as N, its four immediate flags: scale-a, scale-b, trans-a, trans-b)}."""
    return {(re.sub(r"m64n\d+k16", "m64nNk16", ins), tuple(flags)) for ins, _, *flags in wgmmas}


# ----------------------------------------------------------------------------------------------------
# A model of the barrier protocol (the kernel's loops and counter arithmetic, in Python)


def _wait(bar: MBarrier, parity: int, meant: int):
    """A parity wait for the completion of phase `meant` (-1: the phase before the first)."""
    assert parity == meant & 1, (bar.name, parity, meant)  # the kernel's parity formula means that phase
    return ("wait", bar, parity, meant)


def _run_protocol(tiles: int, nprog: int, pid: int, k_steps: int, stages: int, pingpong: bool, ordered: bool,
                  rng: random.Random) -> None:
    """Run producer, two consumers and the TMA engine as coroutines under a random schedule; raise
    ProtocolError on an aliased wait, a wrong slot read, a refill of an unreleased slot or a deadlock."""
    ready = [MBarrier(f"ready[{s}]", 1) for s in range(stages)]
    empty = [MBarrier(f"empty[{s}]", 1 if pingpong else 2) for s in range(stages)]
    order = [MBarrier("order[0]", 1), MBarrier("order[1]", 1)]
    slot = [None] * stages  # the (tile, K step) a slot holds; None while a copy is writing it
    in_flight = []  # TMA copies issued and not landed: (slot, (tile, K step))

    def producer():
        p = 0
        for tile in range(pid, tiles, nprog):
            for k in range(k_steps):
                s = p % stages
                yield _wait(empty[s], ((p // stages) & 1) ^ 1, p // stages - 1)
                ready[s].arrive(tx=1)  # expect-tx (the slot's bytes as one unit) + the producer's arrive
                slot[s] = None
                in_flight.append((s, (tile, k)))
                p += 1
                yield None

    def consumer(wg):
        if pingpong:
            first, stride, c, skip = pid + wg * nprog, 2 * nprog, wg * k_steps, k_steps
        else:
            first, stride, c, skip = pid, nprog, 0, 0
        turn = 0
        for tile in range(first, tiles, stride):
            if pingpong and ordered:
                yield _wait(order[wg], (turn & 1) ^ (1 - wg), turn - 1 + wg)
            for k in range(k_steps):
                s = c % stages
                yield _wait(ready[s], (c // stages) & 1, c // stages)
                if slot[s] != (tile, k):
                    raise ProtocolError(f"wg{wg} read slot {s} holding {slot[s]} for {(tile, k)}")
                if k > 0:  # the previous step's wgmma retired: release its slot, still unchanged
                    _release(wg, (c + stages - 1) % stages, (tile, k - 1))
                c += 1
                yield None
            if pingpong and ordered:
                order[1 - wg].arrive()
            _release(wg, (c + stages - 1) % stages, (tile, k_steps - 1))
            c += skip
            turn += 1
            yield None

    def _release(wg, s, want):
        if slot[s] != want:
            raise ProtocolError(f"wg{wg}: slot {s} refilled ({slot[s]}) before the wgmma reading {want} retired")
        empty[s].arrive()

    procs = {"producer": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    blocked = {name: None for name in procs}  # the wait each coroutine is stuck on
    while procs or in_flight:
        runnable = [n for n in procs if blocked[n] is None or blocked[n][1].passes(blocked[n][2])]
        choices = runnable + (["tma"] if in_flight else [])
        if not choices:
            raise ProtocolError(f"deadlock: {({n: (w[1].name, w[2]) for n, w in blocked.items() if n in procs})}")
        pick = rng.choice(choices)
        if pick == "tma":
            s, what = in_flight.pop(rng.randrange(len(in_flight)))  # copies land in any order
            slot[s] = what
            ready[s].complete_tx(1)
            continue
        if blocked[pick] is not None:
            _, bar, _, meant = blocked[pick]
            if bar.phase <= meant:
                raise ProtocolError(f"{pick}: wait on {bar.name} for phase {meant} passed in phase {bar.phase} (aliased)")
            blocked[pick] = None
        try:
            step = next(procs[pick])
        except StopIteration:
            del procs[pick]
            continue
        if step is not None:
            blocked[pick] = step


# (tiles, grid size, K steps, stages): qwen3-30b-a3b's down_fwd (12 steps), gate_up_dgrad (24), few tiles
# per CTA, an odd count, K steps below and at the ring size.
_PROBLEMS = [(40, 3, 12, 4), (7, 2, 24, 3), (5, 1, 3, 4), (9, 2, 4, 4), (6, 3, 1, 5), (11, 4, 7, 5), (1, 1, 6, 3)]


@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "coop"])
def test_protocol_model_never_aliases(pingpong):
    rng = random.Random(0)
    for tiles, nprog, k_steps, stages in _PROBLEMS:
        for pid in range(nprog):
            for _ in range(30):
                _run_protocol(tiles, nprog, pid, k_steps, stages, pingpong, True, rng)


def test_protocol_model_prototype_pingpong_aliases():
    """The prototype's ping-pong (no order barrier): warpgroup 1 waits for slot uses a ring cycle or more
    ahead, and some schedule lets a parity wait pass on the wrong phase (the crash of the first prototype,
    commit fbd1888, benchmarks/gluon_gemm.py)."""
    rng = random.Random(0)
    failures = []
    for _ in range(50):
        try:
            _run_protocol(tiles=40, nprog=3, pid=0, k_steps=12, stages=4, pingpong=True, ordered=False, rng=rng)
        except ProtocolError as error:
            failures.append(str(error))
    assert failures and any("aliased" in f for f in failures), failures[:3]


def _run_spread(T: int, nprog: int, pid: int, dest_row: list[list[int]], rng: random.Random, parts: int = 1,
                store_wait: bool = True) -> dict:
    """_spread_x's loop (two buffers, one barrier each; a row in `parts` parts of one buffer each) with the TMA
    engine as a coroutine landing loads and finishing stores' reads in any order; ProtocolError on an aliased
    wait, a load issued into a buffer whose stores have not read it, a store reading the wrong token's part, or a
    deadlock. Returns {(row, part): token} written."""
    bars = [MBarrier("x_bars[0]", 1), MBarrier("x_bars[1]", 1)]
    buf = [None, None]  # the (token, part) a buffer holds; None while a load is writing it
    loads, stores = [], []  # in flight: (buffer, (token, part)) / (buffer, (token, part), row) not yet read
    written = {}

    def load(s, t):
        if any(b == s for b, *_ in stores):
            raise ProtocolError(f"load of token {t} into buffer {s} while stores still read it")
        bars[s].arrive(tx=1)  # the expect (the row's bytes as one unit)
        buf[s] = None
        loads.append((s, t))

    def warp():
        if pid < T:
            load(0, (pid, 0))
        i = 0
        for t in range(pid, T, nprog):
            for part in range(parts):
                s = i % 2
                yield _wait(bars[s], (i // 2) & 1, i // 2)
                if store_wait:
                    yield ("stores_read",)
                next_t, next_part = (t, part + 1) if part + 1 < parts else (t + nprog, 0)
                if next_t < T:
                    load(1 - s, (next_t, next_part))
                for row in dest_row[t]:
                    if row >= 0:
                        stores.append((s, (t, part), row))
                i += 1
                yield None
        yield ("stores_read",)

    proc, blocked = warp(), None
    while proc is not None or loads or stores:
        ready = proc is not None and (blocked is None or (blocked[0] == "stores_read" and not stores)
                                      or (blocked[0] == "wait" and blocked[1].passes(blocked[2])))
        choices = (["warp"] if ready else []) + (["load"] if loads else []) + (["store"] if stores else [])
        if not choices:
            raise ProtocolError(f"deadlock on {blocked}")
        pick = rng.choice(choices)
        if pick == "load":
            s, t = loads.pop(rng.randrange(len(loads)))
            buf[s] = t
            bars[s].complete_tx(1)
        elif pick == "store":
            s, (t, part), row = stores.pop(rng.randrange(len(stores)))
            if buf[s] != (t, part):
                raise ProtocolError(f"store of token {t} part {part} to row {row} read buffer {s} holding {buf[s]}")
            if (row, part) in written:
                raise ProtocolError(f"row {row} part {part} written twice")
            written[row, part] = t
        else:
            if blocked is not None and blocked[0] == "wait" and blocked[1].phase <= blocked[3]:
                raise ProtocolError(f"wait on {blocked[1].name} for phase {blocked[3]} passed early (aliased)")
            blocked = None
            try:
                blocked = next(proc)
            except StopIteration:
                proc = None
    return written


# (tokens, grid size, top_k, every how many pairs one without a row): fewer tokens than programs, one or two
# tokens a program, many; k = 1 and 8; pairs a capacity cut (dest_row -1).
_SPREADS = [(1, 3, 1, 0), (2, 3, 8, 0), (7, 2, 8, 0), (40, 3, 2, 5), (13, 4, 8, 3), (9, 1, 4, 0)]


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("T,nprog,k,cut", _SPREADS)
def test_spread_model_writes_every_row_once_from_its_token(T, nprog, k, cut, parts):
    """The model of _spread_x (gate_up_dgrad's SPREAD warp) under random schedules of its TMA loads and stores,
    rows in one part (H <= 4096) or several: no aliased wait, no buffer reloaded before its stores read it, every
    part of every row with a pair written once, from its token, nothing else written."""
    rng = random.Random(T * 100 + k * 10 + parts)
    pairs = [(t, j) for t in range(T) for j in range(k)]
    rows = rng.sample(range(len(pairs)), len(pairs))
    dest_row = [[-1] * k for _ in range(T)]
    for n, (t, j) in enumerate(pairs):
        if not cut or n % cut:
            dest_row[t][j] = rows[n]
    want = {(row, part): t for t in range(T) for row in dest_row[t] if row >= 0 for part in range(parts)}
    for _ in range(40):
        written = {}
        for pid in range(nprog):
            written.update(_run_spread(T, nprog, pid, dest_row, rng, parts))
        assert written == want


@pytest.mark.parametrize("parts", [1, 2])
def test_spread_model_catches_a_reload_before_the_stores_read(parts):
    """Without the stores' read wait before a buffer is reloaded, some schedule loads the next part into a
    buffer a store still reads: the model sees it (so the test above can fail)."""
    rng = random.Random(parts)
    dest_row = [[4 * t + j for j in range(4)] for t in range(12)]
    failures = []
    for _ in range(50):
        try:
            _run_spread(12, 1, 0, dest_row, rng, parts, store_wait=False)
        except ProtocolError as error:
            failures.append(str(error))
    assert failures and any("still read" in f for f in failures), failures[:3]


@pytest.mark.parametrize("gemm,spread_h", [(gemm, 0) for gemm in GEMMS] + [("gate_up_dgrad", 2048)],
                         ids=list(GEMMS) + ["gate_up_dgrad-spread"])
def test_gluon_row_gemm_fp16_sm90a(gemm, spread_h):
    """fp16 operands run the same kernels on Hopper (configs.tma_kernel_configs takes float16): the table's tile
    (its entries' gluon_rows tile, "coop"), and gate_up_dgrad spreading fp16 x beside it (the backward's default,
    experts.py), must take fp16 descriptors only and issue fp16 wgmma, without spills or local memory."""
    from megamoe.backends.triton.kernels.gluon_common import ConsumerTile

    tile = ConsumerTile.of(getattr(_SM90_TMA, gemm))
    assert tile == gluon_rows.TILES["coop"], tile
    r = warp_specialized_report(_compile(gemm, tile, spread_h=spread_h, dtype=torch.float16))
    descs = {name: t for name, t in r["compiled"].src.signature.items() if t.startswith("tensordesc")}
    assert all(t.startswith("tensordesc<fp16[") for t in descs.values()), f"{gemm} fp16: descriptors {descs}"
    forms = wgmma_operand_types(r["ptx"])
    assert forms == {("f16", "f16")}, f"{gemm} fp16: wgmma forms {forms}"
    assert_no_spills_or_serialisation(f"{gemm} fp16", r)
