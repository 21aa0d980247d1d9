"""The Triton placement (megamoe.backends.triton.kernels.schedule) equals place_routing_torch, bit for bit, and
fails its assert on an expert id outside [0, E).

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
        flat = ids.reshape(-1).to(torch.int32 if E % 2 else torch.int64)
        for rank in range(W):
            R = receive_rows(T, k, E // W, W, B, cf)
            want = place_routing_torch(flat, num_experts=E, world_size=W, rank=rank, block_m=B, num_rows=R)
            got = place_routing(flat, num_experts=E, world_size=W, rank=rank, block_m=B, num_rows=R)
            for f in dataclasses.fields(want):
                a, b = getattr(want, f.name), getattr(got, f.name)
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (W, T, k, E, B, cf, routing, rank, f.name)
    bad = torch.tensor([0, 3, 4, 1], dtype=torch.int32)  # 4 lies outside [0, 4)
    try:
        place_routing(bad, num_experts=4, world_size=1, rank=0, block_m=4, num_rows=receive_rows(2, 2, 4, 1, 4, None))
    except RuntimeError as e:
        assert "expert ids in [0, 4)" in str(e), e
    else:
        raise AssertionError("an id outside [0, E) passed")
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

    count = {"ids_ptr": "*i64", "chunk_counts_ptr": "*i32", "num_pairs": "i32", "num_experts": "i32",
             "CHUNK": "constexpr", "BINS": "constexpr"}
    layout = {
        "chunk_counts_ptr": "*i32", "starts_ptr": "*i32", "counts_ptr": "*i32", "offsets_ptr": "*i32",
        "block_expert_ptr": "*i32", "num_blocks_ptr": "*i32", "overflow_ptr": "*i32", "ids_ok_ptr": "*i32",
        "row_src_ptr": "*i32", "num_chunks": "i32", "num_experts": "i32", "world_size": "i32", "num_local": "i32",
        "rank": "i32", "block_m": "i32", "num_rows": "i32", "num_row_blocks": "i32",
        "BLOCK_W": "constexpr", "BLOCK_L": "constexpr", "CHUNKS": "constexpr", "BLOCKS": "constexpr",
        "ROWS": "constexpr",
    }
    place = {
        "ids_ptr": "*i32", "chunk_counts_ptr": "*i32", "starts_ptr": "*i32", "dest_row_ptr": "*i32",
        "row_src_ptr": "*i32", "dest_rank_ptr": "*i32", "num_pairs": "i32", "num_experts": "i32",
        "num_local": "i32", "rank": "i32", "num_rows": "i32", "local_first": "i32", "local_pairs": "i32",
        "CHUNK": "constexpr", "BINS": "constexpr", "CHUNKS": "constexpr",
    }
    bins = 256  # 128 experts + the out-of-range count, rounded up
    for fn, signature, constexprs in (
        (kernels.count_kernel, count, {"CHUNK": 1024, "BINS": bins}),
        (kernels.layout_kernel, layout, {"BLOCK_W": 2, "BLOCK_L": 64, "CHUNKS": kernels.LOAD_ELEMENTS // 128,
                                         "BLOCKS": kernels.BLOCKS_PER_STEP, "ROWS": kernels.ROWS_PER_STEP}),
        (kernels.place_kernel, place, {"CHUNK": 1024, "BINS": bins, "CHUNKS": kernels.LOAD_ELEMENTS // bins}),
    ):
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
        assert compiled.asm["ptx"], fn.__name__
