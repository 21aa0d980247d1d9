"""Expert parallelism (torchrun): the EP path's kernels on every GPU there is (one included); the layer and the
EP kernels with one process per GPU (skipped without 2 CUDA GPUs) and with two processes sharing GPU 0 (any CUDA
machine: the ranks' kernels are time-sliced, so their exchanges, pulls and pushes cross real process and
symmetric-memory boundaries, at no meaningful speed)."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


WORKER = pathlib.Path(__file__).with_name("ep_worker.py")
# NVLink multicast must stay off on shared machines.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# Where the ranks run: one per GPU (needs 2 GPUs), or two on GPU 0 (ep_worker.ONE_GPU_RANKS).
PLACEMENTS = [pytest.param("gpu-per-rank", marks=[pytest.mark.multigpu, pytest.mark.skipif(
                  torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]),
              pytest.param("one-gpu")]


def _world(placement: str) -> int:
    if placement == "one-gpu":
        return 2
    return min(torch.cuda.device_count(), int(os.environ.get("MEGAMOE_TEST_GPUS", torch.cuda.device_count())))


def _torchrun(mode: str, timeout: int, placement: str = "gpu-per-rank", nproc: int | None = None) -> subprocess.CompletedProcess:
    nproc = _world(placement) if nproc is None else nproc
    env = {**os.environ, **SAFE_ENV, "MEGAMOE_TEST_ONE_GPU_RANKS": "1" if placement == "one-gpu" else "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", str(WORKER), mode]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_ep_kernels_on_one_gpu():
    """The EP path's kernels (pulls, fused GEMMs, pushes, exchanges) through a group of one: the GPU pulls from
    and pushes to its own symmetric memory, so every session's GPU tests them, two GPUs or not."""
    result = _torchrun("ep-kernels", timeout=900, nproc=1)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_ep_kernels_across_ranks(placement):
    result = _torchrun("ep-kernels", timeout=900, placement=placement)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_ep_correct_deterministic_graph(placement):
    result = _torchrun("checks", timeout=900, placement=placement)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_peer_that_never_arrives_is_an_error_not_a_hang(placement):
    """Rank 1 skips a call: rank 0 fails within comm_timeout_ms, and the report names the rank that waited,
    the peer that never arrived and the exchange (its barrier channel: the routing exchange comes first)."""
    from megamoe.backends.triton.comm.workspace import BARRIER_CHANNELS

    result = _torchrun("timeout", timeout=120, placement=placement)
    output = result.stdout + result.stderr
    assert result.returncode != 0, "rank 0 finished although its peer never took part"
    assert "NO ERROR" not in result.stdout, result.stdout[-2000:]
    want = f"rank 0 failed to receive signal from rank 1 on channel {BARRIER_CHANNELS['routing']}"
    assert want in output, output[-4000:]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_one_workspace_reused_across_t(placement):
    result = _torchrun("workspace", timeout=300, placement=placement)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_ranks_on_different_checked_shapes_fail_not_hang(placement):
    """Every rank runs the agreeing shapes, then the mismatched call fails the routing exchange's device assert
    (a non-zero exit alone would also come from a worker that crashed before, or never reached the GPU)."""
    result = _torchrun("mismatch", timeout=120, placement=placement)
    output = result.stdout + result.stderr
    assert result.returncode != 0, "ranks calling with different shapes finished"
    assert "NO ERROR" not in result.stdout, result.stdout[-2000:]
    for rank in range(_world(placement)):
        assert f"rank {rank}: agreeing shapes ran" in result.stdout, f"rank {rank} failed before the mismatch:\n{output[-4000:]}"
    # CUDA's report of a failed device assert (torch._assert_async): "assert" alone also matches a host-side
    # AssertionError (a TMA descriptor's, say), which is not the routing exchange's check.
    assert "device-side assert" in result.stderr, f"no device assert:\n{output[-4000:]}"


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_rejected_arguments_fail_the_peers_at_once(placement):
    result = _torchrun("reject", timeout=300, placement=placement)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
