"""A process group destroyed and created again under the same name starts afresh (2 gloo processes).

megamoe keeps state per expert-parallel group by its name (the custom ops carry the name): the agreement
exchanges' (which groups have met, which are out of step after a timed-out exchange), the ranks' hosts and the
symmetric-memory workspaces. After dist.destroy_process_group() and init_process_group() the default group is
"0" again, a new group: the out-of-step error tells users to recreate the group, and the recreated one must work,
not inherit the old one's verdict.
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist

import megamoe
from megamoe import MoEConfig
from megamoe.autograd import AGREE_FIELDS
from conftest import assert_close_tight, init_gloo, leave_gloo, make_problem, run_gloo_workers

WORLD = 2
T, H, I, K, E_LOCAL = 4, 8, 4, 2, 2
COMM_TIMEOUT_MS = 500
STATUS_LEN = 3  # autograd's per-rank status after the signature in the agreement exchange
CONFIG = MoEConfig(backend="torch", comm_timeout_ms=COMM_TIMEOUT_MS)


def _problem():
    return make_problem(torch.Generator().manual_seed(5), WORLD * T, H, I, E_LOCAL * WORLD, K)


def _call(rank: int) -> torch.Tensor:
    p = _problem()
    tok, exp = slice(rank * T, (rank + 1) * T), slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    return megamoe.experts(p.x[tok], p.topk_ids[tok], p.topk_weights[tok], p.w_gate_up[exp], p.w_down[exp],
                           group=dist.group.WORLD, config=CONFIG)


def _attempt(fn) -> dict:
    try:
        return {"value": fn(), "error": None}
    except Exception as e:  # noqa: BLE001 - the parent checks the message
        return {"value": None, "error": f"{type(e).__name__}: {e}"}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    results = {}
    try:
        results["warm"] = _attempt(lambda: _call(rank))
        # Rank 0 calls alone: its agreement exchange times out and stays pending, the group is out of step on
        # rank 0. Rank 1 then completes that gather (the same collective, late), so both can tear the group down.
        if rank == 0:
            results["alone"] = _attempt(lambda: _call(rank))
            results["again"] = _attempt(lambda: _call(rank))
        else:
            time.sleep(2 * COMM_TIMEOUT_MS / 1000)
            payload = torch.zeros(len(AGREE_FIELDS) + STATUS_LEN, dtype=torch.int64)
            dist.all_gather_into_tensor(payload.new_empty(WORLD * payload.numel()), payload)
        name = dist.group.WORLD.group_name
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/init-again", rank=rank, world_size=world)
        results["same_name"] = dist.group.WORLD.group_name == name
        results["recreated"] = _attempt(lambda: _call(rank))
    except Exception as e:  # noqa: BLE001 - reported by the test
        results["worker"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


def test_recreated_group_is_not_out_of_step(tmp_path):
    results = run_gloo_workers(_worker, WORLD, (str(tmp_path),), tmp_path, 120, "recreated group")
    p = _problem()
    want = megamoe.reference.experts(p.x, p.topk_ids, p.topk_weights, p.w_gate_up, p.w_down)
    for rank, res in enumerate(results):
        assert "worker" not in res, f"rank {rank}: {res['worker']}"
        assert res["warm"]["error"] is None, f"rank {rank}: {res['warm']['error']}"
        assert res["same_name"], f"rank {rank}: the recreated default group has another name"
    assert "did not join" in results[0]["alone"]["error"], results[0]["alone"]["error"]
    assert "is out of step" in results[0]["again"]["error"], results[0]["again"]["error"]
    for rank, res in enumerate(results):
        assert res["recreated"]["error"] is None, f"rank {rank}: {res['recreated']['error']}"
        assert_close_tight(f"rank {rank}: out on the recreated group", res["recreated"]["value"],
                           want[rank * T : (rank + 1) * T], 1e-12)
