"""Stage 3, graph: the global DAG of training steps, as compact arrays.

A ``Graph`` holds one node per (rank, op, iteration) with its queue, duration and gap (framework
overhead before it on its queue), and predecessor lists in CSR form. Queue order is an edge like any
other (each op waits for the previous op on its queue), so replay is a longest-path computation.

Collectives join ranks: each rank's member is an *arrival* node (zero duration) on its comm queue,
and one *transfer* node (on no queue) follows all arrivals; whatever came after a member on its rank
(the next op on the comm queue, the optimizer) waits for the transfer. So an allreduce starts when
the last rank arrives, and its transfer time is calibrated from the last-arriving rank.

``GraphBuilder`` assembles a graph from any trace source: dpro run directories (``dpro.dag.step_model`` summarises
their steps, ``dpro.dag.wiring`` wires them), PyTorch profiler traces (``dpro.dag.kineto``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["NO_QUEUE", "Flows", "Graph", "GraphBuilder"]


NO_QUEUE = -1


@dataclass(frozen=True)
class Flows:
    """Nodes that are transfers over network links shared with other connections (a parameter server's pushes and
    answers): replayed by ``dpro.sim.links.replay_shared``."""

    nodes: np.ndarray                   # int64 node ids (their duration: the time with the links to themselves)
    connection: np.ndarray              # int64, per node: messages of one connection go one after another
    links: tuple[tuple[int, ...], ...]  # per node: the links it crosses (ids into link_names)
    link_names: tuple[str, ...]         # "link-out@host", "cpu@host", ...
    # per link: how many connections it carries at full rate (a network link 1, a host's CPUs their count)
    capacity: tuple[float, ...] = ()
    weight: tuple[float, ...] = ()  # per link: how much of it one message takes (a server's work: CPUs)
    # nodes that are no message but take a share of a link while they run, at their own pace (a worker's compute
    # on its host's CPUs): node id -> link id
    occupants: dict[int, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.nodes.size)


@dataclass
class Graph:
    """The DAG, one array entry per node (see module docstring)."""

    names: list[str]            # op name, e.g. "BW.fc1" (same on every rank)
    rank: np.ndarray            # int32
    iteration: np.ndarray       # int32: which replayed iteration the node belongs to
    queue: np.ndarray           # int32 index into queue_names, or NO_QUEUE
    duration: np.ndarray        # float64 µs
    gap: np.ndarray             # float64 µs, waited after the predecessors are done
    pred_ptr: np.ndarray        # int64, CSR row pointers (len n+1)
    pred_idx: np.ndarray        # int64, predecessor node ids
    category: list[str]         # FW, BW, COMM, UPDATE, IO, STEP, XFER (collective transfer), ...
    queue_names: list[str]      # "r0/compute", "r1/comm", ...
    step_end: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, iteration) -> STEP end node
    flows: Flows | None = None  # transfers over shared links, if any

    @property
    def size(self) -> int:
        return len(self.names)

    def preds(self, node: int) -> np.ndarray:
        return self.pred_idx[self.pred_ptr[node]:self.pred_ptr[node + 1]]


@dataclass
class GraphBuilder:
    """Collects nodes and edges, then freezes them into a ``Graph``."""

    names: list[str] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    iteration: list[int] = field(default_factory=list)
    queue: list[int] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    preds: list[list[int]] = field(default_factory=list)
    queue_names: list[str] = field(default_factory=list)
    _queue_id: dict[str, int] = field(default_factory=dict)
    _queue_last: dict[int, int] = field(default_factory=dict)
    _queue_first: dict[int, int] = field(default_factory=dict)
    step_end: dict[tuple[int, int], int] = field(default_factory=dict)
    _flows: list[tuple[int, str, tuple[str, ...]]] = field(default_factory=list)  # node, connection, links
    _occupants: dict[int, str] = field(default_factory=dict)  # node -> the link it takes a share of
    link_capacity: dict[str, float] = field(default_factory=dict)  # link -> connections at full rate (default 1)
    link_weight: dict[str, float] = field(default_factory=dict)  # link -> how much of it one message takes

    def queue_id(self, name: str) -> int:
        if name not in self._queue_id:
            self._queue_id[name] = len(self.queue_names)
            self.queue_names.append(name)
        return self._queue_id[name]

    def add(self, name: str, category: str, rank: int, iteration: int, queue: str | None,
            duration: float, gap: float = 0.0, preds: list[int] | None = None) -> int:
        """Add a node; on a queue it also waits for the previous node of that queue."""
        node = len(self.names)
        deps = list(preds or [])
        qid = NO_QUEUE
        if queue is not None:
            qid = self.queue_id(queue)
            last = self._queue_last.get(qid)
            if last is not None and last not in deps:
                deps.append(last)
            self._queue_last[qid] = node
            self._queue_first.setdefault(qid, node)
        self.names.append(name)
        self.category.append(category)
        self.rank.append(rank)
        self.iteration.append(iteration)
        self.queue.append(qid)
        self.duration.append(max(float(duration), 0.0))
        self.gap.append(max(float(gap), 0.0))
        self.preds.append(deps)
        return node

    def wait_on_queue(self, queue: str, node: int) -> None:
        """Make ``node`` (already added) wait for the last node on ``queue`` and take its place there: a node on
        several queues (a transfer on every server holding a parameter-server key)."""
        last = self._queue_last.get(self.queue_id(queue))
        if last is not None and last != node and last not in self.preds[node]:
            self.preds[node].append(last)
        self.occupy(queue, node)

    def share_links(self, node: int, connection: str, links: tuple[str, ...]) -> None:
        """Make ``node`` (already added; its duration: its time with the links to itself) a message on
        ``connection`` over ``links``, shared with the other connections crossing them (``Flows``)."""
        self._flows.append((node, connection, tuple(links)))

    def take_share(self, node: int, link: str) -> None:
        """Make ``node`` (already added; not a message) take a share of ``link`` while it runs, at its own pace:
        the messages on the link move slower meanwhile (a worker's compute on the CPUs its host's servers use)."""
        self._occupants[node] = link

    def queue_first(self) -> dict[int, int]:
        """Queue id -> the first node added on it."""
        return dict(self._queue_first)

    def queue_last(self) -> dict[int, int]:
        """Queue id -> the node the next op on it would wait for."""
        return dict(self._queue_last)

    def occupy(self, queue: str, node: int) -> None:
        """Make ``node`` the op the next op on ``queue`` waits for (a collective's transfer)."""
        self._queue_last[self.queue_id(queue)] = node

    def build(self) -> Graph:
        counts = np.fromiter((len(p) for p in self.preds), dtype=np.int64, count=len(self.preds))
        ptr = np.zeros(len(self.preds) + 1, dtype=np.int64)
        np.cumsum(counts, out=ptr[1:])
        idx = np.fromiter((d for p in self.preds for d in p), dtype=np.int64, count=int(ptr[-1]))
        return Graph(
            names=self.names, rank=np.asarray(self.rank, dtype=np.int32),
            iteration=np.asarray(self.iteration, dtype=np.int32), queue=np.asarray(self.queue, dtype=np.int32),
            duration=np.asarray(self.duration, dtype=np.float64), gap=np.asarray(self.gap, dtype=np.float64),
            pred_ptr=ptr, pred_idx=idx, category=self.category, queue_names=self.queue_names,
            step_end=dict(self.step_end), flows=self._frozen_flows(),
        )

    def _frozen_flows(self) -> Flows | None:
        if not self._flows:
            return None
        connections: dict[str, int] = {}
        links: dict[str, int] = {}
        per_node = tuple(tuple(links.setdefault(x, len(links)) for x in ls) for _, _, ls in self._flows)
        occupants = {node: links[link] for node, link in self._occupants.items() if link in links}
        return Flows(nodes=np.array([n for n, _, _ in self._flows], dtype=np.int64),
                     connection=np.array([connections.setdefault(c, len(connections)) for _, c, _ in self._flows],
                                         dtype=np.int64),
                     links=per_node, link_names=tuple(links),
                     capacity=tuple(float(self.link_capacity.get(name, 1.0)) for name in links), occupants=occupants,
                     weight=tuple(float(self.link_weight.get(name, 1.0)) for name in links))
