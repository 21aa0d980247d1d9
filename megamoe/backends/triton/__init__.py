"""The fused Triton backend (same interface as megamoe.backends.torch_native).

One GPU (schedule.world_size == 1): experts.py gathers token rows expert-contiguous once and runs the
fused grouped GEMMs on contiguous rows. Expert parallelism: ep.py, symmetric-memory dispatch/combine inside
the GEMM kernels (on Hopper the Gluon core's: kernels/gluon_ep.py pulls the gate/up GEMM's rows,
kernels/gluon_rows.py pushes the down GEMM's; elsewhere one persistent kernel per direction built from the
pointer-load core's tiles, kernels/ep_fused.py; the slot sums are the one-GPU kernels), and the routing
exchange that build_schedule uses (`routing_exchange`).
"""

import re

import triton

# The oldest Triton whose Gluon API the Hopper kernels use (SharedLinearLayout, warp_specialize's form); older
# ones fail while the kernels' modules are imported, so the backend reports it here as an ImportError.
MIN_TRITON = (3, 6)
if tuple(int(n) for n in re.findall(r"\d+", triton.__version__)[:2]) < MIN_TRITON:
    raise ImportError(f"megamoe's Triton backend needs triton >= {'.'.join(map(str, MIN_TRITON))}, "
                      f"found triton {triton.__version__}")

from megamoe.backends import ALL_GRADS  # noqa: E402
from megamoe.backends.triton import ep, experts  # noqa: E402
from megamoe.backends.triton.configs import block_m_for  # noqa: E402
from megamoe.backends.triton.ep import routing_exchange  # noqa: E402
from megamoe.backends.triton.kernels.schedule import place_routing  # noqa: E402


def _path(schedule):
    return experts if schedule.world_size == 1 else ep


def experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group=None, config=None,
                *, save_for_backward=True):
    return _path(schedule).experts_fwd(x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group,
                                       config, save_for_backward=save_for_backward)


def experts_bwd(d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config, saved,
                *, needs_grad=ALL_GRADS):
    return _path(schedule).experts_bwd(
        d_out, x, topk_weights, w_gate_up, w_down, shared_gate_up, shared_down, schedule, group, config, saved,
        needs_grad=needs_grad,
    )


def empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule, config):
    return _path(schedule).empty_saved(x, w_gate_up, w_down, shared_gate_up, schedule, config)


__all__ = ["block_m_for", "empty_saved", "experts_bwd", "experts_fwd", "place_routing", "routing_exchange"]
