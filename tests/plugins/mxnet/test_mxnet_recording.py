"""MXNet recording on real ps-lite jobs (2 workers, 1 or 2 servers, loopback), run by the MXNet venv's
interpreter (``make mxnet``): the Profiler in a Gluon loop, an unmodified script under ``dpro-launch --engine
mxnet``, a hybridized block, a worker that dies inside the window; on an emulated network of two machines, the
link probe."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobrunner import JOBS, job_env, run_job

from dpro import testbed
from dpro.engines.mxnet_ps import link_rate
from dpro.io.load import load_run

ROOT = Path(__file__).resolve().parents[3]
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"
needs_mxnet = pytest.mark.skipif(not MXNET_PYTHON.exists(), reason="no MXNet venv here (make mxnet builds it)")
pytestmark = [pytest.mark.slow, needs_mxnet]


def launch(*argv: str, servers: int = 2) -> list[str]:
    return [sys.executable, "-m", "dpro.launch", "--engine", "mxnet", "-np", "2", "-H", "localhost:2",
            "--num-servers", str(servers), *argv]


def events(run: Path, rank: int) -> list[dict]:
    doc = json.loads((run / f"rank-{rank}.json").read_text())
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def gradients(run: Path) -> dict[str, int]:
    return {g["name"]: g["bytes"] for g in json.loads((run / "model.json").read_text())["gradients"]}


def analyzed(run: Path) -> dict:
    proc = run_job([sys.executable, "-m", "dpro", "analyze", "--json", str(run)], timeout=120)
    return json.loads(proc.stdout)


def test_the_profiler_records_blocks_and_push_pulls_on_two_workers_and_servers(tmp_path):
    run = tmp_path / "run"
    run_job(launch("--no-profile", str(MXNET_PYTHON), str(JOBS / "mxnet_profiled.py"), str(run)), cwd=tmp_path,
            timeout=150)
    loaded = load_run(run)
    assert sorted(loaded.ranks) == [0, 1] and loaded.meta["engine"] == "mxnet-ps"
    assert loaded.meta["knobs"]["num_servers"] == 2
    grads = gradients(run)
    blocks = {name.rpartition(".")[0] for name in grads}  # every block with parameters: 0.0, 0.2, 2, 3
    assert blocks == {"0.0", "0.2", "2", "3"}
    for rank in (0, 1):
        evs = events(run, rank)
        steps = sorted({e["args"]["step"] for e in evs})
        assert steps == list(range(4, 10))
        for step in steps:
            mine = [e for e in evs if e["args"]["step"] == step]
            assert {e["name"][3:] for e in mine if e["cat"] == "FW"} == blocks
            assert {e["name"][3:] for e in mine if e["cat"] == "BW"} == blocks
            comm = [e for e in mine if e["cat"] == "COMM"]
            # one push_pull per kvstore key; pushed bytes per step = the gradient bytes
            assert sorted(t for e in comm for t in e["args"]["tensors"]) == sorted(grads)
            assert sum(e["args"]["bytes"] for e in comm) == sum(grads.values())
            assert {s for e in comm for s in e["args"]["servers"]} == {0, 1}  # small keys spread over both
            step_event = next(e for e in mine if e["cat"] == "STEP")
            last_bw = max(e["ts"] + e["dur"] for e in mine if e["cat"] == "BW")
            first_fw = min(e["ts"] for e in mine if e["cat"] == "FW")
            assert step_event["ts"] <= first_fw < last_bw
            for e in comm:  # a key is pushed once its gradient is ready, and answered before the step ends
                # (MXNet's profiler times are mapped onto the rank's clock: tens of µs apart from the STEP marks)
                slack = 200.0
                assert e["ts"] >= first_fw - slack
                assert e["ts"] + e["dur"] <= step_event["ts"] + step_event["dur"] + slack, (e, step_event)
    result = analyzed(run)
    assert result["measured_step_ms"] > 0 and abs(result["error_pct"]) < 50  # the bench measures accuracy


def test_an_unmodified_script_is_recorded_and_priced_for_one_server(tmp_path):
    run = tmp_path / "run"
    run_job(launch("--run-dir", str(run), "--profile", "3:9", str(MXNET_PYTHON), str(JOBS / "mxnet_gluon_job.py"),
                   "--steps", "12"), cwd=tmp_path, timeout=150)
    loaded = load_run(run)
    assert loaded.meta["engine"] == "mxnet-ps" and loaded.meta["mxnet"]["server_hosts"]
    assert set(loaded.meta["mxnet"]["host_cpus"]) == set(loaded.meta["mxnet"]["worker_hosts"])  # servers share them
    # the window began at step 3: push_pulls of dpro's own key, twice after one to warm up (no more than the
    # trainer's keys were pushed), on one server; each worker read its machine's busy CPUs meanwhile
    probe = loaded.meta["mxnet"]["server_probe"]
    assert probe["rounds"] == 2 and probe["server"] in (0, 1)
    assert probe["bytes"] == 4 * 999_999  # float32, one element under MXNet's default bound: on one server
    assert len(probe["us_per_round"]) == 2 and all(t > 0 for t in probe["us_per_round"])
    assert len(probe["busy_cpus"]) == 2 and all(0 <= c <= 64 for c in probe["busy_cpus"])
    assert loaded.meta["mxnet"]["link_probe"] is None  # both workers on one machine: no link between them
    for rank in (0, 1):
        names = {e["name"] for e in events(run, rank)}
        assert {"FW.0", "FW.1", "BW.0", "BW.1"} <= names
        assert {f"COMM.{g}.push_pull" for g in gradients(run)} <= names
    proc = run_job([sys.executable, "-m", "dpro", "whatif", str(run), "--set", "num_servers=1"], timeout=120)
    assert "num_servers=1" in proc.stdout


def test_a_hybridized_block_is_split_into_its_blocks_with_parameters(tmp_path):
    run = tmp_path / "run"
    run_job(launch("--no-profile", str(MXNET_PYTHON), str(JOBS / "mxnet_profiled.py"), str(run), "--hybridize"),
            cwd=tmp_path, timeout=150)
    evs = events(run, 0)
    inside = [e for e in evs if e["cat"] in ("FW", "BW") and e["name"].split(".", 1)[1].startswith("0.")]
    assert {e["name"] for e in inside} == {"FW.0.0", "FW.0.2", "BW.0.0", "BW.0.2"}
    # the cached graph's forward is one bulk: its blocks' shares are estimates, said so
    assert all("hybridized" in e["args"]["estimated"] for e in inside if e["cat"] == "FW")
    # its backward writes each block's gradients as it reaches them: a block's backward ends with its own gradients,
    # unless the engine wrote both together (one bulked segment, said so)
    for e in (e for e in inside if e["cat"] == "BW"):
        own = {g.rpartition(".")[0] for g in e["args"]["grads"]}
        assert own == {e["name"][3:]} or "hybridized" in e["args"].get("estimated", ""), e
    for step in {e["args"]["step"] for e in evs}:  # every gradient ready once per step, at some block's backward
        carried = [g for e in evs if e["cat"] == "BW" and e["args"]["step"] == step for g in e["args"]["grads"]]
        assert sorted(carried) == sorted(gradients(run))


def test_a_worker_dying_in_the_window_leaves_the_steps_it_finished(tmp_path):
    run = tmp_path / "run"
    proc = run_job(launch("--no-profile", str(MXNET_PYTHON), str(JOBS / "mxnet_profiled.py"), str(run),
                          "--steps", "300", "--fail-at", "7"), cwd=tmp_path, timeout=150, check=False)
    assert proc.returncode == 3 and "exited with status 3; stopping the others" in proc.stderr
    loaded = load_run(run)  # the journals of both workers
    assert sorted(loaded.ranks) == [0, 1]
    assert all({4, 5} <= set(trace.steps) for trace in loaded.ranks.values())
    assert analyzed(run)["measured_step_ms"] > 0


def test_a_second_window_in_one_job_records_again(tmp_path):
    """Two Profiler windows, one after the other, on one kvstore: the second one's server probe must not set up its
    key again (a second init would be a push the other workers never match)."""
    first, second = tmp_path / "first", tmp_path / "second"
    run_job(launch("--no-profile", str(MXNET_PYTHON), str(JOBS / "mxnet_profiled.py"), str(first), "--again",
                   str(second)), cwd=tmp_path, timeout=150)
    one, two = load_run(first), load_run(second)
    assert sorted(one.ranks) == sorted(two.ranks) == [0, 1]
    assert one.meta["mxnet"]["server_probe"] and two.meta["mxnet"]["server_probe"]


_netns_ok, _netns_why = testbed.testbed_available()


@pytest.mark.skipif(not _netns_ok, reason=_netns_why)
def test_workers_on_two_machines_probe_the_link_between_them(tmp_path):
    """Worker 0 with the scheduler and the server on one emulated machine, worker 1 on another, 1 Gbit/s between
    them (dpro.testbed): the recorder streams from worker 1's machine to worker 0's and finds the link's rate, not
    loopback's, and the what-ifs price the links at that rate. The side channel's usual port is taken on both
    machines (as ps-lite's own connections may take it): worker 0 listens on another and tells the others."""
    from dpro.record.socket_transport import side_port_of

    run = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    argv = [str(MXNET_PYTHON), str(JOBS / "mxnet_profiled.py"), str(run), "--steps", "10", "--window", "4:8"]
    held = side_port_of(port)
    hold = (f"import socket, time; s = socket.socket(); s.bind(('', {held})); s.listen(1); print('held', flush=True); "
            "time.sleep(300)")
    with testbed.emulated_cluster(2, testbed.NetworkSpec(rate="1gbit")) as cluster:
        hosts = [h.address for h in cluster.hosts]
        base = job_env(DMLC_PS_ROOT_URI=hosts[0], DMLC_PS_ROOT_PORT=str(port), DMLC_NUM_SERVER="1",
                       DMLC_NUM_WORKER="2", DPRO_MXNET_SERVER_HOSTS=hosts[0])
        procs = [("holder", cluster.popen(h, [sys.executable, "-c", hold], stdout=subprocess.PIPE)) for h in (0, 1)]
        try:
            for _, holder in procs:
                assert holder.stdout.readline().strip() == b"held"
            for role, host in (("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1)):
                env = dict(base, DMLC_ROLE=role, DMLC_NODE_HOST=hosts[host])
                procs.append((role, cluster.popen(host, argv, env=env, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT)))
                time.sleep(0.5)
            for role, proc in procs[2:]:
                out, _ = proc.communicate(timeout=150)
                assert proc.returncode == 0, f"{role} exited {proc.returncode}:\n{out.decode()[-3000:]}"
                assert b"recording stopped" not in out, out.decode()[-3000:]
        finally:
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    loaded = load_run(run)
    assert sorted(loaded.meta["mxnet"]["worker_hosts"]) == sorted(hosts)
    streams = loaded.meta["mxnet"]["link_probe"]["streams"]
    assert len(streams) == 1 and {streams[0]["from"], streams[0]["to"]} == set(hosts)
    # 1 Gbit/s is 125 MB/s less TCP's and IP's headers; loopback carries gigabytes a second
    assert 60e6 < streams[0]["bytes_per_s"] < 125e6
    assert link_rate(loaded) == pytest.approx(streams[0]["bytes_per_s"] / 1e6)
    proc = run_job([sys.executable, "-m", "dpro", "whatif", str(run), "--set", "num_servers=2"], timeout=120)
    assert "links between hosts" in proc.stdout
