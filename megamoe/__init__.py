"""megamoe: a whole MoE layer (dispatch, expert MLPs, combine; forward and backward) as fused kernels."""

from megamoe import parallel, reference
from megamoe.autograd import CapacityOverflowError, experts
from megamoe.config import MoEConfig
from megamoe.layer import MoELayer
from megamoe.schedule import Schedule, build_schedule

__all__ = [
    "CapacityOverflowError",
    "MoEConfig",
    "MoELayer",
    "Schedule",
    "build_schedule",
    "clear_workspaces",
    "experts",
    "get_workspace",
    "parallel",
    "reference",
]
__version__ = "0.1.0"

# The expert-parallel symmetric-memory workspace lives in the Triton backend, which needs Triton: its two
# entry points are imported on first use, so `import megamoe` works without Triton.
_WORKSPACE_API = ("get_workspace", "clear_workspaces")


def __getattr__(name: str):
    if name in _WORKSPACE_API:
        from megamoe.backends.triton.comm import workspace

        return getattr(workspace, name)
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
