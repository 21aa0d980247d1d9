"""Routing for timing: balanced (top-k of uniform scores) and skewed (a Zipf-like preference for some experts)."""

from __future__ import annotations

import torch

ROUTINGS = ("balanced", "skewed")
ZIPF_EXPONENT = 1.2
PRIOR_SEED = 0  # one expert preference for all ranks, so the skew adds up over the group


def zipf_log_prior_E(num_experts: int) -> torch.Tensor:
    """[E] fp32: log of a Zipf(1.2) preference, p(expert) ~ 1 / rank^1.2, over a fixed random permutation."""
    generator = torch.Generator().manual_seed(PRIOR_SEED)
    popularity_rank = torch.randperm(num_experts, generator=generator) + 1
    return -ZIPF_EXPONENT * popularity_rank.double().log().float()


def route(
    routing: str, num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing: (topk_ids [T, k] int64, k distinct experts per token; topk_weights [T, k] fp32, rows sum to 1).

    balanced: top-k of uniform scores, so every expert gets T*k/E pairs on average.
    skewed: top-k of Gumbel noise + the Zipf log-prior, i.e. k experts drawn without replacement from the
        Zipf preference; the most popular experts get many times the mean.
    The weights are the softmax of the chosen scores. Runs on the generator's device.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    device = generator.device
    scores_TE = torch.rand(num_tokens, num_experts, generator=generator, device=device)
    if routing == "skewed":
        # rand is in [0, 1): -log(-log(0)) = -inf is never picked before a finite score.
        scores_TE = -torch.log(-torch.log(scores_TE)) + zipf_log_prior_E(num_experts).to(device)
    top_scores_TK, topk_ids_TK = torch.topk(scores_TE, top_k, dim=1)
    return topk_ids_TK, torch.softmax(top_scores_TK, dim=1)


def expert_load_E(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: (token, slot) pairs routed to each expert."""
    return torch.bincount(topk_ids_TK.flatten(), minlength=num_experts)
