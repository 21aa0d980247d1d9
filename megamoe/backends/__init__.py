"""Backends: each exposes `block_m_for`, `experts_fwd` and `experts_bwd` over a Schedule (see torch_native);
swiglu.py holds what they share (SwiGLU in torch ops, the shared expert)."""
