"""A group whose ranks run on several hosts gets the torch path (2 gloo processes on CPU).

"auto" must pick the fused Triton path only for a group whose ranks all share this host, whose GPUs
symmetric memory maps over NVLink: megamoe.autograd.group_hosts gathers each rank's host once per group,
and a group spanning hosts resolves to "torch" under "auto" and is a ValueError under "triton". Both
processes run here, so rank 1 is made to report another host (autograd._host_id patched); the fused path
needs a GPU, so where it matters autograd.triton_runs_on (and the bench gate's) is patched to True (resolve_backend
only asks).
One spawn runs every scenario; the parent checks what each rank saved.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist

import megamoe
from megamoe import MoEConfig, autograd
from megamoe.bench import gate, run
from conftest import assert_equal, init_gloo, leave_gloo, run_gloo_workers

WORLD = 2
T, H, I, K, E_LOCAL = 5, 8, 4, 2, 2
SPAWN_TIMEOUT_S = 240
OTHER_HOST = "other-host/00000000"


def _inputs(rank: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(rank)
    return dict(
        x=torch.randn(T, H, generator=gen).to(dtype),
        topk_ids=torch.stack([torch.randperm(E_LOCAL * WORLD, generator=gen)[:K] for _ in range(T)]),
        topk_weights=torch.rand(T, K, generator=gen),
        w_gate_up=(torch.randn(E_LOCAL, 2 * I, H, generator=gen) / H**0.5).to(dtype),
        w_down=(torch.randn(E_LOCAL, H, I, generator=gen) / I**0.5).to(dtype),
    )


def _attempt(fn) -> dict:
    try:
        return {"value": fn(), "error": None}
    except Exception as e:  # noqa: BLE001 - the parent checks type and message
        return {"value": None, "error": f"{type(e).__name__}: {e}"}


def _scenarios(rank: int) -> dict:
    results = {"host": autograd._host_id()}
    cpu = torch.device("cpu")
    same = dist.new_group(list(range(WORLD)))
    results["same-hosts"] = autograd.group_hosts(same.group_name, cpu)
    real_host_id = autograd._host_id
    if rank == 1:
        autograd._host_id = lambda: OTHER_HOST
    split = dist.new_group(list(range(WORLD)))
    results["split-hosts"] = autograd.group_hosts(split.group_name, cpu)

    # Cached by group name: no second gather, whatever _host_id says now.
    gathers = []
    real_gather = dist.all_gather_object
    dist.all_gather_object = lambda *args, **kwargs: gathers.append(1) or real_gather(*args, **kwargs)
    autograd._host_id = lambda: "changed"
    results["cached"] = (autograd.group_hosts(split.group_name, cpu), len(gathers))
    dist.all_gather_object = real_gather
    autograd._host_id = lambda: OTHER_HOST if rank == 1 else real_host_id()

    # Backend choice as on a Hopper GPU (resolve_backend only asks triton_runs_on), bf16.
    autograd.triton_runs_on = lambda device: True
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    for name, group in (("same", same), ("split", split)):
        for backend in ("auto", "triton"):
            results[f"resolve-{backend}-{name}"] = _attempt(
                lambda: autograd.resolve_backend(MoEConfig(backend=backend), x, group))
    # `python -m megamoe bench` as on Hopper GPUs: triton among the default backends only on one host.
    gate.triton_runs_on = lambda device: True
    results["bench-backends"] = {name: run.default_backends(cpu, group) for name, group in (("same", same),
                                                                                            ("split", split))}
    results["bench-triton-split"] = gate.unavailable_reason("triton", cpu, split)

    # The public path on the split group: "auto" runs torch (bitwise what backend="torch" gives), eager and
    # under torch.compile(fullgraph=True) on a fresh group, whose first call (the host gather) is traced.
    inputs = _inputs(rank, torch.bfloat16)
    args = [inputs[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")]
    torch_out = megamoe.experts(*args, group=split, config=MoEConfig(backend="torch"))
    auto_out = megamoe.experts(*args, group=split, config=MoEConfig())
    fresh = dist.new_group(list(range(WORLD)))
    compiled = torch.compile(lambda *a: megamoe.experts(*a, group=fresh, config=MoEConfig()), fullgraph=True)
    results["experts"] = {"torch": torch_out, "auto": auto_out, "compiled": _attempt(lambda: compiled(*args))}
    results["fresh-hosts"] = autograd._GROUP_HOSTS.get(fresh.group_name)
    return results


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    try:
        results = _scenarios(rank)
    except Exception as e:  # noqa: BLE001 - reported by every test
        results = {"worker": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi_host")
    results = run_gloo_workers(_worker, WORLD, (str(tmp),), tmp, SPAWN_TIMEOUT_S, "multi-host checks")
    for rank, res in enumerate(results):
        assert "worker" not in res, f"rank {rank}: {res['worker']}"
    return results


def test_group_hosts_gathers_each_ranks_host_once(hosts):
    real = hosts[0]["host"]
    for rank in range(WORLD):
        assert hosts[rank]["host"] == real, "both processes run on this machine"
        assert hosts[rank]["same-hosts"] == (real, real)
        assert hosts[rank]["split-hosts"] == (real, OTHER_HOST), f"rank {rank}: {hosts[rank]['split-hosts']}"
        assert hosts[rank]["cached"] == ((real, OTHER_HOST), 0), f"rank {rank}: gathered again or changed"


def test_auto_picks_triton_only_on_one_host(hosts):
    for rank in range(WORLD):
        assert hosts[rank]["resolve-auto-same"] == {"value": "triton", "error": None}
        assert hosts[rank]["resolve-auto-split"] == {"value": "torch", "error": None}
        assert hosts[rank]["resolve-triton-same"] == {"value": "triton", "error": None}


def test_triton_on_a_group_spanning_hosts_is_a_value_error(hosts):
    real = hosts[0]["host"]
    for rank in range(WORLD):
        message = hosts[rank]["resolve-triton-split"]["error"]
        assert message is not None and message.startswith("ValueError: MoEConfig.backend='triton' "), message
        for words in ("symmetric memory over NVLink", "spans 2 hosts", f"rank 0 has host {real!r}",
                      f"rank 1 has host {OTHER_HOST!r}", "use backend='torch'"):
            assert words in message, f"rank {rank}: the message does not say {words!r}: {message}"


def test_bench_times_triton_only_on_one_host(hosts):
    """A bench under torchrun over several hosts reports triton unavailable there, not FAILED (its gate's
    ValueError), and leaves it out of its default backends."""
    for rank in range(WORLD):
        assert hosts[rank]["bench-backends"] == {"same": ["torch", "triton"], "split": ["torch"]}, hosts[rank]
        assert "every rank of the group on one host" in hosts[rank]["bench-triton-split"], hosts[rank]


def test_experts_on_a_group_spanning_hosts_runs_the_torch_path(hosts):
    real = hosts[0]["host"]
    for rank in range(WORLD):
        res = hosts[rank]["experts"]
        assert_equal(f"rank {rank}: auto out", res["auto"], res["torch"])
        assert res["compiled"]["error"] is None, f"rank {rank}: {res['compiled']['error']}"
        assert_equal(f"rank {rank}: compiled auto out", res["compiled"]["value"], res["torch"])
        assert hosts[rank]["fresh-hosts"] == (real, OTHER_HOST), "the compiled call gathered the hosts"


def test_no_group_is_one_host():
    assert autograd._on_one_host(None, torch.device("cpu"))
