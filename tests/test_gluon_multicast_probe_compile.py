"""CPU compile checks of benchmarks/multicast_probe.py (Triton >= 3.9's Gluon: multi-CTA layouts, multicast TMA),
skipped under an older Triton; scripts/test_triton_next.sh runs them against Triton 3.9.

For one CTA per program and for 2-CTA clusters, compiled for sm_90a: no spills, shared memory within an SM's
227 KB, 16 wgmma per K step of the two consumer warpgroups (2 m64 row halves x 4 k16 steps x 2 warpgroups),
and the slot protocol of the module docstring as lowered: with clusters, the weight tile copied once by a
multicast TMA load to both CTAs (mask 3) issued from the lead CTA only, each release arrives once on the
CTA's own barrier and once on the lead's (shared::cluster, the address with its CTA bits cleared), the lead's
producer alone waits on the cluster barrier, and the barriers are initialised and fenced before the first
cluster barrier.
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
if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip(f"the probe needs Triton >= 3.9's Gluon (multicast TMA), found {triton.__version__}",
                allow_module_level=True)
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from compile_checks import SMEM_LIMIT, count, ptxas_report  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import multicast_probe as P  # noqa: E402


def _compile(cluster: int):
    t = torch.empty(4096, 4096, dtype=torch.bfloat16)
    descs = P.descriptors(t, t, t, cluster)
    signature = {name: d.__mangle__() for name, d in zip(("a_desc", "b_desc", "c_desc"), descs)}
    signature.update(M="i32", N="i32", K="i32")
    src = GluonASTSource(P.multicast_gemm_kernel, signature, {}, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": cluster})


@pytest.mark.parametrize("cluster", [1, 2])
def test_multicast_probe_sm90a(cluster):
    compiled = _compile(cluster)
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx)
    wgmma = count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx)
    multicast = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier::complete_tx::bytes"
                           r"\.multicast::cluster \[[^]]*\], \[[^]]*\], \[[^]]*\], (%rs\d+);", ptx)
    remote_arrives = count(r"mbarrier\.arrive\.shared::cluster\.b64", ptx)
    local_arrives = count(r"mbarrier\.arrive\.shared::cta\.b64", ptx)
    print(f"\nmulticast probe, cluster {cluster}: shared {compiled.metadata.shared} B, {wgmma} wgmma, "
          f"{len(multicast)} multicast loads, arrives local/remote {local_arrives}/{remote_arrives}, "
          f"spills {report['spill_stores']}/{report['spill_loads']} B")
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report["log"]
    assert compiled.metadata.shared <= SMEM_LIMIT
    assert wgmma == 2 * 2 * (P.BLOCK_K.value // 16), wgmma
    assert "elect.sync" in ptx and count(r"wgmma\.wait_group\.sync\.aligned 1;", ptx) >= 2
    if cluster == 1:
        assert not multicast and remote_arrives == 0 and ".reqnctapercluster" not in ptx
        return
    assert ".reqnctapercluster 2" in ptx
    assert len(multicast) == 1, "the weight tile: one multicast load"
    mask = re.search(rf"mov\.b16\s+{re.escape(multicast[0])}, (\d+);", ptx)
    assert mask and mask.group(1) == "3", "the multicast goes to both CTAs"
    assert "%cluster_ctarank" in ptx
    # each consumer warpgroup releases a slot on its CTA's barrier and on the lead's, in the loop and after it
    assert remote_arrives == local_arrives == 4, (local_arrives, remote_arrives)
    assert re.search(r"and\.b32\s+%r\d+, %r\d+, -16777224;\s*\n(?:.*\n){0,3}.*mbarrier\.arrive\.shared::cluster", ptx)
    assert "@!%p" in ptx and "skipWait" in ptx, "the cluster barrier's wait is predicated (the lead only)"
    assert ptx.index("mbarrier.init") < ptx.index("fence.mbarrier_init.release.cluster") < ptx.index("barrier.cluster.wait")
