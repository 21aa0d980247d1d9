"""The Triton placement (megamoe.backends.triton.kernels.schedule) equals place_routing_torch, bit for bit.

Run in the Triton interpreter on the CPU (in a subprocess, since TRITON_INTERPRET must be set before
Triton is imported), and compiled for sm_90a.
"""

import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import dataclasses, torch
    from megamoe.schedule import place_routing_torch, receive_rows
    from megamoe.backends.triton.kernels.schedule import place_routing
    torch.manual_seed(0)
    cases = [  # (W, T, k, E, block_m, capacity_factor, routing)
        (1, 37, 2, 4, 16, None, "random"), (1, 1, 1, 16, 128, None, "random"), (2, 50, 3, 8, 16, None, "one"),
        (4, 33, 2, 8, 4, None, "random"), (2, 64, 4, 6, 16, 0.5, "random"), (3, 20, 2, 9, 1, None, "random"),
        (1, 300, 8, 128, 128, None, "random"), (2, 100, 2, 4, 32, 0.3, "random"), (2, 40, 1, 4, 16, None, "rank0"),
        (8, 16, 2, 48, 16, None, "random"), (1, 129, 3, 7, 64, None, "two"),
    ]
    for W, T, k, E, B, cf, routing in cases:
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(W * T)])
        if routing == "one":
            ids[:, 0] = 3
            ids = ids[:, :1].repeat(1, 1) if k == 1 else ids
        if routing == "rank0":
            ids = torch.randint(0, E // W, (W * T, k))
        if routing == "two":
            ids = torch.tensor([1, E - 2])[torch.randint(0, 2, (W * T, k))]
        flat = ids.reshape(-1).long()
        for rank in range(W):
            R = receive_rows(T, k, E // W, W, B, cf)
            want = place_routing_torch(flat, num_experts=E, world_size=W, rank=rank, block_m=B, num_rows=R)
            got = place_routing(flat, num_experts=E, world_size=W, rank=rank, block_m=B, num_rows=R)
            for f in dataclasses.fields(want):
                a, b = getattr(want, f.name), getattr(got, f.name)
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (W, T, k, E, B, cf, routing, rank, f.name)
    print("ok", len(cases))
    """
)


def test_placement_matches_torch_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.parametrize("arch", [90, 100])
def test_placement_kernels_compile(arch):
    from triton.backends.compiler import GPUTarget

    from megamoe.backends.triton.kernels import schedule as kernels

    layout = {
        "bounds_ptr": "*i64", "starts_ptr": "*i64", "counts_ptr": "*i32", "offsets_ptr": "*i32",
        "block_expert_ptr": "*i32", "num_blocks_ptr": "*i32", "world_size": "i32", "num_local": "i32",
        "rank": "i32", "block_m": "i32", "num_rows": "i32", "num_row_blocks": "i32",
        "BLOCK_W": "constexpr", "BLOCK_L": "constexpr", "BLOCKS": "constexpr",
    }
    place = {
        "sorted_ptr": "*i16", "perm_ptr": "*i64", "bounds_ptr": "*i64", "starts_ptr": "*i64",
        "dest_row_ptr": "*i32", "row_src_ptr": "*i32", "overflow_ptr": "*i32", "num_pairs": "i32",
        "num_local": "i32", "rank": "i32", "num_rows": "i32", "BLOCK": "constexpr",
    }
    for fn, signature, constexprs in (
        (kernels.layout_kernel, layout, {"BLOCK_W": 2, "BLOCK_L": 64, "BLOCKS": kernels.BLOCKS_PER_STEP}),
        (kernels.place_kernel, place, {"BLOCK": kernels.PLACE_BLOCK}),
    ):
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
        assert compiled.asm["ptx"], fn.__name__
