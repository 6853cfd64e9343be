"""The emulated cluster network (Linux network namespaces + tc): a test and benchmark tool, not part of the
analysis pipeline. ``python -m dpro.testbed cleanup`` removes namespaces left by killed runs; see
``dpro.testbed.emulate`` for the details."""

from dpro.testbed.emulate import (
    AUTO_PREFIX,
    BRIDGE_IFNAME,
    HELPER_PORT,
    HOST_IFNAME,
    NETEM_LIMIT,
    TBF_QUEUE_LATENCY,
    Cluster,
    EmulationError,
    Host,
    NetworkSpec,
    cleanup_stale,
    emulated_cluster,
    measure_bandwidth,
    measure_rtt,
    netem_available,
    run_ranks,
    testbed_available,
    torch_rank_env,
)

__all__ = [
    "AUTO_PREFIX",
    "BRIDGE_IFNAME",
    "Cluster",
    "EmulationError",
    "HELPER_PORT",
    "HOST_IFNAME",
    "Host",
    "NETEM_LIMIT",
    "NetworkSpec",
    "TBF_QUEUE_LATENCY",
    "cleanup_stale",
    "emulated_cluster",
    "measure_bandwidth",
    "measure_rtt",
    "netem_available",
    "run_ranks",
    "testbed_available",
    "torch_rank_env",
]
