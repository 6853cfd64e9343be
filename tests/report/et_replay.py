"""A tiny replay of Chakra execution traces read back with Chakra's reader, for the tests: every node starts when its
data dependencies are done; a COMM_COLL starts when every NPU's copy is ready (copies matched by name, iteration and
occurrence) and lasts its ``duration_micros``; a COMM_RECV ends when its COMM_SEND (same source, destination and tag)
is done. It is what ASTRA-sim would compute with a network that takes the recorded times, no more."""

from __future__ import annotations

from collections import defaultdict


def attrs_of(node) -> dict:
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}


def replay_et(files: dict[int, list]) -> dict[int, dict[int, float]]:
    """End time (µs) of every node of every NPU: {npu: {node id: end}}."""
    end: dict[int, dict[int, float]] = {npu: {} for npu in files}
    coll_key: dict[tuple[int, int], tuple] = {}
    members: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    seen: dict[tuple[int, str, int], int] = defaultdict(int)
    by_id = {npu: {n.id: n for n in nodes} for npu, nodes in files.items()}
    for npu, nodes in files.items():
        for n in sorted(nodes, key=lambda n: n.id):
            if n.type == 7:  # COMM_COLL_NODE
                it = attrs_of(n).get("dpro_iteration", 0)
                k = (n.name, it, seen[(npu, n.name, it)])
                seen[(npu, n.name, it)] += 1
                coll_key[(npu, n.id)] = k
                members[k].append((npu, n.id))
    sends: dict[tuple[int, int, int], float] = {}
    pending = {npu: sorted(by_id[npu]) for npu in files}
    progress = True
    while progress:
        progress = False
        for npu in files:
            rest = []
            for nid in pending[npu]:
                n = by_id[npu][nid]
                if any(d not in end[npu] for d in n.data_deps):
                    rest.append(nid)
                    continue
                ready = max((end[npu][d] for d in n.data_deps), default=0.0)
                a = attrs_of(n)
                if n.type == 7:
                    group = members[coll_key[(npu, nid)]]
                    readies = []
                    for m_npu, m_id in group:
                        m = by_id[m_npu][m_id]
                        if any(d not in end[m_npu] for d in m.data_deps):
                            break
                        readies.append(max((end[m_npu][d] for d in m.data_deps), default=0.0))
                    else:
                        t = max(readies) + n.duration_micros
                        for m_npu, m_id in group:
                            end[m_npu][m_id] = t
                        progress = True
                        continue
                    rest.append(nid)
                elif n.type == 5:  # SEND
                    end[npu][nid] = ready + n.duration_micros
                    sends[(a["comm_src"], a["comm_dst"], a["comm_tag"])] = end[npu][nid]
                    progress = True
                elif n.type == 6:  # RECV
                    key = (a["comm_src"], a["comm_dst"], a["comm_tag"])
                    if key in sends:
                        end[npu][nid] = max(ready, sends[key]) + n.duration_micros
                        progress = True
                    else:
                        rest.append(nid)
                else:
                    end[npu][nid] = ready + n.duration_micros
                    progress = True
            pending[npu] = [x for x in rest if x not in end[npu]]
    left = {npu: ids for npu, ids in pending.items() if ids}
    assert not left, f"nodes never ran (a collective or message without its peer): {left}"
    return end
