"""What collectives sharing one link cost: the owner mode's side flows beside a large all-reduce.

In the overlapped owner mode (docs/design.md, section 3.5) a backward bucket's K-FAC gradients
go onto their owners, and the owners' updates come back, while the all-reduce of the bucket's
other gradients is on the wire (BERT's 23.8 MB word embedding). Per direction the link then
carries about what SGD's one all-reduce of the bucket carries; whether it costs that is a
property of the link, gloo and TCP, which this probe measures on the emulated network with
the communicator's own sharded collectives (on gloo alltoallv, :mod:`dpkfac.comm`):

* ``alone``: the all-reduce of ``big_mb``;
* ``whole``: one all-reduce of ``big_mb`` plus the side flows' mean bytes per direction
  (SGD's bucket);
* ``beside``: the all-reduce with the side flows launched as a step launches them: the
  reduction onto the owners at once, the update exchanges on a second process group
  ``delays_ms`` later;
* ``balanced``: ``beside`` with every side flow's two shards made equal (same total);
* ``in_turn``: the side flows one after another, each alone on the link, then the all-reduce.

For each it reports the median over repeats of the slower rank's time, and what a link that
prices the busier direction's bytes at the all-reduce's own rate (``alone``'s) predicts.
P=2 (one rank per node): the shapes are a two-owner step's.

``python -m experiments.bench.flow_probe --rate 1gbit`` runs it on a fresh emulated network.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from experiments import network as network_lib

__all__ = ["SCENARIOS", "SideFlows", "main", "predicted_ms", "run_probe"]

SCENARIOS = ("alone", "whole", "beside", "balanced", "in_turn")
MB = 10**6


class SideFlows:
    """The side flows of one bucket at P=2, in MB per rank's shard.

    Attributes:
        reduction: each owner's shard of the K-FAC gradients (each rank sends the other's).
        exchanges: per update exchange, each owner's shard (each rank sends its own).
        delays_ms: when each exchange is launched after the reduction.
    """

    def __init__(
        self,
        reduction: Sequence[float] = (1.48, 2.67),
        exchanges: Sequence[Sequence[float]] = ((1.18, 0.0), (1.48, 2.67)),
        delays_ms: Sequence[float] = (20.0, 80.0),
    ) -> None:
        if len(reduction) != 2 or any(len(e) != 2 for e in exchanges):
            raise ValueError("side flows are for two ranks: two shards each")
        if len(delays_ms) != len(exchanges):
            raise ValueError(f"{len(exchanges)} exchanges but {len(delays_ms)} delays")
        self.reduction = tuple(float(x) for x in reduction)
        self.exchanges = tuple(tuple(float(x) for x in e) for e in exchanges)
        self.delays_ms = tuple(float(d) for d in delays_ms)

    def balanced(self) -> SideFlows:
        """The same flows with both shards of each equal (the same bytes in all)."""
        half = sum(self.reduction) / 2
        even = tuple((sum(e) / 2, sum(e) / 2) for e in self.exchanges)
        return SideFlows((half, half), even, self.delays_ms)

    def sent_mb(self, rank: int) -> float:
        """MB ``rank`` sends: the other owner's reduction shard, and its own update shards."""
        return self.reduction[1 - rank] + sum(e[rank] for e in self.exchanges)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reduction": list(self.reduction),
            "exchanges": [list(e) for e in self.exchanges],
            "delays_ms": list(self.delays_ms),
        }


def predicted_ms(scenario: str, alone_ms: float, big_mb: float, flows: SideFlows) -> float:
    """``scenario``'s time on a link that prices the busier direction's bytes at the rate the
    all-reduce alone ran at (``alone_ms`` for ``big_mb``: each rank sends ``big_mb`` at P=2)."""
    per_mb = alone_ms / big_mb
    if scenario == "alone":
        return alone_ms
    if scenario == "whole":
        return per_mb * (big_mb + (flows.sent_mb(0) + flows.sent_mb(1)) / 2)
    chosen = flows.balanced() if scenario == "balanced" else flows
    if scenario == "in_turn":  # each flow alone: its busier direction, one after another
        sides = max(chosen.reduction) + sum(max(e) for e in chosen.exchanges)
        return per_mb * (big_mb + sides)
    return per_mb * (big_mb + max(chosen.sent_mb(0), chosen.sent_mb(1)))


def _rank(spec: dict[str, Any]) -> dict[str, list[float]]:
    """One rank of the probe (run by :func:`experiments.bench.launch.launch`)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        from dpkfac.comm import Communicator

        # The side flows go as the step sends them: the communicator's sharded collectives
        # (on gloo alltoallv, cut into calls), the exchanges on a second group.
        comm = Communicator()
        comm2 = comm.duplicate("exchanges")
        flows = SideFlows(**spec["flows"])
        big = torch.ones(int(spec["big_mb"] * MB) // 4)
        mean_side = (flows.sent_mb(0) + flows.sent_mb(1)) / 2
        whole = torch.ones(int((spec["big_mb"] + mean_side) * MB) // 4)

        def shards(mb: Sequence[float]) -> list[list[torch.Tensor]]:
            return [[torch.ones(int(s * MB) // 4)] if s else [] for s in mb]

        def reduction(f: SideFlows) -> Any:
            return comm.reduce_scatter_mean(shards(f.reduction), "grad_allreduce", async_op=True)

        def exchange(mb: Sequence[float], c: Communicator) -> Any:
            return c.all_gather(shards(mb), "precond_broadcast", async_op=True)

        def beside(f: SideFlows) -> None:
            handles = [reduction(f)]
            work = dist.all_reduce(big, async_op=True)
            start = time.perf_counter()
            for mb, delay in zip(f.exchanges, f.delays_ms, strict=True):
                time.sleep(max(0.0, delay / 1e3 - (time.perf_counter() - start)))
                handles.append(exchange(mb, comm2))
            work.wait()
            for h, c in zip(handles, [comm] + [comm2] * len(f.exchanges), strict=True):
                c.wait(h)

        def in_turn() -> None:
            comm.wait(reduction(flows))
            for mb in flows.exchanges:
                comm.wait(exchange(mb, comm))
            dist.all_reduce(big)

        runs: dict[str, Callable[[], object]] = {
            "alone": lambda: dist.all_reduce(big),
            "whole": lambda: dist.all_reduce(whole),
            "beside": lambda: beside(flows),
            "balanced": lambda: beside(flows.balanced()),
            "in_turn": in_turn,
        }
        dist.all_reduce(torch.ones(1024))  # connections made
        out: dict[str, list[float]] = {name: [] for name in SCENARIOS}
        for _ in range(int(spec["repeats"])):
            for name in SCENARIOS:  # interleaved, so a slow spell hits every scenario
                dist.barrier()
                start = time.perf_counter()
                runs[name]()
                out[name].append(time.perf_counter() - start)
        return out
    finally:
        dist.destroy_process_group()


def run_probe(
    rate_bps: int,
    *,
    big_mb: float = 23.8,
    flows: SideFlows | None = None,
    repeats: int = 3,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run the scenarios on a fresh emulated network of two nodes at ``rate_bps``.

    Returns:
        ``ms``: per scenario the median over repeats of the slower rank's milliseconds;
        ``predicted_ms``: :func:`predicted_ms` of each; the inputs.
    """
    from experiments.bench.launch import launch

    flows = SideFlows() if flows is None else flows
    spec = {"big_mb": big_mb, "flows": flows.to_dict(), "repeats": repeats}
    results = launch(_rank, spec, 2, network=network_lib.Network(rate_bps), timeout_s=timeout_s)
    ms = {
        name: 1e3 * statistics.median(max(r[name][i] for r in results) for i in range(repeats))
        for name in SCENARIOS
    }
    predicted = {name: predicted_ms(name, ms["alone"], big_mb, flows) for name in SCENARIOS}
    return {
        "rate_bps": rate_bps,
        "big_mb": big_mb,
        "flows": flows.to_dict(),
        "ms": ms,
        "predicted_ms": predicted,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit", help="each node's link rate (e.g. 1gbit)")
    parser.add_argument("--big-mb", type=float, default=23.8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rate = network_lib.parse_rate(args.rate)
    out = run_probe(rate, big_mb=args.big_mb, repeats=args.repeats)
    print(f"P=2 on the emulated {network_lib.format_rate(rate)} network; side flows {out['flows']}")
    print(f"{'scenario':10s} {'ms':>8s} {'bytes predict':>14s}")
    for name in SCENARIOS:
        print(f"{name:10s} {out['ms'][name]:8.1f} {out['predicted_ms'][name]:14.1f}")
    return 0


if __name__ == "__main__":
    # The ranks unpickle ``_rank`` by its module's name, which ``__main__`` is not.
    from experiments.bench import flow_probe

    raise SystemExit(flow_probe.main())
