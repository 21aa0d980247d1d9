"""Expert parallelism (torchrun, one process per GPU): the EP path's kernels on every GPU there is (one
included), the layer on several GPUs (skipped without 2 CUDA GPUs)."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def multigpu(test):
    """Marks a test that needs several GPUs: skipped with fewer than 2."""
    test = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")(test)
    return pytest.mark.multigpu(test)


WORKER = pathlib.Path(__file__).with_name("ep_worker.py")
# NVLink multicast must stay off on shared machines.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _torchrun(mode: str, timeout: int, nproc: int | None = None) -> subprocess.CompletedProcess:
    if nproc is None:
        nproc = min(torch.cuda.device_count(), int(os.environ.get("MEGAMOE_TEST_GPUS", torch.cuda.device_count())))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", str(WORKER), mode]
    return subprocess.run(cmd, env={**os.environ, **SAFE_ENV}, capture_output=True, text=True, timeout=timeout)


def test_ep_kernels_on_one_gpu():
    """The EP path's kernels (pulls, fused GEMMs, pushes, exchanges) through a group of one: the GPU pulls from
    and pushes to its own symmetric memory, so every session's GPU tests them, two GPUs or not."""
    result = _torchrun("ep-kernels", timeout=900, nproc=1)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@multigpu
def test_ep_kernels_on_every_gpu():
    result = _torchrun("ep-kernels", timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@multigpu
def test_ep_correct_deterministic_graph():
    result = _torchrun("checks", timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@multigpu
def test_peer_that_never_arrives_is_an_error_not_a_hang():
    """Rank 1 skips a call: rank 0 fails within comm_timeout_ms, and the report names the rank that waited,
    the peer that never arrived and the exchange (its barrier channel: the routing exchange comes first)."""
    from megamoe.backends.triton.comm.workspace import BARRIER_CHANNELS

    result = _torchrun("timeout", timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, "rank 0 finished although its peer never took part"
    assert "NO ERROR" not in result.stdout, result.stdout[-2000:]
    want = f"rank 0 failed to receive signal from rank 1 on channel {BARRIER_CHANNELS['routing']}"
    assert want in output, output[-4000:]


@multigpu
def test_one_workspace_reused_across_t():
    result = _torchrun("workspace", timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@multigpu
def test_ranks_on_different_checked_shapes_fail_not_hang():
    """Every rank runs the agreeing shapes, then the mismatched call fails the routing exchange's device assert
    (a non-zero exit alone would also come from a worker that crashed before, or never reached the GPU)."""
    result = _torchrun("mismatch", timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, "ranks calling with different shapes finished"
    assert "NO ERROR" not in result.stdout, result.stdout[-2000:]
    world = min(torch.cuda.device_count(), int(os.environ.get("MEGAMOE_TEST_GPUS", torch.cuda.device_count())))
    for rank in range(world):
        assert f"rank {rank}: agreeing shapes ran" in result.stdout, f"rank {rank} failed before the mismatch:\n{output[-4000:]}"
    assert "assert" in result.stderr.lower(), f"no device assert:\n{output[-4000:]}"


@multigpu
def test_rejected_arguments_fail_the_peers_at_once():
    result = _torchrun("reject", timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
