"""Memory, FLOP and communication planner for training GLM-5.3-Flash on N GPUs (scripts/plan.py).

Built on the trainer's own config, model construction, FSDP2 units, FLOP count and layout validation; see core.py.
"""

from .core import Plan, PlanError, Request, plan, search
from .hardware import GPUS, GpuSpec, get_gpu
from .layout import Layout, Verdict, trainer_verdict

__all__ = ["Plan", "PlanError", "Request", "plan", "search", "GPUS", "GpuSpec", "get_gpu", "Layout", "Verdict",
           "trainer_verdict"]
