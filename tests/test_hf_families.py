"""experts_implementation="megamoe" through transformers' experts interface, on every family of the installed
transformers whose experts use it (CPU, fp32, tiny random models built from each family's own config class,
no downloads): megamoe equals "eager" (loss and every parameter gradient), or refuses with a clear error.

The families are discovered, not listed (megamoe.integrations.hf_families.discover: transformers' own
"@use_experts_implementation" rule, then the classes whose forward is the decorator's wrapper); the ones
named below are pinned so a regression cannot hide as a refusal, or a refusal as a skip.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (it is in megamoe's 'test' extra)"
)
pytest.importorskip("transformers.integrations.moe", reason="transformers >= 5 (its experts interface) is not installed")

import megamoe  # noqa: E402
from megamoe.integrations import hf, hf_families  # noqa: E402

FAMILIES = hf_families.discover()
# (family, experts class); a family whose modeling file does not import here is one case that skips, saying why
CASES = [(family, name) for family in FAMILIES for name in family.experts_classes or (None,)]

# Must run through megamoe where the installed transformers has them (the standard layout, with and
# without shared experts, softmax and sigmoid/grouped routing).
MUST_SUPPORT = {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe", "ernie4_5_moe",
                "minimax", "qwen3_next", "granitemoe", "phimoe", "jamba", "dots1", "hunyuan_v1_moe"}
# Must be refused, for this reason (a substring of the error), where the installed transformers has them.
MUST_REFUSE = {
    "gpt_oss": "has_bias=True",  # and interleaved, transposed, a clamped SwiGLU: every feature is named
    "openai_privacy_filter": "has_bias=True",
    "aria": "is_transposed=True",
    "nemotron_h": "has_gate=False",
    "muse_spark": "has_post_expert_norm=True",
    "gemma4": "is not silu",  # GELU-tanh experts
    "diffusion_gemma": "is not silu",
    "deepseek_v4": "_apply_gate",  # swiglu_limit clamp
    "hy_v4": "_apply_gate",
    "minimax_m3_vl": "_apply_gate",
    "inkling2": "_apply_gate",  # softcapped SwiGLU
    "ergo": "has_gate=False",  # and transposed, relu2; a subclass (ErgoExperts) adds a per-route norm around it
}


def test_discovery_is_explicit():
    """What discovery found, and that it is what transformers itself dispatches."""
    found = {family.model_type for family in FAMILIES}
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"} <= found, f"discovery found only {sorted(found)}"
    module = __import__("transformers.models.qwen3_moe.modeling_qwen3_moe", fromlist=["x"])
    assert hf.is_experts_class(module.Qwen3MoeExperts)
    assert not hf.is_experts_class(module.Qwen3MoeSparseMoeBlock)
    for family in FAMILIES:
        if family.import_error:
            continue
        model_classes = [c for c in vars(__import__(family.module, fromlist=["x"])).values()
                         if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)
                         and c.__module__ == family.module]
        # transformers' own rule for "this model can set its experts implementation"
        assert all(c._can_set_experts_implementation() for c in model_classes), family
    print(f"\n{len(FAMILIES)} families, {len(CASES)} experts classes: "
          + ", ".join(f"{f.model_type}[{'/'.join(f.experts_classes) or f.import_error}]" for f in FAMILIES))


@pytest.mark.parametrize("family,experts_class", CASES, ids=[f"{f.model_type}-{n}" for f, n in CASES])
def test_megamoe_equals_eager_or_refuses(family, experts_class):
    pinned = family.model_type in MUST_SUPPORT or family.model_type in MUST_REFUSE
    if family.import_error:
        assert not pinned, f"{family.model_type}: {family.import_error}"
        pytest.skip(f"{family.model_type} does not import here: {family.import_error}")
    result = hf_families.check_experts_class(family, experts_class, rtol=1e-4)
    if result.status == "skipped" and not pinned:
        pytest.skip(f"{family.model_type}: {result.detail}")
    assert result.status in ("supported", "refused"), (
        f"{family.model_type} {experts_class}: {result.status}: {result.detail}"
    )
    if result.status == "refused":
        # A clear error: it names the experts class, the model_type and the feature.
        assert experts_class in result.detail and "model_type=" in result.detail, result.detail
        assert "megamoe cannot run" in result.detail, result.detail
    if family.model_type in MUST_SUPPORT:
        assert result.status == "supported", f"{family.model_type}: {result.detail}"
    if family.model_type in MUST_REFUSE:
        assert result.status == "refused" and MUST_REFUSE[family.model_type] in result.detail, result.detail


def test_a_wrong_result_is_caught(monkeypatch):
    """The equality check of test_megamoe_equals_eager_or_refuses sees a 0.1% error in megamoe's output."""
    family = next(f for f in FAMILIES if f.model_type == "qwen3_moe")
    original = megamoe.experts
    monkeypatch.setattr(megamoe, "experts", lambda *args, **kwargs: original(*args, **kwargs) * 1.001)
    result = hf_families.check_experts_class(family, family.experts_classes[0])
    assert result.status == "mismatch", result


def test_compare_takes_empty_tensors():
    """compare() of zero-element tensors (the gradient of a zero-size parameter) is equal, as its guard for them
    meant (it raised torch's RuntimeError from max() of an empty tensor, outside check_experts_class's handling)."""
    empty = torch.empty(0, 4)
    assert hf_families.compare(empty, empty.clone(), 1e-4) is None
    assert hf_families.compare(torch.ones(3), torch.full((3,), 1.01), 1e-4) is not None


# --------------------------------------------------------------------------------------------- registration

QWEN = dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, output_router_logits=True)


def _qwen(**kwargs):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**QWEN), dtype=torch.float32,
                                                          **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_()
    return model


def _ids():
    return torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))


def _spy(monkeypatch) -> list:
    calls = []
    original = megamoe.experts

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(megamoe, "experts", spy)
    return calls


def test_registered_and_idempotent():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    assert hf.is_registered() and ALL_EXPERTS_FUNCTIONS["megamoe"] is hf.megamoe_experts_forward
    before = dict(ExpertsInterface._global_mapping)
    hf.register()
    hf.register()
    assert dict(ExpertsInterface._global_mapping) == before
    assert list(ALL_EXPERTS_FUNCTIONS).count("megamoe") == 1
    with pytest.raises(TypeError, match="MoEConfig"):
        hf.register(config={"backend": "torch"})
    assert issubclass(hf.UnsupportedExpertsError, ValueError)
    assert issubclass(hf.UnsupportedExpertsError, NotImplementedError)


def test_from_config_from_pretrained_and_switching(monkeypatch, tmp_path):
    ids = _ids()
    eager = _qwen(experts_implementation="eager")
    with torch.no_grad():
        logits_eager = eager(input_ids=ids).logits
    eager.save_pretrained(tmp_path)
    assert "megamoe" not in (tmp_path / "config.json").read_text()

    calls = _spy(monkeypatch)
    model = _qwen(experts_implementation="megamoe")  # from_config
    assert model.config._experts_implementation == "megamoe"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, logits_eager, rtol=1e-5, atol=1e-6)
    assert len(calls) == 2, "one megamoe.experts call per MoE layer"
    experts = model.model.layers[0].mlp.experts
    args = calls[0][0]
    assert args[3] is experts.gate_up_proj and args[4] is experts.down_proj, "weights passed in place, not copied"
    assert "shared_gate_up" not in calls[0][1] and calls[0][1]["group"] is None

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 experts_implementation="megamoe")
    assert reloaded.config._experts_implementation == "megamoe"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, logits_eager, rtol=1e-5, atol=1e-6)
    assert len(calls) == 4

    # Switch back and forth on a loaded model; saving needs nothing undone and writes a plain checkpoint.
    reloaded.set_experts_implementation("eager")
    with torch.no_grad():
        reloaded(input_ids=ids)
    assert len(calls) == 4, "megamoe ran after set_experts_implementation('eager')"
    reloaded.set_experts_implementation("megamoe")
    with torch.no_grad():
        reloaded(input_ids=ids)
    assert len(calls) == 6
    reloaded.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert "megamoe" not in json.dumps(saved)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, logits_eager, rtol=1e-5, atol=1e-6)


def test_register_config_is_used(monkeypatch):
    calls = _spy(monkeypatch)
    try:
        hf.register(config=megamoe.MoEConfig(backend="reference"))
        model = _qwen(experts_implementation="megamoe")
        with torch.no_grad():
            model(input_ids=_ids())
        assert calls and all(kwargs["config"].backend == "reference" for _, kwargs in calls)
    finally:
        hf.register()
    assert hf._interface_config is None


def test_shared_experts_stay_the_models_own(monkeypatch):
    """DeepSeek-V3 and Qwen2-MoE: megamoe replaces the routed experts only; the shared expert is the model's."""
    calls = _spy(monkeypatch)
    for family in ("deepseek_v3", "qwen2_moe"):
        model, _ = hf_families.tiny_model(next(f for f in FAMILIES if f.model_type == family))
        model.set_experts_implementation("megamoe")
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        assert calls and all("shared_gate_up" not in kwargs for _, kwargs in calls)
        shared = [n for n, p in model.named_parameters() if "shared_expert" in n and p.grad is not None]
        assert shared, f"{family}: no gradient reached the shared expert"
        calls.clear()


def test_refusal_names_family_and_feature_at_first_forward_and_in_check_model():
    """transformers accepts any registered name when it is set; megamoe refuses at the module's first
    forward, and check_model refuses up front. gpt-oss: biased, interleaved, transposed, clamped SwiGLU."""
    config = transformers.GptOssConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="megamoe")
    with pytest.raises(NotImplementedError, match=r"GptOssExperts \(model_type='gpt_oss'\).*has_bias=True"):
        model(input_ids=_ids())
    with pytest.raises(ValueError, match="GptOssExperts"):
        hf.check_model(model)
    with pytest.raises(ValueError, match="no experts module"):
        hf.check_model(torch.nn.Linear(2, 2))
    # every flag, one at a time, on an otherwise supported module
    experts = _qwen().model.layers[0].mlp.experts
    assert hf.unsupported_reason(experts) is None
    for flag, value, text in [("has_bias", True, "has_bias=True"), ("has_gate", False, "has_gate=False"),
                              ("is_concatenated", False, "is_concatenated=False"),
                              ("is_transposed", True, "is_transposed=True"),
                              ("has_post_expert_norm", True, "has_post_expert_norm=True")]:
        probe = copy.copy(experts)
        setattr(probe, flag, value)
        assert text in (hf.unsupported_reason(probe) or ""), flag
    probe = copy.deepcopy(experts)
    probe.act_fn = torch.nn.GELU()
    assert "activation GELU" in hf.unsupported_reason(probe)


def test_fp8_quantized_experts_are_refused():
    """FP8-quantized experts (transformers' FP8Experts, what from_pretrained makes of an FP8 checkpoint such as
    DeepSeek-V3's: float8 weights with separate scales) are refused by name: by check_model and patch_model (the model
    left unchanged) and, with experts_implementation="megamoe", at the first forward. check_model accepted them,
    patch_model patched them and failed at the forward on w_gate_up's dtype, and the forward raised transformers'
    KeyError saying "megamoe" was not registered (FP8 experts dispatch through an interface of their own). Cast to
    bfloat16, whose weights megamoe would take, their scales still make them refused."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8", reason="transformers without FP8 experts")
    from transformers.integrations.moe import use_experts_implementation

    # decorated as transformers' FP8 quantizer does it, on a subclass so that transformers' class stays as it is
    experts_class = use_experts_implementation(experts_class=type("FP8Experts", (fp8.FP8Experts,), {}),
                                               experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    model = _qwen()
    for layer in model.model.layers:
        layer.mlp.experts = experts_class(config=model.config, block_size=(16, 16))
    refused = r"FP8Experts \(model_type='qwen3_moe'\).*quantized expert weights \(gate_up_proj torch\.float8_e4m3fn"
    with pytest.raises(hf.UnsupportedExpertsError, match=refused):
        hf.check_model(model)
    with pytest.raises(hf.UnsupportedExpertsError, match=refused):
        hf.patch_model(model)
    assert not hf.is_patched(model) and all("forward" not in vars(m) for m in model.modules())
    model.set_experts_implementation("megamoe")
    with pytest.raises(hf.UnsupportedExpertsError, match=refused):
        model(input_ids=_ids())
    # cast to bfloat16 (weights and scales alike): still quantized, its scales not megamoe's to ignore
    model.to(torch.bfloat16)
    with pytest.raises(hf.UnsupportedExpertsError, match=refused.replace("float8_e4m3fn", "bfloat16")):
        hf.check_model(model)


def _fsdp2_check_model_worker(rank: int, world: int, init_file: str, result_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        ids = _ids()
        loss_ref = _qwen(experts_implementation="eager")(input_ids=ids, labels=ids).loss
        # DTensor weights that nothing unshards before the forward: still refused
        model = _qwen(experts_implementation="megamoe")
        experts = model.model.layers[0].mlp.experts
        experts.gate_up_proj = torch.nn.Parameter(distribute_tensor(experts.gate_up_proj.detach(), mesh, [Replicate()]))
        with pytest.raises(ValueError, match="DTensor expert weights"):
            hf.check_model(model)
        # under FSDP2 the forward gets the unsharded tensors: accepted, and runs as eager
        model = _qwen(experts_implementation="megamoe")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        hf.check_model(model)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
    open(result_file + f".{rank}", "w").write("ok")


def test_check_model_accepts_fsdp2(tmp_path):
    """check_model accepts experts whose weights fully_shard made DTensors (FSDP2 unshards them for the
    forward), and still refuses DTensor weights elsewhere."""
    import torch.multiprocessing as mp

    result = str(tmp_path / "result")
    mp.spawn(_fsdp2_check_model_worker, args=(1, str(tmp_path / "init"), result), nprocs=1)
    assert (tmp_path / "result.0").read_text() == "ok"


def test_custom_gate_probe():
    """A custom _apply_gate is accepted only if it computes silu(gate) * up, at magnitudes where clamps show."""
    experts = _qwen().model.layers[0].mlp.experts

    def fp32_gate(self, gate_up):  # Beam's: silu(g) * u in fp32
        gate, up = gate_up.chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)

    def clamped_gate(self, gate_up):  # a swiglu_limit of 10
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)

    for function, supported in ((fp32_gate, True), (clamped_gate, False)):
        probe = copy.copy(experts)
        probe._apply_gate = function.__get__(probe)
        reason = hf.unsupported_reason(probe)
        assert (reason is None) == supported, reason
        if not supported:
            assert "_apply_gate" in reason


def _eager_and_megamoe(model, experts, x, ids, weights):
    """(out, grads of x, weights, gate_up_proj, down_proj) of the experts called with the model's eager
    implementation, then with megamoe's."""
    results = []
    for implementation in ("eager", "megamoe"):
        model.set_experts_implementation(implementation)
        out = experts(x, ids, weights)
        grads = torch.autograd.grad(out.square().sum(), [x, weights, experts.gate_up_proj, experts.down_proj])
        results.append((out, grads))
    return results


def test_transformers_expert_parallel_sentinels():
    """transformers' own EP ("all_to_all"/"all_reduce") hands the experts local ids with a sentinel id
    (num_local_experts) and weight 0 for routes to other ranks: same result and gradients as eager."""
    model = _qwen()
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32, generator=gen, requires_grad=True)
    ids = torch.randint(0, 8, (9, 2), generator=gen)
    ids[::2, 1] = 8  # sentinel
    weights = torch.rand(9, 2, generator=gen).masked_fill(ids == 8, 0.0).requires_grad_()
    (out_ref, grads_ref), (out, grads) = _eager_and_megamoe(model, experts, x, ids, weights)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)


def test_float64_model_keeps_float64_routing_weights():
    """A float64 model (model.double(), as for numerics checks) whose router returns float64 weights: megamoe
    keeps them float64, as eager does (rounding them to fp32 left ~1e-8 relative errors), result and gradients."""
    model = _qwen().double()
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 8, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    (out_ref, grads_ref), (out, grads) = _eager_and_megamoe(model, experts, x, ids, weights)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-14)
    for grad, grad_ref in zip(grads, grads_ref):
        assert grad.dtype == torch.float64
        torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-14)


def test_patch_model_shares_the_adapter():
    model = _qwen()
    hf.patch_model(model)
    experts = model.model.layers[0].mlp.experts
    assert experts.forward.func is hf.megamoe_experts_forward and experts.forward.args == (experts,)
    hf.unpatch_model(model)
    assert "forward" not in vars(experts)


def test_torch_compile_fullgraph_first_call():
    """The first forward (which validates the experts) traces in one graph; loss and gradients as eager."""
    ids = _ids()
    model = _qwen(experts_implementation="eager")
    model(input_ids=ids, labels=ids).loss.backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.set_experts_implementation("megamoe")
    assert not hasattr(model.model.layers[0].mlp.experts, "_megamoe_checked")
    loss = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids).loss
    loss.backward()
    for name, grad in grads_ref.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-7, msg=name)
