"""Train a transformers Qwen3-MoE (random init, bf16) for a few AdamW steps with each experts implementation.

Usage: python benchmarks/hf_train_bench.py [--layers 2] [--tokens 16384] [--steps 8] [--impl megamoe,grouped_mm,eager]
       [--tiny] [--json PATH]

The model is built with `AutoModelForCausalLM.from_config(config, experts_implementation=impl)`, the way a user
picks an implementation; importing megamoe.integrations.hf registers "megamoe". Layer sizes are Qwen3-30B-A3B's
(hidden 2048, 128 experts of 768, top-8; 32 query / 4 KV heads of 128) unless --tiny (a CPU smoke test). Every
implementation starts from the same weights and sees the same batches. Reported per implementation: the median
step time (forward, backward, optimizer step; CUDA synchronised around each step) after the first two steps, the
peak memory, and the losses; the JSON adds the GPU, torch, Triton and commit (megamoe.bench.measure.run_facts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import megamoe.integrations.hf  # noqa: F401  (registers experts_implementation="megamoe")
from megamoe.bench.measure import run_facts
from megamoe.bench.workloads import comma_names

WARMUP_STEPS = 2
VOCAB = 32000
SEQ_LEN = 2048


def model_config(layers: int, tiny: bool) -> Qwen3MoeConfig:
    if tiny:
        return Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_experts=8, num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16)
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, norm_topk_prob=True)


def train(impl: str, config: Qwen3MoeConfig, batches: list[torch.Tensor], device: torch.device, dtype) -> dict:
    torch.manual_seed(0)
    with device:  # initialised where it trains (same seed, same weights for every implementation)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times_ms = [], []
    for ids in batches:
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.synchronize()
        times_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if on_gpu else None
    del model, optimizer
    if on_gpu:
        torch.cuda.empty_cache()
    return {"impl": impl, "step_ms": statistics.median(times_ms[WARMUP_STEPS:]), "peak_mem_bytes": peak,
            "losses": losses, "step_times_ms": times_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16384, help=f"tokens per step (sequences of {SEQ_LEN})")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--impl", default="megamoe,grouped_mm,eager", type=comma_names(("eager", *ALL_EXPERTS_FUNCTIONS)))
    parser.add_argument("--tiny", action="store_true", help="tiny layer sizes (CPU smoke test)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be > {WARMUP_STEPS} (the first {WARMUP_STEPS} are not timed), got {args.steps}")
    if args.tokens < 1 or (args.tokens > SEQ_LEN and args.tokens % SEQ_LEN):
        parser.error(f"--tokens must be at most {SEQ_LEN} or a multiple of it (sequences of {SEQ_LEN}), "
                     f"got {args.tokens}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    facts = run_facts(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(args.layers, args.tiny)
    seq = min(SEQ_LEN, args.tokens)
    generator = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (args.tokens // seq, seq), device=device, generator=generator)
               for _ in range(args.steps)]
    import transformers

    results = [train(impl, config, batches, device, dtype) for impl in args.impl]
    header = (f"transformers {transformers.__version__}, torch {facts['torch']}, {facts['gpu']}, "
              f"Qwen3-MoE {args.layers} layers "
              f"{'(tiny)' if args.tiny else '(Qwen3-30B-A3B sizes)'}, {args.tokens} tokens/step, {dtype}")
    print(header)
    print(f"{'impl':12} {'step ms':>9} {'peak GiB':>9}  losses")
    for r in results:
        peak = f"{r['peak_mem_bytes'] / 2**30:9.2f}" if r["peak_mem_bytes"] else f"{'-':>9}"
        print(f"{r['impl']:12} {r['step_ms']:9.2f} {peak}  {' '.join(f'{x:.4f}' for x in r['losses'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**facts, "setup": header, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
