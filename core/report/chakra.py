"""Chakra execution traces (MLCommons' ET format, what ASTRA-sim reads) of dpro's DAG: one file per rank.

``et_nodes`` turns a ``Graph`` into plain ``EtNode`` lists, one per NPU (framework-neutral, no protobuf):

* every op of a rank (FW, BW, UPDATE, IO, a profiler trace's kernels and host operators, step markers) is a COMP
  node lasting its gap and its duration (the replay starts an op its gap after its predecessors end; Chakra has no
  gap, so the gap is part of the op);
* a collective is one COMM_COLL node per rank (``comm_type``, ``comm_size``, the transfer's calibrated time as its
  duration) where the rank's arrival was; what waited for the shared transfer waits for the rank's own copy; a
  gap before a collective's launch is a COMP node of its own before it;
* a parameter-server collective (one whose COMM names its ``servers``) is a COMM_SEND of each part to its server and
  a COMM_RECV of the answer on the worker; each server is an NPU after the workers, whose trace receives every
  worker's part, works (a COMP node lasting the recorded transfer) and sends the answers, one key after another;
* every dependency of dpro's DAG is a ``data_deps`` entry (ASTRA-sim's feeder resolves data dependencies, and
  Chakra's own converter folds control dependencies into them); ``ctrl_deps`` stays empty. Ids are a
  topological order, so a dependency always names an earlier node of the same file.

``write_chakra`` encodes them with Chakra's schema (``chakra.schema.protobuf.et_def_pb2``) and its protolib: a
GlobalMetadata message, then varint-length-prefixed Node messages. mlc-chakra is an optional dependency, imported
here only.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpro import __version__
from dpro.dag.graph import Graph
from dpro.dag.levels import plan_levels
from dpro.errors import GraphError, UsageError
from dpro.record.trace import write_bytes_atomic

if TYPE_CHECKING:
    from dpro.dag.step_model import StepModel

try:  # mlc-chakra: an optional dependency (pip install --no-deps mlc-chakra protobuf)
    from chakra.schema.protobuf import et_def_pb2 as _pb
    from chakra.src.third_party.utils import protolib as _protolib
except ImportError as _err:  # the rest of dpro works without it
    _pb = _protolib = None
    _CHAKRA_MISSING = str(_err)
else:
    _CHAKRA_MISSING = ""

__all__ = [
    "COMM_TYPES",
    "CommInfo",
    "EtNode",
    "comm_info_of_model",
    "comm_type",
    "et_nodes",
    "read_chakra",
    "write_chakra",
]

SCHEMA = "1.0.2-chakra.1.0.0"  # the ET schema version mlc-chakra 1.0.0 writes
COMM_CATEGORIES = ("COMM", "NCCL")
# a collective's operation, lower case without "_" -> Chakra's CollectiveCommType name
COMM_TYPES = {"allreduce": "ALL_REDUCE", "reduce": "REDUCE", "allgather": "ALL_GATHER", "gather": "GATHER",
              "scatter": "SCATTER", "broadcast": "BROADCAST", "alltoall": "ALL_TO_ALL",
              "reducescatter": "REDUCE_SCATTER", "barrier": "BARRIER", "pushpull": "ALL_REDUCE"}


@dataclass(frozen=True)
class CommInfo:
    """What a collective moves: its operation, bytes, and for a parameter server the servers holding its parts."""

    op: str = "allreduce"
    nbytes: int = 0
    servers: tuple[int, ...] = ()
    part_bytes: tuple[int, ...] = ()


@dataclass(eq=False)
class EtNode:
    """One Chakra node before encoding. ``kind``: COMP, COMM_COLL, COMM_SEND or COMM_RECV."""

    id: int
    name: str
    kind: str
    duration_us: float
    data_deps: list[int] = field(default_factory=list)
    is_cpu_op: bool = False
    comm_type: str = ""      # COMM_COLL: a CollectiveCommType name
    comm_size: int = 0       # COMM_*: bytes
    peer: int = -1           # COMM_SEND: the destination NPU, COMM_RECV: the source NPU
    tag: int = 0             # COMM_SEND/RECV: pairs a send with its receive
    category: str = ""       # dpro's category of the op it came from
    iteration: int = 0


def comm_info_of_model(model: StepModel) -> dict[str, CommInfo]:
    """Each collective of a step model (by op name) with what its COMM events say it moves."""
    out: dict[str, CommInfo] = {}
    for ops in model.ops.values():
        for op in ops:
            if op.category != "COMM" or op.name in out:
                continue
            args = op.args
            servers = args.get("servers") if isinstance(args.get("servers"), list) else []
            parts = args.get("part_bytes") if isinstance(args.get("part_bytes"), list) else []
            nbytes = int(args.get("bytes") or 0) if isinstance(args.get("bytes"), (int, float)) else 0
            if len(parts) != len(servers):
                parts = [nbytes // max(len(servers), 1)] * len(servers)
            out[op.name] = CommInfo(op=str(args.get("op") or "allreduce"), nbytes=nbytes,
                                    servers=tuple(int(s) for s in servers), part_bytes=tuple(int(b) for b in parts))
    return out


def comm_type(op: str) -> str:
    """Chakra's CollectiveCommType name of a collective's operation (all-reduce when the name says nothing)."""
    key = op.lower().replace("_", "").replace("-", "")
    # the longest name first: reduce_scatter is no reduce
    return next((COMM_TYPES[k] for k in sorted(COMM_TYPES, key=len, reverse=True) if key.startswith(k)), "ALL_REDUCE")


@dataclass
class _Builder:
    """ET nodes under construction: per NPU, in creation order; ids are given once they are sorted."""

    nodes: dict[int, list[EtNode]] = field(default_factory=lambda: defaultdict(list))

    def add(self, npu: int, node: EtNode) -> EtNode:
        self.nodes[npu].append(node)
        return node


def _topological(nodes: list[EtNode], where: str) -> list[EtNode]:
    """``nodes`` renumbered 0.. in a topological order of their ``data_deps`` (object ids until then)."""
    by_key = {id(n): n for n in nodes}
    indeg = {id(n): len(n.data_deps) for n in nodes}
    succ: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        for d in n.data_deps:
            if d not in by_key:
                raise GraphError(f"{where}: node {n.name} depends on a node of another NPU")
            succ[d].append(id(n))
    ready = [id(n) for n in nodes if indeg[id(n)] == 0]
    ready.reverse()
    order: list[EtNode] = []
    while ready:
        k = ready.pop()
        order.append(by_key[k])
        for c in reversed(succ[k]):
            indeg[c] -= 1
            if indeg[c] == 0:
                ready.append(c)
    if len(order) != len(nodes):
        raise GraphError(f"{where}: the dependencies make a cycle")
    new_id = {id(n): i for i, n in enumerate(order)}
    for n in order:
        n.data_deps = sorted({new_id[d] for d in n.data_deps})
    for i, n in enumerate(order):
        n.id = i
    return order


def et_nodes(g: Graph, comms: dict[str, CommInfo] | None = None,
             node_comms: dict[int, CommInfo] | None = None) -> dict[int, list[EtNode]]:
    """The ET nodes of every NPU (workers by rank, then a parameter server's servers) of ``g``.

    Args:
        comms: collectives by op name (a run's step model: ``comm_info_of_model``).
        node_comms: collectives by node id (a profiler trace's graph: ``KinetoGraphInfo.comm``); wins over ``comms``.

    Raises:
        GraphError: the nodes of one NPU would wait for each other in a cycle (a bug: dpro's DAG has none).
    """
    comms, node_comms = comms or {}, node_comms or {}
    order = np.concatenate(plan_levels(g).nodes) if g.size else np.zeros(0, dtype=np.int64)
    workers = sorted({int(r) for r in g.rank if r >= 0})

    def info(n: int) -> CommInfo:
        return node_comms.get(n) or comms.get(g.names[n]) or CommInfo()

    arrival_of, transfer_of = _shared_transfers(g)
    servers = sorted({s for n in transfer_of for s in info(n).servers})
    server_npu = {s: workers[-1] + 1 + i for i, s in enumerate(servers)} if workers else {}

    b = _Builder()
    entry: dict[int, list[EtNode]] = {}  # dpro node -> the ET nodes that take its dependencies
    launch: dict[int, list[EtNode]] = {}  # a collective's arrival -> its ET nodes after the launch gap
    arrived: dict[int, list[EtNode]] = {}  # a collective's arrival -> the ET nodes whose end is its launch
    exit_: dict[int, list[EtNode]] = {}  # dpro node -> the ET nodes its dependents wait for
    tags = iter(range(0, 2**31 - 1, 2))
    for n in map(int, order):
        rank, cat, it = int(g.rank[n]), g.category[n], int(g.iteration[n])
        if rank < 0:
            continue
        cpu = "/host" in (g.queue_names[g.queue[n]] if g.queue[n] >= 0 else "")
        if cat in COMM_CATEGORIES:
            t = transfer_of.get(n)
            c = info(n)
            length = float(g.duration[t]) if t is not None else float(g.duration[n])
            first: list[EtNode] = []
            if g.gap[n] >= 0.5:
                first = [b.add(rank, EtNode(0, f"{g.names[n]} (launch gap)", "COMP", float(g.gap[n]),
                                            is_cpu_op=True, category=cat, iteration=it))]
            if c.servers and t is not None:
                sends, recvs = [], []
                for s, part in zip(c.servers, c.part_bytes, strict=True):
                    tag = next(tags)
                    deps = [id(x) for x in first]
                    sends.append(b.add(rank, EtNode(0, f"{g.names[n]}.push", "COMM_SEND", 0.0, deps,
                                                    comm_size=part, peer=server_npu[s], tag=tag, category=cat,
                                                    iteration=it)))
                    recvs.append(b.add(rank, EtNode(0, f"{g.names[n]}.pull", "COMM_RECV", 0.0,
                                                    [id(sends[-1])], comm_size=part, peer=server_npu[s],
                                                    tag=tag + 1, category=cat, iteration=it)))
                entry[n], launch[n], exit_[n] = (first or sends), sends, recvs
                arrived[n] = first
                continue
            coll = b.add(rank, EtNode(0, g.names[n], "COMM_COLL", length, [id(x) for x in first],
                                      comm_type=comm_type(c.op), comm_size=c.nbytes, category=cat, iteration=it))
            entry[n], launch[n], exit_[n] = (first or [coll]), [coll], [coll]
            if t is not None:
                arrived[n] = first
        else:
            node = b.add(rank, EtNode(0, g.names[n], "COMP", float(g.gap[n] + g.duration[n]), is_cpu_op=cpu,
                                      category=cat, iteration=it))
            entry[n] = exit_[n] = [node]

    resolved: dict[tuple[int, int], list[EtNode]] = {}

    def on_rank(p: int, rank: int) -> list[EtNode]:
        """What a node of ``rank`` waits for when it waits for ``p``: p's ET nodes on that rank, a shared
        transfer's copy on that rank, or what a transfer without a copy there waited for on it."""
        if g.rank[p] == rank:  # an arrival itself (a launch after it, not after its transfer): its launch moment
            return arrived[p] if p in arrived else exit_.get(p, [])
        if g.rank[p] >= 0:
            return []  # another rank's op: the collective between them carries the wait
        key = (p, rank)
        if key not in resolved:
            a = arrival_of.get(p, {}).get(rank)
            if a is not None:
                resolved[key] = exit_[a]
            else:
                resolved[key] = [x for q in g.preds(p) for x in on_rank(int(q), rank)]
        return resolved[key]

    for n in map(int, order):
        rank = int(g.rank[n])
        if rank < 0 or n not in entry:
            continue
        deps = [x for p in g.preds(n) for x in on_rank(int(p), rank)]
        _add_deps(entry[n], deps)
        if n in arrived and not arrived[n]:
            arrived[n] = list(dict.fromkeys(deps))
        t = transfer_of.get(n)
        if t is not None:  # the collectives its transfer waited for (a background loop's, a server's queue)
            _add_deps(launch[n], [x for q in g.preds(t) if g.rank[q] < 0 for x in on_rank(int(q), rank)
                                  if x not in exit_[n]])

    _server_nodes(g, b, order, arrival_of, info, server_npu, exit_)
    return {npu: _topological(nodes, f"NPU {npu}") for npu, nodes in sorted(b.nodes.items())}


def _add_deps(nodes: list[EtNode], deps: list[EtNode]) -> None:
    for x in nodes:
        x.data_deps = list(dict.fromkeys([*x.data_deps, *(id(d) for d in deps)]))


def _shared_transfers(g: Graph) -> tuple[dict[int, dict[int, int]], dict[int, int]]:
    """The collectives' shared transfers (rank -1) and each rank's arrival into one (a zero-length COMM before it):
    (transfer -> rank -> arrival, arrival -> transfer)."""
    arrival_of: dict[int, dict[int, int]] = defaultdict(dict)
    transfer_of: dict[int, int] = {}
    for n in np.flatnonzero(g.rank < 0):
        for p in map(int, g.preds(int(n))):
            if g.rank[p] >= 0 and g.category[p] in COMM_CATEGORIES and g.duration[p] == 0.0:
                arrival_of[int(n)][int(g.rank[p])] = p
                transfer_of[p] = int(n)
    return arrival_of, transfer_of


def _server_nodes(g: Graph, b: _Builder, order: np.ndarray, arrival_of: dict[int, dict[int, int]],
                  info: Callable[[int], CommInfo], server_npu: dict[int, int],
                  exit_: dict[int, list[EtNode]]) -> None:
    """Each server's trace: per key in its server queue's order (the transfers' creation order), receive every
    worker's part, work, answer."""
    last: dict[int, EtNode] = {}
    for t in sorted(map(int, order)):
        members = arrival_of.get(t)
        if not members:
            continue
        c = info(next(iter(members.values())))
        if not c.servers:
            continue
        for i, s in enumerate(c.servers):
            npu = server_npu[s]
            recvs = []
            for rank, a in sorted(members.items()):
                send = exit_[a][i]  # the worker's answer i pairs with its push i (tag - 1)
                recvs.append(b.add(npu, EtNode(0, f"{g.names[a]}.push", "COMM_RECV", 0.0,
                                               [id(last[npu])] if npu in last else [], comm_size=c.part_bytes[i],
                                               peer=rank, tag=send.tag - 1, category="SERVER",
                                               iteration=int(g.iteration[t]))))
            work = b.add(npu, EtNode(0, f"{g.names[t]}.server{s}", "COMP", float(g.duration[t]),
                                     [id(r) for r in recvs], is_cpu_op=True, category="SERVER",
                                     iteration=int(g.iteration[t])))
            for rank, a in sorted(members.items()):
                answer = exit_[a][i]
                last[npu] = b.add(npu, EtNode(0, f"{g.names[a]}.pull", "COMM_SEND", 0.0, [id(work)],
                                              comm_size=c.part_bytes[i], peer=rank, tag=answer.tag,
                                              category="SERVER", iteration=int(g.iteration[t])))


def _require_chakra() -> None:
    if _pb is None:
        raise UsageError(f"dpro export --format chakra needs MLCommons' Chakra schema ({_CHAKRA_MISSING}): "
                         "pip install --no-deps mlc-chakra protobuf")


def _attr(name: str, **value: object) -> object:
    return _pb.AttributeProto(name=name, **value)


def _message(node: EtNode, npu: int) -> object:
    """``node`` as a Chakra ``Node`` message (ASTRA-sim's attribute names and value kinds)."""
    kinds = {"COMP": _pb.COMP_NODE, "COMM_COLL": _pb.COMM_COLL_NODE, "COMM_SEND": _pb.COMM_SEND_NODE,
             "COMM_RECV": _pb.COMM_RECV_NODE}
    msg = _pb.Node(id=node.id, name=node.name, type=kinds[node.kind], duration_micros=int(round(node.duration_us)))
    msg.data_deps.extend(node.data_deps)
    attrs = [_attr("is_cpu_op", bool_val=node.is_cpu_op)]
    if node.kind == "COMM_COLL":
        attrs += [_attr("comm_type", int64_val=_pb.CollectiveCommType.Value(node.comm_type)),
                  _attr("comm_size", int64_val=node.comm_size)]
    elif node.kind in ("COMM_SEND", "COMM_RECV"):
        src, dst = (npu, node.peer) if node.kind == "COMM_SEND" else (node.peer, npu)
        attrs += [_attr("comm_src", int32_val=src), _attr("comm_dst", int32_val=dst),
                  _attr("comm_size", int64_val=node.comm_size), _attr("comm_tag", int32_val=node.tag)]
    attrs += [_attr("dpro_category", string_val=node.category), _attr("dpro_iteration", int64_val=node.iteration)]
    msg.attr.extend(attrs)
    return msg


def write_chakra(out_dir: str | Path, name: str, npus: dict[int, list[EtNode]],
                 metadata: dict[str, str] | None = None) -> list[Path]:
    """Write ``<out_dir>/<name>.<npu>.et`` for every NPU: GlobalMetadata, then the nodes, each message prefixed
    with its varint length (Chakra's protolib), as ASTRA-sim's ``--workload-configuration=<out_dir>/<name>`` reads.

    Raises:
        UsageError: mlc-chakra is not installed (says how to install it).
    """
    _require_chakra()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    attrs = [_attr("schema", string_val=SCHEMA), _attr("producer", string_val=f"dpro {__version__}"),
             _attr("npus", int64_val=len(npus))]
    attrs += [_attr(k, string_val=v) for k, v in sorted((metadata or {}).items())]
    written = []
    for npu, nodes in sorted(npus.items()):
        buf = io.BytesIO()
        _protolib.encodeMessage(buf, _pb.GlobalMetadata(version=SCHEMA, attr=attrs))
        for node in nodes:
            _protolib.encodeMessage(buf, _message(node, npu))
        written.append(write_bytes_atomic(out / f"{name}.{npu}.et", buf.getvalue()))
    return written


def read_chakra(path: str | Path) -> tuple[object, list[object]]:
    """An ET file read back with Chakra's own reader (protolib): (GlobalMetadata, [Node, ...]).

    Raises:
        UsageError: the file is missing or holds no GlobalMetadata; mlc-chakra is not installed.
    """
    _require_chakra()
    if not Path(path).is_file():  # protolib's opener exits the process on a file it cannot open
        raise UsageError(f"{path}: no such Chakra execution trace")
    with _protolib.openFileRd(str(path)) as f:
        meta = _pb.GlobalMetadata()
        if not _protolib.decodeMessage(f, meta):
            raise UsageError(f"{path}: no GlobalMetadata message: not a Chakra execution trace")
        nodes = []
        while True:
            node = _pb.Node()
            if not _protolib.decodeMessage(f, node):
                break
            nodes.append(node)
    return meta, nodes
