"""Adapters that run other libraries' MoE blocks through megamoe.experts.

Each adapter lives in its own module and imports its library lazily, so `import megamoe` never needs it:
    megamoe.integrations.hf            Hugging Face transformers: experts_implementation="megamoe" (every family of
                                       transformers' experts interface whose experts megamoe computes) and
                                       ep_implementation="megamoe"; patch_model for Qwen3-MoE, Qwen2-MoE, Mixtral,
                                       OLMoE, DeepSeek-V3 with megamoe's own expert parallelism
    megamoe.integrations.hf_families   the families of the installed transformers, tiny models of each, and the
                                       "megamoe equals eager, or refuses" check (tests, benchmarks/hf_families_table.py)
"""
