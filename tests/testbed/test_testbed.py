"""The emulated cluster network (dpro.testbed): real namespaces, real tc limits, real TCP and gloo."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from jobrunner import JOBS  # noqa: E402

from dpro import testbed as tb  # the module, not its functions: pytest would collect testbed_available

_ok, _why = tb.testbed_available()
needs_netns = pytest.mark.skipif(not _ok, reason=_why)


@pytest.fixture(scope="module", autouse=True)
def _no_leftovers():
    if _ok:
        tb.cleanup_stale()  # namespaces of earlier runs that were killed (dead owners only)
    yield


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


# -------------------------------------------------------------------------------- spec validation (no root needed)

@pytest.mark.parametrize("kw, words", [
    ({"rate": "fast"}, "NetworkSpec.rate='fast'"),
    ({"rate": "0gbit"}, "above zero"),
    ({"delay": "5"}, "NetworkSpec.delay='5'"),
    ({"burst": "1kb"}, "at least one frame"),
    ({"subnet": "10.77.0.1/24"}, "NetworkSpec.subnet"),
    ({"subnet": "fd00::/64"}, "IPv4"),
])
def test_spec_rejects_bad_values(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        tb.NetworkSpec(**kw)


def test_spec_units():
    spec = tb.NetworkSpec(rate="10gbit", delay="250us", burst="1mb", subnet="10.9.0.0/30")
    assert (spec.rate_bits, spec.delay_seconds, spec.burst_bytes) == (10e9, 250e-6, 1 << 20)
    assert tb.NetworkSpec(rate="125mbps").rate_bits == 1e9  # tc's bps = bytes per second
    assert spec.addresses(2) == ["10.9.0.1", "10.9.0.2"]
    with pytest.raises(ValueError, match="room for 2 hosts"):
        spec.addresses(3)


def test_wrap_builds_argv_not_shell():
    host = tb.Host(index=0, name="h0", netns="x-h0", address="10.77.0.1")
    assert host.wrap(["echo", "a b; rm -rf /"]) == ["ip", "netns", "exec", "x-h0", "echo", "a b; rm -rf /"]
    with pytest.raises(TypeError):
        host.wrap("echo hi")


# -------------------------------------------------------------------------------- limits are real

@needs_netns
@pytest.mark.slow
def test_bandwidth_follows_rate():
    with tb.emulated_cluster(2, tb.NetworkSpec(rate="1gbit")) as cluster:
        assert [h.address for h in cluster.hosts] == ["10.77.0.1", "10.77.0.2"]
        gbit = tb.measure_bandwidth(cluster, 0, 1, seconds=1.0) / 1e9
        back = tb.measure_bandwidth(cluster, 1, 0, seconds=0.5) / 1e9
        rtt = tb.measure_rtt(cluster)
    with tb.emulated_cluster(2, tb.NetworkSpec(rate="200mbit")) as cluster:
        slow = tb.measure_bandwidth(cluster, 0, 1, seconds=1.0) / 1e9
    assert 0.8 <= gbit <= 1.0, gbit
    assert 0.8 <= back <= 1.0, back
    assert 0.16 <= slow <= 0.2, slow
    assert rtt < 0.005, rtt  # no delay asked for


@needs_netns
def test_delay_sets_round_trip():
    ok, why = tb.netem_available()
    spec = tb.NetworkSpec(rate="1gbit", delay="5ms")
    if not ok:
        with pytest.raises(tb.EmulationError, match="netem"), tb.emulated_cluster(2, spec):
            pass
        pytest.skip(why)
    with tb.emulated_cluster(2, spec) as cluster:
        rtt = tb.measure_rtt(cluster)
    assert 0.010 <= rtt < 0.030, rtt  # 5 ms each way


@needs_netns
def test_hosts_are_isolated_from_the_root_namespace():
    with tb.emulated_cluster(1) as cluster:
        links = cluster.run(0, ["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        addrs = cluster.run(0, ["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == ["eth0", "lo"]
    assert "10.77.0.1/24" in addrs and "127.0.0.1" in addrs


# -------------------------------------------------------------------------------- a real gloo collective

@needs_netns
@pytest.mark.slow
def test_gloo_allreduce_is_limited():
    pytest.importorskip("torch")
    with tb.emulated_cluster(2, tb.NetworkSpec(rate="1gbit")) as cluster:
        results = tb.run_ranks(
            cluster,
            lambda rank: [sys.executable, str(JOBS / "allreduce_job.py"), "--sizes-mb", "8", "--iters", "5"],
            ranks_per_host=1,
            env_for_rank=lambda rank: {**tb.torch_rank_env(cluster, rank, world_size=2, ranks_per_host=1,
                                                           master_port=29511), "PYTHONUNBUFFERED": "1"},
            timeout=60,
        )
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank}\n{res.stdout}\n{res.stderr[-4000:]}"
    median = json.loads(results[0].stdout.splitlines()[-1])["median_s"]
    assert 0.040 < median < 0.5, median  # ~70 ms at 1 Gbit/s; ~10 ms on loopback


def test_torch_rank_env():
    cluster = tb.Cluster(prefix="x", spec=tb.NetworkSpec(), switch_netns="x-sw",
                         hosts=[tb.Host(i, f"h{i}", f"x-h{i}", f"10.77.0.{i + 1}") for i in range(2)])
    env = tb.torch_rank_env(cluster, 3, world_size=4, ranks_per_host=2, master_port=1234)
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "1234", "GLOO_SOCKET_IFNAME": "eth0",
                   "TP_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    with pytest.raises(ValueError, match="needs host 2"):
        tb.torch_rank_env(cluster, 4, world_size=6, ranks_per_host=2)


@needs_netns
@pytest.mark.slow
def test_run_ranks_kills_the_rest_when_one_fails():
    with tb.emulated_cluster(2) as cluster:
        started = time.monotonic()
        results = tb.run_ranks(
            cluster,
            lambda rank: [sys.executable, "-c", "import sys; sys.exit(3)"] if rank == 1
            else [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
            ranks_per_host=2, timeout=30)
        assert time.monotonic() - started < 10
        timed_out = tb.run_ranks(cluster, lambda rank: ["sleep", "60"], timeout=0.5)
    assert [r.returncode for r in results] == [-signal.SIGKILL, 3, -signal.SIGKILL, -signal.SIGKILL]
    assert "killed: rank 1 exited 3" in results[0].stderr
    assert [r.returncode for r in timed_out] == [-signal.SIGKILL] * 2
    assert "timeout after 0.5 s" in timed_out[1].stderr


# -------------------------------------------------------------------------------- cleanup

def _assert_gone(cluster: tb.Cluster) -> None:
    left = set(cluster.netns_names) & _netns()
    assert not left, left
    links = _root_links()
    assert not any(name in links for name in cluster.netns_names), links


@needs_netns
@pytest.mark.parametrize("error", [None, RuntimeError, KeyboardInterrupt])
def test_cleanup_on_exit(error):
    seen = []
    with pytest.raises(error) if error else contextlib.nullcontext():
        with tb.emulated_cluster(2) as cluster:
            seen.append(cluster)
            sleeper = cluster.popen(1, ["sleep", "60"])
            assert set(cluster.netns_names) <= _netns()
            assert len(cluster.netns_names) == 3  # the switch and two hosts
            assert not any(name in _root_links() for name in cluster.netns_names)  # nothing in the root netns
            if error:
                raise error("boom")
    _assert_gone(seen[0])
    assert sleeper.wait(timeout=5) == -signal.SIGKILL  # processes left in a host die with it


@needs_netns
@pytest.mark.slow
def test_cleanup_stale_after_a_crash():
    code = ("import sys, time\nfrom dpro import testbed as tb\n"
            "with tb.emulated_cluster(2, name_prefix=sys.argv[1] or None) as c:\n"
            "    print(c.prefix, *c.netns_names, flush=True)\n    time.sleep(60)\n")
    for explicit in (f"tbcrash{os.getpid()}", ""):
        owner = subprocess.Popen([sys.executable, "-c", code, explicit], stdout=subprocess.PIPE, text=True)
        try:
            prefix, *names = owner.stdout.readline().split()
        finally:
            owner.kill()  # dies without running its cleanup
            owner.wait()
            owner.stdout.close()
        if explicit:  # (an auto-named leftover may go any moment: a parallel run's cleanup_stale() takes it)
            assert set(names) <= _netns()
            with pytest.raises(tb.EmulationError, match="exist already"), tb.emulated_cluster(2, name_prefix=prefix):
                pass
        removed = tb.cleanup_stale(explicit or None)
        if explicit:
            assert set(removed) == set(names)
        assert not set(names) & _netns()


@needs_netns
@pytest.mark.slow
def test_cleanup_on_ctrl_c():
    code = ("import signal, time\nfrom dpro import testbed as tb\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # background shells start us with it ignored\n"
            "with tb.emulated_cluster(2) as c:\n    print(*c.netns_names, flush=True)\n    time.sleep(60)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        names = owner.stdout.readline().split()
        assert len(names) == 3 and set(names) <= _netns()
        owner.send_signal(signal.SIGINT)
        _, err = owner.communicate(timeout=10)
    finally:
        owner.kill()
        owner.wait()
    assert "KeyboardInterrupt" in err
    assert not set(names) & _netns()
