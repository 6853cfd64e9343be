"""Stage 3, wiring: a step model (``dpro.dag.step_model``) as a ``Graph`` of consecutive iterations, within each
rank (program order, forward -> backward -> collectives -> update) and across ranks (a collective's arrivals, then
one transfer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpro.dag.graph import Graph, GraphBuilder

if TYPE_CHECKING:
    from dpro.dag.step_model import OpStats, StepModel

__all__ = ["COMPUTE_CATEGORIES", "graph_from_step_sequence", "graph_from_steps"]


SPLIT_MIN_US = 20.0  # a gradient ready less than this before its op ends is ready at the end (timer noise)


def _ready_splits(op: OpStats) -> list[tuple[float, list[str]]]:
    """Where a backward op's gradients are ready (µs into the op) when clearly before its end: the points to split
    it at, each with the gradients ready there, in order; empty when every gradient is ready at the end."""
    offsets = op.args.get("grads_ready_offset_us")
    if not isinstance(offsets, dict):
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
    mean step; a sequence of single recorded steps replays the steps as they varied)."""
    b = GraphBuilder()
    ranks = sorted(models[0].ops)
    prev_end: dict[int, int | None] = dict.fromkeys(ranks)
    for it, model in enumerate(models):
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
                queue = f"r{rank}/{op.queue}"
                if queue in queue_last:
                    deps.append(queue_last[queue])
                deps = list(dict.fromkeys(deps))
                ready = max((measured_end[d] for d in deps if d in measured_end), default=0.0)
                if op.gap is None:
                    op.gap = max(0.0, op.order - ready)
                gap = op.gap
                if op.category == "COMM" and op.name in model.exchanges:
                    arrival = b.add(op.name, "COMM", rank, it, queue, 0.0, gap, deps)
                    node = b.add(f"{op.name}.done", "XFER", rank, it, None, 0.0)  # its answers: wired below
                    exchanged.setdefault(op.name, {})[rank] = (arrival, node)
                    queue_last[queue] = arrival
                    measured_end[arrival] = op.order
                elif op.category == "COMM" and op.name in model.transfer:
                    arrival = b.add(op.name, "COMM", rank, it, queue, 0.0, gap, deps)
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
                elif op.category == "BW" and _ready_splits(op):
                    # gradients ready part-way through the op: a collective waits for the part before its gradient
                    done, node = 0.0, None
                    for at, grads in _ready_splits(op):
                        node = b.add(op.name if node is None else f"{op.name}.rest", op.category, rank, it, queue,
                                     at - done, gap if node is None else 0.0, deps if node is None else [node])
                        measured_end[node] = op.order + at
                        for g in grads:
                            grad_node[g] = node
                        done = at
                    node = b.add(f"{op.name}.rest", op.category, rank, it, queue, op.duration - done, 0.0, [node])
                    queue_last[queue] = node
                else:
                    node = b.add(op.name, op.category, rank, it, queue, op.duration, gap, deps)
                    queue_last[queue] = node
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
                    if not _ready_splits(op):  # a split op registered its ready parts above
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
    _share_cpus(b, models[-1])
    return b.build()


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
