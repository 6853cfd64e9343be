"""Stage 3, wiring: a step model (``dpro.dag.step_model``) as a ``Graph`` of consecutive iterations, within each
rank (program order, forward -> backward -> collectives -> update) and across ranks (a collective's arrivals, then
one transfer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dpro.dag.graph import NO_QUEUE, Graph, GraphBuilder

if TYPE_CHECKING:
    from dpro.dag.step_model import OpStats, StepModel

__all__ = ["COMPUTE_CATEGORIES", "WiredStep", "graph_from_step_sequence", "graph_from_steps", "graph_of_wired",
           "stitch", "wire_once"]


SPLIT_MIN_US = 20.0  # a gradient ready less than this before its op ends is ready at the end (timer noise)


def _ready_splits(op: OpStats) -> list[tuple[float, list[str]]]:
    """Where a backward op's gradients are ready (µs into the op) when clearly before its end: the points to split
    it at, each with the gradients ready there, in order; empty when every gradient is ready at the end."""
    offsets = op.args.get("grads_ready_offset_us")
    if not offsets or not isinstance(offsets, dict):
        return []
    points: list[tuple[float, list[str]]] = []
    for grad, offset in sorted(offsets.items(), key=lambda kv: kv[1]):
        at = min(max(0.0, offset), op.duration)
        if op.duration - at <= SPLIT_MIN_US:
            break  # this one and the later ones are ready at the op's end
        if points and at - points[-1][0] <= SPLIT_MIN_US:
            points[-1][1].append(grad)
        else:
            points.append((at, [grad]))
    return points


def graph_from_steps(model: StepModel, iterations: int = 3) -> Graph:
    """Wire ``iterations`` consecutive copies of the mean step into one DAG.

    Within a rank: program order on each queue; FW -> next FW; last FW -> first BW; a COMM group
    waits for the BW ops that produced its gradients (a collective carrying no gradients, e.g. a loss or
    metric reduction, for the op before it in program order, or on an engine that chains its collectives for
    the collective before it); UPDATE waits for the last BW and the COMMs that carry gradients;
    the step ends after UPDATE; the next iteration's first op waits for the step end.
    Across ranks: COMM ops of the same name are one collective (arrivals, then one transfer).
    Each op's gap is its measured start minus the measured end of the last of its predecessors; ops
    without a gap get it filled in here (so a transformed copy of ``model`` keeps the measured gaps).
    """
    return graph_from_step_sequence([model] * iterations)


def graph_from_step_sequence(models: list[StepModel]) -> Graph:
    """Wire one iteration per model, each after the one before it on every rank (``graph_from_steps`` repeats one
    mean step; a sequence of single recorded steps replays the steps as they varied).

    Where the models allow it (``_stitchable``), each distinct model is wired once and its copies are joined by
    ``stitch``: the same graph, without wiring a thousand ranks' ops in Python once per iteration."""
    ranks = sorted(models[0].ops)
    if _stitchable(models):
        wired: dict[int, WiredStep] = {}
        for model in models:
            if id(model) not in wired:
                wired[id(model)] = wire_once(model, ranks)
        return stitch([wired[id(model)] for model in models])
    b = GraphBuilder()
    prev_end: dict[int, int | None] = dict.fromkeys(ranks)
    for it, model in enumerate(models):
        _wire_iteration(b, model, it, ranks, prev_end, {})
    _share_cpus(b, models[-1])
    return b.build()


@dataclass
class WiredStep:
    """One iteration of a step model wired alone (``wire_once``), with what ``stitch`` needs to chain copies of it:
    each rank's first op node (it waits for the previous iteration's step end), and per queue its first node (it
    waits for the previous iteration's last node there) and its last (what the next iteration's first waits for)."""

    graph: Graph
    first_op: dict[int, int]
    queue_first: dict[int, int]
    queue_last: dict[int, int]


def graph_of_wired(model: StepModel, wired: WiredStep, iterations: int) -> Graph:
    """``graph_from_steps(model, iterations)`` from ``wired``, ``model`` wired once (``wire_once``)."""
    if _stitchable([model]):
        return stitch([wired] * iterations)
    return graph_from_steps(model, iterations)


def _stitchable(models: list[StepModel]) -> bool:
    """Whether ``stitch`` gives the graph ``_wire_iteration`` would: no transfer on a server's queue or exchange (a
    queue shared across ranks carries over between iterations in ways the seams do not hold), and every model first
    met after the first iteration already wired once (its gaps measured without a previous iteration)."""
    seen: set[int] = set()
    for i, model in enumerate(models):
        if model.exchanges or model.transfer_queues:
            return False
        if i and id(model) not in seen and (any(op.gap is None for ops in model.ops.values() for op in ops)
                                            or any(r not in model.tail_us for r in model.ops)):
            return False
        seen.add(id(model))
    return True


def wire_once(model: StepModel, ranks: list[int] | None = None) -> WiredStep:
    """One iteration of ``model`` wired alone (and its gaps and tails filled in, as ``graph_from_steps`` does)."""
    ranks = sorted(model.ops) if ranks is None else ranks
    b = GraphBuilder()
    first_op: dict[int, int] = {}
    _wire_iteration(b, model, 0, ranks, dict.fromkeys(ranks), first_op)
    _share_cpus(b, model)
    return WiredStep(b.build(), first_op, b.queue_first(), b.queue_last())


def stitch(parts: list[WiredStep]) -> Graph:
    """The graph of the iterations ``parts`` one after another: each part's nodes after the previous part's (its
    iteration number its place), each rank's first op waiting first for its previous step end, and each queue's first
    node last for the previous iteration's last node on that queue (unless it waits for it already), as
    ``GraphBuilder`` chains iterations wired in one go."""
    names: list[str] = []
    category: list[str] = []
    queue_names: list[str] = []
    queue_ids: dict[str, int] = {}
    arrays: dict[str, list[np.ndarray]] = {k: [] for k in ("rank", "iteration", "queue", "duration", "gap")}
    counts_parts: list[np.ndarray] = []
    idx_parts: list[np.ndarray] = []
    step_end: dict[tuple[int, int], int] = {}
    last_on: dict[int, int] = {}      # global queue -> its last node so far
    prev_end: dict[int, int] = {}     # rank -> its last step end so far
    offset = 0
    for it, part in enumerate(parts):
        g = part.graph
        qmap = np.array([queue_ids.setdefault(q, len(queue_ids)) for q in g.queue_names] + [NO_QUEUE],
                        dtype=np.int32)
        queue_names.extend(list(queue_ids)[len(queue_names):])
        names.extend(g.names)
        category.extend(g.category)
        arrays["rank"].append(g.rank)
        arrays["iteration"].append(np.full(g.size, it, dtype=np.int32))
        arrays["queue"].append(qmap[g.queue])  # NO_QUEUE (-1) indexes the last entry, NO_QUEUE
        arrays["duration"].append(g.duration)
        arrays["gap"].append(g.gap)
        counts = np.diff(g.pred_ptr)
        idx = g.pred_idx + offset
        changed: dict[int, list[int]] = {}
        if it:
            for rank, node in part.first_op.items():
                if rank in prev_end:
                    changed[node] = [prev_end[rank], *(idx[g.pred_ptr[node]:g.pred_ptr[node + 1]].tolist())]
            for q, node in part.queue_first.items():
                last = last_on.get(int(qmap[q]))
                if last is not None:
                    deps = changed.get(node)
                    if deps is None:
                        deps = changed[node] = idx[g.pred_ptr[node]:g.pred_ptr[node + 1]].tolist()
                    if last not in deps:
                        deps.append(last)
        if changed:
            counts, idx = _with_rows(g.pred_ptr, counts, idx, changed)
        counts_parts.append(counts)
        idx_parts.append(idx)
        for (rank, _), node in g.step_end.items():
            step_end[(rank, it)] = offset + node
            prev_end[rank] = offset + node
        for q, node in part.queue_last.items():
            last_on[int(qmap[q])] = offset + node
        offset += g.size
    counts = np.concatenate(counts_parts) if counts_parts else np.zeros(0, dtype=np.int64)
    ptr = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return Graph(
        names=names, rank=_joined(arrays["rank"], np.int32), iteration=_joined(arrays["iteration"], np.int32),
        queue=_joined(arrays["queue"], np.int32), duration=_joined(arrays["duration"], np.float64),
        gap=_joined(arrays["gap"], np.float64), pred_ptr=ptr,
        pred_idx=_joined(idx_parts, np.int64), category=category, queue_names=queue_names, step_end=step_end,
    )


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _with_rows(ptr: np.ndarray, counts: np.ndarray, idx: np.ndarray,
               rows: dict[int, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """CSR rows ``rows`` (node -> its predecessors) replaced, the others kept."""
    counts = counts.copy()
    pieces: list[np.ndarray] = []
    at = 0
    for node in sorted(rows):
        pieces.append(idx[at:ptr[node]])
        pieces.append(np.asarray(rows[node], dtype=np.int64))
        counts[node] = len(rows[node])
        at = int(ptr[node + 1])
    pieces.append(idx[at:])
    return counts, np.concatenate(pieces)


def _wire_iteration(b: GraphBuilder, model: StepModel, it: int, ranks: list[int], prev_end: dict[int, int | None],
                    first_op: dict[int, int]) -> None:
    """Iteration ``it`` of ``model`` into ``b``, after ``prev_end`` (rank -> its previous step end, updated); the node
    of each rank's first op into ``first_op``."""
    transfers: dict[str, int] = {}
    previous_transfer: int | None = None
    exchanged: dict[str, dict[int, tuple[int, int]]] = {}  # exchange -> rank -> (arrival, done) nodes
    for rank in ranks:
        last: dict[str, int] = {}
        queue_last: dict[str, int] = {}
        busy_until: dict[str, float] = {}  # queue -> the latest measured end of its ops so far (µs)
        measured_end: dict[int, float] = {}   # node -> its measured end in this rank's step (µs)
        if prev_end[rank] is not None:
            measured_end[prev_end[rank]] = 0.0
        grad_node: dict[str, int] = {}
        own_end: dict[int, float] = {}  # collective node -> its measured end on this rank (µs into the step)
        bw_nodes: list[int] = []
        comm_done: list[int] = []
        grad_comm_done: list[int] = []  # the collectives that carry gradients (the optimizer needs those)
        last_work: int | None = None  # the last compute/IO/update node in program order
        last_transfer: int | None = None  # the transfer of this rank's previous collective
        for i, op in enumerate(model.ops[rank]):
            deps: list[int] = []
            head: int | None = None  # the node that takes ``deps``
            if i == 0 and prev_end[rank] is not None:
                deps.append(prev_end[rank])
            if op.category in ("FW", "BW") and "FW" in last:
                deps.append(last["FW"])
            if op.category == "FW" and "IO" in last:
                deps.append(last["IO"])
            if op.category == "COMM":
                deps += [grad_node[g] for g in op.args.get("tensors", []) if g in grad_node]
                if not op.args.get("tensors") and last_work is not None and not (
                        model.chained_launch and last_transfer is not None):
                    # carries no gradient: the program launched it after that work (on an engine that chains
                    # its collectives, after the collective before it, whatever the compute queue does)
                    deps.append(last_work)
                elif (not deps or model.comm_after_backward) and bw_nodes:
                    deps.append(bw_nodes[-1])  # (an engine that reduces only after the whole backward)
            if op.category == "UPDATE":
                # the gradients' collectives; a reduction of the step's outputs (loss, metrics) is no input of
                # the update (a source that names no collective's tensors: every collective). A collective
                # that, as measured on this rank, was still running when the update started is no input of its
                # start (TensorFlow applies each variable once its own gradient is reduced): the step's end
                # waits for it instead
                deps += bw_nodes[-1:] + [c for c in (grad_comm_done or comm_done)
                                         if own_end[c] <= op.order]
            if op.category == "COMM" and model.chained_launch and last_transfer is not None:
                deps.append(last_transfer)
            splits = _ready_splits(op) if op.category == "BW" else []
            queue = f"r{rank}/{op.queue}"
            if queue in queue_last:
                deps.append(queue_last[queue])
            deps = list(dict.fromkeys(deps))
            if op.gap is None:
                ready = max((measured_end[d] for d in deps if d in measured_end), default=0.0)
                op.gap = max(0.0, op.order - ready)
            gap = op.gap
            if op.category == "COMM" and op.name in model.exchanges:
                arrival = b.add(op.name, "COMM", rank, it, queue, 0.0, gap, deps)
                head = arrival
                node = b.add(f"{op.name}.done", "XFER", rank, it, None, 0.0)  # its answers: wired below
                exchanged.setdefault(op.name, {})[rank] = (arrival, node)
                queue_last[queue] = arrival
                measured_end[arrival] = op.order
            elif op.category == "COMM" and op.name in model.transfer:
                arrival = b.add(op.name, "COMM", rank, it, queue, 0.0, gap, deps)
                head = arrival
                if op.name not in transfers:
                    transfers[op.name] = b.add(f"{op.name}.transfer", "XFER", -1, it, None,
                                               model.transfer[op.name])
                    servers = model.transfer_queues.get(op.name, ())
                    for server in servers:  # one request after another on each server holding it
                        b.wait_on_queue(server, transfers[op.name])
                    if not servers:
                        if model.async_launch and previous_transfer is not None:
                            b.preds[transfers[op.name]].append(previous_transfer)
                        previous_transfer = transfers[op.name]
                node = transfers[op.name]
                last_transfer = node
                b.preds[node].append(arrival)
                if model.async_launch:
                    queue_last[queue] = arrival  # the next launch follows this one, not its transfer
                    measured_end[arrival] = op.order
                else:
                    b.occupy(queue, node)  # the rank's comm queue is busy until the transfer ends
                    queue_last[queue] = node
                late = model.done_after.get(op.name, {}).get(rank, 0.0)
                if late > 0:
                    node = b.add(f"{op.name}.done", "XFER", rank, it, None, late, 0.0, [node])
            elif splits:
                # gradients ready part-way through the op: a collective waits for the part before its gradient
                done, node = 0.0, None
                for at, grads in splits:
                    node = b.add(op.name if node is None else f"{op.name}.rest", op.category, rank, it, queue,
                                 at - done, gap if node is None else 0.0, deps if node is None else [node])
                    head = node if head is None else head
                    measured_end[node] = op.order + at
                    for g in grads:
                        grad_node[g] = node
                    done = at
                node = b.add(f"{op.name}.rest", op.category, rank, it, queue, op.duration - done, 0.0, [node])
                queue_last[queue] = node
            else:
                node = b.add(op.name, op.category, rank, it, queue, op.duration, gap, deps)
                head = node
                queue_last[queue] = node
            if i == 0 and head is not None:
                first_op[rank] = head
            if op.category == "COMM":
                measured_end[node] = model.transfer_end.get(op.name, op.order + op.duration)
            else:
                # means of starts and durations can overlap on a queue: an op's queue is busy until the
                # latest end so far, so the op after it measures its gap from there, not from an earlier end
                measured_end[node] = max(op.order + op.duration, busy_until.get(queue, float("-inf")))
                busy_until[queue] = measured_end[node]
            if op.category == "COMM":
                own_end[node] = op.order + op.duration
                comm_done.append(node)
                if op.args.get("tensors"):
                    grad_comm_done.append(node)
            elif op.category != "STEP":
                last_work = node
            last[op.category] = node
            if op.category == "BW":
                bw_nodes.append(node)
                if not splits:  # a split op registered its ready parts above
                    for g in op.args.get("grads", []):
                        # the latest pass so far: under gradient accumulation a collective after the last
                        # backward waits for that pass's gradients, not the first micro-batch's
                        grad_node[g] = node
        ends = [last[c] for c in ("UPDATE", "BW") if c in last] + comm_done
        if rank not in model.tail_us:
            # like any op's gap: the mean step's end after the mean end of what it waits for (a mean of each
            # step's tail after its own last op would add up to a shorter step whenever the last op varies)
            ready = max((measured_end[d] for d in ends if d in measured_end), default=0.0)
            model.tail_us[rank] = max(0.0, model.step_us_by_rank.get(rank, ready) - ready)
        step_end = b.add("STEP.end", "STEP", rank, it, f"r{rank}/host", 0.0, model.tail_us[rank], ends)
        b.step_end[(rank, it)] = step_end
        prev_end[rank] = step_end
    _wire_exchanges(b, model, exchanged, it)


COMPUTE_CATEGORIES = ("FW", "BW", "UPDATE", "IO")  # what a worker computes on its host's CPUs


def _share_cpus(b: GraphBuilder, model: StepModel) -> None:
    """The hosts' CPUs of an exchange model (a what-if repeats one model): their lanes, what one server's work takes
    of them, and every compute node taking a share of its rank's host while it runs."""
    if not model.exchanges:
        return
    b.link_capacity.update(model.link_capacity)
    b.link_weight.update(model.link_weight)
    for node, (rank, category) in enumerate(zip(b.rank, b.category, strict=True)):
        if category in COMPUTE_CATEGORIES and rank in model.compute_links:
            b.take_share(node, model.compute_links[rank])


def _wire_exchanges(b: GraphBuilder, model: StepModel, exchanged: dict[str, dict[int, tuple[int, int]]],
                    it: int) -> None:
    """The pushes, server work and answers of the iteration's exchanges, each phase key by key in launch order
    (the order the servers take their work in). Pushes and answers that cross hosts are messages on their
    connections over shared links (``GraphBuilder.share_links``): the replay times them together."""
    parts = [(name, members, part) for name, members in exchanged.items() for part in model.exchanges[name]]
    pushed = []
    for name, members, part in parts:
        nodes = []
        for rank, (arrival, _) in sorted(members.items()):
            us, links = part.push.get(rank, (0.0, ()))
            node = b.add(f"{name}.push", "XFER", rank, it, None, us, 0.0, [arrival])
            if links:
                b.share_links(node, f"r{rank}->{part.server}", links)
            nodes.append(node)
        pushed.append(nodes)
    served = []
    for (name, _, part), pushes in zip(parts, pushed, strict=True):
        node = b.add(f"{name}.server", "XFER", -1, it, None, part.server_us, 0.0, pushes)
        if part.server_links:
            b.share_links(node, part.server, part.server_links)
        else:
            b.wait_on_queue(part.server_queue, node)
        served.append(node)
    for (name, members, part), server in zip(parts, served, strict=True):
        for rank, (_, done) in sorted(members.items()):
            us, links = part.pull.get(rank, (0.0, ()))
            node = b.add(f"{name}.pull", "XFER", rank, it, None, us, 0.0, [server])
            if links:
                b.share_links(node, f"{part.server}->r{rank}", links)
            b.preds[done].append(node)
