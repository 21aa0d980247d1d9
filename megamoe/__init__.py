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
    "experts",
    "parallel",
    "reference",
]
__version__ = "0.1.0"
