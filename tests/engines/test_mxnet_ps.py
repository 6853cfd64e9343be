"""The mxnet-ps engine: MXNet's key-to-server rule, the parameter-server DAG (requests on server queues), the
what-if of num_servers / bigarray_bound and the search, on a real recorded run (tests/data/mxnet: a 3-layer MLP,
2 workers and 2 servers on one machine, recorded by dpro.plugins.mxnet.Profiler)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dpro.config import knob_table
from dpro.engines import get_engine
from dpro.engines.mxnet_ps import (
    BIGARRAY_BOUND,
    NUM_SERVERS,
    bigarray_bound,
    host_cpus,
    key_servers,
    link_queues,
    link_rate,
    server_cpus,
    server_queue,
)
from dpro.errors import UsageError
from dpro.io.load import load_run
from dpro.optimize import optimize
from dpro.sim.whatif import context, predict

RECORDED = Path(__file__).resolve().parents[1] / "data" / "mxnet" / "mlp-2workers-2servers"
RESNET = RECORDED.parent / "resnet18-2workers-2servers"


def test_small_keys_go_to_one_server_and_big_ones_are_split_evenly():
    assert key_servers(0, 10, 2, 1000) == [(0, 1.0)]
    assert key_servers(1, 10, 2, 1000) == [(9973 % 2, 1.0)]
    assert [s for s, _ in (key_servers(k, 10, 3, 1000)[0] for k in range(6))] == [k * 9973 % 3 for k in range(6)]
    parts = key_servers(5, 1001, 3, 1000)
    assert [s for s, _ in parts] == [0, 1, 2] and sum(share for _, share in parts) == pytest.approx(1.0)
    assert key_servers(5, 10**7, 1, 1000) == [(0, 1.0)]
    assert bigarray_bound({"MXNET_KVSTORE_BIGARRAY_BOUND": "5000"}) == 5000
    assert bigarray_bound({}) == 1_000_000 and bigarray_bound({"MXNET_KVSTORE_BIGARRAY_BOUND": "x"}) == 1_000_000


def test_servers_on_one_host_share_its_queue():
    assert server_queue(0, ["a", "a"]) == server_queue(1, ["a", "a"]) == "server@a"
    assert server_queue(3, ["a", "b"]) == "server@b"  # beyond the recorded ones: round-robin over their hosts
    assert server_queue(1, []) == "server1"


def test_servers_on_one_host_take_turns_on_its_cpus():
    assert server_queue(0, ["a", "a"], cpus={"a": 2}) == "server@a#0"
    assert server_queue(1, ["a", "a"], cpus={"a": 2}) == "server@a#1"
    assert server_queue(2, ["a", "a", "a"], cpus={"a": 2}) == "server@a#0"  # a third server shares a CPU
    assert server_queue(1, ["a", "b"], cpus={"a": 2, "b": 4}) == "server@b#0"
    assert server_queue(1, ["a", "a"], cpus={"a": 1}) == "server@a"


def _with_cpus(tmp_path: Path, probe: dict | None = None, name: str = "known"):
    """The recorded run with its host's CPUs known (2) and, if given, a server probe in run.json."""
    known = tmp_path / name
    shutil.copytree(RECORDED, known)
    meta = json.loads((known / "run.json").read_text())
    host = meta["mxnet"]["server_hosts"][0]
    meta["mxnet"]["host_cpus"] = {host: 2, "other": "x", "huge": 10**30}
    meta["mxnet"]["server_probe"] = probe
    (known / "run.json").write_text(json.dumps(meta))
    return load_run(known), host


def test_the_probe_says_how_many_cpus_a_working_server_takes(tmp_path):
    probe = {"server": 1, "busy_cpus": [1.6, 1.7], "bytes": 4 << 20, "rounds": 8, "us_per_round": [20e3, 21e3]}
    run, host = _with_cpus(tmp_path, probe)
    assert server_cpus(run) == {host: pytest.approx(1.65)}  # both workers read the probed server's machine
    assert f"takes 1.6 of {host}'s 2 CPUs" in " ".join(get_engine("mxnet-ps").notes(run))  # dpro analyze says so
    run, host = _with_cpus(tmp_path, {**probe, "busy_cpus": [3.5, 9.0]}, "capped")
    assert server_cpus(run) == {host: 2.0}  # at most the machine's CPUs
    run, host = _with_cpus(tmp_path, {**probe, "busy_cpus": [0.4, None]}, "idle")
    assert server_cpus(run) == {host: 1.0}  # at least one
    for i, bad in enumerate(({**probe, "server": "1"}, {**probe, "busy_cpus": "1.6"}, {**probe, "busy_cpus": [-1]},
                             {**probe, "server": True}, {**probe, "us_per_round": [2e3, 2e3]}, 7)):
        run, _ = _with_cpus(tmp_path, bad, f"bad{i}")
        assert server_cpus(run) == {}, bad
        assert "no server probe" in " ".join(get_engine("mxnet-ps").notes(run))


def test_servers_that_take_more_cpus_slow_each_other_and_leave_one_server_faster(tmp_path):
    """The recorded 2-server layout replays to the recorded step either way; with each working server taking
    more of the machine's 2 CPUs, the two are priced as slowing each other, so one server alone is faster than
    the same model without the probe says."""
    plain = context(_with_cpus(tmp_path, None, "plain")[0])
    probed = context(_with_cpus(tmp_path, {"server": 0, "busy_cpus": [1.8, 1.8], "rounds": 8,
                                           "us_per_round": [30e3, 30e3]}, "probed")[0])
    for ctx in (plain, probed):
        assert predict(ctx, {NUM_SERVERS: 2}).predicted_step_ms == pytest.approx(predict(ctx, {}).predicted_step_ms,
                                                                                  rel=0.02)
    assert predict(probed, {NUM_SERVERS: 1}).predicted_step_ms < predict(plain, {NUM_SERVERS: 1}).predicted_step_ms


def test_one_server_gives_the_workers_compute_back_the_cpus_the_second_took():
    """The host's CPUs are conserved: compute that ran beside two working servers runs faster beside one, so one
    server costs less than a model that leaves compute at its recorded pace says; the recorded layout is unchanged.
    (A real recording whose backward overlaps the servers' work: a hybridized Gluon ResNet-18, 2 workers and 2
    servers on one 2-CPU machine, with the recorder's server probe.)"""
    from dpro.engines.mxnet_ps import ps_model, replay_priced, server_model
    from dpro.sim.whatif import recorded_crowding, replay_model

    ctx = context(load_run(RESNET))
    server = server_model(ctx)
    assert max(recorded_crowding(ps_model(ctx, {}, server)).values()) > 1.5  # compute shared its CPUs
    one = {NUM_SERVERS: 1}
    conserved = replay_priced(ctx, one, server).predicted_step_ms
    as_recorded = replay_model(ctx, ps_model(ctx, one, server), one).predicted_step_ms
    assert conserved < 0.99 * as_recorded
    two = {NUM_SERVERS: 2}
    assert replay_priced(ctx, two, server).predicted_step_ms == pytest.approx(
        replay_model(ctx, ps_model(ctx, two, server), two).predicted_step_ms, rel=1e-9)


def test_a_recording_that_knows_its_cpus_prices_a_second_server_on_them(tmp_path):
    run, host = _with_cpus(tmp_path)
    assert host_cpus(run) == {host: 2}  # what is not a believable count is left out
    ctx = context(run)
    assert len(set(ctx.base.transfer_queues.values())) == 2
    two = predict(ctx, {NUM_SERVERS: 2}).predicted_step_ms
    assert two == pytest.approx(predict(ctx, {}).predicted_step_ms, rel=0.02)
    assert predict(ctx, {NUM_SERVERS: 1}).predicted_step_ms > two


def test_the_search_tries_no_more_servers_than_their_machines_have_cpus(tmp_path):
    from dpro.engines.mxnet_ps import max_servers

    run, _ = _with_cpus(tmp_path)
    assert max_servers(run) == 2  # both servers on the one 2-CPU machine
    result = optimize(context(run))
    env = result.knobs.get("env") or {}
    assert int(env.get("DMLC_NUM_SERVER", 2)) <= 2
    assert "at most 2 server(s)" in " ".join(item["why"] for item in result.explain)
    assert max_servers(load_run(RECORDED)) is None or max_servers(load_run(RECORDED)) >= 1


def _recommends_only_what_both_fits_gain(ctx, model, plain) -> None:
    """The recorded step cannot tell a wait per message from a slower link: the search weighs a setting by the less
    hopeful of the two fits."""
    from dpro.engines.mxnet_ps import ps_model, rate_scaled_model
    from dpro.sim.whatif import replay_model

    other = rate_scaled_model(ctx)
    assert other.link_latency_us == 0 and other.link_us_per_byte == pytest.approx(plain.link_us_per_byte, rel=0.01)
    result = optimize(ctx)
    assert "two fits of the links" in " ".join(item["why"] for item in result.explain)
    env = result.knobs.get("env")
    if env:
        knobs = {NUM_SERVERS: int(env["DMLC_NUM_SERVER"]), BIGARRAY_BOUND: int(env["MXNET_KVSTORE_BIGARRAY_BOUND"])}
        for fit in (model, other):
            def step(k, fit=fit):
                return replay_model(ctx, ps_model(ctx, k, fit), k).predicted_step_ms
            assert step(knobs) < 0.97 * step({NUM_SERVERS: 2, BIGARRAY_BOUND: 1_000_000})


def test_the_knobs_are_the_engines_and_tensor_groups_are_refused():
    table = knob_table()
    assert table[NUM_SERVERS].engine == table[BIGARRAY_BOUND].engine == "mxnet-ps"
    ctx = context(load_run(RECORDED))
    with pytest.raises(UsageError, match="one key per parameter"):
        predict(ctx, {"tensor_groups": [[n for n, _ in ctx.gradients]]})


def test_the_recorded_run_replays_with_requests_on_the_servers_host_queue():
    run = load_run(RECORDED)
    ctx = context(run)
    assert set(ctx.base.transfer_queues.values()) == {(f"server@{run.meta['mxnet']['server_hosts'][0]}",)}
    replayed = predict(ctx, {}).predicted_step_ms
    assert replayed == pytest.approx(ctx.base.measured_step_us / 1000, rel=0.10)
    # the recorded layout priced by the fitted server model replays where the measured requests do
    assert predict(ctx, {NUM_SERVERS: 2}).predicted_step_ms == pytest.approx(replayed, rel=0.02)


def test_one_server_on_the_same_host_changes_little_and_on_hosts_of_their_own_serializes(tmp_path):
    same = context(load_run(RECORDED))
    two, one = predict(same, {NUM_SERVERS: 2}).predicted_step_ms, predict(same, {NUM_SERVERS: 1}).predicted_step_ms
    assert one == pytest.approx(two, rel=0.02)  # one machine answers one request after another either way
    apart = tmp_path / "apart"
    shutil.copytree(RECORDED, apart)
    meta = json.loads((apart / "run.json").read_text())
    meta["mxnet"]["server_hosts"] = None  # servers on machines of their own (not known: one queue each)
    (apart / "run.json").write_text(json.dumps(meta))
    ctx = context(load_run(apart))
    assert len(set(ctx.base.transfer_queues.values())) == 2
    assert predict(ctx, {NUM_SERVERS: 1}).predicted_step_ms > predict(ctx, {NUM_SERVERS: 2}).predicted_step_ms
    split = predict(ctx, {BIGARRAY_BOUND: 1000})  # every weight over both servers
    assert split.predicted_step_ms > 0
    result = optimize(ctx)
    assert any("server" in item["why"] for item in result.explain)
    env = result.knobs.get("env", {})
    assert not env or int(env["DMLC_NUM_SERVER"]) >= 2


def test_the_engine_says_how_its_config_is_applied():
    engine = get_engine("mxnet-ps")
    assert "DMLC_NUM_SERVER" in engine.apply and "MXNET_KVSTORE_BIGARRAY_BOUND" in engine.apply


def _on_two_hosts(tmp_path: Path, link_probe: object = None, name: str = "two-hosts"):
    """The recorded run's context with worker 0 and server 0 on hostB, worker 1 and server 1 on hostA (and, if
    given, a link probe in run.json)."""
    apart = tmp_path / name
    shutil.copytree(RECORDED, apart)
    meta = json.loads((apart / "run.json").read_text())
    meta["mxnet"].update(server_hosts=["hostB", "hostA"], worker_hosts=["hostB", "hostA"], link_probe=link_probe)
    (apart / "run.json").write_text(json.dumps(meta))
    return context(load_run(apart))


def _streams(*rates: object) -> dict:
    return {"streams": [{"from": "hostA", "to": "hostB", "bytes_per_s": r} for r in rates], "seconds": 0.3}


def test_the_link_probe_gives_the_median_rate_of_its_streams(tmp_path):
    run = _on_two_hosts(tmp_path, _streams(100e6, 120e6, 900e6)).run
    assert link_rate(run) == pytest.approx(120.0)  # bytes/us
    assert "carried 120 MB/s" in " ".join(get_engine("mxnet-ps").notes(run))  # dpro analyze says so
    assert link_rate(_on_two_hosts(tmp_path, _streams(120e6, "fast", None, -5, float("nan")), "bad").run) == 120.0
    for i, bad in enumerate((None, 7, {"streams": "x"}, _streams(None), _streams(0))):
        assert link_rate(_on_two_hosts(tmp_path, bad, f"none{i}").run) is None, bad


def test_links_at_the_probed_rate_leave_each_message_a_wait_fitted_to_the_recorded_step(tmp_path):
    """Links probed faster than the recorded requests went: the bytes go at the probed rate and each message
    between hosts waits a fitted time beyond them, so that the recorded layout replays to the recorded step. A
    probe slower than the recorded requests went cannot be: the links' cost per byte is scaled instead."""
    from dpro.engines.mxnet_ps import server_model

    plain = server_model(_on_two_hosts(tmp_path, None, "plain"))
    assert plain.link_latency_us == 0 and plain.link_us_per_byte > 0
    for name, rate, waits in (("fast", 50 / plain.link_us_per_byte, True), ("slow", 0.02 / plain.link_us_per_byte,
                                                                             False)):
        ctx = _on_two_hosts(tmp_path, _streams(rate * 1e6), name)
        model = server_model(ctx)
        assert (model.link_latency_us > 0) is waits, name
        if waits:
            assert model.link_us_per_byte == pytest.approx(1 / rate)
            assert "each message waiting" in get_engine("mxnet-ps").describe_model(ctx)
            _recommends_only_what_both_fits_gain(ctx, model, plain)
        assert predict(ctx, {NUM_SERVERS: 2}).predicted_step_ms == pytest.approx(predict(ctx, {}).predicted_step_ms,
                                                                                  rel=0.02)


def test_servers_on_other_hosts_are_priced_by_the_links_between_hosts(tmp_path):
    """Each worker and server on a host of its own (as in bench/mxnet_ps.py's emulated network): a key's pushes
    and answers cross the connection between two hosts, and one server's host carries every remote push."""
    ctx = _on_two_hosts(tmp_path)
    from dpro.engines.mxnet_ps import ps_model, server_model

    model = server_model(ctx)
    assert model.link_us_per_byte > 0 and model.us_per_byte == 0  # the recorded requests crossed hosts
    replayed = predict(ctx, {}).predicted_step_ms
    assert predict(ctx, {NUM_SERVERS: 2}).predicted_step_ms == pytest.approx(replayed, rel=0.02)
    one = predict(ctx, {NUM_SERVERS: 1})
    split = predict(ctx, {BIGARRAY_BOUND: 1000})  # every key half on each server: both connections carry half
    assert split.predicted_step_ms < predict(ctx, {NUM_SERVERS: 1, BIGARRAY_BOUND: 1000}).predicted_step_ms
    exchanges = ps_model(ctx, {NUM_SERVERS: 1}, model).exchanges
    links = {q for parts in exchanges.values() for part in parts for _, qs in part.push.values() for q in qs}
    assert links == {"link-out@hostA", "link-in@hostB"}  # worker 1 (hostA) pushes to the one server, on hostB
    assert predict(ctx, {"env": {"DMLC_NUM_SERVER": "1"}}).predicted_step_ms == one.predicted_step_ms


def test_a_transfer_takes_its_hosts_outgoing_and_incoming_links():
    assert link_queues("A", "B") == ("link-out@A", "link-in@B")
    assert not set(link_queues("A", "B")) & set(link_queues("B", "A"))  # full duplex: opposite ways side by side


def test_a_hosts_pushes_and_its_servers_answers_share_the_link_they_both_take(tmp_path):
    """Two hosts, a worker and a server on each, every key split over both servers: worker B's pushes to the
    server on A and server B's answers to worker A both leave host B. They are messages on two connections sharing
    link-out@hostB, so they run at once, not one after the other."""
    ctx = _on_two_hosts(tmp_path)
    from dpro.dag.wiring import graph_from_steps
    from dpro.engines.mxnet_ps import ps_model, server_model
    from dpro.sim.replay import replay

    g = graph_from_steps(ps_model(ctx, {BIGARRAY_BOUND: 1000}, server_model(ctx)), iterations=2)
    assert g.flows is not None and g.flows.size > 0
    sched = replay(g)
    out_of_b = [(float(sched.start[n]), float(sched.end[n]), g.names[n]) for n, links in
                zip(g.flows.nodes, g.flows.links, strict=True)
                if g.iteration[n] == 1 and g.flows.link_names[links[0]] == "link-out@hostB"]
    pushes = [(s, e) for s, e, name in out_of_b if name.endswith(".push") and e > s]
    answers = [(s, e) for s, e, name in out_of_b if name.endswith(".pull") and e > s]
    assert pushes and answers
    assert any(s1 < e2 and s2 < e1 for s1, e1 in pushes for s2, e2 in answers)  # at once on one link



def test_a_fitted_shape_no_scale_can_fit_falls_back_to_the_mean_cost_per_byte():
    """Along a server's queue the requests may all end together, the first holding the whole wait: the slope of
    time against bytes comes out near 0, and no scale of it replays the recorded step. The model is then the mean
    cost per byte, scaled, and replays the recorded step."""
    import dataclasses
    import importlib

    engine = importlib.import_module("dpro.engines.mxnet_ps")
    ctx = context(load_run(RECORDED))
    fitted, step_of, target = engine._fit_inputs(ctx)
    flat = dataclasses.replace(fitted, fixed_us=0.0, us_per_byte=fitted.us_per_byte * 1e-9)
    assert abs(step_of(engine._fit_scale(flat, step_of, target)) - target) > engine.SCALE_TOLERANCE * target
    model = engine._scaled_to_recorded(ctx, flat, step_of, target)
    assert model.source.startswith("mean cost per byte")
    assert step_of(model) == pytest.approx(target, rel=engine.SCALE_TOLERANCE)
