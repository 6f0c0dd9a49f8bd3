"""Layer 3: pipeline parallelism: stage split of an unchanged model, schedules as data, the simulator and the
point-to-point runtime."""

from memsave.pp.balance import Balance, balance, balance_by_params, by_count
from memsave.pp.schedule import (
    KINDS,
    SCHEDULES,
    Action,
    Schedule,
    build,
    check,
    gpipe,
    interleaved,
    one_f_one_b,
    zero_bubble,
)
from memsave.pp.simulate import Costs, SimResult, Timed, bubble_formula, simulate

__all__ = ["KINDS", "SCHEDULES", "Action", "Balance", "Costs", "Schedule", "SimResult", "Timed", "balance",
           "balance_by_params", "bubble_formula", "build", "by_count", "check", "gpipe", "interleaved",
           "one_f_one_b", "simulate", "zero_bubble"]
