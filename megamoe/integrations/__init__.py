"""Adapters that run other libraries' MoE blocks through megamoe.experts.

Each adapter lives in its own module and imports its library lazily, so `import megamoe` never needs it:
    megamoe.integrations.hf   Hugging Face transformers (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3)
"""
