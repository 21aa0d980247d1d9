"""Backends: each exposes `block_m_for`, `experts_fwd` and `experts_bwd` over a Schedule (see torch_native)."""
