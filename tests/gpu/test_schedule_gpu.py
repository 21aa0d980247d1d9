"""The Triton placement compiled for the GPU (megamoe.backends.triton.kernels.schedule.place_routing, what
build_schedule runs on CUDA tensors) against place_routing_torch on the same GPU, bit for bit, at the sizes
the benchmarks route (up to a million pairs: chunks of 1024 to 8192 pairs, one to 384 experts), in expert
parallel groups (every rank's placement), under a capacity, and on skewed routing; and a bad expert id
failing the device assert (in a subprocess: the failed assert ends its CUDA context).

Run on a CUDA machine: pytest -m gpu tests/gpu/test_schedule_gpu.py
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [  # (W, T, k, E, block_m, capacity_factor, routing)
    (1, 16384, 8, 128, 128, None, "balanced"),  # qwen3-30b-a3b / qwen3-235b-a22b
    (1, 16384, 4, 128, 128, None, "skewed"),  # gpt-oss-120b
    (1, 8192, 2, 8, 128, None, "balanced"),  # mixtral-8x7b
    (1, 8192, 8, 32, 128, None, "skewed"),  # deepseek-v3 on one GPU
    (2, 16384, 8, 128, 128, None, "skewed"),  # EP=2
    (8, 16384, 8, 384, 128, None, "balanced"),  # a million pairs over 384 experts: 8192-pair chunks
    (2, 4096, 8, 64, 128, 1.0, "skewed"),  # a capacity that cuts segments
    (1, 3, 2, 16, 16, None, "balanced"),  # fewer pairs than a chunk
]


def _ids(world_size: int, tokens: int, top_k: int, num_experts: int, routing: str) -> torch.Tensor:
    from megamoe.bench.routing import route

    g = torch.Generator(device="cuda").manual_seed(world_size * 1000 + num_experts)
    return torch.cat([route(routing, tokens, num_experts, top_k, g)[0] for _ in range(world_size)])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "W{}-T{}-k{}-E{}-B{}-cf{}-{}".format(*c))
def test_placement_matches_torch_on_the_gpu(case):
    from megamoe.backends.triton.kernels.schedule import place_routing
    from megamoe.schedule import place_routing_torch, receive_rows

    world_size, tokens, top_k, num_experts, block_m, capacity, routing = case
    flat = _ids(world_size, tokens, top_k, num_experts, routing).reshape(-1)
    rows = receive_rows(tokens, top_k, num_experts // world_size, world_size, block_m, capacity)
    for rank in range(world_size):
        kw = dict(num_experts=num_experts, world_size=world_size, rank=rank, block_m=block_m, num_rows=rows)
        want = place_routing_torch(flat, **kw)
        got = place_routing(flat.to(torch.int32), **kw)
        for field in dataclasses.fields(want):
            a, b = getattr(want, field.name), getattr(got, field.name)
            assert a.dtype == b.dtype and a.shape == b.shape, (rank, field.name, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), (rank, field.name, (a != b).sum().item())
    if capacity is not None:
        assert int(got.overflow) > 0, "the capacity case should cut pairs"


BAD_ID = textwrap.dedent(
    """
    import torch
    from megamoe.schedule import build_schedule
    from megamoe.backends.triton.kernels.schedule import place_routing
    ids = torch.randint(0, 8, (64, 2), device="cuda")
    ids[5, 1] = 8  # outside [0, 8)
    schedule = build_schedule(ids, 8, block_m=16, place_routing=place_routing)
    torch.cuda.synchronize()
    print("no error")
    """
)


def test_bad_expert_id_fails_the_device_assert():
    result = subprocess.run([sys.executable, "-c", BAD_ID], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "no error" not in result.stdout, result.stdout + result.stderr[-2000:]
    # CUDA's own report of a failed device assert: "assert" alone also matches the AssertionError of a torch
    # without CUDA ("Torch not compiled with CUDA enabled"), where no GPU code ran.
    assert "device-side assert" in result.stderr, result.stderr[-2000:]
