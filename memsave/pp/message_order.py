"""The order in which a rank posts a pipeline step's messages: one order, the same at both ends of every message.

[Note: messages in one order] NCCL ignores tags. Between two ranks it pairs the n-th send with the n-th receive,
and torch runs a rank's point-to-point operations with a peer (with every peer, once the group's communicator is
shared) one after another on one stream, where a receive holds the stream until its send arrives. Messages
posted as each rank's own progress allows (a receive posted ahead of the next action, a send when its action
ends) then pair wrongly, two micro-batches' activations of one shape swapped without an error, or hang: in 1F1B,
rank 0's stream waits in the receive of a gradient that rank 1 sends only after a receive that waits for rank
0's next send. Gloo pairs by tag, so the tests on gloo could not see it.

So every rank posts its messages in one global order (:func:`message_order`): by the time a message is ready in a
run of the schedule on paper (memsave.pp.simulate with unit costs: the end of the action that computes it), ties
by the message's name. The two ends of a message compute the same order from the same schedule and layout,
which every pp rank agreed on, so each pair's operations come in the same sequence on both ranks, and no stream
waits in a cycle (the operations at the head of every stream with the smallest key always pair with each other).
A rank can always post in this order: a message it must receive before an action has a key no later than that
action's start on paper, and every send of a smaller key is computed by an action that comes earlier on the same
rank. The runner posts the receives of its next action before it runs the current one, as far as this order
allows ([Note: receives posted ahead] in runtime_messages.py; on gloo, which pairs by tag, out of it).

``MEMSAVE_PP_MATCH=order`` makes gloo pair by order as NCCL does (every pipeline message has tag 0):
tests/test_pp.py runs so, and a message out of order fails it (tests/test_pp_message_order.py checks the order).
"""

from __future__ import annotations

from typing import Any

from memsave.pp.probe import Layout
from memsave.pp.schedule import Action, Schedule
from memsave.pp.simulate import Costs, simulate

__all__ = ["MessageName", "Op", "evaluation_schedule", "message_order"]

MessageName = tuple[int, Any, int, bool]  # (micro-batch, the producing atom call, the reading stage, backward)
Op = tuple[bool, MessageName, int]  # (a send, the message, the pp rank at its other end)


def evaluation_schedule(pp: int, virtual: int, micro_batches: int) -> Schedule:
    """A forward-only pass (an evaluation) as a schedule: each micro-batch through a rank's stages in order. The
    backward actions after the forwards only make it complete for the simulator; they send nothing here."""
    n = pp * virtual
    actions = []
    for r in range(pp):
        mine = [s for s in range(n) if s % pp == r]
        fwd = [Action("F", s, mb) for mb in range(micro_batches) for s in mine]
        actions.append(tuple(fwd + [Action("B", s, mb) for mb in range(micro_batches) for s in reversed(mine)]))
    return Schedule("evaluation", pp, micro_batches, tuple(actions), virtual)


def message_order(schedule: Schedule, layout: Layout, pp_rank: int, *, forward_only: bool = False
                  ) -> tuple[list[Op], dict[MessageName, int]]:
    """This rank's sends and receives of one step of ``schedule``, in the order it posts them ([Note: messages in
    one order]), and each message's position in that list. A message is every tensor of one atom call's output
    sent to one stage (or their gradients sent back); messages between stages of one rank are not in it."""
    timed = simulate(schedule, Costs.uniform(schedule.n_stages, backward_input=1.0, backward_weight=1.0)).timed
    end = {(t.action.kind, t.action.stage, t.action.mb): t.end for t in timed}
    grad_of = {(s, mb): "I" if ("I", s, mb) in end else "B"
               for (_k, s, mb) in end}  # the action that sends (s, mb)'s input gradients
    keyed: list[tuple[float, tuple[Any, ...], Op]] = []
    for key, dsts in layout.readers.items():
        src = layout.stage_of[key]
        idx = layout.index(key)
        for dst in dsts:
            a, b = schedule.rank_of(src), schedule.rank_of(dst)
            if a == b or pp_rank not in (a, b):
                continue
            peer = b if pp_rank == a else a
            for mb in range(schedule.micro_batches):
                keyed.append((end[("F", src, mb)], (0, mb, idx, dst), (pp_rank == a, (mb, key, dst, False), peer)))
                if not forward_only:  # the gradients back, sent by the reader's B (or I)
                    keyed.append((end[(grad_of[(dst, mb)], dst, mb)], (1, mb, idx, dst),
                                  (pp_rank == b, (mb, key, dst, True), peer)))
    keyed.sort(key=lambda k: (k[0], k[1]))
    ops = [op for _t, _name, op in keyed]
    return ops, {op[1]: i for i, op in enumerate(ops)}
