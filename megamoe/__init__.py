"""megamoe: a whole MoE layer (dispatch, expert MLPs, combine; forward and backward) as fused kernels."""

from megamoe import parallel, reference
from megamoe.autograd import BACKENDS as _BACKENDS
from megamoe.autograd import TRITON_UNAVAILABLE as _TRITON_UNAVAILABLE
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
# entry points are imported on first use, so `import megamoe` works without Triton. Without the backend they
# are not in __all__ (`from megamoe import *` would fail on them) and reading one is an AttributeError that
# says why (so hasattr is False rather than an ImportError).
_WORKSPACE_API = ("get_workspace", "clear_workspaces")
if "triton" not in _BACKENDS:
    __all__ = [name for name in __all__ if name not in _WORKSPACE_API]


def __getattr__(name: str):
    if name in _WORKSPACE_API:
        try:
            from megamoe.backends.triton.comm import workspace
        except ImportError as error:
            raise AttributeError(
                f"megamoe.{name} needs megamoe's Triton backend (the expert-parallel symmetric-memory workspace), "
                f"which is not available here: {_TRITON_UNAVAILABLE or error}"
            ) from error
        return getattr(workspace, name)
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
