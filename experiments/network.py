"""An emulated cluster network on one machine: the launchers' ``network`` option.

On loopback, gloo's transfers are memory copies made by the same cores that compute, with
no bandwidth limit: no step is ever bound by the wire, and no transfer can run beside the
backward pass. Linux can instead give every node of ranks a network of its own, each node's
link shaped to a cluster's bandwidth. ``network=emulated network.rate=1gbit`` (both
``python -m experiments.bench`` and ``python -m experiments.train``) does this:

* a *hub*: ``unshare --net --pid --mount-proc --fork --kill-child python -m
  experiments.network hub PLAN``, pid 1 of a PID namespace of its own, whose network
  namespace holds a bridge (:data:`BRIDGE`, 10.77.0.1/24);
* from inside the hub, one network namespace per node (``unshare --net``), joined to the
  bridge by a veth pair (``dpkh<i>`` on the bridge, ``eth0`` in the node at
  10.77.0.<i+2>/24), both ends shaped by a token-bucket filter at ``rate``
  (``tc qdisc ... tbf``): a node sends and receives at most ``rate``;
* each node runs its command there (the elastic agent of its ranks,
  :mod:`experiments.bench.launch`); the ranks rendezvous and talk over the 10.77.0.0/24
  addresses only (gloo bound to ``eth0``).

Nothing is made outside these namespaces, and nothing outlives them. The hub is pid 1 of its
PID namespace: when it ends, the kernel kills every process in it, the node namespaces lose
their last process and vanish with their links. The hub dies with the ``unshare`` that
started it (``--kill-child``), and that ``unshare`` with the launcher (``PR_SET_PDEATHSIG``),
so a crash, a timeout or Ctrl-C leaves nothing behind; there are no named namespaces
(``ip netns``), whose bind mounts would.

What is emulated is each node's bandwidth, both ways. Latency is not: this kernel has no
``netem``, and a round trip stays the host's. Above some rate the host's cores cannot push
the bytes through veth, bridge and gloo any faster; the benchmark measures that rate in
every job (:func:`experiments.bench.link_probe.faithful_rate`) and records it in its rows.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from experiments.errors import ExperimentError

__all__ = [
    "Network",
    "NetworkUnavailable",
    "NodeLink",
    "address",
    "check_host",
    "format_rate",
    "from_config",
    "missing_pieces",
    "node_link",
    "parse_rate",
    "run_nodes",
]

#: The bridge in the hub's namespace, and the /24 every address lives in (namespaces only).
BRIDGE = "dpk0"
SUBNET = "10.77.0"
#: The hub's address on the bridge; node i is ``SUBNET.(i + 2)``.
HUB_ADDRESS = f"{SUBNET}.1"
#: A node's end of its veth pair, inside its namespace.
NODE_LINK = "eth0"
#: Environment variable through which a node's processes learn their link (:func:`node_link`).
ENV = "DPKFAC_NETWORK"
#: The hub's network namespace as every process of its PID namespace sees it (it is pid 1).
HUB_NS = "/proc/1/ns/net"
#: Queue of a tbf in time at its rate: deep enough that TCP is paced, not dropped.
QUEUE_MS = 50
#: The token bucket: 2 ms at the rate, at least 64 KiB (several full-size segments).
BURST_S, MIN_BURST = 0.002, 64 * 2**10
#: Seconds a node may take to enter its namespace, and the others to end after one failed.
START_S, GRACE_S = 10.0, 30.0
#: Linux capability bits (linux/capability.h) and prctl's PR_SET_PDEATHSIG.
CAP_NET_ADMIN, CAP_SYS_ADMIN, PR_SET_PDEATHSIG = 12, 21, 1
#: Tools the network is built with: iproute2 and util-linux.
TOOLS = {"ip": "iproute2", "tc": "iproute2", "unshare": "util-linux", "nsenter": "util-linux"}

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class NetworkUnavailable(ExperimentError):
    """The emulated network cannot be built here; the message names the missing piece."""


def parse_rate(value: str | int | float) -> int:
    """Bits per second of ``network.rate``: ``1gbit``, ``200mbit``, ``2.5Gbit`` or a number.

    Only bit units (tc's ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``, decimal) are
    accepted: tc reads ``mbps`` as megabytes per second, which is too easy to get wrong by 8x.

    Raises:
        ValueError: Naming the value and what is accepted.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid rate {value!r}: expected e.g. 1gbit, 200mbit or bits/s")
    if isinstance(value, int | float):
        number, unit = float(value), "bit"
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match:
            raise ValueError(f"invalid rate {value!r}: expected e.g. 1gbit, 200mbit or bits/s")
        number, unit = float(match[1]), (match[2].lower() or "bit")
        if unit not in _UNITS:
            raise ValueError(
                f"invalid rate {value!r}: unit {match[2]!r} is not one of "
                f"{', '.join(_UNITS)} (bits per second; tc reads 'bps' as bytes)"
            )
    bps = round(number * _UNITS[unit])
    if bps < 10**5:
        raise ValueError(f"invalid rate {value!r}: expected at least 100kbit")
    return bps


def format_rate(bps: float) -> str:
    """``1gbit``, ``200mbit``, ``2.5gbit``: a rate as people (and tc) write it."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps >= _UNITS[unit]:
            return f"{bps / _UNITS[unit]:g}{unit}"
    return f"{bps:g}bit"


def address(node: int) -> str:
    """Node ``node``'s address on the bridge (namespaces only)."""
    if not 0 <= node < 250:
        raise ValueError(f"node {node} outside the network's 250 addresses")
    return f"{SUBNET}.{node + 2}"


def burst_bytes(rate_bps: int) -> int:
    """The token bucket of a link at ``rate_bps`` (:data:`BURST_S` of it, at least 64 KiB)."""
    return max(int(rate_bps / 8 * BURST_S), MIN_BURST)


def tbf(device: str, rate_bps: int, verb: str = "add") -> list[str]:
    """The tc command that shapes ``device``'s egress to ``rate_bps`` (``verb``: add/change)."""
    return [
        "tc", "qdisc", verb, "dev", device, "root", "tbf",
        "rate", f"{rate_bps}bit", "burst", str(burst_bytes(rate_bps)), "latency", f"{QUEUE_MS}ms",
    ]  # fmt: skip


def hub_link(node: int) -> str:
    """The bridge's end of node ``node``'s veth pair, in the hub's namespace."""
    return f"dpkh{node}"


@dataclass(frozen=True)
class Network:
    """An emulated network: every node's link shaped to ``rate_bps`` both ways.

    Attributes:
        rate_bps: Bits per second each node sends and receives at most.
        ranks_per_node: Ranks sharing a node's namespace (they talk over its loopback).
    """

    rate_bps: int
    ranks_per_node: int = 1

    @property
    def label(self) -> str:
        """``emulated 1gbit``: how rows, tables and logs name it."""
        return f"emulated {format_rate(self.rate_bps)}"

    def nodes(self, world_size: int) -> int:
        """How many nodes ``world_size`` ranks fill.

        Raises:
            ExperimentError: ``world_size`` is not a multiple of ``ranks_per_node``, or
                fills fewer than two nodes (nothing would cross the network).
        """
        nodes, rest = divmod(world_size, self.ranks_per_node)
        if rest or nodes < 2:
            raise ExperimentError(
                f"network=emulated with {world_size} rank(s) and network.ranks_per_node="
                f"{self.ranks_per_node}: expected a world size that fills at least 2 nodes "
                "(a multiple of ranks_per_node)"
            )
        return nodes

    def describe(self) -> dict[str, Any]:
        """What a row records of the network it ran on."""
        return {"network": "emulated", "network_rate_bps": self.rate_bps}


#: What a row records when it ran on loopback.
LOOPBACK = {"network": "loopback", "network_rate_bps": None}


def from_config(node: Mapping[str, Any] | None) -> Network | None:
    """The ``network`` config node as a :class:`Network` (None or absent: loopback).

    Raises:
        ExperimentError: Naming the offending key and value.
    """
    if node is None:
        return None
    name = node.get("name")
    if name is None or name == "loopback":
        return None
    if name != "emulated":
        raise ExperimentError(f"invalid value network.name={name!r}: expected emulated or null")
    try:
        rate = parse_rate(node.get("rate"))
    except ValueError as err:
        raise ExperimentError(f"invalid value network.rate: {err}") from None
    per_node = node.get("ranks_per_node", 1)
    if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 1:
        raise ExperimentError(
            f"invalid value network.ranks_per_node={per_node!r}: expected a positive integer"
        )
    return Network(rate, per_node)


# ------------------------------------------------------------------ what it needs
def effective_capabilities() -> int:
    """This process's effective capability set (``CapEff`` of /proc/self/status); 0 if unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def missing_pieces(euid: int, capabilities: int, tools: Mapping[str, str | None]) -> list[str]:
    """What the host lacks for the emulated network, one phrase each (empty: nothing).

    Args:
        euid: The effective user id.
        capabilities: The effective capability bits.
        tools: Each of :data:`TOOLS` and where it was found (None: not on PATH).
    """
    missing = []
    if euid != 0:
        missing.append(f"root (running as uid {euid})")
    if not capabilities >> CAP_NET_ADMIN & 1:
        missing.append("CAP_NET_ADMIN (to make links and shape them)")
    if not capabilities >> CAP_SYS_ADMIN & 1:
        missing.append("CAP_SYS_ADMIN (to make namespaces with unshare)")
    for tool, path in tools.items():
        if path is None:
            missing.append(f"`{tool}` on PATH ({TOOLS.get(tool, 'its package')})")
    return missing


#: A throwaway namespace tries every kernel piece; the first that fails is printed.
_KERNEL_CHECK = f"""
ip link add dpkb type bridge 2>/dev/null || {{ echo 'the kernel bridge (CONFIG_BRIDGE)'; exit 1; }}
ip link add dpkv type veth peer name dpkw 2>/dev/null || {{ echo 'veth (CONFIG_VETH)'; exit 1; }}
{" ".join(tbf("dpkv", 10**9))} 2>/dev/null || {{ echo 'tbf (CONFIG_NET_SCH_TBF)'; exit 1; }}
"""


@functools.cache
def check_host() -> None:
    """Raise unless this host can build the emulated network (checked once per process).

    The kernel's pieces are tried in a throwaway network namespace of their own, which
    vanishes when the check's shell ends: nothing outside it is touched.

    Raises:
        NetworkUnavailable: Naming every missing piece.
    """
    tools = {tool: shutil.which(tool) for tool in TOOLS}
    missing = missing_pieces(os.geteuid(), effective_capabilities(), tools)
    if not missing:
        probe = subprocess.run(
            ["unshare", "--net", "sh", "-c", _KERNEL_CHECK],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if probe.returncode:
            said = probe.stdout.strip() or f"unshare --net ({probe.stderr.strip()})"
            missing.append(said)
    if missing:
        raise NetworkUnavailable(
            "network=emulated cannot run on this host: it needs " + "; ".join(missing)
        )


# ------------------------------------------------------------------------ the plan
def hub_commands() -> list[list[str]]:
    """What the hub runs in its own namespace first: loopback up, the bridge and its address."""
    return [
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", f"{HUB_ADDRESS}/24", "dev", BRIDGE],
        ["ip", "link", "set", BRIDGE, "up"],
    ]


def link_commands(node: int, pid: int, rate_bps: int) -> list[list[str]]:
    """The hub's commands joining node ``node`` (its first process is ``pid``) to the bridge.

    The veth pair is made in the hub's namespace with its node end moved straight into the
    node's (``netns <pid>``); that end is then configured from inside it (``nsenter``).
    Both ends get a tbf: the node's shapes what it sends, the bridge's what it receives.
    """
    inside = ["nsenter", "--target", str(pid), "--net", "--"]
    here = hub_link(node)
    return [
        ["ip", "link", "add", here, "type", "veth", "peer", "name", NODE_LINK, "netns", str(pid)],
        ["ip", "link", "set", here, "master", BRIDGE],
        ["ip", "link", "set", here, "up"],
        tbf(here, rate_bps),
        [*inside, "ip", "link", "set", "lo", "up"],
        [*inside, "ip", "addr", "add", f"{address(node)}/24", "dev", NODE_LINK],
        [*inside, "ip", "link", "set", NODE_LINK, "up"],
        [*inside, *tbf(NODE_LINK, rate_bps)],
    ]


#: A node's command waits in its fresh namespace for the hub's go (a line on stdin).
_WAIT_FOR_LINK = 'read go && exec "$@"'


def node_command(argv: Sequence[str]) -> list[str]:
    """How the hub starts a node: a namespace of its own, where ``argv`` waits for its link."""
    return ["unshare", "--net", "--", "sh", "-c", _WAIT_FOR_LINK, "dpkfac-node", *argv]


def hub_command(plan: Path) -> list[str]:
    """How the launcher starts the hub: pid 1 of new PID, mount and network namespaces."""
    return [
        "unshare", "--net", "--pid", "--mount-proc", "--fork", "--kill-child",
        sys.executable, "-m", "experiments.network", "hub", str(plan),
    ]  # fmt: skip


# ------------------------------------------------------------------- node's view
@dataclass(frozen=True)
class NodeLink:
    """What a node's processes know of their link (from :data:`ENV`).

    Attributes:
        node: This node's index.
        nodes: How many nodes the network has.
        rate_bps: The rate its links were made with.
    """

    node: int
    nodes: int
    rate_bps: int

    @property
    def address(self) -> str:
        """This node's address on the bridge."""
        return address(self.node)

    def set_rate(self, rate_bps: int) -> None:
        """Reshape both ends of this node's link to ``rate_bps`` (the link probe's ladder).

        The bridge's end lives in the hub's namespace, which every process of the
        network reaches as :data:`HUB_NS`.
        """
        _run(tbf(NODE_LINK, rate_bps, "change"))
        _run(["nsenter", f"--net={HUB_NS}", "--", *tbf(hub_link(self.node), rate_bps, "change")])


def node_link() -> NodeLink | None:
    """This process's node on the emulated network (None: not on one)."""
    raw = os.environ.get(ENV)
    return NodeLink(**json.loads(raw)) if raw else None


def node_env(node: int, nodes: int, rate_bps: int) -> dict[str, str]:
    """Environment of node ``node``'s processes: its link, and the interface gloo must use."""
    link = json.dumps(asdict(NodeLink(node, nodes, rate_bps)))
    return {ENV: link, "GLOO_SOCKET_IFNAME": NODE_LINK, "NCCL_SOCKET_IFNAME": NODE_LINK}


# ------------------------------------------------------------------------- the hub
def _run(argv: Sequence[str]) -> None:
    """Run one plan command; a failure raises naming the command and what it printed."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if done.returncode:
        said = (done.stderr or done.stdout).strip()
        raise RuntimeError(f"{' '.join(argv)} failed (exit {done.returncode}): {said}")


def _await_namespace(pid: int, hub: str) -> None:
    """Wait until process ``pid`` has left the hub's network namespace for its own."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != hub:
                return
        except OSError:
            break  # it ended
        time.sleep(0.005)
    raise RuntimeError(f"node process {pid} did not enter a network namespace of its own")


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Every node's exit status; once one fails, the others get :data:`GRACE_S` to end."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.returncode for p in procs if p.returncode is not None):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return [int(p.returncode) for p in procs]


def hub_main(plan_path: str) -> int:
    """The hub (pid 1 of the network's PID namespace): build the network, run the nodes.

    The plan (JSON, written by :func:`run_nodes`) holds the rate, every node's command and
    where to write their exit statuses. Returns the first failing status (0: all ran).
    """
    plan = json.loads(Path(plan_path).read_text())
    rate, commands = int(plan["rate_bps"]), plan["commands"]
    hub_ns = os.readlink("/proc/self/ns/net")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv in hub_commands():
            _run(argv)
        for node, argv in enumerate(commands):
            env = {**os.environ, **node_env(node, len(commands), rate)}
            proc = subprocess.Popen(node_command(argv), stdin=subprocess.PIPE, env=env)
            procs.append(proc)
            _await_namespace(proc.pid, hub_ns)
            for step in link_commands(node, proc.pid, rate):
                _run(step)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.close()
        codes = _wait_all(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    Path(plan["status"]).write_text(json.dumps(codes))
    return next((c for c in codes if c), 0)


# -------------------------------------------------------------------- the launcher
def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher's thread ends (PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_nodes(
    network: Network, commands: Sequence[Sequence[str]], *, timeout_s: float | None = None
) -> list[int]:
    """Run ``commands[i]`` on node i of a fresh emulated network; their exit statuses.

    The network is built before the first command starts and gone when this returns or
    raises (every namespace ends with the hub's PID namespace).

    Args:
        network: The rate (and ranks per node, which the commands start themselves).
        commands: One argv per node (at least two).
        timeout_s: Seconds the whole run may take (None: no bound beyond the commands' own).

    Raises:
        NetworkUnavailable: The host cannot build it (naming the missing piece).
        TimeoutError: The run did not end within ``timeout_s``; everything was killed.
        RuntimeError: The network could not be built (the failing command and its message).
    """
    check_host()
    if len(commands) < 2:
        raise ValueError(f"an emulated network needs at least 2 nodes, got {len(commands)}")
    with tempfile.TemporaryDirectory(prefix="dpkfac-net-") as tmp:
        plan, status = Path(tmp) / "plan.json", Path(tmp) / "status.json"
        plan.write_text(
            json.dumps({"rate_bps": network.rate_bps, "commands": [list(c) for c in commands],
                        "status": str(status)})
        )  # fmt: skip
        hub = subprocess.Popen(hub_command(plan), preexec_fn=_die_with_parent)
        try:
            code = hub.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"the emulated network's {len(commands)} nodes did not finish within "
                f"{timeout_s:g} s; they were killed"
            ) from None
        finally:
            if hub.poll() is None:
                hub.kill()
                hub.wait()
        if not status.exists():
            raise RuntimeError(f"the emulated network's hub failed (exit {code}) before its nodes")
        return [int(c) for c in json.loads(status.read_text())]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.network hub PLAN``: the hub, as :func:`run_nodes` starts it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "hub":
        print("usage: python -m experiments.network hub PLAN", file=sys.stderr)
        return 2
    return hub_main(args[1])


if __name__ == "__main__":
    sys.exit(main())
