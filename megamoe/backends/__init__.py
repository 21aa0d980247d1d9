"""Backends: each exposes `block_m_for`, `experts_fwd` and `experts_bwd` over a Schedule (see torch_native);
swiglu.py holds what they share (SwiGLU in torch ops, the shared expert), this module experts_bwd's default
needs_grad (ALL_GRADS)."""

# needs_grad with every gradient asked for: (x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down).
ALL_GRADS = (True,) * 6
