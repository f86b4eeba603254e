"""The simulated engine's options, under the simulator's name for them: the value itself is
:mod:`llmgw_common.sim_options`, the contract from which the agent builds an engine's command line
without importing the simulator."""

from llmgw_common.sim_options import METRICS_STYLES, POOLING_TASKS, RUNNERS, SimOptions

__all__ = ["METRICS_STYLES", "POOLING_TASKS", "RUNNERS", "SimOptions"]
