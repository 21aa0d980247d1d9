"""megamoe.integrations.hf: patched transformers MoE models match the originals (CPU, fp32, no downloads)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (it is in megamoe's 'test' extra)"
)

import megamoe  # noqa: E402
from megamoe.integrations import hf  # noqa: E402

VOCAB, SEQ, BATCH = 101, 24, 2
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)


def _config(family: str):
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True,
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=3,
        )
    if family == "mixtral":
        return transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    if family == "olmoe":
        return transformers.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    if family == "deepseek_v3":
        # first layer dense, second MoE; 2 expert groups of 4, top-1 group: grouped, bias-corrected routing.
        return transformers.DeepseekV3Config(
            **COMMON, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        )
    raise AssertionError(family)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"]


def _model(family: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: make DeepSeek-V3's bias matter
                buf.copy_(0.1 * torch.randn_like(buf))
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # routers start at zero in some families: spread routing
                param.copy_(torch.randn_like(param))
    return model.train()


def _batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _count_megamoe_calls(monkeypatch) -> list:
    calls = []
    original = megamoe.experts

    def counting(*args, **kwargs):
        calls.append(kwargs.get("shared_gate_up") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(megamoe, "experts", counting)
    return calls


def assert_close(name: str, actual, expected, rtol=2e-5, atol=2e-6):
    if torch.isnan(actual).any():
        raise AssertionError(f"{name}: NaN in the patched model's tensor")
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_matches_original(family, monkeypatch, tmp_path):
    original = _model(family)
    patched = copy.deepcopy(original)
    ids = _batch()
    out_ref, grads_ref = _forward_backward(original, ids)

    calls = _count_megamoe_calls(monkeypatch)
    hf.patch_model(patched)
    assert hf.is_patched(patched)
    out, grads = _forward_backward(patched, ids)
    moe_layers = sum(type(m).__name__ in hf.BLOCK_SPECS for m in patched.modules())
    assert len(calls) == moe_layers > 0, f"megamoe.experts ran {len(calls)} times for {moe_layers} MoE blocks"
    assert all(calls) == (family == "deepseek_v3"), f"shared expert fused in calls: {calls}"

    assert_close("logits", out.logits, out_ref.logits)
    assert_close("loss", out.loss, out_ref.loss)
    if out_ref.aux_loss is not None:
        assert_close("aux_loss", out.aux_loss, out_ref.aux_loss)
    assert grads.keys() == grads_ref.keys(), f"parameters with gradients differ: {grads.keys() ^ grads_ref.keys()}"
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, grads_ref[name], rtol=1e-4, atol=1e-6)

    # Saved while patched: the parameters are the model's own, so the checkpoint is a plain one.
    patched.save_pretrained(tmp_path)
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).train()
        assert not hf.is_patched(reloaded)
        logits_reloaded = reloaded(input_ids=ids).logits
        logits_patched = patched(input_ids=ids).logits
    assert_close("logits after save_pretrained + from_pretrained", logits_reloaded, logits_patched)

    hf.unpatch_model(patched)
    assert not hf.is_patched(patched)
    for module in patched.modules():
        assert "forward" not in vars(module), f"{type(module).__name__} still has an instance forward"
    n_calls = len(calls)
    with torch.no_grad():
        logits_unpatched = patched(input_ids=ids).logits
        logits_original = original(input_ids=ids).logits
    assert len(calls) == n_calls, "megamoe.experts ran after unpatch_model"
    assert torch.equal(logits_unpatched, logits_original), "logits after unpatch_model differ from the original's"


def test_parameters_are_shared_not_copied():
    model = _model("deepseek_v3")
    before = {name: p for name, p in model.named_parameters()}
    hf.patch_model(model)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys(), "patch_model changed the parameter names"
    for name, param in after.items():
        assert param is before[name], f"{name} was replaced by patch_model"


def test_patch_twice_and_unsupported_model_raise():
    model = _model("qwen3_moe")
    hf.patch_model(model)
    with pytest.raises(ValueError, match="already patched"):
        hf.patch_model(model)
    with pytest.raises(ValueError, match="no supported MoE block"):
        hf.patch_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="MoEConfig"):
        hf.patch_model(_model("olmoe"), config={"backend": "torch"})


def test_unsupported_activation_leaves_model_untouched():
    config = _config("mixtral")
    config.hidden_act = "gelu"
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="silu"):
        hf.patch_model(model)
    assert not hf.is_patched(model)
    assert all("forward" not in vars(m) for m in model.modules())


def test_reference_backend_config_is_used():
    original = _model("qwen2_moe")
    patched = hf.patch_model(copy.deepcopy(original), config=megamoe.MoEConfig(backend="reference"))
    ids = _batch()
    with torch.no_grad():
        assert_close("logits (reference backend)", patched(input_ids=ids).logits, original(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_autocast_bf16_within_error_budget(family):
    """Under CPU bf16 autocast the patched model's error against fp32 stays within 2x the original's (+ floor)."""
    original = _model(family).eval()
    patched = hf.patch_model(copy.deepcopy(original))
    ids = _batch()
    with torch.no_grad():
        exact = original(input_ids=ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_ref = original(input_ids=ids).logits
            logits = patched(input_ids=ids).logits
    assert not torch.isnan(logits).any(), "logits (autocast): NaN"
    budget = 2 * (logits_ref.float() - exact).abs().max().item() + 1e-3
    error = (logits.float() - exact).abs().max().item()
    assert error <= budget, f"logits (autocast): max error {error:.3g} against fp32 exceeds budget {budget:.3g}"


def _expert_parallel_worker(rank: int, world: int, init_file: str, family: str, result_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _model(family)
        ids = _batch()[rank : rank + 1]  # each rank its own tokens
        out_ref, grads_ref = _forward_backward(copy.deepcopy(model), ids)
        hf.patch_model(model, group=dist.group.WORLD)
        out, grads = _forward_backward(model, ids)
        assert_close(f"rank {rank} logits", out.logits, out_ref.logits)
        assert_close(f"rank {rank} loss", out.loss, out_ref.loss)
        for name, grad in grads.items():
            expected = grads_ref[name]
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # A rank's expert gradients hold every rank's tokens: sum the replicas' local gradients.
                dist.all_reduce(expected)
                num_local = expected.shape[0] // world
                expected = expected[rank * num_local : (rank + 1) * num_local]
            assert_close(f"rank {rank} grad of {name}", grad, expected, rtol=1e-4, atol=1e-6)
        hf.unpatch_model(model)
        full = dict(model.named_parameters())
        for name, param in _model(family).named_parameters():
            assert torch.equal(full[name], param), f"rank {rank}: {name} not restored by unpatch_model"
    finally:
        dist.destroy_process_group()
    open(result_file + f".{rank}", "w").write("ok")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_expert_parallel_two_ranks(family, tmp_path):
    import torch.multiprocessing as mp

    world = 2
    result = str(tmp_path / "result")
    mp.spawn(_expert_parallel_worker, args=(world, str(tmp_path / "init"), family, result), nprocs=world)
    for rank in range(world):
        assert (tmp_path / f"result.{rank}").read_text() == "ok", f"rank {rank} did not finish"
