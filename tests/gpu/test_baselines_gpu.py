"""The TorchTitan-style baseline (megamoe.bench.baselines.torchtitan_experts) on one GPU: no host
synchronisation in its forward and backward, as TorchTitan's own path has none on one GPU, so that every
published ratio against it times its kernels and not a sync megamoe does not pay; and therefore it captures as
a CUDA graph, whose replay gives the eager call's bits; run to run it gives the same bits, as TorchTitan's
deterministic combine does.

Run on a CUDA machine: pytest -m gpu tests/gpu/test_baselines_gpu.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from megamoe.bench.baselines import torchtitan_experts
from megamoe.bench.measure import cuda_graph
from megamoe.bench.problem import forward_backward, make_tokens, make_weights, megamoe_layout, torchtitan_weights
from megamoe.bench.workloads import WORKLOADS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_TOKENS, NUM_EXPERTS = 1024, 16


@pytest.fixture
def problem():
    w = WORKLOADS["qwen3-30b-a3b"]
    device = torch.device("cuda")
    weights = torchtitan_weights(make_weights(w, range(NUM_EXPERTS), torch.bfloat16, device))
    tokens = make_tokens(w, NUM_TOKENS, NUM_EXPERTS, "balanced", torch.bfloat16,
                         torch.Generator(device=device).manual_seed(0))
    return weights, tokens


def test_torchtitan_baseline_has_no_host_sync(problem):
    weights, tokens = problem
    forward_backward(torchtitan_experts, weights, tokens)  # warm-up outside the check (allocator, cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_backward(torchtitan_experts, weights, tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_torchtitan_baseline_captures_as_a_cuda_graph(problem):
    weights, tokens = problem
    stream = torch.cuda.Stream()  # eager calls on the capturing stream too (cuda_graph's docstring)
    with torch.cuda.stream(stream):
        step = functools.partial(forward_backward, torchtitan_experts, weights, tokens)
        replay, captured = cuda_graph(step)
        replay()
        eager = step()
    torch.cuda.synchronize()
    # The combine is TorchTitan's deterministic scatter_add: the output and every gradient bit for bit.
    for name in eager:
        assert torch.equal(megamoe_layout(captured[name]), megamoe_layout(eager[name])), name


def test_torchtitan_baseline_is_deterministic(problem):
    """Run to run the same bits (TorchTitan's combine is a deterministic scatter_add, not atomics)."""
    weights, tokens = problem
    first, second = (forward_backward(torchtitan_experts, weights, tokens) for _ in range(2))
    for name in first:
        assert torch.equal(megamoe_layout(first[name]), megamoe_layout(second[name])), name
