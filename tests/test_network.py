"""The emulated cluster network (experiments/network.py): its plan, its errors, and that it is real.

The multi-process test starts two ranks on the network at 200 Mbit/s through the
benchmark's launcher and checks that an all-reduce takes at least 0.8x its wire bytes at
that rate, and that no namespace or link outlives the run. Where the host cannot build
the network (not root, no CAP_NET_ADMIN, no tc/ip, no tbf) it is skipped with the reason.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from dpkfac.plan.hardware import wire_bytes
from experiments import network as net
from experiments.config import ExperimentError

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------ pure parts
@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1gbit", 10**9),
        ("200mbit", 200 * 10**6),
        ("2.5Gbit", 2_500_000_000),
        (" 100 kbit ", 100_000),
        ("300000000", 300_000_000),
        (5e8, 500_000_000),
        (10**9, 10**9),
    ],
)
def test_rates_parse_in_bits_per_second(text: str | int | float, bps: int) -> None:
    assert net.parse_rate(text) == bps


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("1gbps", "'gbps' is not one of bit, kbit"),
        ("fast", "expected e.g. 1gbit"),
        ("10bit", "at least 100kbit"),
        (True, "expected e.g. 1gbit"),
    ],
)
def test_bad_rates_are_named(text: Any, said: str) -> None:
    with pytest.raises(ValueError, match=said) as err:
        net.parse_rate(text)
    assert repr(text) in str(err.value)


def test_rates_print_as_written() -> None:
    assert [net.format_rate(r) for r in (10**9, 2.5e9, 2e8, 64e3)] == [
        "1gbit",
        "2.5gbit",
        "200mbit",
        "64kbit",
    ]


def test_the_config_node_becomes_a_network() -> None:
    assert net.from_config(None) is None
    assert net.from_config({"name": "loopback"}) is None
    with pytest.raises(ExperimentError, match=r"network.name='none': expected emulated or null"):
        net.from_config({"name": "none"})  # "none" is the first-order strategy's name
    got = net.from_config({"name": "emulated", "rate": "1gbit", "ranks_per_node": 2})
    assert got == net.Network(10**9, 2)
    assert got.label == "emulated 1gbit" and got.nodes(4) == 2
    with pytest.raises(ExperimentError, match=r"network.rate: invalid rate '1gbps'"):
        net.from_config({"name": "emulated", "rate": "1gbps"})
    with pytest.raises(ExperimentError, match=r"network.ranks_per_node=0"):
        net.from_config({"name": "emulated", "rate": "1gbit", "ranks_per_node": 0})
    with pytest.raises(ExperimentError, match=r"network.name='wan'"):
        net.from_config({"name": "wan", "rate": "1gbit"})
    with pytest.raises(ExperimentError, match=r"3 rank\(s\) and network.ranks_per_node=2"):
        got.nodes(3)
    with pytest.raises(ExperimentError, match=r"at least 2 nodes"):
        net.Network(10**9).nodes(1)


def test_missing_pieces_are_each_named() -> None:
    every = (1 << net.CAP_NET_ADMIN) | (1 << net.CAP_SYS_ADMIN)
    found = {tool: f"/usr/sbin/{tool}" for tool in net.TOOLS}
    assert net.missing_pieces(0, every, found) == []
    missing = net.missing_pieces(1000, 0, {**found, "tc": None})
    assert missing == [
        "root (running as uid 1000)",
        "CAP_NET_ADMIN (to make links and shape them)",
        "CAP_SYS_ADMIN (to make namespaces with unshare)",
        "`tc` on PATH (iproute2)",
    ]
    assert net.missing_pieces(0, 1 << net.CAP_SYS_ADMIN, found) == [
        "CAP_NET_ADMIN (to make links and shape them)"
    ]


def test_the_plan_shapes_both_ends_of_every_link_inside_the_namespaces() -> None:
    hub = net.hub_commands()
    assert ["ip", "link", "add", net.BRIDGE, "type", "bridge"] in hub
    assert ["ip", "addr", "add", "10.77.0.1/24", "dev", net.BRIDGE] in hub
    steps = net.link_commands(1, 4242, 200 * 10**6)
    assert steps[0] == [
        "ip", "link", "add", "dpkh1", "type", "veth", "peer", "name", "eth0", "netns", "4242",
    ]  # fmt: skip
    shaped = [s for s in steps if "tbf" in s]
    assert [s[s.index("dev") + 1] for s in shaped] == ["dpkh1", "eth0"]
    for step in shaped:
        assert step[step.index("rate") + 1] == "200000000bit"
        assert int(step[step.index("burst") + 1]) == 64 * 2**10  # 2 ms at 25 MB/s is less
    inside = [s for s in steps if s[0] == "nsenter"]
    assert all(s[:5] == ["nsenter", "--target", "4242", "--net", "--"] for s in inside)
    assert ["ip", "addr", "add", "10.77.0.3/24", "dev", "eth0"] in [s[5:] for s in inside]
    # The hub is pid 1 of namespaces of its own; nodes make theirs from inside it.
    assert net.hub_command(Path("plan.json"))[:6] == [
        "unshare", "--net", "--pid", "--mount-proc", "--fork", "--kill-child",
    ]  # fmt: skip
    assert net.node_command(["python", "x"])[:3] == ["unshare", "--net", "--"]
    assert net.burst_bytes(10**10) == 2_500_000
    with pytest.raises(ValueError, match="node 250"):
        net.address(250)


# ------------------------------------------------------------------- it is real
def _allreduce(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: join over the network's addresses, time an all-reduce of ``numel`` floats."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        dist.all_reduce(torch.ones(1024))  # connections made, buffers warm
        buf = torch.ones(int(spec["numel"]))
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "sum": float(buf[0]),
            "namespace": os.readlink("/proc/self/ns/net"),
            "master": os.environ["MASTER_ADDR"],
        }
    finally:
        dist.destroy_process_group()


def _namespaces() -> set[str]:
    """The network namespaces of every process on the host."""
    out = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out.add(os.readlink(proc / "ns" / "net"))
            except OSError:
                continue
    return out


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@pytest.mark.distributed
def test_an_allreduce_on_the_network_takes_its_wire_time_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    try:
        net.check_host()
    except net.NetworkUnavailable as err:
        pytest.skip(str(err))
    from experiments.bench.launch import launch

    # The nodes' ranks import this module's function by name.
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    rate, numel = 200 * 10**6, 2**20  # 4 MiB: 0.17 s on the wire at 200 Mbit/s
    links_before = _links()
    results = launch(_allreduce, {"numel": numel}, 2, network=net.Network(rate), timeout_s=120)
    wire = wire_bytes("allreduce", 4 * numel, 2) * 8 / rate
    assert [r["sum"] for r in results] == [2.0, 2.0]
    assert all(r["master"].startswith("10.77.0.") for r in results)
    assert min(r["seconds"] for r in results) >= 0.8 * wire, (results, wire)
    spaces = {r["namespace"] for r in results}
    assert len(spaces) == 2 and os.readlink("/proc/self/ns/net") not in spaces
    assert not spaces & _namespaces()  # gone with their processes
    assert _links() == links_before and "dpk" not in _links()


def test_the_launchers_refuse_what_no_network_lies_between() -> None:
    from experiments.bench.run import job_spec
    from experiments.config import compose_config
    from experiments.train import run

    threads = ["network=emulated", "launcher=threads", "launcher.world_size=2", "logger=none"]
    with pytest.raises(ExperimentError, match="network=emulated with launcher=threads"):
        run(compose_config("config", threads))
    with pytest.raises(ExperimentError, match=r"with 1 rank\(s\).*at least 2 nodes"):
        run(compose_config("config", ["network=emulated", "network.world_size=1", "logger=none"]))
    with pytest.raises(ExperimentError, match=r"network\.rate: invalid rate '10 gbps'"):
        job_spec(compose_config("benchmark", ["network=emulated", "network.rate=10 gbps"]))
    with pytest.raises(ExperimentError, match=r"with 3 rank\(s\) and network.ranks_per_node=2"):
        job_spec(
            compose_config(
                "benchmark", ["network=emulated", "network.ranks_per_node=2", "world_size=3"]
            )
        )
