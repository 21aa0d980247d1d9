"""megamoe.integrations.hf: patched transformers MoE models match the originals (CPU, fp32, no downloads)."""

from __future__ import annotations

import copy
import functools
import io
import os
import re
import traceback

import pytest
import torch
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (it is in megamoe's 'test' extra)"
)

import megamoe  # noqa: E402
from megamoe.integrations import hf  # noqa: E402
from conftest import assert_equal, init_gloo, leave_gloo, run_gloo_workers  # noqa: E402

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


def test_a_model_that_is_not_a_module_is_a_type_error():
    """What from_pretrained(..., output_loading_info=True) returns, (model, info), is a TypeError naming the argument
    in every function that takes a model or an experts module (it was an AttributeError from reading named_modules,
    or vars()'s TypeError)."""
    loaded = (_model("qwen3_moe"), {})
    for function in (hf.patch_model, hf.unpatch_model, hf.is_patched, hf.check_model, hf.experts_modules):
        with pytest.raises(TypeError, match=r"^model must be a torch\.nn\.Module .*, got tuple$"):
            function(loaded)
    for function in (hf.check_experts, hf.unsupported_reason, hf.unsupported_reasons):
        with pytest.raises(TypeError, match=r"^experts must be a torch\.nn\.Module .*, got tuple$"):
            function(loaded)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_torch_save_load_and_deepcopy_of_patched_model(family):
    """torch.save(model) of a patched model loads (the forwards are bound so that pickle can rebuild them) and
    computes bit-identical logits; copies are bound to themselves; both unpatch to the original."""
    original = _model(family).eval()
    patched = hf.patch_model(copy.deepcopy(original))
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(patched)
    ids = _batch()
    with torch.no_grad():
        logits = patched(input_ids=ids).logits
        for what, model in (("torch.load", loaded), ("copy.deepcopy", copied)):
            assert hf.is_patched(model), what
            for module in model.modules():
                if "forward" in vars(module):
                    assert module.forward.args == (module,), f"{what}: {type(module).__name__} bound to another module"
            assert torch.equal(model(input_ids=ids).logits, logits), f"logits after {what}"
            hf.unpatch_model(model)
            assert all("forward" not in vars(m) for m in model.modules()), what
            assert torch.equal(model(input_ids=ids).logits, original(input_ids=ids).logits), f"{what} + unpatch"


class _Scaled(torch.nn.Module):
    """A wrapper around a module (as PEFT wraps layers): its output times `scale`."""

    def __init__(self, inner: torch.nn.Module, scale: float):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, *args):
        return self.inner(*args) * self.scale


def _set_forward(module: torch.nn.Module, fired: list, scale: float = 1.0) -> None:
    """Replace module.forward on the instance as accelerate's add_hook_to_module does (its output times scale)."""
    module._old_forward = module.forward

    def new_forward(module, *args):
        fired.append(1)
        return module._old_forward(*args) * scale

    module.forward = functools.update_wrapper(functools.partial(new_forward, module), module._old_forward)


def _change(model, change: str, fired: list):
    """Apply one post-patching change to every DeepSeek-V3 MoE block of `model`."""
    for block in (m for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"):
        shared = block.shared_experts
        if change == "hook on shared_experts":
            shared.register_forward_hook(lambda module, args, out: fired.append(1) or out * 2)
        elif change == "pre-hook on experts":
            block.experts.register_forward_pre_hook(
                lambda module, args: fired.append(1) or (args[0] * 0.5, *args[1:])
            )
        elif change == "new gate_proj weight":  # a plain nn.Linear still: the fused path reads its weight
            linear = torch.nn.Linear(shared.gate_proj.in_features, shared.gate_proj.out_features, bias=False)
            torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(5))
            shared.gate_proj = linear
        elif change == "forward set on gate_proj":  # as accelerate's hooks replace module.forward
            _set_forward(shared.gate_proj, fired, 3.0)
        elif change == "hook on act_fn":
            shared.act_fn.register_forward_hook(lambda module, args, out: fired.append(1) or out * 2)
        elif change == "wrapped gate_proj":
            shared.gate_proj = _Scaled(shared.gate_proj, 3.0)
        elif change == "wrapped experts":  # as PEFT's ParamWrapper wraps the experts module
            block.experts = _Scaled(block.experts, 0.5)
        else:
            raise AssertionError(change)


@pytest.mark.parametrize("change", ["hook on shared_experts", "pre-hook on experts", "new gate_proj weight",
                                    "forward set on gate_proj", "hook on act_fn", "wrapped gate_proj", "wrapped experts"])
def test_deepseek_v3_changes_after_patching_are_honoured(change, monkeypatch):
    """Hooks and wrappers put on DeepSeek-V3's experts or shared expert after patch_model take effect, as in
    the unpatched model with the same change (the fused call is used only while it computes the same)."""
    original = _model("deepseek_v3").eval()
    patched = hf.patch_model(copy.deepcopy(original))
    ids = _batch()
    with torch.no_grad():
        before = original(input_ids=ids).logits
    fired_ref, fired = [], []
    _change(original, change, fired_ref)
    _change(patched, change, fired)
    calls = _count_megamoe_calls(monkeypatch)
    with torch.no_grad():
        expected = original(input_ids=ids).logits
        logits = patched(input_ids=ids).logits
    assert not torch.allclose(expected, before), f"{change}: the change does not change the model"
    assert len(fired) == len(fired_ref), f"{change}: hooks fired {len(fired)} times, unpatched {len(fired_ref)}"
    assert_close(f"logits ({change})", logits, expected)
    # still megamoe's experts, in one fused call only when no module in between was skipped
    assert calls == [change == "new gate_proj weight"], f"{change}: megamoe.experts calls (shared fused): {calls}"


@pytest.mark.parametrize("module,kind", [("shared_experts", "full_backward_hook"),
                                         ("experts", "full_backward_pre_hook"),
                                         ("shared_experts.down_proj", "full_backward_hook")])
def test_deepseek_v3_backward_hooks_after_patching_are_honoured(module, kind):
    """A backward hook put on DeepSeek-V3's experts, shared expert or one of its projections after patch_model fires
    and changes the gradients as in the unpatched model with the same hook (the fused call, which calls none of these
    modules, skipped it: the hook never fired and the gradients were those of the model without it)."""
    original = _model("deepseek_v3")
    patched = hf.patch_model(copy.deepcopy(original))
    ids = _batch()
    _, before = _forward_backward(original, ids)
    fired_ref, fired = [], []
    for model, record in ((original, fired_ref), (patched, fired)):
        for block in (m for m in model.modules() if type(m).__name__ == "DeepseekV3MoE"):
            register = getattr(block.get_submodule(module), f"register_{kind}")
            if kind == "full_backward_pre_hook":
                register(lambda m, grad_out, record=record: record.append(1) or tuple(2 * g for g in grad_out))
            else:
                register(lambda m, grad_in, grad_out, record=record: record.append(1) or tuple(
                    None if g is None else 2 * g for g in grad_in))
    _, grads_ref = _forward_backward(original, ids)
    _, grads = _forward_backward(patched, ids)
    assert fired_ref and len(fired) == len(fired_ref), (
        f"{kind} on {module}: fired {len(fired)} times, unpatched {len(fired_ref)}"
    )
    key = "model.embed_tokens.weight"
    assert not torch.allclose(grads_ref[key], before[key]), f"{kind} on {module}: the hook does not change the model"
    for name, grad in grads.items():
        assert_close(f"grad of {name} ({kind} on {module})", grad, grads_ref[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_unpatch_through_a_wrapper_added_after_patching(family, monkeypatch):
    """A module wrapped around the patched experts (as PEFT's ParamWrapper does with LoRA on the expert weights):
    is_patched still sees the patch and unpatch_model undoes it (both looked only at the wrapper: is_patched said
    False and unpatch_model did nothing, the experts kept running through megamoe)."""
    original = _model(family).eval()
    patched = hf.patch_model(copy.deepcopy(original))
    for model in (original, patched):
        for block in (m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")):
            block.experts = _Scaled(block.experts, 0.5)
    assert hf.is_patched(patched), "is_patched: False once the experts are wrapped"
    hf.unpatch_model(patched)
    assert not hf.is_patched(patched), "is_patched: True after unpatch_model"
    for name, module in patched.named_modules():
        assert "forward" not in vars(module), f"{name}: megamoe's forward still bound after unpatch_model"
    calls = _count_megamoe_calls(monkeypatch)
    ids = _batch()
    with torch.no_grad():
        assert torch.equal(patched(input_ids=ids).logits, original(input_ids=ids).logits), "logits after unpatch"
    assert calls == [], f"megamoe.experts still called after unpatch_model: {calls}"


def test_unpatch_deepseek_v3_with_experts_replaced_after_patching():
    """DeepSeek-V3's block, whose forward patch_model replaced, with its experts module replaced since (by an unpatched
    one): is_patched sees it, unpatch_model restores the block's forward and patch_model patches it again (before:
    is_patched said False, unpatch_model left megamoe's forward on the block and patch_model refused it as a forward set
    by accelerate's hooks)."""
    original = _model("deepseek_v3").eval()
    patched = hf.patch_model(copy.deepcopy(original))
    for model in (original, patched):
        block = next(m for m in model.modules() if type(m).__name__ == "DeepseekV3MoE")
        block.experts = copy.deepcopy(next(m for m in original.modules() if type(m).__name__ == "DeepseekV3Experts"))
    assert hf.is_patched(patched), "is_patched: False with the block's forward still megamoe's"
    hf.unpatch_model(patched)
    assert not hf.is_patched(patched), "is_patched: True after unpatch_model"
    for name, module in patched.named_modules():
        assert "forward" not in vars(module) and not hasattr(module, "_megamoe_patch"), f"{name}: still patched"
    ids = _batch()
    with torch.no_grad():
        assert torch.equal(patched(input_ids=ids).logits, original(input_ids=ids).logits), "logits after unpatch"
    hf.patch_model(patched)
    assert hf.is_patched(patched)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_forward_set_on_the_instance_is_refused_not_dropped(family):
    """A forward set on the experts' (or DeepSeek-V3's block's) instance, as accelerate's hooks set it: patch_model
    refuses it, the model unchanged, and unpatch_model refuses one set after patching (patch_model replaced it,
    megamoe ran without it, and unpatch_model deleted it, also when set after patching)."""
    ids = _batch()
    for module_name in ("experts", "block") if family == "deepseek_v3" else ("experts",):
        model = _model(family).eval()
        blocks = [b for b in model.modules() if type(b).__name__ in hf.BLOCK_SPECS]
        modules = blocks if module_name == "block" else [b.experts for b in blocks]
        fired = []
        for module in modules:
            _set_forward(module, fired)
        with pytest.raises(ValueError, match=r"mlp(\.experts)? \(.*\): its forward was replaced on the instance, by "
                                             r"_set_forward\.<locals>\.new_forward .*remove_hook_from_module"):
            hf.patch_model(model)
        assert not hf.is_patched(model), module_name
        for module in modules:
            del module.forward
        hf.patch_model(model)
        for module in modules:
            _set_forward(module, fired)
        with torch.no_grad():
            model(input_ids=ids)
        assert len(fired) == len(modules), f"{module_name}: forward set after patching ran {len(fired)} times"
        with pytest.raises(ValueError, match=r"its forward was replaced on the instance after patch_model"):
            hf.unpatch_model(model)
        assert hf.is_patched(model) and all("forward" in vars(m) for m in modules), module_name


def test_patching_experts_wrapped_before_is_a_value_error_saying_so():
    """Experts already wrapped (as PEFT's ParamWrapper wraps them): a ValueError naming the wrapper and the order
    that works (it said the wrapper lacked the fused layout and silu), the model left unchanged."""
    model = _model("qwen3_moe")
    for block in (m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")):
        block.experts = _Scaled(block.experts, 0.5)
    with pytest.raises(ValueError, match=r"\(Qwen3MoeExperts\) are wrapped by _Scaled .*call patch_model before"):
        hf.patch_model(model)
    assert not hf.is_patched(model)


def test_per_expert_mlps_are_refused_for_their_layout_only():
    """Experts kept as a ModuleList of per-expert SwiGLU MLPs (transformers < 5's layout, and that of remote-code
    checkpoints): refused for that layout alone (the refusal also named an 'activation None' that is not silu, which
    these experts do not have: each MLP has its own silu)."""
    model = _model("deepseek_v3")
    block = model.model.layers[1].mlp
    block.experts = torch.nn.ModuleList([type(block.shared_experts)(model.config, intermediate_size=32)
                                         for _ in range(8)])
    reasons = hf.unsupported_reasons(block.experts)
    assert len(reasons) == 1 and reasons[0].startswith("no fused 3-D gate_up_proj"), reasons
    with pytest.raises(hf.UnsupportedExpertsError, match="cannot run ModuleList: no fused 3-D") as error:
        hf.patch_model(model)
    assert "activation" not in str(error.value), str(error.value)
    assert not hf.is_patched(model)


def test_refusal_names_the_decorated_class_a_subclass_dispatches_through():
    """A subclass of the decorated experts class whose forward wraps the dispatched one (transformers 5.25's
    ErgoExperts around ErgoExpertProjections): the refusal names both, the decorated one being what the model
    family's code and transformers' experts flags speak of; the decorated class itself is named alone."""
    model = _model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts

    class WrappedExperts(type(experts)):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights)

    for module, expected in ((experts, "Qwen3MoeExperts (model_type='qwen3_moe')"),
                             (copy.deepcopy(experts), "WrappedExperts (subclass of Qwen3MoeExperts, "
                                                      "model_type='qwen3_moe')")):
        if module is not experts:
            module.__class__ = WrappedExperts
        module.is_transposed = True
        with pytest.raises(hf.UnsupportedExpertsError, match="is_transposed=True") as error:
            hf.check_experts(module)
        assert f"megamoe cannot run {expected}: " in str(error.value), str(error.value)


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
        _check_expert_parallel_state(model, family, rank, os.path.dirname(result_file))
        _check_parametrized_after_patching(model, family, rank, os.path.dirname(result_file))
        hf.unpatch_model(model)
        full = dict(model.named_parameters())
        for name, param in _model(family).named_parameters():
            assert torch.equal(full[name], param), f"rank {rank}: {name} not restored by unpatch_model"
        assert not any(isinstance(t, DTensor) for t in model.state_dict().values()), f"rank {rank}: DTensors unpatched"
    finally:
        dist.destroy_process_group()
    open(result_file + f".{rank}", "w").write("ok")


def _assert_dcp_round_trip(model, state: dict, other, path: str, rank: int) -> None:
    """DCP saves state (model's state dict) to path and loads it into other: other's parameters become model's."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)
    loaded = other.state_dict()
    dcp.load(loaded, checkpoint_id=path)
    other.load_state_dict(loaded)
    want = dict(model.named_parameters())
    for name, param in other.named_parameters():
        assert torch.equal(param, want[name]), f"rank {rank}: {name} not restored by the DCP round trip"


def _check_expert_parallel_state(model, family: str, rank: int, directory: str) -> None:
    """A model patched with a group: its state_dict holds each experts weight as a DTensor of the full [E, ...]
    (the unpatched model's values); a DCP round trip restores every rank's experts into another patched model;
    a deep copy shares the group."""
    import torch.distributed as dist

    original = _model(family).state_dict()
    state = model.state_dict()
    experts = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts, "the tiny model has experts"
    for key, value in state.items():
        assert isinstance(value, DTensor) == (key in experts), f"rank {rank}: {key} is a {type(value).__name__}"
        if key in experts:
            assert torch.equal(value.full_tensor(), original[key]), f"rank {rank}: {key} is not the full experts'"
    path = os.path.join(directory, f"dcp-{family}")
    other = hf.patch_model(_model(family), group=dist.group.WORLD)
    with torch.no_grad():
        for param in other.parameters():
            param.zero_()
    _assert_dcp_round_trip(model, state, other, path, rank)
    copied = copy.deepcopy(model)
    patched = [m for m in copied.modules() if getattr(m, "_megamoe_patch", None) is not None]
    assert patched and all(m._megamoe_patch.group is dist.group.WORLD for m in patched), f"rank {rank}: deepcopy"


def _check_parametrized_after_patching(model, family: str, rank: int, directory: str) -> None:
    """Expert weights parametrized after patch_model (weight_norm on gate_up_proj): the originals of one entry per
    local expert are DTensor shards in the state dict, so a DCP round trip restores every rank's."""
    import torch.distributed as dist
    from torch.nn.utils.parametrizations import weight_norm

    def normed(model):
        for module in model.modules():
            if getattr(module, "_megamoe_patch", None) is not None and hasattr(module, "gate_up_proj"):
                weight_norm(module, "gate_up_proj", dim=0)
        return model

    model = normed(copy.deepcopy(model))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "parametrizations" in name:
                param.add_(rank + 1)  # every rank's experts differ
    state = model.state_dict()
    originals = [k for k in state if ".parametrizations.gate_up_proj.original" in k]
    assert originals and all(isinstance(state[k], DTensor) for k in originals), f"rank {rank}: {originals}"
    path = os.path.join(directory, f"dcp-parametrized-{family}")
    _assert_dcp_round_trip(model, state, normed(hf.patch_model(_model(family), group=dist.group.WORLD)), path, rank)


def _group_checks_worker(rank: int, world: int, init_file: str, result_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        only_rank_0 = dist.new_group([0])  # a collective: every rank calls it; rank 1 gets a non-member value
        model = _model("deepseek_v3")
        # Layer 1 keeps 8 experts, the last MoE layer 3 (not divisible by 2): refused before any block is sharded.
        model.config.num_hidden_layers = 3
        layers = model.model.layers
        layers.append(copy.deepcopy(layers[1]))
        last = layers[2].mlp.experts
        last.gate_up_proj = torch.nn.Parameter(last.gate_up_proj.detach()[:3].clone())
        last.down_proj = torch.nn.Parameter(last.down_proj.detach()[:3].clone())
        params = dict(model.named_parameters())

        def assert_unchanged(what):
            assert not hf.is_patched(model), what
            assert all("forward" not in vars(m) for m in model.modules()), what
            assert dict(model.named_parameters()) == params, f"{what}: parameters replaced"
            assert all(p.shape[0] == 8 for n, p in params.items() if "layers.1.mlp.experts." in n), what

        for group in (2, "ep"):
            with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
                hf.patch_model(model, group=group)
            assert_unchanged(f"group={group!r}")
        if rank == 1:
            with pytest.raises(ValueError, match=r"group must be .* this rank \(global rank 1\) belongs to"):
                hf.patch_model(model, group=only_rank_0)
            assert_unchanged("a group without this rank")
        with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts .*num_experts=3, group size=2"):
            hf.patch_model(model, group=dist.group.WORLD)
        assert_unchanged("num_experts not divisible")
        layers.pop(2)
        model.config.num_hidden_layers = 2
        torch.nn.utils.parametrizations.weight_norm(layers[1].mlp.experts, "gate_up_proj", dim=0)
        params = dict(model.named_parameters())
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts .*parametrized ones \(gate_up_proj"):
            hf.patch_model(model, group=dist.group.WORLD)
        assert not hf.is_patched(model) and dict(model.named_parameters()) == params, "parametrized: changed"
    finally:
        dist.destroy_process_group()
    open(result_file + f".{rank}", "w").write("ok")


def test_patch_model_checks_group(tmp_path):
    """group: a ProcessGroup (TypeError otherwise), of which this rank is a member, whose size divides every
    patched block's number of experts (ValueError otherwise); the model is unchanged after each error."""
    import torch.multiprocessing as mp

    world = 2
    result = str(tmp_path / "result")
    mp.spawn(_group_checks_worker, args=(world, str(tmp_path / "init"), result), nprocs=world)
    for rank in range(world):
        assert (tmp_path / f"result.{rank}").read_text() == "ok", f"rank {rank} did not finish"


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_expert_parallel_two_ranks(family, tmp_path):
    import torch.multiprocessing as mp

    world = 2
    result = str(tmp_path / "result")
    mp.spawn(_expert_parallel_worker, args=(world, str(tmp_path / "init"), family, result), nprocs=world)
    for rank in range(world):
        assert (tmp_path / f"result.{rank}").read_text() == "ok", f"rank {rank} did not finish"


def _mark_experts(model, rank: int = 0) -> None:
    """Add e + 1 to every weight of global expert e (in place), so that each expert differs from its initial
    value and from the others. Rank r of a model patched with a group holds experts [r*E_l, (r+1)*E_l) and marks
    them with their global indices, bit for bit as the one-process model (rank 0, all E experts) marks its rows."""
    for module in model.modules():
        if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            first = rank * module.gate_up_proj.shape[0]
            with torch.no_grad():
                for weight in (module.gate_up_proj, module.down_proj):
                    weight.add_(torch.arange(first + 1, first + 1 + weight.shape[0]).view(-1, 1, 1))


def _save_pretrained_worker(rank: int, world: int, port: int, out_dir: str, family: str) -> None:
    """Per rank: save_pretrained of the model patched with the world group (every rank calls it, rank 0 writes)
    into out_dir/patched, with a state dict of this rank's experts only into out_dir/keep_vars (refused), and once
    unpatched into out_dir/unpatched; what the model is after saving."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    results: dict = {}
    try:
        model = hf.patch_model(_model(family), group=dist.group.WORLD)
        _mark_experts(model, rank)
        before = {name: param.detach().clone() for name, param in model.named_parameters()}
        try:
            model.save_pretrained(os.path.join(out_dir, "keep_vars"), state_dict=model.state_dict(keep_vars=True))
            results["keep_vars"] = "no error"
        except ValueError as error:
            results["keep_vars"] = str(error)
        model.save_pretrained(os.path.join(out_dir, "patched"))
        results["patched after saving"] = hf.is_patched(model)
        results["parameters after saving"] = {name: torch.equal(param, before[name])
                                              for name, param in model.named_parameters()}
        results["state_dict types"] = {key: type(value).__name__ for key, value in model.state_dict().items()}
        hf.unpatch_model(model)
        results["save_pretrained bound after unpatch_model"] = "save_pretrained" in vars(model)
        model.save_pretrained(os.path.join(out_dir, "unpatched"))
    except Exception:  # noqa: BLE001 - reported by the parent
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3"])
def test_save_pretrained_of_expert_parallel_model_is_a_one_process_checkpoint(family, tmp_path):
    """save_pretrained of a model patched with a group, called on every rank, writes the files a one-process
    unpatched model of the same weights writes, byte for byte, which plain transformers loads with every expert
    (it failed inside safetensors, which takes no DTensors). The model stays patched, its state_dict DTensors
    for DCP. A state dict of this rank's experts only is a ValueError and nothing is written (before, rank 0 wrote
    its own E/2 experts as the checkpoint's)."""
    results = run_gloo_workers(_save_pretrained_worker, 2, (str(tmp_path), family), tmp_path, 120,
                               f"save_pretrained ({family})")
    expected = _model(family)
    _mark_experts(expected)
    num_experts = next(m for m in expected.modules() if hasattr(m, "gate_up_proj")).gate_up_proj.shape[0]
    refused = (rf"save_pretrained: state_dict\['model\.layers\.\d+\.mlp\.experts\.gate_up_proj'\] must hold all "
               rf"{num_experts} experts, .* got a Parameter of shape \({num_experts // 2}, ")
    experts = ("experts.gate_up_proj", "experts.down_proj")
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        assert re.match(refused, result["keep_vars"]), f"rank {rank}, keep_vars state dict: {result['keep_vars']}"
        assert result["patched after saving"], f"rank {rank}: unpatched by save_pretrained"
        assert all(result["parameters after saving"].values()), f"rank {rank}: {result['parameters after saving']}"
        for key, kind in result["state_dict types"].items():
            assert (kind == "DTensor") == key.endswith(experts), f"rank {rank}: state_dict()[{key!r}] is a {kind}"
        assert not result["save_pretrained bound after unpatch_model"], f"rank {rank}"
    assert not (tmp_path / "keep_vars").exists(), "save_pretrained wrote files before refusing the state dict"

    expected.save_pretrained(tmp_path / "one-process")
    files = sorted(os.listdir(tmp_path / "one-process"))
    assert "model.safetensors" in files, files
    for saved in ("patched", "unpatched"):
        assert sorted(os.listdir(tmp_path / saved)) == files, f"{saved}: files differ from the one-process model's"
        for file in files:
            same = (tmp_path / saved / file).read_bytes() == (tmp_path / "one-process" / file).read_bytes()
            assert same, f"{saved}/{file} differs from the one-process model's"

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "patched", dtype=torch.float32)
    assert not hf.is_patched(reloaded)
    state, want = reloaded.state_dict(), expected.state_dict()
    assert state.keys() == want.keys(), f"keys differ: {state.keys() ^ want.keys()}"
    for key, tensor in want.items():
        assert_equal(key, state[key], tensor)


def _weight_norm_experts(model) -> None:
    """weight_norm (per expert: dim 0) on the gate_up_proj of every experts module."""
    from torch.nn.utils.parametrizations import weight_norm

    for module in list(model.modules()):
        if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            weight_norm(module, "gate_up_proj", dim=0)



def _parametrized_save_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Per rank: a Mixtral patched with the world group, its gate_up_proj parametrized after patching; save_pretrained
    into out_dir/patched, then unpatch_model: the error of each (or None) and the parameters once unpatched."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    results: dict = {}
    model = hf.patch_model(_model("mixtral"), group=dist.group.WORLD)
    _mark_experts(model, rank)
    _weight_norm_experts(model)
    for name, call in (("save_pretrained", lambda: model.save_pretrained(os.path.join(out_dir, "patched"))),
                       ("unpatch_model", lambda: hf.unpatch_model(model))):
        try:
            call()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported by the parent
            results[name] = traceback.format_exc()
    results["parameters"] = {name: param.detach().clone() for name, param in model.named_parameters()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo(rank, world)


@pytest.fixture(scope="module")
def parametrized_after_patching(tmp_path_factory):
    """(the workers' results, the directory), and the one-process model of the same weights, parametrized alike."""
    tmp = tmp_path_factory.mktemp("parametrized-after-patching")
    results = run_gloo_workers(_parametrized_save_worker, 2, (str(tmp),), tmp, 120,
                               "save_pretrained and unpatch_model, parametrized experts")
    expected = _model("mixtral")
    _mark_experts(expected)
    _weight_norm_experts(expected)
    return results, tmp, expected


def test_save_pretrained_of_experts_parametrized_after_patching(parametrized_after_patching):
    """Expert weights parametrized after patch_model with a group (weight_norm on gate_up_proj; the state dict shards
    the originals): save_pretrained writes the files of the one-process model parametrized alike, every expert's
    originals. Before: it failed inside safetensors on the originals' DTensors."""
    results, tmp, expected = parametrized_after_patching
    for rank, result in enumerate(results):
        assert result["save_pretrained"] is None, f"rank {rank}:\n{result['save_pretrained']}"
    expected.save_pretrained(tmp / "one-process")
    files = sorted(os.listdir(tmp / "one-process"))
    assert sorted(os.listdir(tmp / "patched")) == files, "files differ from the one-process model's"
    for file in files:
        same = (tmp / "patched" / file).read_bytes() == (tmp / "one-process" / file).read_bytes()
        assert same, f"patched/{file} differs from the one-process model's"


def test_unpatch_model_of_experts_parametrized_after_patching(parametrized_after_patching):
    """unpatch_model of a model patched with a group whose gate_up_proj was parametrized after patching gathers every
    rank's originals: the one-process model parametrized alike. Before: a KeyError ("attribute 'gate_up_proj' already
    exists"), setting a parameter in the parametrized weight's place."""
    results, _, expected = parametrized_after_patching
    want = dict(expected.named_parameters())
    for rank, result in enumerate(results):
        assert result["unpatch_model"] is None, f"rank {rank}:\n{result['unpatch_model']}"
        assert result["parameters"].keys() == want.keys(), f"rank {rank}: {sorted(result['parameters'])}"
        for name, param in result["parameters"].items():
            assert_equal(f"rank {rank}: {name} after unpatch_model", param, want[name])
