"""CPU checks of benchmarks/multicast_probe.py: compiles (Gluon's multi-CTA layouts and multicast TMA loads, Triton
>= 3.8, see the probe's docstring; skipped under an older Triton, scripts/test_triton_next.sh runs them under 3.8.0
and 3.9.0) and a model of its slot protocol (any Triton).

For one CTA per program and for 2-CTA clusters, A by TMA and A gathered by cp.async, compiled for sm_90a: no spills,
shared memory within an SM's 227 KB, 16 wgmma per K step of the two consumer warpgroups (2 m64 row halves x 4 k16
steps x 2 warpgroups), and the slot protocol of the module docstring as lowered: with clusters, the weight tile copied
once by a multicast TMA load to both CTAs (mask 3) issued from the lead CTA only, each release arrives once on the
CTA's own barrier and once on the lead's (shared::cluster), the lead's producer alone waits on the cluster barrier,
and the barriers are initialised and fenced before the first cluster barrier; gathering, 8 cp.async of 16 bytes per
producer thread per K step and one arrival of each producer thread on the slot's "ready" barrier when they landed.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compile checks need compiled (not interpreted) kernels", allow_module_level=True)

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
import torch  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from compile_checks import SMEM_LIMIT, TRITON, count, divisible_by_16, ptxas_report  # noqa: E402

needs_multicast = pytest.mark.skipif(TRITON < (3, 8),
                                     reason=f"the probe needs Triton >= 3.8's Gluon, found {triton.__version__}")
if TRITON >= (3, 8):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import multicast_probe as P  # noqa: E402


def _compile(cluster: int, gather: bool):
    t = torch.empty(4096, 4096, dtype=torch.bfloat16)
    descs = P.descriptors(t, t, t, cluster)
    signature = {name: mangle_type(d) for name, d in zip(("a_desc", "b_desc", "c_desc"), descs)}
    signature.update(x_ptr="*bf16", idx_ptr="*i32", M="i32", N="i32", K="i32", STAGES="constexpr", GATHER="constexpr")
    src = triton.experimental.gluon._runtime.GluonASTSource(
        P.multicast_gemm_kernel, signature, {"STAGES": P.STAGES, "GATHER": gather},
        divisible_by_16(P.multicast_gemm_kernel, ("x_ptr", "idx_ptr", "K")))
    return triton.compile(src, target=triton.backends.compiler.GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_ctas": cluster})


@needs_multicast
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("cluster", [1, 2])
def test_multicast_probe_sm90a(cluster, gather):
    compiled = _compile(cluster, gather)
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx)
    wgmma = count(rf"wgmma\.mma_async\.sync\.aligned\.m64n{P.BLOCK_N.value // 2}k16\.f32\.bf16\.bf16", ptx)
    multicast = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier::complete_tx::bytes"
                           r"\.multicast::cluster \[[^]]*\], \[[^]]*\], \[[^]]*\], (%rs\d+);", ptx)
    tma_loads = count(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cta|cluster)\.global\.mbarrier::complete_tx::bytes",
                      ptx)
    cp_async = count(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    noinc = count(r"cp\.async\.mbarrier\.arrive\.noinc\.shared", ptx)
    remote_arrives = count(r"mbarrier\.arrive\.shared::cluster\.b64", ptx)
    local_arrives = count(r"mbarrier\.arrive\.shared::cta\.b64", ptx)
    print(f"\nmulticast probe, cluster {cluster}, gather {gather}: shared {compiled.metadata.shared} B, "
          f"{wgmma} wgmma, {tma_loads} TMA loads ({len(multicast)} multicast), {cp_async} cp.async, "
          f"arrives local/remote "
          f"{local_arrives}/{remote_arrives}, spills {report['spill_stores']}/{report['spill_loads']} B")
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report["log"]
    assert compiled.metadata.shared <= SMEM_LIMIT
    assert wgmma == 2 * 2 * (P.BLOCK_K.value // 16), wgmma
    assert "elect.sync" in ptx and count(r"wgmma\.wait_group\.sync\.aligned 1;", ptx) >= 2
    # the B tile's two halves by TMA, A by TMA or by 8 cp.async a thread and its arrival
    if gather:
        assert tma_loads == 2 and cp_async == 8 and noinc == 1, (tma_loads, cp_async, noinc)
    else:
        assert tma_loads == 3 and cp_async == 0 and noinc == 0, (tma_loads, cp_async, noinc)
    if cluster == 1:
        assert not multicast and remote_arrives == 0 and ".reqnctapercluster" not in ptx
        return
    assert ".reqnctapercluster 2" in ptx
    assert len(multicast) == 2, "the weight tile: its two halves multicast"
    for mask_reg in multicast:
        mask = re.search(rf"mov\.b16\s+{re.escape(mask_reg)}, (\d+);", ptx)
        assert mask and mask.group(1) == "3", "the multicast goes to both CTAs"
    assert "%cluster_ctarank" in ptx
    # each consumer warpgroup releases a slot on its CTA's barrier and on the lead's, in the loop and after it
    assert remote_arrives == local_arrives == 4, (local_arrives, remote_arrives)
    assert "@!%p" in ptx and "skipWait" in ptx, "the cluster barrier's wait is predicated (the lead only)"
    fence = ptx.index("fence.mbarrier_init.release.cluster")
    assert ptx.index("mbarrier.init") < fence < ptx.index("barrier.cluster.wait")


def _run_ring(stages: int, tiles: int, k_steps: int, seed: int, cluster_wait: bool = True) -> None:
    """One random interleaving of the probe's slot protocol (test_multicast_ring_model); raises AssertionError on
    a violation. cluster_wait False: the lead refills a slot once its own consumers released it (the bug the
    lead-CTA barrier prevents)."""
    import random

    a_bytes, b_bytes = 16, 32

    class Barrier:
        def __init__(self, count):
            self.count, self.pending, self.tx, self.phase = count, count, 0, 0

        def _maybe_complete(self):
            if self.pending == 0 and self.tx == 0:
                self.phase, self.pending = self.phase + 1, self.count

        def arrive(self, expect=0):
            self.tx += expect
            self.pending -= 1
            assert self.pending >= 0, "more arrivals than the phase counts"
            self._maybe_complete()

        def complete_tx(self, nbytes):
            self.tx -= nbytes
            self._maybe_complete()

        def passes(self, parity):
            return (self.phase & 1) != parity

    rnd = random.Random(seed)
    fills = tiles * k_steps
    ready = [[Barrier(1) for _ in range(stages)] for _ in range(2)]
    empty_cta = [[Barrier(2) for _ in range(stages)] for _ in range(2)]
    empty_cluster = [Barrier(2 * 2) for _ in range(stages)]  # on the lead: 2 CTAs x 2 warpgroups
    slot_a = [[None] * stages for _ in range(2)]  # the fill whose data each slot holds
    slot_b = [[None] * stages for _ in range(2)]
    reading = [[set() for _ in range(stages)] for _ in range(2)]  # the warpgroups reading each slot
    copies = []  # in flight: (cta, slot, fill, "a" or "b")
    prod = [0, 0]  # each CTA's producer: its next fill
    cons = {(cta, wg): [0, None] for cta in (0, 1) for wg in (0, 1)}  # next fill, the fill held unreleased

    def release(cta, wg, fill):
        s = fill % stages
        reading[cta][s].discard(wg)
        empty_cta[cta][s].arrive()
        empty_cluster[s].arrive()

    while True:
        moves = []
        for cta in (0, 1):
            p = prod[cta]
            if p < fills:
                s, parity = p % stages, ((p // stages) & 1) ^ 1
                lead_ok = cta == 1 or not cluster_wait or empty_cluster[s].passes(parity)
                if empty_cta[cta][s].passes(parity) and lead_ok:
                    moves.append(("produce", cta))
        for who, (c, _) in cons.items():
            if c < fills and ready[who[0]][c % stages].passes((c // stages) & 1):
                moves.append(("consume", who))
        moves += [("land", i) for i in range(len(copies))]
        if not moves:
            break
        kind, who = rnd.choice(moves)
        if kind == "produce":
            cta, p = who, prod[who]
            s = p % stages
            ready[cta][s].arrive(expect=a_bytes + b_bytes)
            copies.append((cta, s, p, "a"))
            if cta == 0:  # the lead multicasts B into both CTAs
                copies += [(0, s, p, "b"), (1, s, p, "b")]
            prod[cta] += 1
        elif kind == "land":
            cta, s, p, part = copies.pop(who)
            assert not reading[cta][s], f"fill {p} lands in slot {s} of CTA {cta} while it is read"
            assert ready[cta][s].phase == p // stages, f"fill {p}'s bytes land on another phase"
            (slot_a if part == "a" else slot_b)[cta][s] = p
            ready[cta][s].complete_tx(a_bytes if part == "a" else b_bytes)
        else:  # a consumer warpgroup's K step: wait ready, read, release the previous step (and at a tile's end this)
            cta, wg = who
            c, held = cons[who]
            s = c % stages
            assert slot_a[cta][s] == c and slot_b[cta][s] == c, f"CTA {cta} reads fill {c} from another fill's data"
            reading[cta][s].add(wg)
            if held is not None:  # step c - 1's wgmma retired once step c is issued
                release(cta, wg, held)
            if (c + 1) % k_steps == 0:  # the tile's end: wait(0), release step c too
                release(cta, wg, c)
                cons[who] = [c + 1, None]
            else:
                cons[who] = [c + 1, c]
    done = prod == [fills, fills] and not copies and all(c == fills for c, _ in cons.values())
    assert done, f"deadlock: producers at {prod}, consumers at {cons}, {len(copies)} copies in flight"


def test_multicast_ring_model():
    """The probe's slot protocol in Python under random interleavings of the warps and of the copies' completions,
    with mbarriers as the hardware has them (an arrival count and a transaction byte count per phase; the phase
    completes when both reach zero, the byte count may dip below zero first; try_wait.parity(x) passes while the
    phase's parity differs from x). Two CTAs, each a producer and two consumers reading every slot; A rows per CTA,
    the B tile multicast by the lead into both CTAs. Checked: every consumer reads the A and B of the fill it waited
    for, no copy lands in a slot a consumer still reads, every byte count lands on the phase it was meant for, and
    every run ends (no deadlock)."""
    for stages in (2, 3, 4):
        for tiles, k_steps in ((1, 1), (1, 5), (3, 4), (6, 7)):
            for seed in range(60):
                _run_ring(stages, tiles, k_steps, seed)


def test_multicast_ring_model_needs_the_cluster_wait():
    """Without the lead's wait on the lead-CTA barrier the same model finds a violation (a multicast landing in the
    other CTA's slot while it is read, or on a wrong phase): the check can fail."""
    failures = 0
    for seed in range(200):
        try:
            _run_ring(2, 3, 4, seed, cluster_wait=False)
        except AssertionError:
            failures += 1
    assert failures > 0, "the model found no violation without the cluster wait"
