"""megamoe inside transformers' native parallelism (DistributedConfig), 2 gloo ranks on CPU, fp32.

- ep_implementation="megamoe" (registered by megamoe.integrations.hf in transformers' EPImplementationInterface):
  each rank's tokens go, with global expert ids, to one megamoe.experts call over the EP group;
- experts_implementation="megamoe" under transformers' own EP styles ("all_to_all"; "all_reduce", whose
  experts see a sentinel id for other ranks' experts) and tensor-parallel experts ("moe_tp_experts");

each against the same layout with experts_implementation="eager": loss and every gradient (this rank's shard);
hf.check_model accepts every one of these models (their DTensor expert weights reach the forward as local shards).
The model is distributed the way from_pretrained(..., distributed_config=...) does it
(prepare_distribute_model + maybe_distribute_model), minus the checkpoint loading, which needs `accelerate`.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers without native expert parallelism")

from conftest import init_gloo, run_gloo_workers  # noqa: E402

WORLD = 2
SPAWN_TIMEOUT_S = 240
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True)
# name: (DistributedConfig kwargs, experts_implementation, ranks hold the same batch)
SCENARIOS = {
    "all_to_all/eager": (dict(fsdp_size=2, ep_size=2, ep_implementation="all_to_all"), "eager", False),
    "all_to_all/megamoe": (dict(fsdp_size=2, ep_size=2, ep_implementation="all_to_all"), "megamoe", False),
    "megamoe-ep/eager": (dict(fsdp_size=2, ep_size=2, ep_implementation="megamoe"), "eager", False),
    "megamoe-ep/megamoe": (dict(fsdp_size=2, ep_size=2, ep_implementation="megamoe"), "megamoe", False),
    "all_reduce/eager": (dict(tp_size=2, ep_size=2, ep_implementation="all_reduce"), "eager", True),
    "all_reduce/megamoe": (dict(tp_size=2, ep_size=2, ep_implementation="all_reduce"), "megamoe", True),
    "tp/eager": (dict(tp_size=2), "eager", True),
    "tp/megamoe": (dict(tp_size=2), "megamoe", True),
}
COMPARE = {  # scenario -> its reference
    "all_to_all/megamoe": "all_to_all/eager",
    "megamoe-ep/eager": "all_to_all/eager",
    "megamoe-ep/megamoe": "all_to_all/eager",
    "all_reduce/megamoe": "all_reduce/eager",
    "tp/megamoe": "tp/eager",
}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    init_gloo(rank, world, port)
    results: dict = {}
    try:
        import transformers
        from torch.distributed.tensor import DTensor
        from transformers.distributed import DistributedConfig

        import megamoe
        import megamoe.integrations.hf  # noqa: F401 - registers "megamoe" in both interfaces

        calls = []  # (ran with a group) per megamoe.experts call
        original = megamoe.experts

        def counting(*args, **kwargs):
            calls.append(kwargs.get("group") is not None)
            return original(*args, **kwargs)

        megamoe.experts = counting

        def build(experts_implementation, distributed):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.Qwen3MoeConfig(**CONFIG), dtype=torch.float32,
                experts_implementation=experts_implementation,
            )
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("mlp.gate.weight"):  # zero-initialised routers tie every top-k
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
            cls = type(model)
            distributed, _, mesh = cls.prepare_distribute_model(DistributedConfig(**distributed))
            return cls.maybe_distribute_model(model, distributed, mesh).train()

        for name, (distributed, experts_implementation, shared_batch) in SCENARIOS.items():
            calls.clear()
            model = build(experts_implementation, distributed)
            try:  # the DTensor weights of every scenario reach the experts as local shards: accepted up front
                megamoe.integrations.hf.check_model(model)
                results[f"{name} check_model"] = "ok"
            except ValueError as error:
                results[f"{name} check_model"] = str(error)
            seed = 1 if shared_batch else 1 + rank
            ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(seed))
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            results[name] = (out.loss.detach(), grads, list(calls))

        try:  # megamoe's EP exchanges tokens between ranks holding different batches: not with TP
            build("eager", dict(tp_size=2, ep_size=2, ep_implementation="megamoe"))
            results["megamoe-ep with tp"] = "no error"
        except ValueError as error:
            results["megamoe-ep with tp"] = str(error)
    except Exception:  # noqa: BLE001 - reported by the parent
        results["error"] = traceback.format_exc()
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_native_parallelism_two_ranks(tmp_path):
    per_rank = run_gloo_workers(_worker, WORLD, (str(tmp_path),), tmp_path, SPAWN_TIMEOUT_S, "hf native EP")
    for rank, results in enumerate(per_rank):
        assert "error" not in results, f"rank {rank}:\n{results['error']}"
        assert "tp_size=1" in results["megamoe-ep with tp"], results["megamoe-ep with tp"]
        for name in SCENARIOS:
            assert results[f"{name} check_model"] == "ok", f"rank {rank} {name}: {results[f'{name} check_model']}"
            calls = results[name][2]
            if name.startswith("megamoe-ep/"):  # the EP implementation runs megamoe over the group
                assert calls == [True, True], f"rank {rank} {name}: megamoe.experts calls {calls}"
            elif name.endswith("/megamoe"):  # the experts implementation runs megamoe on this rank's shard
                assert calls == [False, False], f"rank {rank} {name}: megamoe.experts calls {calls}"
            else:
                assert calls == [], f"rank {rank} {name}: megamoe ran"
        for name, reference in COMPARE.items():
            loss, grads, _ = results[name]
            loss_ref, grads_ref, _ = results[reference]
            torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name} loss: {m}")
            assert grads.keys() == grads_ref.keys(), f"rank {rank} {name}: {grads.keys() ^ grads_ref.keys()}"
            for param, grad in grads.items():
                scale = grads_ref[param].abs().max().item()
                torch.testing.assert_close(grad, grads_ref[param], rtol=1e-4, atol=1e-4 * scale + 1e-8,
                                           msg=lambda m: f"rank {rank} {name} grad of {param}: {m}")
