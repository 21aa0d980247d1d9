"""The MoE families of the installed transformers, as experts_implementation="megamoe" sees them: discovery,
tiny random models of each, and the check "megamoe equals eager, or refuses with a clear error".

Tooling for tests/test_hf_families.py and benchmarks/hf_families_table.py (CPU, fp32, no downloads):

    for family in discover():                      # every family whose experts use transformers' interface
        result = check_family(family)              # FamilyResult: supported / refused (reason) / error
        print(family.model_type, result.status, result.detail)

Discovery is transformers' own rule for "this model can set its experts implementation"
(PreTrainedModel._can_set_experts_implementation: the modeling file's source contains
"@use_experts_implementation"), applied to every `transformers/models/<name>/modeling_<name>.py`; the
experts classes are the classes of that file whose forward is the decorator's dispatching wrapper
(`hf.is_experts_class`: the same code object the decorator gives a probe class), so nothing is matched by name.

Tiny models: each family's own config class with sizes shrunk by `TINY` (hidden 32, 2 layers, 8 experts of
intermediate size 16, top-2, vocab 96: applied to the fields the config has) and the few family-specific
settings of `FAMILY_OVERRIDES` (fields that make a layer MoE, or that the config derives from the ones
above). The model class is the file's *ForCausalLM (loss = its LM loss on random tokens), else a text
model (loss = a fixed random projection of its last hidden state).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os

import torch
from torch import nn

from megamoe.integrations import hf

# Sizes applied to every field of these names a family's config has.
TINY: dict[str, object] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16,
    "shared_experts_intermediate_size": 16,
    "dense_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "top_k_experts": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 8,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "index_topk": 8,
    "sliding_window": 16,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "decoder_sparse_step": 1,
    "router_jitter_noise": 0.0,
    "output_router_logits": True,
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Family-specific settings: what makes a layer MoE where TINY does not, and sizes TINY does not name.
FAMILY_OVERRIDES: dict[str, dict[str, object]] = {
    "beam": {"mlp_layer_types": ["dense", "sparse"], "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_ocr2": {"mlp_layer_types": ["dense", "sparse"]},
    "deepseek_v4": {"mlp_layer_types": ["moe", "moe"]},
    "ernie4_5_vl_moe": {
        "moe_intermediate_size": [16, 16], "moe_k": 2, "moe_num_experts": 8, "moe_num_shared_experts": 1,
        "mlp_layer_types": ["dense", "sparse"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [1, 1, 2]},
    },
    "flint": {"mlp_only_layers": [0]},
    "gemma4": {
        "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 16,
        "layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 96,
    },
    "glm4v_moe": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "mrope_section": [1, 1, 0]}},
    "glm5_next": {"qk_rope_head_dim": 0, "head_dim": 0, "qk_nope_head_dim": 16, "qk_head_dim": 16, "v_head_dim": 16,
                  "index_kpool": 4, "linear_head_dim": 8, "linear_num_heads": 4,
                  "mlp_layer_types": ["dense", "sparse"]},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 16},
    "hy_v4_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                 "mlp_layer_types": ["dense", "sparse"]},
    "kimi_linear": {"num_experts_per_token": 2, "num_expert_group": 1, "linear_head_dim": 8, "linear_num_heads": 4,
                    "mlp_layer_types": ["dense", "sparse"]},
    # Its NVFP4 key/value rounding needs a head_dim that is a multiple of 16; its indexer at most the query heads
    # of one key head; its first two layers are dense by default.
    "kolibri1_1": {"head_dim": 16, "num_key_value_heads": 2, "index_num_heads": 2, "mlp_only_layers": [0]},
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
    # LongCat-Flash's own size fields; two zero-computation (identity) experts beside the routed ones.
    "longcat_flash": {"num_layers": 2, "ffn_hidden_size": 64, "expert_ffn_hidden_size": 16, "moe_topk": 2,
                      "zero_expert_num": 2},
    "mimo_v2_flash": {"num_key_value_heads": 2},
    "mistral4": {"qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "qk_head_dim": 8},
    "muse_spark": {"moe_hidden_size": 16, "layer_rope_theta": None},
    # The talker's text config lacks the field its shared expert reads (its parent config sets it).
    "qwen3_omni_moe": {"shared_expert_intermediate_size": 16},
    "step3p7": {"share_expert_dim": 16, "mlp_layer_types": ["dense", "sparse"]},
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 16},
}

# Per-layer list fields: reset to None so the config derives them from num_hidden_layers.
_PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types", "mlp_only_layers", "layers_block_type")

MAX_PARAMETERS = 3_000_000  # a "tiny" model above this was not shrunk: reported, not run


@dataclasses.dataclass(frozen=True)
class Family:
    """One modeling file of transformers whose experts use the experts interface."""

    model_type: str  # the models/<name> directory (the config's model_type for almost every family)
    module: str  # transformers.models.<name>.modeling_<name>
    experts_classes: tuple[str, ...]  # names of its @use_experts_implementation classes
    import_error: str = ""  # why the modeling file did not import here (then experts_classes is empty)


@dataclasses.dataclass
class FamilyResult:
    family: str  # Family.model_type
    status: str  # "supported" (megamoe == eager), "refused" (clear error), "mismatch", "error", "skipped"
    detail: str = ""  # the refusal reason, the mismatch, the error, why it was skipped
    model_class: str = ""
    experts_class: str = ""
    reasons: list[str] = dataclasses.field(default_factory=list)  # hf.unsupported_reasons, when refused


def discover() -> list[Family]:
    """Every modeling file of the installed transformers that dispatches experts through the interface
    (one that does not import here, e.g. for a missing optional dependency, is listed with its error)."""
    import transformers.models

    root = os.path.dirname(transformers.models.__file__)
    families = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, f"modeling_{name}.py")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            if "@use_experts_implementation" not in f.read():
                continue
        module_name = f"transformers.models.{name}.modeling_{name}"
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 - reported, not hidden
            families.append(Family(name, module_name, (), f"{type(error).__name__}: {error}"))
            continue
        experts = tuple(
            cls.__name__ for cls in vars(module).values() if hf.is_experts_class(cls) and cls.__module__ == module_name
        )
        if experts:
            families.append(Family(name, module_name, experts))
    return families


def _model_candidates(module) -> list[type]:
    from transformers import PreTrainedModel

    classes = [
        cls for name, cls in vars(module).items()
        if inspect.isclass(cls) and cls.__module__ == module.__name__ and issubclass(cls, PreTrainedModel)
        and not name.endswith("PreTrainedModel") and getattr(cls, "config_class", None) is not None
    ]

    def rank(cls) -> tuple[int, str]:
        name = cls.__name__
        for i, suffix in enumerate(("ForCausalLM", "TextModel", "Model")):
            if name.endswith(suffix):
                return i, name
        return 3, name

    return sorted(classes, key=rank)


def tiny_config(config_class, model_type: str | None = None):
    """config_class with TINY (and FAMILY_OVERRIDES[model_type]) applied to the fields it has."""
    default = config_class()
    fields = set(vars(default))
    if dataclasses.is_dataclass(config_class):
        fields |= {f.name for f in dataclasses.fields(config_class)}
    kwargs = {key: value for key, value in TINY.items() if key in fields}
    for key in _PER_LAYER_LISTS:
        if key in fields and isinstance(getattr(default, key, None), list):
            kwargs[key] = None
    kwargs.update(FAMILY_OVERRIDES.get(model_type or getattr(config_class, "model_type", ""), {}))
    return config_class(**kwargs)


def _randomise(model: nn.Module, experts: list[nn.Module], seed: int) -> None:
    """Seeded N(0, 0.02) expert weights (some families' _init_weights skip an experts class, e.g. Qwen3-Omni's
    talker, leaving torch.empty's garbage), N(0, 0.02) for any other parameter left non-finite or above 1e4
    (the same garbage), and random values for routers and biases that start constant (zero routers tie every
    top-k)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in experts:
            for param in module.parameters(recurse=False):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point():
                continue
            if isinstance(tensor, nn.Parameter) and not (torch.isfinite(tensor).all() and tensor.abs().max() < 1e4):
                tensor.copy_(0.02 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
            if tensor.numel() < 2:
                continue
            if name.endswith("e_score_correction_bias") or (
                tensor.dim() >= 1 and bool((tensor == tensor.flatten()[0]).all())
                and ("gate" in name or "router" in name or "bias" in name)
            ):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))


def tiny_model(family: Family, experts_class: str | None = None, *, seed: int = 0):
    """(model, experts modules) of the family's first model class that builds with a tiny config and holds
    an experts module of `experts_class` (default: the family's first), with experts_implementation
    "eager". Raises RuntimeError when none does."""
    module = importlib.import_module(family.module)
    experts_type = getattr(module, experts_class or family.experts_classes[0])
    errors = []
    for cls in _model_candidates(module):
        try:
            config = tiny_config(cls.config_class, family.model_type)
            with torch.device("meta"):
                probe = cls(config)
            if not any(isinstance(m, experts_type) for m in probe.modules()):
                errors.append(f"{cls.__name__}: no {experts_type.__name__}")
                continue
            size = sum(p.numel() for p in probe.parameters())
            if size > MAX_PARAMETERS:
                errors.append(f"{cls.__name__}: {size} parameters with the tiny config")
                continue
            torch.manual_seed(seed)
            config._experts_implementation = "eager"
            model = cls(config).float()
        except Exception as error:  # noqa: BLE001 - reported per candidate
            errors.append(f"{cls.__name__}: {type(error).__name__}: {error}")
            continue
        experts = [m for m in model.modules() if isinstance(m, experts_type)]
        _randomise(model, experts, seed)
        return model.train(), experts
    raise RuntimeError("; ".join(errors) or "no model class")


def _loss(model, input_ids) -> torch.Tensor:
    """A causal LM's own loss on input_ids (labels = input_ids); for a text model, a fixed random projection
    of its last hidden state on fixed random input embeddings (some text models are fed embeddings by their
    parent model and cannot embed ids themselves, e.g. Qwen3-Omni's talker)."""
    if "labels" in inspect.signature(model.forward).parameters:
        kwargs = {"input_ids": input_ids, "labels": input_ids}
    else:
        generator = torch.Generator().manual_seed(5)
        shape = (*input_ids.shape, model.config.hidden_size)
        kwargs = {"inputs_embeds": torch.randn(shape, generator=generator, dtype=model.dtype)}
    out = model(**kwargs)
    loss = getattr(out, "loss", None)
    if loss is not None:
        aux = getattr(out, "aux_loss", None)
        return loss if aux is None else loss + 0 * aux  # loss already holds coef * aux where the model adds it
    hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
    weight = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(7), dtype=hidden.dtype)
    return (hidden * weight).sum() / hidden.numel() ** 0.5


def _forward_backward(model, input_ids, seed: int):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same random numbers (jitter, dropout) in both runs
    loss = _loss(model, input_ids)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def compare(expected: torch.Tensor, actual: torch.Tensor, rtol: float) -> float | None:
    """The error of actual against expected relative to expected's largest magnitude (None: within rtol)."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    error = (actual - expected).abs().max().item() if expected.numel() else 0.0
    if not torch.isfinite(actual).all():
        return float("inf")
    return None if error <= rtol * scale + 1e-8 else error / max(scale, 1e-30)


def check_family(family: Family, *, tokens: tuple[int, int] = (2, 6), rtol: float = 1e-4,
                 seed: int = 0) -> list[FamilyResult]:
    """check_experts_class for each of the family's experts classes ("skipped" if it did not import)."""
    if family.import_error:
        return [FamilyResult(family.model_type, "skipped", f"does not import: {family.import_error}")]
    return [check_experts_class(family, name, tokens=tokens, rtol=rtol, seed=seed) for name in family.experts_classes]


def check_experts_class(family: Family, experts_class: str, *, tokens: tuple[int, int] = (2, 6), rtol: float = 1e-4,
                        seed: int = 0) -> FamilyResult:
    """Build a tiny model of the family holding `experts_class` and run one forward + backward with
    experts_implementation "eager" and then "megamoe" (set_experts_implementation on the same model):
    "supported" if the loss and every parameter gradient agree within rtol (relative to each tensor's largest
    magnitude, plus 1e-8), "refused" if megamoe raised UnsupportedExpertsError (detail: its message,
    reasons: hf.unsupported_reasons), "mismatch" or "error" otherwise."""
    result = FamilyResult(family.model_type, "error", experts_class=experts_class)
    try:
        model, experts = tiny_model(family, experts_class, seed=seed)
    except Exception as error:  # noqa: BLE001
        result.status, result.detail = "skipped", f"no tiny model: {error}"
        return result
    result.model_class = type(model).__name__
    vocab = getattr(model.config, "vocab_size", None) or 96
    input_ids = torch.randint(3, min(vocab, 96), tokens, generator=torch.Generator().manual_seed(seed + 1))
    try:
        loss_ref, grads_ref = _forward_backward(model, input_ids, seed)
        if not torch.isfinite(loss_ref):
            raise RuntimeError(f"the tiny model's eager loss is {loss_ref.item()}")
        model.set_experts_implementation(hf.EXPERTS_IMPLEMENTATION)
        calls = []
        original = hf.megamoe.experts

        def counting(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        hf.megamoe.experts = counting
        try:
            loss, grads = _forward_backward(model, input_ids, seed)
        finally:
            hf.megamoe.experts = original
    except hf.UnsupportedExpertsError as error:
        result.status, result.detail = "refused", str(error)
        result.reasons = hf.unsupported_reasons(experts[0])
    except Exception as error:  # noqa: BLE001
        result.status, result.detail = "error", f"{type(error).__name__}: {error}"
    else:
        problems = []
        if not calls:
            problems.append("megamoe.experts never ran")
        if (e := compare(loss_ref, loss, rtol)) is not None:
            problems.append(f"loss {loss.item():.6g} vs eager {loss_ref.item():.6g}")
        if grads.keys() != grads_ref.keys():
            problems.append(f"parameters with gradients differ: {sorted(grads.keys() ^ grads_ref.keys())[:4]}")
        for name in sorted(grads.keys() & grads_ref.keys()):
            if (e := compare(grads_ref[name], grads[name], rtol)) is not None:
                problems.append(f"grad of {name}: relative error {e:.3g}")
        result.status = "mismatch" if problems else "supported"
        result.detail = "; ".join(problems[:5]) or f"{len(calls)} megamoe.experts calls, {len(grads)} gradients"
    return result
