"""Layer 3: pipeline parallelism: stage split of an unchanged model, schedules as data, the simulator and the
point-to-point runtime."""

from memsave.pp.schedule import KINDS, Action, Schedule, gpipe, one_f_one_b

__all__ = ["KINDS", "Action", "Schedule", "gpipe", "one_f_one_b"]
