"""The order in which pipeline ranks post their messages (memsave/pp/message_order.py, [Note: messages in one
order]): for every schedule, on a chain of stages and on one with a skip connection, both ends of every pair of
ranks list their messages in the same sequence, and a model of NCCL, which pairs the n-th send with the n-th
receive and runs a rank's point-to-point operations one after another on one stream, finishes the step without
a wait in a cycle. The equality tests in tests/test_pp.py run on gloo with every message tagged 0
(``MEMSAVE_PP_MATCH=order``), so gloo pairs them by order as NCCL does."""

from __future__ import annotations

from typing import Any

import pytest

from memsave.pp.message_order import Op, evaluation_schedule, message_order
from memsave.pp.probe import Layout
from memsave.pp.schedule import Schedule, build


def _layout(n_stages: int, skip: bool) -> Layout:
    """Stage s runs atom ``b{s}``, read by stage s + 1; with ``skip``, stage 0's output is read by stage 2 too
    (a U-Net's skip connection) and by the last stage."""
    order = [(f"b{s}", 0) for s in range(n_stages)]
    readers = {(f"b{s}", 0): [s + 1] for s in range(n_stages - 1)}
    if skip:
        readers[("b0", 0)] = sorted({1, 2, n_stages - 1})
    reads = {s: [k for k in order if s in readers.get(k, [])] for s in range(n_stages)}
    return Layout(order, {k: i for i, k in enumerate(order)}, {}, reads, readers,
                  {s: k for s, k in enumerate(order)})


def _messages(layout: Layout, schedule: Schedule, forward_only: bool
              ) -> tuple[dict[Any, list[Any]], dict[Any, list[Any]]]:
    """Per action: the messages it receives before it runs, and the ones it sends after (remote or not)."""
    needs: dict[Any, list[Any]] = {}
    makes: dict[Any, list[Any]] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            key = (r, a)
            if a.kind == "F":
                needs[key] = [(a.mb, k, a.stage, False) for k in layout.reads[a.stage]]
                makes[key] = [(a.mb, k, d, False) for k, ds in layout.readers.items()
                              if layout.stage_of[k] == a.stage for d in ds]
            elif a.kind in "BI" and not forward_only:
                needs[key] = [(a.mb, k, d, True) for k, ds in layout.readers.items()
                              if layout.stage_of[k] == a.stage for d in ds]
                makes[key] = [(a.mb, k, a.stage, True) for k in layout.reads[a.stage]]
    return needs, makes


def _nccl_finishes(schedule: Schedule, orders: list[list[Op]], layout: Layout, forward_only: bool = False) -> bool:
    """A model of a step on NCCL: each rank's compute runs its actions in order, its one communication stream runs
    its operations in the posted order, an operation completes together with its counterpart at the head of the
    peer's stream, a send only after the action that computed it, an action only after its receives. True when
    every rank gets through (no wait in a cycle)."""
    needs, makes = _messages(layout, schedule, forward_only)
    remote = [{op[1] for op in order} for order in orders]
    done_msgs: set[Any] = set()
    sent_ready: set[Any] = set()
    act_pos = [0] * schedule.pp
    op_pos = [0] * schedule.pp
    progress = True
    while progress:
        progress = False
        for r in range(schedule.pp):
            while act_pos[r] < len(schedule.actions[r]):
                a = schedule.actions[r][act_pos[r]]
                if not all(m in done_msgs for m in needs.get((r, a), []) if m in remote[r]):
                    break
                sent_ready.update(makes.get((r, a), []))
                act_pos[r] += 1
                progress = True
            if op_pos[r] < len(orders[r]):
                is_send, name, peer = orders[r][op_pos[r]]
                if op_pos[peer] < len(orders[peer]):
                    p_send, p_name, p_peer = orders[peer][op_pos[peer]]
                    if (p_name == name and p_peer == r and p_send != is_send and name in sent_ready):
                        op_pos[r] += 1
                        op_pos[peer] += 1
                        done_msgs.add(name)
                        progress = True
    return all(act_pos[r] == len(schedule.actions[r]) and op_pos[r] == len(orders[r]) for r in range(schedule.pp))


CASES = [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("interleaved", 2, 4, 2),
         ("interleaved", 4, 8, 2), ("zero-bubble", 2, 4, 1), ("zero-bubble", 4, 8, 1), ("zero-bubble-h2", 4, 8, 1),
         ("evaluation", 2, 4, 2), ("evaluation", 4, 4, 1)]


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_both_ends_post_in_one_order_and_nccl_gets_through(name: str, p: int, m: int, v: int, skip: bool) -> None:
    forward_only = name == "evaluation"
    schedule = evaluation_schedule(p, v, m) if forward_only else build(name, p, m, v)
    layout = _layout(schedule.n_stages, skip and schedule.n_stages > 2)
    orders = [message_order(schedule, layout, r, forward_only=forward_only)[0] for r in range(p)]
    for a in range(p):
        for b in range(a + 1, p):
            at_a = [(name_, send) for send, name_, peer in orders[a] if peer == b]
            at_b = [(name_, not send) for send, name_, peer in orders[b] if peer == a]
            assert at_a == at_b, f"ranks {a} and {b} list their messages in different orders"
    assert all(orders), "every rank sends or receives"
    assert _nccl_finishes(schedule, orders, layout, forward_only)


def test_an_order_each_rank_picks_for_itself_hangs_on_nccl() -> None:
    """The model fails an order that is not one order: 1F1B at pp=2 where rank 1 posts the next forward's input
    ahead of the gradient it sends now (what the runner did, posting each rank's next receives ahead)."""
    schedule = build("1f1b", 2, 4)
    layout = _layout(2, False)
    orders = [message_order(schedule, layout, r)[0] for r in range(2)]
    assert _nccl_finishes(schedule, orders, layout)
    one = orders[1]
    g0 = next(i for i, op in enumerate(one) if op[1] == (0, ("b0", 0), 1, True))
    a2 = next(i for i, op in enumerate(one) if op[1] == (2, ("b0", 0), 1, False))
    assert g0 < a2
    one.insert(g0, one.pop(a2))
    assert not _nccl_finishes(schedule, orders, layout)


def test_a_bad_match_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from memsave.dist.p2p import P2P

    monkeypatch.setenv("MEMSAVE_PP_MATCH", "tags")
    with pytest.raises(ValueError, match=r"MEMSAVE_PP_MATCH='tags'.*'tag'.*'order'"):
        P2P(torch.device("cpu"))
    monkeypatch.setenv("MEMSAVE_PP_MATCH", "order")
    assert P2P(torch.device("cpu")).by_order
    monkeypatch.delenv("MEMSAVE_PP_MATCH")
    assert not P2P(torch.device("cpu")).by_order  # no process group: gloo's default, by tag
