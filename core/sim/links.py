"""Replay of a graph whose transfers share network links (``Graph.flows``: a parameter server's pushes and answers).

Pushes and answers are messages on connections (one per worker/server pair and direction). A connection sends its
messages one after another, in the order they became ready; connections crossing one link share it evenly, and a
connection crossing several links (a host's outgoing link, then the other host's incoming one) moves at its share of
the busiest. A link that instead took its transfers strictly in turn, a step's pushes before its answers, let a
worker's pushes run ahead of the answers its host's server sends the same way, which TCP connections do not do,
and predicted the server-count and partition what-ifs worse (docs/measurements.md).

A host's CPUs are a link of this kind with several lanes (``Flows.capacity``: a message alone moves at full rate
while what is on the link asks for no more than its lanes): a parameter server's work is a message on it taking
``Flows.weight`` lanes (the CPUs its threads, its workers' sending and receiving and the kernel keep busy), and a
worker's compute takes one lane while it runs (``Flows.occupants``) at its own recorded pace. When they ask for more
lanes than there are, every message on the link moves at lanes / asked. The host's CPUs are conserved: the worker
too gets lanes / asked of what it asks for, so compute that ran crowded in the recording runs faster in a what-if
less crowded, and slower in one more crowded. Compute keeps its recorded duration inside the replay (what it did with
the crowding it met); ``replay_shared`` reports each compute node's crowding (the mean of asked / lanes while it
ran, at least 1), and ``scale_for_crowding`` rescales it against the recording's, replay after replay.

How long a shared transfer takes depends on what else is on its links while it runs, so these graphs are replayed
event by event (``replay_shared``) rather than level by level: every other node ends its duration after it starts,
as in ``dpro.sim.replay``.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque

import numpy as np

from dpro.dag.graph import Graph
from dpro.errors import GraphError

__all__ = ["OpKey", "crowding_by_op", "replay_shared", "scale_for_crowding"]

_DONE, _OCCUPY, _ARRIVE = 0, 1, 2  # event kinds: a node ends; a node starts taking a share of a link; a shared
# transfer is ready to be sent


def replay_shared(g: Graph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, crowding) of every node of ``g``, a graph with ``flows`` (µs): ``start = max(end of
    predecessors) + gap``; a node that is no shared transfer ends ``duration`` later, a shared transfer when its
    connection has sent it (see the module docstring; its ``duration`` is its time with the links to itself).
    ``crowding``: for a node taking a share of a link (``Flows.occupants``), the mean over its run of what the link
    was asked for against its lanes (at least 1); 1 for every other node.

    Raises:
        GraphError: the graph has a cycle (names one node on it).
    """
    n = g.size
    flows = g.flows
    flow_of = {int(node): i for i, node in enumerate(flows.nodes)}
    occupants = flows.occupants
    capacity = flows.capacity or (1.0,) * len(flows.link_names)
    occupied: dict[int, int] = defaultdict(int)  # link -> nodes taking a share of it now
    crowded: dict[int, float] = {}  # occupied link -> asked / lanes now, at least 1
    crowd_sum: dict[int, float] = defaultdict(float)  # occupied link -> integral of ``crowded`` over time
    crowd_mark: dict[int, float] = {}  # occupant node -> its link's integral when it started
    crowding = np.ones(n)
    weight = flows.weight or (1.0,) * len(flows.link_names)
    counts = np.diff(g.pred_ptr)
    waiting_preds = counts.astype(np.int64).copy()
    succ: list[list[int]] = [[] for _ in range(n)]
    for node in range(n):
        for p in g.preds(node):
            succ[int(p)].append(node)
    start = np.zeros(n)
    end = np.zeros(n)
    ready = np.zeros(n)  # latest end of the predecessors so far
    events: list[tuple[float, int, int]] = []  # (time, kind, node)

    def release(node: int) -> None:
        start[node] = ready[node] + g.gap[node]
        if node in flow_of:
            heapq.heappush(events, (start[node], _ARRIVE, node))
            return
        heapq.heappush(events, (start[node] + g.duration[node], _DONE, node))
        if node in occupants and g.duration[node] > 0:
            heapq.heappush(events, (start[node], _OCCUPY, node))

    for node in np.flatnonzero(counts == 0):
        release(int(node))
    queued: dict[int, deque[int]] = defaultdict(deque)  # connection -> messages waiting, in order
    sending: dict[int, int] = {}                         # connection -> the message it sends now
    left: dict[int, float] = {}                          # message -> µs left at its links' full rate
    rate: dict[int, float] = {}
    now, finished = 0.0, 0

    def share() -> None:
        load: dict[int, float] = defaultdict(float, occupied)
        for node in sending.values():
            for link in flows.links[flow_of[node]]:
                load[link] += weight[link]
        rate.clear()
        crowded.clear()
        for link in occupied:
            crowded[link] = max(1.0, load[link] / capacity[link])
        for node in sending.values():
            rate[node] = min((min(1.0, capacity[link] / load[link]) for link in flows.links[flow_of[node]]),
                             default=1.0)

    def done(node: int, t: float) -> None:
        nonlocal finished
        end[node] = t
        finished += 1
        for s in succ[node]:
            ready[s] = max(ready[s], t)
            waiting_preds[s] -= 1
            if waiting_preds[s] == 0:
                release(s)

    while events or sending:
        next_event = events[0][0] if events else np.inf
        next_sent = min((now + left[m] / rate[m] for m in sending.values()), default=np.inf)
        t = min(next_event, next_sent)
        for m in sending.values():
            left[m] -= rate[m] * (t - now)
        for link, k in crowded.items():
            crowd_sum[link] += k * (t - now)
        now = t
        changed = False
        for c, m in list(sending.items()):
            if left[m] <= 1e-9 * max(1.0, float(g.duration[m])):
                del sending[c]
                changed = True
                done(m, now)
                if queued[c]:
                    sending[c] = queued[c].popleft()
        while events and events[0][0] <= now:
            _, kind, node = heapq.heappop(events)
            if kind == _OCCUPY:
                occupied[occupants[node]] += 1
                crowd_mark[node] = crowd_sum[occupants[node]]
                changed = True
                continue
            if kind == _DONE:
                if node in occupants and g.duration[node] > 0:
                    link = occupants[node]
                    occupied[link] -= 1
                    crowding[node] = (crowd_sum[link] - crowd_mark.pop(node)) / g.duration[node]
                    changed = True
                done(node, now)
                continue
            c = int(flows.connection[flow_of[node]])
            left[node] = float(g.duration[node])
            if c in sending:
                queued[c].append(node)
            else:
                sending[c] = node
                changed = True
        if changed:
            share()
    if finished != n:
        stuck = int(np.flatnonzero(waiting_preds > 0)[0])
        raise GraphError(f"the graph has a cycle through node {stuck} ({g.names[stuck]})")
    return start, end, crowding


# (rank, iteration, op name, occurrence) of a node: the same op in two replays of one step model (an op split in
# parts repeats its name within an iteration)
OpKey = tuple[int, int, str, int]


def _occupant_keys(g: Graph) -> dict[int, OpKey]:
    """Every node taking a share of a link -> its ``OpKey``."""
    flows = g.flows
    seen: dict[tuple[int, int, str], int] = defaultdict(int)
    keys = {}
    for node in sorted(flows.occupants if flows is not None else {}):
        op = (int(g.rank[node]), int(g.iteration[node]), g.names[node])
        keys[node] = (*op, seen[op])
        seen[op] += 1
    return keys


def crowding_by_op(g: Graph, crowding: np.ndarray) -> dict[OpKey, float]:
    """``OpKey`` -> the crowding of that node taking a share of a link (``replay_shared``)."""
    return {key: float(crowding[node]) for node, key in _occupant_keys(g).items()}


def scale_for_crowding(g: Graph, crowding: np.ndarray, recorded: dict[OpKey, float],
                       base_duration: np.ndarray) -> None:
    """Set each node taking a share of a link to ``base_duration`` (as recorded) times its crowding now over its
    crowding in the replay of the recorded configuration (``recorded``, ``crowding_by_op``): the host's CPUs
    conserved."""
    for node, key in _occupant_keys(g).items():
        before = recorded.get(key)
        if before:
            g.duration[node] = base_duration[node] * float(crowding[node]) / before
