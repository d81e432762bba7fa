"""SPD-KFAC: D-KFAC's maths with pipelined, fused, triangle-packed factor traffic.

The plan (:mod:`dpkfac.plan.spd_kfac`) places each factor's decomposition
locally or on one rank by the hardware model; the runtime here does the rest,
after Shi et al.'s smart parallel D-KFAC:

1. **Pipelining.** Each batch factor's all-reduce is launched asynchronously
   from the capture hook that built it (A in the forward hook, G in the
   backward hook); ``step()`` only waits.
2. **Dynamic tensor fusion.** During the first ``profile_steps`` factor
   updates every factor travels alone while its ready time (seconds since
   the step's first factor) is recorded. The ranks then agree on the
   element-wise maximum of those times and of a measured alpha-beta model of
   the collective (:func:`dpkfac.probes.measure_comm_model`), and
   :func:`dpkfac.plan.fusion.plan_buckets` merges consecutive factors while
   the next one will be ready before the current bucket's communication would
   finish (or waiting for it costs less than alpha). A bucket is launched as
   soon as its last factor is built: the buckets' all-reduces are
   :func:`dpkfac.plan.exchange.factor_transfers`'s, the list the cost model prices.
3. **Triangle packing.** Only the upper triangle of each symmetric factor is sent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from dpkfac.comm import Handle, triangle_numel
from dpkfac.curvature import KFACLayer
from dpkfac.curvature.layer import FACTORS
from dpkfac.plan.exchange import Transfer, factor_transfers
from dpkfac.plan.fusion import CommModel, plan_buckets
from dpkfac.plan.spd_kfac import SPDKFACOptions, SPDKFACScheme
from dpkfac.probes import measure_comm_model
from dpkfac.strategies.base import Strategy

__all__ = ["SPDKFAC", "SPDKFACOptions"]

Key = tuple[str, str]


class SPDKFAC(Strategy[SPDKFACOptions]):
    """Pipelined, fused, triangle-packed factor all-reduces and thresholded placement."""

    scheme = SPDKFACScheme

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The fusion buckets of (layer, "A"/"G") keys, fixed after profiling.
        self.fusion_plan: list[list[Key]] | None = None
        #: Their all-reduces, as :func:`~dpkfac.plan.exchange.factor_transfers` says (the
        #: description the cost model prices): one per bucket, launched when it fills.
        self.transfers: list[Transfer[Key]] = []
        self.comm_model: CommModel | None = None
        self._bucket_of: dict[Key, int] = {}
        self._profiles: list[dict[Key, float]] = []
        self._reset_step()

    def _reset_step(self) -> None:
        self._t0: float | None = None
        self._times: dict[Key, float] = {}
        self._ready: dict[int, list[Key]] = {}
        self._launched: set[Key] = set()
        self._stale: set[Key] = set()
        self._inflight: list[tuple[list[tuple[KFACLayer, str]], list[torch.Tensor], Handle]] = []
        self._layers: dict[str, KFACLayer] = {}

    # -------------------------------------------------------------- pipelining
    def factor_ready(self, layer: KFACLayer, which: str) -> None:
        if not self.comm.active:
            return
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        key = (layer.name, which)
        self._layers[layer.name] = layer
        if key in self._times:
            # The module ran again in this step (a shared layer, activation
            # checkpointing, a micro-batch beyond the declared ones): whatever
            # was or will be launched for it is partial, so step() all-reduces
            # the complete sum instead. It must not count twice towards its
            # bucket, or the bucket would launch before its other members exist.
            self._stale.add(key)
            return
        self._times[key] = now - self._t0
        if key in self._launched:
            self._stale.add(key)
            return
        bucket = self._bucket_of.get(key)
        if bucket is None:  # profiling, or a factor the plan has not seen: it travels alone
            for transfer in factor_transfers(self.traits.factor_comm, [key]):
                self._launch_keys(transfer.shards[0])
            return
        ready = self._ready.setdefault(bucket, [])
        ready.append(key)
        (members,) = self.transfers[bucket].shards
        if len(ready) == len(members):
            self._launch_keys(members)

    def _launch_keys(self, keys: Sequence[Key]) -> None:
        self._launch([(self._layers[name], which) for name, which in keys])

    def _launch(self, items: list[tuple[KFACLayer, str]]) -> None:
        tensors = [layer.pending_factor(which).clone() for layer, which in items]
        handle = self.comm.allreduce_mean(
            tensors, "factor_allreduce", triangle=True, async_op=True, overlapped=True
        )
        self._launched.update((layer.name, which) for layer, which in items)
        self._inflight.append((items, tensors, handle))

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        if not self.comm.active:
            self._reset_step()
            return
        # Buckets with members that did not run this step (on any rank, since
        # usage must match across ranks) still go, in plan order.
        for bucket in sorted(self._ready):
            keys = self._ready[bucket]
            (members,) = self.transfers[bucket].shards
            if len(keys) < len(members):
                self._launch_keys([k for k in members if k in keys])
        for items, tensors, handle in self._inflight:
            self.comm.wait(handle)
            for (layer, which), tensor in zip(items, tensors, strict=True):
                if (layer.name, which) not in self._stale:
                    layer.set_pending(which, tensor)
        redo = [
            (layer, w)
            for layer in layers
            for w in FACTORS
            if layer.has_pending(w)
            and ((layer.name, w) in self._stale or (layer.name, w) not in self._launched)
        ]
        if redo:
            tensors = [layer.pending_factor(w) for layer, w in redo]
            self.comm.allreduce_mean(tensors, "factor_allreduce", triangle=True)
            for (layer, which), tensor in zip(redo, tensors, strict=True):
                layer.set_pending(which, tensor)
        if self.fusion_plan is None and self._times:
            self._profiles.append(dict(self._times))
            if len(self._profiles) >= self.options.profile_steps:
                self._build_plan(layers)
        self._reset_step()

    # ------------------------------------------------------------------ fusion
    def _measure_comm_model(self) -> CommModel:
        """The alpha-beta model of the all-reduce: given, or measured now (a collective)."""
        alpha, beta = self.options.comm_alpha, self.options.comm_beta
        if alpha is not None and beta is not None:
            return CommModel(float(alpha), float(beta))
        return measure_comm_model(self.comm)

    def _build_plan(self, layers: Sequence[KFACLayer]) -> None:
        """Fix the fusion plan from the profiled ready times, identically on every rank."""
        keys = [(layer.name, w) for layer in layers for w in FACTORS]
        seen = [k for k in keys if any(k in p for p in self._profiles)]
        times = [sum(p.get(k, 0.0) for p in self._profiles) / len(self._profiles) for k in seen]
        model = self._measure_comm_model()
        agreed = self.comm.agree_max([*times, model.alpha, model.beta])
        times_l = agreed[:-2]
        self.comm_model = CommModel(agreed[-2], agreed[-1])
        order = sorted(range(len(seen)), key=lambda i: (times_l[i], i))
        by_name = {layer.name: layer for layer in layers}
        sizes: list[int] = []
        for i in order:
            name, which = seen[i]
            dim = by_name[name].dim(which)
            dtype = by_name[name].helper.module.weight.dtype
            sizes.append(triangle_numel(dim) * dtype.itemsize)
        ready = [times_l[i] for i in order]
        if self.options.fusion == "dynamic":
            buckets = plan_buckets(ready, sizes, self.comm_model)
        else:
            buckets = [[i] for i in range(len(order))]
        self._set_plan([[seen[order[i]] for i in bucket] for bucket in buckets])

    def _set_plan(self, plan: list[list[Key]] | None) -> None:
        """Fix the fusion plan and the all-reduces that carry it (none: not profiled yet)."""
        self.fusion_plan = plan
        keys = [k for bucket in plan or [] for k in bucket]
        self.transfers = factor_transfers(self.traits.factor_comm, keys, plan) if plan else []
        self._bucket_of = {
            k: b for b, transfer in enumerate(self.transfers) for k in transfer.shards[0]
        }

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": [list(map(list, bucket)) for bucket in self.fusion_plan]
            if self.fusion_plan
            else None,
            "comm_model": (self.comm_model.alpha, self.comm_model.beta)
            if self.comm_model
            else None,
            "profiles": [[[k[0], k[1], t] for k, t in p.items()] for p in self._profiles],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        plan = state.get("plan")
        self._set_plan([[(k[0], k[1]) for k in bucket] for bucket in plan] if plan else None)
        cm = state.get("comm_model")
        self.comm_model = CommModel(*cm) if cm else None
        self._profiles = [{(n, w): t for n, w, t in p} for p in state.get("profiles", [])]
