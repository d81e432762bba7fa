"""Curvature-fidelity probe: what one rank's batch costs the curvature estimate.

DP-KFAC builds each layer's Kronecker factors on one owner rank from that
rank's local batch only (1/P of the global batch). The probe measures the
effect on the update. Every ``fidelity_every`` steps, for the probed layer(s):

1. every rank captures the layer's batch factors A and G on its own batch,
   whether or not its strategy captures the layer that step (a *shadow*
   capture that never touches the layer's state), or copies the pending
   batch factors the strategy captured, before the strategy reduces them;
2. the local factors are averaged over all ranks by one extra all-reduce
   (category ``fidelity_allreduce``);
3. the layer's owner preconditions the layer's averaged gradient with (a) the
   damped factors of its own batch and (b) the damped averaged factors (same
   damping, same compute method, decomposed in at least float32) and computes
   ``cosine`` (cosine similarity of the two updates) and ``rel_error``
   (``‖a − b‖ / ‖b‖``);
4. one all-reduce of a small float64 vector (non-owners put zeros) gives every
   rank the owner's values, so :meth:`FidelityProbe.results` is the same on
   every rank.

Nothing of the probe feeds back into training: the strategy's pending and
running factors, decompositions, gradients and collectives are those of a run
without the probe, so the model is bitwise the same. The metric values stay
device tensors until :meth:`FidelityProbe.results` reads them: the probe adds
no host read in the hooks or in ``step()`` (``torch.linalg.eigh`` checks its
own result on a GPU, once per decomposition, i.e. up to four per probed layer
on the owner).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from dpkfac.amp import inverse_loss_scale
from dpkfac.comm import Communicator
from dpkfac.curvature.decomposition import (
    Decomposition,
    EigenDecomposition,
    InverseDecomposition,
    precondition,
    working_dtype,
)
from dpkfac.curvature.layer import FACTORS, KFACLayer
from dpkfac.options import KFACOptions
from dpkfac.stats import PhaseTimer

#: Accounting category of the probe's collectives (waiting timed as ``fidelity_comm``).
CATEGORY = "fidelity_allreduce"
#: Phase of the probe's own compute (shadow captures, decompositions, comparison).
PHASE = "fidelity"
#: The values reported per probed layer, in the order they travel.
METRICS = ("cosine", "rel_error")


def select_layers(names: Sequence[str], patterns: Sequence[str] | None) -> list[str] | None:
    """The layer names ``patterns`` selects, in module order (None: rotation).

    An entry selects the names it equals or fully matches as a regular expression.

    Raises:
        ValueError: an entry that selects no K-FAC layer (named with the layers there are).
    """
    if patterns is None:
        return None
    chosen: set[str] = set()
    for pattern in patterns:
        regex = re.compile(pattern)
        hits = {n for n in names if n == pattern or regex.fullmatch(n)}
        if not hits:
            raise ValueError(
                f"fidelity_layers entry {pattern!r} matches no K-FAC layer; layers: {list(names)}"
            )
        chosen |= hits
    return [n for n in names if n in chosen]


def probed_names(
    step: int, every: int, names: Sequence[str], selected: Sequence[str] | None
) -> list[str]:
    """The layers probed at ``step``: none off the schedule, else the selection or the rotation.

    The rotation probes one layer per probe step, in module order, the k-th
    probe step (``step = k·every``) probing layer ``k mod L``.
    """
    if every <= 0 or step % every != 0 or not names:
        return []
    if selected is not None:
        return list(selected)
    return [names[(step // every) % len(names)]]


def metric_rank(layer: KFACLayer, world_size: int) -> int:
    """The rank that compares the two updates: the layer's owner (rank 0 if it has none)."""
    owner = layer.owner
    return owner if 0 <= owner < world_size else 0


def _eigen(factor: torch.Tensor, dtype: torch.dtype) -> EigenDecomposition:
    """As :meth:`EigenDecomposition.compute`, without its host-side finiteness checks.

    Retried in float64 where LAPACK does not converge, as the training path
    does: a local batch factor has rank at most the batch size, and float32
    ``eigh`` failed on such 101x101 factors (many repeated zero eigenvalues)
    in MNIST-1D runs at P=64.
    """
    try:
        d, q = torch.linalg.eigh(factor.to(dtype))
    except torch.linalg.LinAlgError:
        d, q = (t.to(dtype) for t in torch.linalg.eigh(factor.to(torch.float64)))
    return EigenDecomposition(q, d.clamp(min=0.0))


def _inverse(
    factor: torch.Tensor, shift: torch.Tensor | float, dtype: torch.dtype
) -> InverseDecomposition:
    """``(F + shift·I)⁻¹`` without host reads (``inv_ex`` does not check on the host)."""
    eye = torch.eye(factor.shape[0], dtype=dtype, device=factor.device)
    inv, _ = torch.linalg.inv_ex(factor.to(dtype) + shift * eye)
    return InverseDecomposition((inv + inv.t()) / 2)


def _pi(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """π = sqrt((tr A/d_A) / (tr G/d_G)) as a device scalar; 1 where degenerate."""
    a_mean = torch.trace(a.double()) / a.shape[0]
    g_mean = torch.trace(g.double()) / g.shape[0]
    ratio = a_mean / g_mean
    ok = (a_mean > 0) & (g_mean > 0) & torch.isfinite(ratio)
    return torch.where(ok, ratio, torch.ones_like(ratio)).sqrt()


def damped_update(
    grad: torch.Tensor,
    a: torch.Tensor,
    g: torch.Tensor,
    *,
    method: str,
    damping: float,
    dtype: torch.dtype,
    pi_damping: bool = False,
) -> torch.Tensor:
    """``grad`` preconditioned with the damped factors ``a`` and ``g``, in ``dtype``.

    The library's conventions (``docs/design.md`` section 5): eigen,
    ``(G ⊗ A + γI)⁻¹ vec(∇W)``; inverse, ``(G + √γI)⁻¹ ∇W (A + √γI)⁻¹`` (with
    π-damping, ``π√γ`` for A and ``√γ/π`` for G).
    """
    if method == EigenDecomposition.method:
        a_dec: Decomposition = _eigen(a, dtype)
        g_dec: Decomposition = _eigen(g, dtype)
    elif method == InverseDecomposition.method:
        root = math.sqrt(damping)
        if pi_damping:
            pi = _pi(a, g).to(dtype)
            a_dec, g_dec = _inverse(a, pi * root, dtype), _inverse(g, root / pi, dtype)
        else:
            a_dec, g_dec = _inverse(a, root, dtype), _inverse(g, root, dtype)
    else:
        raise ValueError(f"unknown compute method {method!r}")
    return precondition(grad.to(dtype), a_dec, g_dec, damping=damping)


def compare(local: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[cosine, rel_error]`` of two updates as a float64 device vector (no host read)."""
    x, y = local.double().reshape(-1), reference.double().reshape(-1)
    tiny = torch.finfo(torch.float64).tiny
    cosine = (x @ y) / (x.norm() * y.norm()).clamp(min=tiny)
    rel_error = (x - y).norm() / y.norm().clamp(min=tiny)
    return torch.stack([cosine, rel_error])


class FidelityProbe:
    """The probe of one preconditioner (built by it when ``fidelity_every > 0``).

    Args:
        layers: the preconditioner's K-FAC layers, in module order.
        options: the preconditioner's common options (``fidelity_every``,
            ``fidelity_layers``, compute method, dtypes, damping split, weight sharing).
        comm: the preconditioner's communicator (its accounting and timeouts).
        timer: the preconditioner's phase timer.
        grad_scaler: the preconditioner's GradScaler, if any (G is unscaled as in the
            preconditioner's hooks).

    Raises:
        ValueError: a ``fidelity_layers`` entry that matches no layer.
    """

    def __init__(
        self,
        layers: Sequence[KFACLayer],
        options: KFACOptions,
        *,
        comm: Communicator,
        timer: PhaseTimer,
        grad_scaler: Any = None,
    ) -> None:
        every = options.fidelity_every
        patterns = options.fidelity_layers
        self.factor_dtype = options.factor_dtype
        self.method = options.compute_method
        self.decomposition_dtype = options.decomposition_dtype
        self.pi_damping = options.pi_damping
        self.weight_sharing = options.weight_sharing
        self.layers = {x.name: x for x in layers}
        self.names = [x.name for x in layers]
        self.every = int(every)
        self.selected = select_layers(self.names, patterns)
        self.comm = comm
        self.timer = timer
        self.grad_scaler = grad_scaler
        #: Layers probed at the armed step (empty off the schedule).
        self.active: frozenset[str] = frozenset()
        self._shadows: dict[str, KFACLayer] = {}
        self._local: dict[str, dict[str, torch.Tensor | None]] = {}
        #: Latest probe per layer: (float64 device vector of METRICS, step).
        self._latest: dict[str, tuple[torch.Tensor, int]] = {}
        #: Probe steps completed (a host counter: lets callers skip reading results).
        self.probes = 0

    def dtype_for(self, layer: KFACLayer) -> torch.dtype:
        """The dtype the layer's factors are built in (as the preconditioner builds them)."""
        return self.factor_dtype or layer.helper.module.weight.dtype

    # ---------------------------------------------------------------- schedule
    def arm(self, step: int) -> None:
        """Decide which layers the hooks of ``step`` capture for the probe."""
        self.active = frozenset(probed_names(step, self.every, self.names, self.selected))
        self._shadows = {}
        self._local = {}

    # ------------------------------------------------------------------ capture
    def capture_input(
        self,
        layer: KFACLayer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        captured: bool,
        grad_enabled: bool,
    ) -> Callable[[torch.Tensor], None] | None:
        """Shadow-capture A of a probed layer the strategy does not capture this step.

        Called by the preconditioner's forward hook (eagerly, or from the
        compiled graph's capture operator, see :mod:`dpkfac.compile`).

        Args:
            captured: whether the preconditioner's own hook builds this layer's
                batch factors now (then :meth:`collect` copies those instead).
            grad_enabled: whether the forward runs with gradients (read by the
                caller: the compiled graph's operator runs without).

        Returns:
            The hook that shadow-captures G from the gradient of the layer's
            output (the caller puts it there), or None when nothing was captured.
        """
        if captured or layer.name not in self.active:
            return None
        if not (module.training and grad_enabled):
            return None
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            return None
        shadow = self._shadows.get(layer.name)
        if shadow is None:
            shadow = KFACLayer(layer.name, module, layer.helper, layer.accumulation_steps)
            self._shadows[layer.name] = shadow
        with self.timer.phase(PHASE):
            shadow.accumulate_a(x, self.weight_sharing, self.dtype_for(layer))
        return partial(self._grad_hook, layer, shadow)

    def _grad_hook(self, layer: KFACLayer, shadow: KFACLayer, grad: torch.Tensor) -> None:
        with self.timer.phase(PHASE):
            shadow.accumulate_g(
                grad,
                self.weight_sharing,
                self.dtype_for(layer),
                inverse_scale=inverse_loss_scale(self.grad_scaler, grad.device),
            )

    def collect(self) -> None:
        """Take this rank's local batch factors of the probed layers.

        Called at the start of ``step()``, before the placement is finalised
        and before the strategy reduces (eager d_kfac: averages in place) or
        drops the pending factors: the strategy's own pending factors are
        copied, the shadow captures taken as they are.
        """
        for name in self.active:
            shadow = self._shadows.get(name)
            layer = self.layers[name]
            local: dict[str, torch.Tensor | None] = {}
            for which in FACTORS:
                if shadow is not None and shadow.has_pending(which):
                    local[which] = shadow.pending(which)
                elif layer.has_pending(which):
                    local[which] = layer.pending_factor(which).clone()
                else:
                    local[which] = None
            self._local[name] = local
        self._shadows = {}

    # -------------------------------------------------------------- comparison
    def run(self, step: int, damping: float) -> None:
        """Average the local factors, compare the two updates on the owners, share the values.

        Every rank calls it at every step (a collective on probe steps only);
        the gradients must already be averaged (the owner's, at least).
        """
        names = [n for n in self.names if n in self.active]
        if not names:
            return
        local: dict[str, dict[str, torch.Tensor]] = {}
        averaged: list[torch.Tensor] = []
        with self.timer.phase(PHASE):
            for name in names:
                layer = self.layers[name]
                dtype = self.dtype_for(layer)
                device = layer.helper.module.weight.device
                got = self._local.get(name, {})
                local[name] = {}
                for which in FACTORS:
                    factor = got.get(which)
                    if factor is None:  # not captured here (hook never fired): count as zero
                        dim = layer.dim(which)
                        factor = torch.zeros(dim, dim, dtype=dtype, device=device)
                    local[name][which] = factor
                    averaged.append(factor.clone())
        self.comm.allreduce_mean(averaged, CATEGORY)
        first = self.layers[names[0]].helper.module.weight
        values = torch.zeros(len(METRICS) * len(names), dtype=torch.float64, device=first.device)
        with self.timer.phase(PHASE):
            for i, name in enumerate(names):
                layer = self.layers[name]
                if metric_rank(layer, self.comm.size) != self.comm.rank:
                    continue
                grad = layer.helper.grad_matrix()
                lo, hi = i * len(METRICS), (i + 1) * len(METRICS)
                if grad is None:
                    values[lo:hi] = math.nan
                    continue
                a_avg, g_avg = averaged[2 * i], averaged[2 * i + 1]
                work = working_dtype(a_avg.dtype, self.decomposition_dtype)
                update = partial(
                    damped_update,
                    method=self.method,
                    damping=damping,
                    dtype=work,
                    pi_damping=self.pi_damping,
                )
                try:
                    mine = update(grad, local[name]["A"], local[name]["G"])
                    ref = update(grad, a_avg, g_avg)
                except torch.linalg.LinAlgError as err:
                    # A measurement must never end the run it measures: no value this time.
                    warnings.warn(
                        f"dpkfac: fidelity probe of layer {name!r} at step {step} skipped "
                        f"(cosine and rel_error NaN): {err}",
                        stacklevel=2,
                    )
                    values[lo:hi] = math.nan
                    continue
                values[lo:hi] = compare(mine, ref).to(values.device)
        if self.comm.active:
            # Non-owners hold zeros: the mean times P is the owners' values on every rank.
            self.comm.allreduce_mean([values], CATEGORY)
            values.mul_(self.comm.size)
        for i, name in enumerate(names):
            self._latest[name] = (values[i * len(METRICS) : (i + 1) * len(METRICS)], step)
        self._local = {}
        self.probes += 1

    # -------------------------------------------------------------- inspection
    def results(self) -> dict[str, dict[str, float | int]]:
        """``{layer: {"cosine", "rel_error", "step"}}`` of each layer's latest probe.

        Reads the host (the values are device tensors until here).
        """
        out: dict[str, dict[str, float | int]] = {}
        for name in self.names:
            if name not in self._latest:
                continue
            vector, step = self._latest[name]
            cosine, rel_error = vector.tolist()
            out[name] = {"cosine": cosine, "rel_error": rel_error, "step": step}
        return out

    def step_bytes(self, names: Sequence[str]) -> int:
        """Bytes one probe step of ``names`` hands to torch.distributed (for accounting checks)."""
        total = 0
        for name in names:
            layer = self.layers[name]
            size = self.dtype_for(layer).itemsize
            total += size * sum(layer.dim(w) ** 2 for w in FACTORS)
        return total + 8 * len(METRICS) * len(names)
