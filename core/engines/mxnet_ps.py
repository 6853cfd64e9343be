"""The ``mxnet-ps`` engine: MXNet's kvstore parameter server (``dist_sync`` on ps-lite).

How it communicates (MXNet 1.9): ``gluon.Trainer.step`` issues one ``pushpull`` per parameter, key = the
parameter's index in the trainer, priority ``-key``. The engine runs it once the gradient is written: one ps-lite
request carries the gradient to the key's servers, and each server answers once every worker's push of the key has
arrived (with ``update_on_kvstore``, the default on a ``dist`` kvstore, after running the optimizer on it). A key
of fewer than ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements lives on one server, ``(key * 9973) % num_servers``; a
larger one is split evenly over all servers (``key_servers``). A server handles its requests one after another,
so a server holding many or large keys is a hot spot.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpro.config import Knob, _count
from dpro.dag.step_model import ExchangePart
from dpro.engines.base import Engine
from dpro.errors import UsageError
from dpro.io.limits import is_finite_number
from dpro.sim.choices import clears, optimize_common
from dpro.sim.cost import robust_line, scale_to_reach
from dpro.sim.links import OpKey
from dpro.sim.whatif import add_recompute, recorded_crowding, replay_model, scaled_compute
from dpro.sim.whatif import predict as whatif_predict

if TYPE_CHECKING:
    from dpro.dag.step_model import StepModel
    from dpro.io.load import Run
    from dpro.sim.choices import OptimizeResult
    from dpro.sim.whatif import Context, Prediction

__all__ = ["BIGARRAY_BOUND", "DEFAULT_BIGARRAY_BOUND", "ENGINE", "ENV_KNOBS", "NAME", "NUM_SERVERS", "ServerModel",
           "bigarray_bound", "cpu_link", "fit_server_model", "host_cpus", "key_servers", "link_queues",
           "link_rate", "max_servers", "ps_model", "rate_scaled_model", "replay_priced", "search", "server_cpus",
           "server_host", "server_hosts", "server_model", "server_queue", "worker_hosts"]

NAME = "mxnet-ps"
BIGARRAY_BOUND = "mxnet.kvstore.bigarray_bound"
NUM_SERVERS = "num_servers"
DEFAULT_BIGARRAY_BOUND = 1_000_000          # MXNET_KVSTORE_BIGARRAY_BOUND's default (elements)
BIGARRAY_BOUND_ENV = "MXNET_KVSTORE_BIGARRAY_BOUND"
NUM_SERVERS_ENV = "DMLC_NUM_SERVER"
ENV_KNOBS = {NUM_SERVERS_ENV: NUM_SERVERS, BIGARRAY_BOUND_ENV: BIGARRAY_BOUND}  # variable -> the knob it sets
KEY_SPREAD = 9973                           # MXNet's multiplier spreading small keys over the servers
SCALE_TOLERANCE = 0.01                      # a server model calibrated further than this from the recorded step failed


def bigarray_bound(environ: Mapping[str, str]) -> int:
    """The partition bound in force (elements), from ``MXNET_KVSTORE_BIGARRAY_BOUND`` or MXNet's default."""
    try:
        return max(1, int(environ.get(BIGARRAY_BOUND_ENV, DEFAULT_BIGARRAY_BOUND)))
    except ValueError:
        return DEFAULT_BIGARRAY_BOUND


def key_servers(key: int, elements: int, num_servers: int, bound: int) -> list[tuple[int, float]]:
    """The servers holding kvstore key ``key`` of ``elements`` elements, each with its share of the key:
    one server below ``bound`` elements, else an even split over all ``num_servers`` (MXNet's rule)."""
    servers = max(1, int(num_servers))
    if elements < bound or servers == 1:
        return [((key * KEY_SPREAD) % servers, 1.0)]
    cuts = [round(elements / servers * i) for i in range(servers + 1)]
    return [(i, (cuts[i + 1] - cuts[i]) / elements) for i in range(servers)]


# ---- the model: keys on server queues, each request priced by a line fitted through the recorded ones -----------

@dataclass(frozen=True)
class ServerModel:
    """What the parameter server's work costs (µs), fitted from the recorded requests and scaled so that the
    recorded layout, priced by it, replays to the step the measured requests give.

    A server's work on one part of ``b`` bytes (every worker's push summed, the optimizer run): ``fixed_us +
    us_per_byte * b``, its requests one after another. Where its host's CPUs are known, the host's busy servers and
    computing workers share them (``cpu_link``, replayed by ``dpro.sim.links``): a working server takes
    ``server_cpus`` of them (its own threads, the workers' sending and receiving, the kernel's copies: the
    recorder's probe; 1 without one), a computing worker one, and when they ask for more than the host has, the
    servers' work slows in proportion, and so does the workers' compute against how crowded it was in the recorded
    layout's replay (``replay_priced``: the host's CPUs conserved). A push or an answer that crosses
    from one host to another: ``link_us_per_byte * b`` with the sending host's outgoing link and the receiving host's
    incoming link to itself (``link_queues``). Links are full duplex and shared: the replay sends each
    worker/server connection's messages in turn and shares a link evenly between the connections on it
    (``dpro.sim.links``), so a host's pushes and its server's answers going the same way slow each other. Between
    processes of one host: nothing beyond the server's work. (Shared links predict the what-ifs better than links
    that take their transfers in turn, pushes first: docs/measurements.md.)"""

    fixed_us: float
    us_per_byte: float
    link_us_per_byte: float
    world_size: int
    source: str = ""
    server_cpus: dict[str, float] = dataclasses.field(default_factory=dict)  # host -> CPUs a working server takes
    link_latency_us: float = 0.0  # what each push or answer between hosts waits beyond its bytes (busy links)

    def server_us(self, nbytes: float, world_size: int | None = None) -> float:
        workers = (world_size or self.world_size) / max(self.world_size, 1)  # pushes per key grow with the workers
        return self.fixed_us + self.us_per_byte * nbytes * workers

    def link_us(self, nbytes: float, world_size: int | None = None, bandwidth_scale: float = 1.0) -> float:
        # the server's links carry every worker's push and answer: with more workers each transfer gets less
        workers = (world_size or self.world_size) / max(self.world_size, 1)
        return self.link_latency_us + self.link_us_per_byte * nbytes * workers / bandwidth_scale


SERVER_HOSTS_ENV = "DPRO_MXNET_SERVER_HOSTS"  # the host of each server, by server rank (comma-separated)
MAX_HOST_CPUS = 1 << 16  # a host's CPU count beyond this is not believed (run.json is input)


def server_hosts(run: Run) -> list[str]:
    """The host of each recorded server, by server rank (run.json's ``mxnet.server_hosts``); empty when not
    known."""
    hosts = _section(run).get("server_hosts")
    return [h for h in hosts if isinstance(h, str)] if isinstance(hosts, list) else []


def _section(run: Run) -> dict[str, Any]:
    section = ((run.meta or {}) if run is not None else {}).get("mxnet")
    return section if isinstance(section, dict) else {}


def worker_hosts(run: Run) -> list[str]:
    """The host of each worker, by rank (run.json's ``mxnet.worker_hosts``, else its ``hosts``)."""
    meta = (run.meta or {}) if run is not None else {}
    hosts = _section(run).get("worker_hosts") or meta.get("hosts") or []
    return [h for h in hosts if isinstance(h, str)] if isinstance(hosts, list) else []


def server_host(server: int, recorded: list[str], workers: list[str]) -> str | None:
    """Where server ``server`` runs: as recorded, else (a server beyond the recorded ones) where a launcher spreading
    servers over the job's machines puts it: on the machine running the fewest; None when the servers' hosts are
    not known."""
    if not recorded:
        return None
    if server < len(recorded):
        return recorded[server]
    machines = list(dict.fromkeys([*workers, *recorded]))
    placed = [*recorded]
    while len(placed) <= server:  # each new server on the machine running the fewest so far
        placed.append(min(machines, key=lambda m: (placed.count(m), machines.index(m))))
    return placed[server]


def host_cpus(run: Run) -> dict[str, int]:
    """The CPUs each recorded host lets the job use (run.json's ``mxnet.host_cpus``); empty when not known."""
    cpus = _section(run).get("host_cpus")
    if not isinstance(cpus, dict):
        return {}
    return {h: n for h, n in cpus.items() if isinstance(h, str) and isinstance(n, int) and not isinstance(n, bool)
            and 1 <= n <= MAX_HOST_CPUS}


def server_queue(server: int, hosts: list[str], workers: list[str] | None = None,
                 cpus: Mapping[str, int] | None = None) -> str:
    """The queue a server's work takes. A server answers its requests one after another on one thread; servers
    on one host run side by side on its CPUs (``cpus``: per host; 2 servers on a 2-CPU machine answer sooner than
    1), so a host's servers take turns on as many lanes as it has CPUs
    (``server@host#lane``; one lane, ``server@host``, where its CPUs are not known). Unknown hosts: its own."""
    workers = workers or []
    host = server_host(server, hosts, workers)
    if host is None:
        return f"server{server}"
    lanes = (cpus or {}).get(host, 1)
    if lanes <= 1:
        return f"server@{host}"
    before = sum(server_host(k, hosts, workers) == host for k in range(server))  # this host's servers before it
    return f"server@{host}#{before % lanes}"


def _transfer_queues(run: Run, args: dict[str, Any]) -> tuple[str, ...]:
    servers = args.get("servers")
    if not isinstance(servers, list):
        return ()
    hosts, workers, cpus = server_hosts(run), worker_hosts(run), host_cpus(run)
    return tuple(dict.fromkeys(server_queue(int(k), hosts, workers, cpus) for k in servers
                               if isinstance(k, int) and not isinstance(k, bool)))


def _key_ops(ctx: Context) -> dict[str, dict[str, Any]]:
    """The recorded push_pull collectives: name -> args (key, bytes, servers, part_bytes, tensors)."""
    out: dict[str, dict[str, Any]] = {}
    for ops in ctx.base.ops.values():
        for op in ops:
            if op.category == "COMM" and isinstance(op.args.get("key"), int) and op.name in ctx.base.transfer:
                out.setdefault(op.name, op.args)
    return out


def _elements(ctx: Context) -> dict[str, int]:
    out = {}
    for g in (ctx.run.model or {}).get("gradients", []):
        shape = g.get("shape") or []
        out[g["name"]] = math.prod(int(d) for d in shape) if shape else int(g["bytes"]) // 4
    return out


def _recorded_parts(args: dict[str, Any]) -> list[tuple[int, float]]:
    nbytes = float(args.get("bytes", 0))
    shares = [b / nbytes for b in args.get("part_bytes") or []] if nbytes else []
    return list(zip(args.get("servers") or [0], shares or [1.0], strict=False))


def _crosses_hosts(ctx: Context) -> bool:
    """Whether a recorded push or answer went from one host to another (servers and workers on known hosts)."""
    hosts, workers = server_hosts(ctx.run), worker_hosts(ctx.run)
    if not hosts or not workers:
        return False
    return any(server_host(k, hosts, workers) != w for args in _key_ops(ctx).values()
               for k, _ in _recorded_parts(args) for w in workers)


def fit_server_model(ctx: Context, *, mean_per_byte: bool = False) -> ServerModel:
    """The shape of ``ServerModel`` from the recorded requests, as each server queue answered them one after
    another.

    Requests answered together end together, so the later ones of such a batch show no time of their own; a line
    through single requests (bytes, transfer) would be fitted to zeros. The cost per byte is the slope of the
    cumulative time against the cumulative bytes along each queue (a robust line; queues weighted by their bytes); the
    fixed cost is the median of what each request took beyond its bytes. When the bytes say nothing (sizes too
    alike, or ``mean_per_byte``), the mean cost per byte. A run whose pushes crossed hosts spends that per byte on
    the links: its servers' work is left at the fixed cost. (``server_model`` scales it to the recorded step.)"""
    chains: dict[str, list[tuple[float, float]]] = {}
    for name, args in _key_ops(ctx).items():  # in program order
        queue = ctx.base.transfer_queues.get(name, ("",))[0]
        chains.setdefault(queue, []).append((float(args.get("bytes", 0)), ctx.base.transfer[name]))
    samples = [s for chain in chains.values() for s in chain]
    if not samples:
        return ServerModel(0.0, 0.0, 0.0, ctx.run.world_size, "no push_pull recorded")
    slopes = []  # (slope, the chain's bytes)
    for chain in chains.values():
        cumulative, x, y = [], 0.0, 0.0
        for nbytes, took in chain:
            x, y = x + nbytes, y + took
            cumulative.append((x, y))
        line = robust_line(cumulative)
        if line is not None:
            slopes.append((line[1], x))
    total_bytes, total_us = sum(b for b, _ in samples), sum(t for _, t in samples)
    # queues weighted by their bytes: a queue of a few small keys says little about the cost of a byte
    weight = sum(b for _, b in slopes)
    per_byte = sum(slope * b for slope, b in slopes) / weight if weight > 0 else 0.0
    how = f"cumulative time vs bytes along {len(chains)} server queue(s), {len(samples)} requests"
    if (per_byte <= 0 or mean_per_byte) and total_bytes > 0:
        per_byte, how = total_us / total_bytes, f"mean cost per byte of {len(samples)} requests"
    fixed = max(0.0, statistics.median(t - per_byte * b for b, t in samples))
    if _crosses_hosts(ctx):
        return ServerModel(min(fixed, min(t for _, t in samples)), 0.0, per_byte, ctx.run.world_size,
                           how + "; on the links between hosts")
    return ServerModel(fixed, per_byte, 0.0, ctx.run.world_size, how)


def cpu_link(host: str) -> str:
    """The link standing for a host's CPUs, shared by its working servers and computing workers."""
    return f"cpu@{host}"


PROBE_MIN_US = 80_000  # a probe shorter than this spans too few of /proc/stat's 10 ms ticks per CPU


def server_cpus(run: Run) -> dict[str, float]:
    """Per host of known CPUs: how many of them a server's work takes while it runs, from the recorder's probe
    (run.json's ``mxnet.server_probe``: one server working alone, the workers waiting; the busy CPUs of the probed
    server's machine, as its workers read them), between 1 and the host's CPUs; empty when not probed. Every
    server runs the same software, so the one probed speaks for all."""
    probe = _section(run).get("server_probe")
    if not isinstance(probe, dict):
        return {}
    workers, hosts, cpus = worker_hosts(run), server_hosts(run), host_cpus(run)
    server, busy, rounds, took = (probe.get(k) for k in ("server", "busy_cpus", "rounds", "us_per_round"))
    if not isinstance(server, int) or isinstance(server, bool) or not isinstance(busy, list) or server < 0:
        return {}
    took = [t for t in took if is_finite_number(t) and t > 0] if isinstance(took, list) else []
    if not is_finite_number(rounds) or not took or rounds * statistics.median(took) < PROBE_MIN_US:
        return {}  # too short for /proc/stat's clock ticks to tell
    at = server_host(server, hosts, workers)
    seen = [b for w, b in zip(workers, busy, strict=False)
            if w == at and is_finite_number(b) and 0 < b <= MAX_HOST_CPUS]
    if not seen:
        return {}
    taken = statistics.median(seen)
    return {host: min(float(n), max(1.0, taken)) for host, n in cpus.items()}


def link_rate(run: Run) -> float | None:
    """What a link between two of the job's machines carries, bytes/µs: the median of the recorder's link probe
    (run.json's ``mxnet.link_probe``: one TCP stream per machine to worker 0's, nothing else running); None when
    not probed (one machine, an older recorder)."""
    probe = _section(run).get("link_probe")
    streams = probe.get("streams") if isinstance(probe, dict) else None
    if not isinstance(streams, list):
        return None
    rates = [s["bytes_per_s"] for s in streams if isinstance(s, dict) and is_finite_number(s.get("bytes_per_s"))
             and s["bytes_per_s"] > 0]
    return statistics.median(rates) / 1e6 if rates else None


def ps_model(ctx: Context, knobs: dict[str, Any], server: ServerModel) -> StepModel:
    """The mean step with every key re-placed on the servers (``key_servers`` under the knobs' server count and
    bound) as exchanges (``dpro.dag.step_model.ExchangePart``): each part pushed by every worker over the links
    between their hosts, the server's work (on its host's CPUs where they are known, else on its host's queue),
    the answers back, priced by ``server``."""
    servers = int(knobs.get(NUM_SERVERS) or ctx.knobs.get(NUM_SERVERS) or 1)
    bound = int(knobs.get(BIGARRAY_BOUND) or ctx.knobs.get(BIGARRAY_BOUND) or DEFAULT_BIGARRAY_BOUND)
    compression = knobs.get("gradient_compression")
    scale = 0.5 if compression in ("fp16", "bf16") else 1.0
    world, bandwidth = knobs.get("world_size"), float(knobs.get("bandwidth_scale", 1.0))
    elements = _elements(ctx)
    hosts, workers, cpus = server_hosts(ctx.run), worker_hosts(ctx.run), host_cpus(ctx.run)
    ranks = sorted(ctx.base.ops)
    layout = []
    for name, args in _key_ops(ctx).items():
        tensor = (args.get("tensors") or [""])[0]
        count = elements.get(tensor) or max(1, int(args.get("bytes", 0)) // 4)
        layout.append((name, [(k, share * float(args.get("bytes", 0)) * scale, server_host(k, hosts, workers))
                              for k, share in key_servers(int(args["key"]), count, servers, bound)]))
    out = copy.deepcopy(ctx.base)
    out.link_capacity = {cpu_link(h): float(n) for h, n in cpus.items()}
    out.link_weight = {cpu_link(h): server.server_cpus.get(h, 1.0) for h in cpus}
    out.compute_links = {r: cpu_link(workers[r]) for r in ranks if r < len(workers) and workers[r] in cpus}
    for name, parts in layout:
        priced = []
        for k, nbytes, at in parts:
            push, pull = {}, {}
            for rank in ranks:
                mine = workers[rank] if rank < len(workers) else None
                if at is None or mine is None or mine == at:
                    push[rank] = pull[rank] = (0.0, ())
                    continue
                us = server.link_us(nbytes, world, bandwidth)
                push[rank] = (us, link_queues(mine, at))
                pull[rank] = (us, link_queues(at, mine))
            priced.append(ExchangePart(server_queue(k, hosts, workers, cpus), server.server_us(nbytes, world), push,
                                       pull, server=f"server{k}", server_links=(cpu_link(at),) if at in cpus else ()))
        out.exchanges[name] = priced
    return out


def link_queues(source: str, destination: str) -> tuple[str, str]:
    """The links a transfer from one host to another crosses: the source's outgoing link and the destination's
    incoming one (full duplex: transfers in opposite directions run side by side, the same way share them)."""
    return f"link-out@{source}", f"link-in@{destination}"


def server_model(ctx: Context) -> ServerModel:
    """``fit_server_model``, fitted so the recorded layout replays to the measured requests' replay (cached).

    When the recorded pushes crossed hosts, the links take the difference. Where the recorder probed the links'
    rate (``link_rate``), the links carry bytes at that rate and each message waits the same time beyond its bytes
    (``link_latency_us``: on a busy link a message queues behind what the other connections sent before it; the
    even sharing of ``dpro.sim.links`` leaves that out), that wait fitted; else the links' cost per byte is scaled.
    Without crossings, the servers' work is scaled."""
    cached = ctx.cache.get(NAME)
    if cached is not None:
        return cached
    fitted, step_of, target = _fit_inputs(ctx)
    rate = link_rate(ctx.run)
    if fitted.link_us_per_byte > 0 and rate is not None:
        probed = dataclasses.replace(fitted, link_us_per_byte=1.0 / rate)
        if step_of(probed) < target:
            model = _fit_latency(probed, step_of, target)
            ctx.cache[NAME] = model
            return model
        fitted = probed  # the links at the probed rate replay slower than the run was: their rate is scaled

    model = _scaled_to_recorded(ctx, fitted, step_of, target)
    ctx.cache[NAME] = model
    return model


def rate_scaled_model(ctx: Context) -> ServerModel:
    """The other fit a recording with probed links allows (cached): no wait per message, the links' cost per byte
    scaled to replay the recorded step, as without a probe. The recorded step alone cannot tell the two apart, so the
    search recommends a change only when both predict its gain."""
    key = f"{NAME}/rate-scaled"
    if key not in ctx.cache:
        fitted, step_of, target = _fit_inputs(ctx)
        ctx.cache[key] = _scaled_to_recorded(ctx, fitted, step_of, target)
    return ctx.cache[key]


def _scaled_to_recorded(ctx: Context, fitted: ServerModel, step_of: Any, target_ms: float) -> ServerModel:
    """``_fit_scale`` of ``fitted``; where no scale of that shape replays the recorded step (along the queues the
    requests ended together, the first holding the whole wait: a slope near 0), of the mean cost per byte."""
    model = _fit_scale(fitted, step_of, target_ms)
    if abs(step_of(model) - target_ms) <= SCALE_TOLERANCE * target_ms:
        return model
    mean = dataclasses.replace(fit_server_model(ctx, mean_per_byte=True), server_cpus=fitted.server_cpus)
    return _fit_scale(mean, step_of, target_ms)


def _fit_inputs(ctx: Context) -> tuple[ServerModel, Any, float]:
    """The fitted shape, the replayed step (ms) of the recorded layout under a model, and the step it must replay
    to (the measured requests' replay)."""
    fitted = dataclasses.replace(fit_server_model(ctx), server_cpus=server_cpus(ctx.run))

    def step_of(model: ServerModel) -> float:
        return replay_model(ctx, ps_model(ctx, {}, model), {}).predicted_step_ms

    return fitted, step_of, whatif_predict(ctx, {}).predicted_step_ms


def _fit_latency(model: ServerModel, step_of: Any, target_ms: float) -> ServerModel:
    """``model`` with the ``link_latency_us`` under which it replays to ``target_ms`` (the step grows with it; a
    bisection between nothing and a whole step)."""
    lo, hi = 0.0, target_ms * 1000.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step_of(dataclasses.replace(model, link_latency_us=mid)) < target_ms else (lo, mid)
    wait = (lo + hi) / 2
    return dataclasses.replace(model, link_latency_us=wait, source=f"{model.source}; the links' rate probed, each "
                               "message's wait fitted to replay the recorded run")


def _fit_scale(fitted: ServerModel, step_of: Any, target_ms: float) -> ServerModel:
    """``fitted`` with its links' cost per byte (when the recorded pushes crossed hosts) or its servers' work scaled
    so that it replays to ``target_ms``."""
    links = fitted.link_us_per_byte > 0

    def scaled(k: float) -> ServerModel:
        if links:
            return dataclasses.replace(fitted, link_us_per_byte=fitted.link_us_per_byte * k)
        return dataclasses.replace(fitted, fixed_us=fitted.fixed_us * k, us_per_byte=fitted.us_per_byte * k)

    if fitted.fixed_us <= 0 and fitted.us_per_byte <= 0 and not links:
        k = 1.0  # nothing to scale (no request took time)
    else:
        k = scale_to_reach(lambda k: step_of(scaled(k)), target_ms, 1e-4, 1e3)
    return dataclasses.replace(scaled(k), source=f"{fitted.source}, scaled x{k:.2f} to replay the recorded run")


def knobs_from_env(env: Mapping[str, Any]) -> dict[str, int]:
    """The engine's knobs an ``env`` section sets (``DMLC_NUM_SERVER``, ``MXNET_KVSTORE_BIGARRAY_BOUND``)."""
    out = {}
    for variable, knob in ENV_KNOBS.items():
        if variable in env:
            try:
                out[knob] = max(1, int(env[variable]))
            except (TypeError, ValueError):
                raise UsageError(f"env {variable}={env[variable]!r} is not a positive integer") from None
    return out


PS_KNOBS = (NUM_SERVERS, BIGARRAY_BOUND, "world_size", "bandwidth_scale", "gradient_compression")


def predict(ctx: Context, knobs: dict[str, Any]) -> Prediction | None:
    """What-if of the parameter server's knobs (and the common world_size, bandwidth_scale, compression): every
    key's request re-placed and priced by the server model, replayed; None when ``knobs`` hold none of them."""
    if "tensor_groups" in knobs:
        raise UsageError("tensor_groups: MXNet's kvstore sends one key per parameter (no fusion); what changes its "
                         f"communication is {NUM_SERVERS} and {BIGARRAY_BOUND}")
    knobs = {**knobs, **knobs_from_env(knobs.get("env") or {})}  # a config's env knobs (what the search writes)
    if not any(k in knobs for k in PS_KNOBS):
        return None

    return replay_priced(ctx, knobs, server_model(ctx))


def replay_priced(ctx: Context, knobs: dict[str, Any], server: ServerModel) -> Prediction:
    """The what-if of ``knobs`` with every key priced by ``server``: the workers' compute on CPUs their host's
    servers share runs as much faster or slower than recorded as those CPUs are less or more crowded than in the
    recorded layout's replay (the host's CPUs conserved)."""
    model = ps_model(ctx, knobs, server)
    if knobs.get("recompute"):
        model = add_recompute(ctx, model, list(knobs["recompute"]))
    if float(knobs.get("compute_scale", 1.0)) != 1.0:
        model = scaled_compute(model, float(knobs["compute_scale"]))
    return replay_model(ctx, model, knobs, crowded_as=_recorded_crowding(ctx, server))


def _recorded_crowding(ctx: Context, server: ServerModel) -> dict[OpKey, float]:
    key = f"{NAME}/crowding/{server!r}"
    if key not in ctx.cache:
        ctx.cache[key] = recorded_crowding(ps_model(ctx, {}, server))
    return ctx.cache[key]


SERVER_CANDIDATES = (1, 2, 3, 4, 6, 8)
BOUND_CANDIDATES = (10**5, 2 * 10**5, 5 * 10**5, 10**6, 4 * 10**6, 10**9)  # 10**9: no key is split


def sweeps(ctx: Context) -> list[tuple[str, list[Any]]]:
    """Server count and partition bound over the values the search tries (``dpro report``'s curves)."""
    return [(NUM_SERVERS, sorted({*SERVER_CANDIDATES, int(ctx.knobs.get(NUM_SERVERS) or 1)})),
            (BIGARRAY_BOUND, list(BOUND_CANDIDATES))]


def search(ctx: Context, *, memory_budget_bytes: int | None = None, allow_compression: bool = False) -> OptimizeResult:
    """dPRO's tensor partition for a parameter server: every server count and partition bound replayed; the best
    is recommended when its predicted gain clears the prediction's uncertainty (``optimize.search.clears``; written
    as the config's ``env``), then the common searches."""
    began = time.perf_counter()
    baseline = whatif_predict(ctx, {})
    servers0 = int(ctx.knobs.get(NUM_SERVERS) or 1)
    bound0 = int(ctx.knobs.get(BIGARRAY_BOUND) or DEFAULT_BIGARRAY_BOUND)
    # every fit the recording allows (``rate_scaled_model``): a setting gains what the least hopeful of them says
    alternatives = [rate_scaled_model(ctx)] if server_model(ctx).link_latency_us > 0 else []

    def steps(knobs: dict[str, Any]) -> list[float]:
        return [whatif_predict(ctx, knobs).predicted_step_ms] + [
            replay_priced(ctx, knobs, m).predicted_step_ms for m in alternatives]

    now = steps({NUM_SERVERS: servers0, BIGARRAY_BOUND: bound0})
    cap = max_servers(ctx.run)
    counts = sorted({*(c for c in SERVER_CANDIDATES if cap is None or c <= cap), servers0})
    ranked = sorted(((min(n - c for n, c in zip(now, cand, strict=True)), cand[0], s, b)
                     for s in counts for b in sorted({*BOUND_CANDIDATES, bound0})
                     for cand in [steps({NUM_SERVERS: s, BIGARRAY_BOUND: b})]),
                    key=lambda t: (-round(t[0], 3), t[2], -t[3]))  # ties: fewer servers, fewer splits
    gain, best_ms, servers, bound = ranked[0]
    both = (f"; {gain:.2f} ms faster by the less hopeful of two fits of the links: a wait per message, or their "
            "rate scaled") if alternatives else ""
    if cap is not None and cap < max(SERVER_CANDIDATES):
        both += (f"; at most {cap} server(s), the CPUs of the machines they run on: each server beyond is a "
                 "process whose threads contend for those CPUs, which the model does not price")
    knobs: dict[str, Any] = {}
    explain: list[dict[str, Any]] = []
    worth, shown = clears(ctx, gain, now[0])
    if worth and (servers, bound) != (servers0, bound0):
        knobs["env"] = {NUM_SERVERS_ENV: str(servers), BIGARRAY_BOUND_ENV: str(bound)}
        explain.append({"knob": "env", "predicted_gain_ms": now[0] - best_ms,
                        "why": f"{servers} server(s), keys of {bound:,} elements or more split over all of them "
                               f"(now {servers0}, bound {bound0:,}): {best_ms:.2f} ms vs {now[0]:.2f} ms replayed, "
                               f"{shown} ({len(ranked)} settings{both})"})
    else:
        explain.append({"knob": "env", "predicted_gain_ms": 0.0,
                        "why": f"the best found ({servers} servers, bound {bound:,}: {best_ms:.2f} ms vs "
                               f"{now[0]:.2f} ms, {shown}{both}) gains no more than the prediction can tell: "
                               f"{servers0} servers with bound {bound0:,} are kept"})
    return optimize_common(ctx, memory_budget_bytes=memory_budget_bytes, allow_compression=allow_compression,
                           knobs=knobs, explain=explain, baseline=baseline, began=began)


def max_servers(run: Run) -> int | None:
    """The most servers the search tries: the usable CPUs of the machines the servers run on (the recorded
    servers' hosts, which dpro-launch also gives any further ones), where every one is known; None otherwise.
    Servers beyond that add no CPU to serve with, only processes contending for it, a contention the model does
    not price (docs/benchmarks/whatif_matrix_engines.md)."""
    cpus = host_cpus(run)
    hosts = set(server_hosts(run))
    if not hosts or not all(h in cpus for h in hosts):
        return None
    return max(1, sum(cpus[h] for h in hosts))


def _servers(value: Any, source: str, key: str) -> int:
    return _count(value, source, key, positive=True)


def _bound(value: Any, source: str, key: str) -> int:
    return _count(value, source, key, positive=True)


def _describe(ctx: Context) -> str:
    model = server_model(ctx)

    def rate(per_byte: float) -> str:
        return f"{1 / per_byte:,.0f} MB/s" if per_byte > 0 else "free"

    cpus = ", ".join(f"{host} {n:.1f}" for host, n in sorted(model.server_cpus.items()))
    side = f"; while it works it takes CPUs of its host: {cpus} (probed)" if cpus else \
        "; while it works it takes 1 CPU of its host (no probe recorded)" if host_cpus(ctx.run) else ""
    if side:
        side += (", and the workers' compute beside it runs as much faster or slower than recorded as those CPUs "
                 "are less or more crowded than in the recorded layout")
    wait = f", each message waiting {model.link_latency_us / 1000:.2f} ms" if model.link_latency_us > 0 else ""
    return (f"parameter-server model: a server's work {model.fixed_us:.0f} us + {rate(model.us_per_byte)}{side}, "
            f"links between hosts {rate(model.link_us_per_byte)}{wait} ({model.source})")


def _notes(run: Run) -> list[str]:
    knobs = (run.meta or {}).get("knobs", {})
    return [f"parameter server: {knobs.get(NUM_SERVERS, '?')} servers, keys of "
            f"{knobs.get(BIGARRAY_BOUND, DEFAULT_BIGARRAY_BOUND):,} elements or more split over all of them; each "
            "key's push_pull is one request answered once every worker's push arrived (server queues: server<k>)"
            ] + _probe_notes(run) + _link_notes(run)


def _link_notes(run: Run) -> list[str]:
    rate = link_rate(run)
    if rate is None:
        return []
    return [f"link probe: one TCP stream between machines carried {rate:,.0f} MB/s (what-ifs carry the bytes between "
            "hosts at that rate and fit a wait per message to the recorded step, unless the step was faster than that "
            "rate allows; dpro whatif prints the model)"]


def _probe_notes(run: Run) -> list[str]:
    cpus, machines = server_cpus(run), host_cpus(run)
    if cpus:
        taken = ", ".join(f"{n:.1f} of {host}'s {machines[host]}" for host, n in sorted(cpus.items()))
        return [f"server probe: a working server takes {taken} CPUs (what-ifs share a machine's CPUs between its "
                "working servers and computing workers)"]
    if machines:
        return ["no server probe recorded (a window starting before step 3, or an older recorder): what-ifs take a "
                "working server to use 1 CPU of its machine, which on a machine it shares with other servers can "
                "price fewer servers too slow"]
    return []


ENGINE = Engine(
    name=NAME,
    doc="MXNet kvstore parameter server (dist_sync on ps-lite): one push_pull request per key to its servers",
    knobs=(Knob(NUM_SERVERS, "parameter servers of an MXNet job (DMLC_NUM_SERVER); applied through the config's env",
                _servers, default=1, config=False, engine=NAME),
           Knob(BIGARRAY_BOUND, "keys of at least this many elements are split over all servers "
                "(MXNET_KVSTORE_BIGARRAY_BOUND); applied through the config's env", _bound,
                default=DEFAULT_BIGARRAY_BOUND, config=False, engine=NAME)),
    optimize=search,
    predict=predict,
    notes=_notes,
    transfer_queues=_transfer_queues,
    describe_model=_describe,
    env_variables=(NUM_SERVERS_ENV, BIGARRAY_BOUND_ENV),
    sweeps=sweeps,
    apply="environment (DMLC_NUM_SERVER: dpro-launch starts that many servers; MXNET_KVSTORE_BIGARRAY_BOUND) set by "
          "dpro-launch --apply",
)
