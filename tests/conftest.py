"""Shared helpers of the CPU test suite: seeded random problems, error-budget asserts, experts runners.

Test modules import the plain functions with `from conftest import ...` (pytest puts tests/ on sys.path);
fixtures (`rng`, `seed`) are picked up by pytest. Nothing here is GPU-specific: the gpu/multigpu/slow
markers are declared in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import subprocess
import sys
import time
import unittest.mock
import zlib

import pytest
import torch
import torch._functorch.config as functorch_config

import megamoe



def pytest_configure(config) -> None:
    # Tiny CPU problems: intra-op threads only add OpenMP spin/handoff cost (a 10x24 fp64 matmul takes
    # 25 ms with 2 threads on a loaded 2-core runner, 3 us with 1). Bitwise checks compare runs made
    # under the same setting.
    torch.set_num_threads(1)
    # AOTAutograd's on-disk cache keys a compiled graph by the graph that calls megamoe's custom ops, not by
    # the ops' Python backward formula (autograd.py): after an edit to it, the torch.compile tests would run the
    # backward traced by an earlier session. Off here and in the processes the tests start (inductor's own
    # cache, keyed by the traced ops, stays on).
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    functorch_config.enable_autograd_cache = False


# --------------------------------------------------------------------------------------------- seeding


@pytest.fixture
def seed(request) -> int:
    """A seed derived from the test's node id: stable across runs, different between tests."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def rng(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------- problems


@dataclasses.dataclass
class Problem:
    """One experts() problem in fp64 (the ground-truth precision); `cast` gives other dtypes.

    x [T, H]; topk_ids [T, k] int64; topk_weights [T, k]; w_gate_up [E, 2I, H]; w_down [E, H, I];
    shared_gate_up [2I_s, H] / shared_down [H, I_s] or None; d_out [T, H] the upstream gradient.
    """

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    shared_gate_up: torch.Tensor | None
    shared_down: torch.Tensor | None
    d_out: torch.Tensor

    @property
    def float_names(self) -> list[str]:
        names = ["x", "topk_weights", "w_gate_up", "w_down"]
        return names + (["shared_gate_up", "shared_down"] if self.shared_gate_up is not None else [])

    def cast(self, dtype: torch.dtype, weights_dtype: torch.dtype | None = None) -> "Problem":
        """The same problem with floating tensors in `dtype` (topk_weights in `weights_dtype`, default fp32
        for low precision, as a router produces them)."""
        if weights_dtype is None:
            weights_dtype = torch.float64 if dtype == torch.float64 else torch.float32

        def c(t, dt=dtype):
            return None if t is None else t.detach().to(dt).clone()

        return Problem(
            c(self.x), self.topk_ids.clone(), c(self.topk_weights, weights_dtype), c(self.w_gate_up),
            c(self.w_down), c(self.shared_gate_up), c(self.shared_down), c(self.d_out),
        )


def routing(kind: str, num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] int64 expert ids with distinct experts per token (as top-k produces them).

    kind: "random" (uniform), "one" (every token's first slot on expert 0, the rest on 1..k-1: expert 0
    gets all T tokens), "empty" (only even experts used, odd ones stay empty; needs E >= 2k),
    "last" (only the last k experts used).
    """
    if kind == "random":
        return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).reshape(
            num_tokens, top_k
        )
    if kind == "one":
        return torch.arange(top_k).repeat(num_tokens, 1)
    if kind == "empty":
        even = torch.arange(0, num_experts, 2)
        assert even.numel() >= top_k, "routing('empty') needs E >= 2k"
        return torch.stack([even[torch.randperm(even.numel(), generator=gen)[:top_k]] for _ in range(num_tokens)]).reshape(
            num_tokens, top_k
        )
    if kind == "last":
        return (num_experts - top_k + torch.arange(top_k)).repeat(num_tokens, 1)
    raise ValueError(kind)


def make_problem(
    gen: torch.Generator,
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    *,
    shared_intermediate: int = 0,
    route: str = "random",
    topk_ids: torch.Tensor | None = None,
) -> Problem:
    """A random fp64 problem; weights scaled like nn.Linear so activations stay O(1) at every size."""

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    if topk_ids is None:
        topk_ids = routing(route, num_tokens, num_experts, top_k, gen)
    shared_gate_up = shared_down = None
    if shared_intermediate:
        shared_gate_up = randn(2 * shared_intermediate, hidden, scale=hidden**-0.5)
        shared_down = randn(hidden, shared_intermediate, scale=shared_intermediate**-0.5)
    return Problem(
        x=randn(num_tokens, hidden),
        topk_ids=topk_ids.to(torch.int64),
        topk_weights=torch.rand(num_tokens, top_k, generator=gen, dtype=torch.float64) + 0.1,
        w_gate_up=randn(num_experts, 2 * intermediate, hidden, scale=hidden**-0.5),
        w_down=randn(num_experts, hidden, intermediate, scale=intermediate**-0.5),
        shared_gate_up=shared_gate_up,
        shared_down=shared_down,
        d_out=randn(num_tokens, hidden),
    )


def run_experts(problem: Problem, fn=None, **kwargs) -> dict[str, torch.Tensor]:
    """Forward + backward of `fn` (default megamoe.experts) with d_out; returns {"out", "d_<name>"...}.

    Leaves are fresh detached copies, so the problem's tensors are never touched.
    """
    fn = megamoe.experts if fn is None else fn
    leaves = {name: getattr(problem, name).detach().clone().requires_grad_() for name in problem.float_names}
    out = fn(
        leaves["x"], problem.topk_ids, leaves["topk_weights"], leaves["w_gate_up"], leaves["w_down"],
        shared_gate_up=leaves.get("shared_gate_up"), shared_down=leaves.get("shared_down"), **kwargs,
    )
    grads = torch.autograd.grad(out, list(leaves.values()), problem.d_out.to(out.dtype))
    return {"out": out.detach(), **{f"d_{name}": g for name, g in zip(leaves, grads)}}


def run_reference(problem: Problem) -> dict[str, torch.Tensor]:
    return run_experts(problem, megamoe.reference.experts)


# --------------------------------------------------------------------------------------------- asserts


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in fp64 (0 when both are zero)."""
    diff = (a.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    return diff / scale if scale > 0 else diff


def _check_meta(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert isinstance(ours, torch.Tensor), f"{name}: expected a tensor, got {type(ours).__name__}"
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(ours).all(), f"{name}: has {(~torch.isfinite(ours)).sum().item()} non-finite values"


BF16_ULP = 2.0**-8


def assert_close_budget(
    name: str, ours: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, factor: float = 2.0, floor: float = 1e-5,
    ulp: float = 0.0,
) -> None:
    """Error budget (docs/design.md, "Accuracy"): err(ours) <= factor * err(PyTorch's own low-precision
    run) + floor, errors relative to the fp64 reference in the Frobenius norm. NaN/inf never pass.

    ulp (one ulp of the low precision, e.g. BF16_ULP) adds ulp / sqrt(n) to the low-precision run's error first:
    on few elements that error is itself a random draw (for a single dot product it can be 50x below typical);
    on large tensors the term is nil. An all-zero reference (e.g. the weight gradients of experts that no token
    reached) has no relative error to scale by: ours must be all zeros too."""
    _check_meta(name, ours, ref64)
    assert torch.isfinite(ref_lowp).all(), f"{name}: the low-precision reference itself is non-finite"
    if not ref64.any():
        assert not ours.any(), f"{name}: {int(ours.count_nonzero())} nonzero values where the reference is all zeros"
        return
    ours_err = rel_err(ours, ref64)
    budget_err = rel_err(ref_lowp, ref64) + (ulp / ref64.numel() ** 0.5 if ref64.numel() else 0.0)
    assert ours_err <= factor * budget_err + floor, (
        f"{name}: rel err {ours_err:.3e} > {factor} * {budget_err:.3e} (PyTorch low-precision) + {floor:.0e}"
    )


def assert_close_tight(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Relative Frobenius error below `tol` (fp32 ~1e-5, fp64 ~1e-12); NaN/inf never pass."""
    _check_meta(name, ours, ref)
    err = rel_err(ours, ref)
    assert err <= tol, f"{name}: rel err {err:.3e} > {tol:.0e}"


def assert_equal(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Exact equality of values, shape and dtype (indices, counts, repeated runs)."""
    assert isinstance(ours, torch.Tensor), f"{name}: expected a tensor, got {type(ours).__name__}"
    assert ours.dtype == ref.dtype, f"{name}: dtype {ours.dtype} != expected {ref.dtype}"
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != expected {tuple(ref.shape)}"
    if not torch.equal(ours, ref):
        mismatch = ours != ref  # NaN != NaN: a NaN never passes, even when both sides have it
        where = mismatch.nonzero()[:5].tolist()
        raise AssertionError(
            f"{name}: {int(mismatch.sum())} of {ours.numel()} elements differ, first at {where}\n"
            f"got      {ours.flatten()[:32].tolist()}\nexpected {ref.flatten()[:32].tolist()}"
        )


def problem_id(shape: tuple) -> str:
    """Readable parametrize ids: T{}-H{}-I{}-E{}-k{}."""
    return "T{}-H{}-I{}-E{}-k{}".format(*shape)


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty, torch.empty_like and Tensor.new_empty (megamoe allocates its outputs with all three) return
    NaN-filled floating tensors inside the block: unwritten outputs show as NaN."""

    def poisoned(allocate):
        def allocate_nan(*args, **kwargs):
            out = allocate(*args, **kwargs)
            if out.is_floating_point():
                out.fill_(float("nan"))
            return out

        return allocate_nan

    with contextlib.ExitStack() as stack:
        for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
            stack.enter_context(unittest.mock.patch.object(owner, name, poisoned(getattr(owner, name))))
        yield


# ----------------------------------------------------------------------------------------------------
# gloo process groups on this machine (the CPU expert-parallel and distributed-wrapper tests)


def init_gloo(rank: int, world: int, port: int) -> None:
    """In a spawned worker: one thread, and the gloo group of `world` ranks on 127.0.0.1:port."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def leave_gloo(rank: int, world: int) -> None:
    """End a spawned gloo worker once every rank has saved its results: no destroy_process_group and no
    collective (a worker may leave a collective pending by design, and gloo's threads torn down at exit
    aborted a worker now and then: "terminate called without an active exception"); the store (served by
    rank 0) says when every rank is done, rank 0 leaves last, and the process exits without teardown."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add("saved", 1)
    while store.add("saved", 0) < world:
        time.sleep(0.05)
    if rank != 0:
        store.add("left", 1)
    else:
        while store.add("left", 0) < world - 1:
            time.sleep(0.05)
    os._exit(0)


def run_gloo_workers(worker, world: int, args: tuple, out_dir, timeout_s: float, what: str) -> list:
    """Spawn `world` processes running worker(rank, world, port, *args) on a free local port and return
    each rank's results, which the worker saves to out_dir/rank{r}.pt. Past timeout_s the processes are
    killed and the test fails, naming `what`."""
    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(worker, args=(world, port, *args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"gloo workers ({what}) did not finish within {timeout_s}s")
    return [torch.load(f"{out_dir}/rank{r}.pt", weights_only=False) for r in range(world)]


# ----------------------------------------------------------------------------------------------------
# Triton interpreter suites (tests/test_*_interpret.py). Each begins with
#
#     pytestmark = INTERPRETER_WARNINGS
#     test_interpreter_suite = interpreter_suite(__file__)
#
# and marks its own tests @interpreted; it imports megamoe's Triton modules under `if INTERPRET:` only.

# Whether this process runs Triton's interpreter (set before any kernel is defined: run_interpreted).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# A test that needs the interpreter: skipped in a plain process, where its file's test_interpreter_suite runs it.
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in test_interpreter_suite's TRITON_INTERPRET=1 subprocess")
# The interpreter itself trips a NumPy deprecation on every scalar index; not ours to fix.
INTERPRETER_WARNINGS = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def run_interpreted(test_file: str) -> None:
    """Run test_file's tests in a TRITON_INTERPRET=1 subprocess (Triton reads the variable when a kernel is
    defined, so it must be set before megamoe's kernels are imported) and fail with its output if any fails."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"interpreted tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"


def interpreter_suite(test_file: str):
    """test_file's test_interpreter_suite: in a plain process it runs the file's @interpreted tests in a
    TRITON_INTERPRET=1 subprocess (run_interpreted); in that subprocess it is skipped."""

    @pytest.mark.skipif(INTERPRET, reason="already interpreted")
    def test_interpreter_suite():
        run_interpreted(test_file)

    return test_interpreter_suite
