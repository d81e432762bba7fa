"""``nn.MultiheadAttention`` as four ``nn.Linear`` layers K-FAC can capture.

``nn.MultiheadAttention`` keeps its query, key and value projections in one
packed parameter (``in_proj_weight``, or ``q_proj_weight``/``k_proj_weight``/
``v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``) that is no
module, and applies it and its ``out_proj`` functionally
(``F.multi_head_attention_forward``, or a fused kernel in inference): no
forward hook of any of them ever fires, so K-FAC can precondition none of the
four projections. :class:`LinearMultiheadAttention` computes the same function
with four ``nn.Linear`` modules called as modules, and :func:`split_attention`
swaps it in for every ``nn.MultiheadAttention`` of a model, weights copied.

:func:`not_capturable` is the one place that says which modules of a model
K-FAC cannot capture for this reason; the preconditioner's registration, its
layer report and the cost model's shape reader all ask it, so they agree.

This module is model surgery only: it imports torch and nothing of dpkfac, so
every floor of the package may use it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

__all__ = [
    "LinearMultiheadAttention",
    "merge_attention",
    "not_capturable",
    "split_attention",
]

#: What the layer report and the errors tell a user to do about nn.MultiheadAttention.
SPLIT_HINT = "dpkfac.split_attention(model) makes its projections K-FAC layers"


def not_capturable(model: nn.Module) -> dict[str, str]:
    """Modules of ``model`` whose parameters K-FAC's hooks can never capture, with the reason.

    Every ``nn.MultiheadAttention`` (by its name: its packed in-projection is a
    bare parameter) and its ``out_proj`` (a Linear that the attention calls
    functionally, so its forward hook never fires) are listed, by their names
    in ``model.named_modules()``. Registering such an ``out_proj`` as a K-FAC
    layer would plan, place and report a layer that can never have factors;
    the preconditioner, :func:`dpkfac.report.skipped_modules` and
    :func:`dpkfac.costmodel.shapes.shapes_from_model` all leave them out by
    this function, and the reason says what to do.
    """
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        packed = [
            n
            for n in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
            if getattr(module, n, None) is not None
        ]
        if getattr(module, "in_proj_bias", None) is not None:
            packed.append("in_proj_bias")
        shown = name or "<root>"
        out[name] = (
            f"nn.MultiheadAttention {shown!r} applies its in-projection "
            f"({', '.join(packed)}) functionally, as bare parameters of no module; {SPLIT_HINT}"
        )
        out[f"{name}.out_proj" if name else "out_proj"] = (
            f"called functionally by nn.MultiheadAttention {shown!r}, so its hooks never fire; "
            f"{SPLIT_HINT}"
        )
    return out


class LinearMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with its four projections as ``nn.Linear`` modules.

    Same constructor, same ``forward`` signature and return values as
    ``nn.MultiheadAttention`` (batch-first or not, unbatched inputs,
    self- and cross-attention, ``kdim``/``vdim``, ``bias``, ``add_bias_kv``,
    ``add_zero_attn``, boolean and float ``key_padding_mask``/``attn_mask``,
    ``is_causal``, dropout on the attention weights). ``q_proj``, ``k_proj``,
    ``v_proj`` and ``out_proj`` are called as modules on batch-major
    (N, L, features) tensors, so forward hooks see the batch in dim 0 and the
    positions in dim 1 whatever ``batch_first`` is: K-FAC's "reduce" weight
    sharing then averages over positions, not over the batch. Without
    ``need_weights`` the attention is ``F.scaled_dot_product_attention``; with
    it, an explicit softmax whose weights are returned (after dropout, averaged
    over heads if ``average_attn_weights``), as ``nn.MultiheadAttention`` does.
    With dropout the random masks differ from ``nn.MultiheadAttention``'s (the
    distribution is the same).

    ``in_proj_weight`` and ``in_proj_bias`` are ``None`` and
    ``_qkv_same_embed_dim`` is False, so that ``nn.TransformerEncoderLayer``
    never takes its fused inference path (which reads the packed weights);
    :func:`split_attention` also turns off an ``nn.TransformerEncoder``'s
    nested-tensor path, which would hand this module nested tensors.

    State dict: the keys are ``q_proj.weight``, ``k_proj.weight``,
    ``v_proj.weight``, ``out_proj.weight``, then with ``bias`` ``q_proj.bias``,
    ``k_proj.bias``, ``v_proj.bias``, ``out_proj.bias``, and with
    ``add_bias_kv`` ``bias_k``, ``bias_v``. A checkpoint of the original
    ``nn.MultiheadAttention`` loads too (a load_state_dict pre-hook maps it):

    ==================================  =====================================
    ``nn.MultiheadAttention`` key       here
    ==================================  =====================================
    ``in_proj_weight`` (3E, E)          rows [0, E) ``q_proj.weight``,
                                        [E, 2E) ``k_proj.weight``,
                                        [2E, 3E) ``v_proj.weight``
    ``q_proj_weight`` (E, E)            ``q_proj.weight``
    ``k_proj_weight`` (E, kdim)         ``k_proj.weight``
    ``v_proj_weight`` (E, vdim)         ``v_proj.weight``
    ``in_proj_bias`` (3E,)              thirds: ``q_proj.bias``,
                                        ``k_proj.bias``, ``v_proj.bias``
    ``out_proj.weight``/``.bias``,      unchanged
    ``bias_k``, ``bias_v``
    ==================================  =====================================

    :meth:`to_packed` is the inverse: an equal ``nn.MultiheadAttention``, whose
    ``state_dict()`` is the original format.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim,
        vdim, batch_first, device, dtype: as ``nn.MultiheadAttention``.
    """

    bias_k: nn.Parameter | None
    bias_v: nn.Parameter | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} "
                f"and num_heads={num_heads}"
            )
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        # What nn.TransformerEncoderLayer / nn.TransformerEncoder read before their fused
        # paths: with these they never take them (there are no packed weights to hand over).
        self._qkv_same_embed_dim = False
        self.in_proj_weight: torch.Tensor | None = None
        self.in_proj_bias: torch.Tensor | None = None
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), device=device, dtype=dtype))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), device=device, dtype=dtype))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()
        self.register_load_state_dict_pre_hook(_load_packed)

    def _reset_parameters(self) -> None:
        """nn.MultiheadAttention's initialisation: one Xavier bound over the packed (3E, E)
        weight when the dims agree (per weight otherwise), zero biases, normal bias_k/v."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        with torch.no_grad():
            if self.kdim == self.embed_dim and self.vdim == self.embed_dim:
                bound = math.sqrt(6.0 / (self.embed_dim + 3 * self.embed_dim))
                for proj in projections:
                    nn.init.uniform_(proj.weight, -bound, bound)
            else:
                for proj in projections:
                    nn.init.xavier_uniform_(proj.weight)
            for proj in (*projections, self.out_proj):
                if proj.bias is not None:
                    nn.init.zeros_(proj.bias)
            if self.bias_k is not None and self.bias_v is not None:
                nn.init.xavier_normal_(self.bias_k)
                nn.init.xavier_normal_(self.bias_v)

    @classmethod
    def from_module(cls, mha: nn.MultiheadAttention) -> LinearMultiheadAttention:
        """An equal module: ``mha``'s options, weights copied (same device, dtype,
        ``requires_grad`` and training mode)."""
        out_proj = mha.out_proj
        weight = out_proj.weight
        if (mha.in_proj_bias is None) != (out_proj.bias is None):
            raise ValueError(
                "in_proj_bias and out_proj.bias must both be present or both absent "
                "(nn.MultiheadAttention's bias option sets both)"
            )
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            dropout=mha.dropout,
            bias=mha.in_proj_bias is not None,
            add_bias_kv=mha.bias_k is not None,
            add_zero_attn=mha.add_zero_attn,
            kdim=mha.kdim,
            vdim=mha.vdim,
            batch_first=mha.batch_first,
            device=weight.device,
            dtype=weight.dtype,
        )
        new._copy_from(mha)
        return new.train(mha.training)

    def _copy_from(self, mha: nn.MultiheadAttention) -> None:
        """Copy ``mha``'s parameters into this module's (device and dtype per parameter)."""
        e = self.embed_dim
        if mha._qkv_same_embed_dim:
            packed = mha.in_proj_weight
            weights = [(packed, packed[i * e : (i + 1) * e]) for i in range(3)]
        else:
            weights = [(w, w) for w in (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        pairs: list[tuple[torch.Tensor, torch.Tensor, bool]] = [
            (proj.weight, value, source.requires_grad)
            for proj, (source, value) in zip(projections, weights, strict=True)
        ]
        if mha.in_proj_bias is not None:
            bias = mha.in_proj_bias
            pairs += [
                (proj.bias, bias[i * e : (i + 1) * e], bias.requires_grad)
                for i, proj in enumerate(projections)
                if proj.bias is not None
            ]
        pairs.append((self.out_proj.weight, mha.out_proj.weight, mha.out_proj.weight.requires_grad))
        if self.out_proj.bias is not None and mha.out_proj.bias is not None:
            pairs.append((self.out_proj.bias, mha.out_proj.bias, mha.out_proj.bias.requires_grad))
        for ours, theirs in ((self.bias_k, mha.bias_k), (self.bias_v, mha.bias_v)):
            if ours is not None and theirs is not None:
                pairs.append((ours, theirs, theirs.requires_grad))
        with torch.no_grad():
            for target, value, requires_grad in pairs:
                target.data = value.detach().clone()
                target.requires_grad_(requires_grad)

    def to_packed(self) -> nn.MultiheadAttention:
        """The inverse of :meth:`from_module`: an equal ``nn.MultiheadAttention`` (its state
        dict is the original format). A packed parameter requires grad if any of its parts do."""
        weight = self.out_proj.weight
        bias = self.out_proj.bias is not None
        mha = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=bias,
            add_bias_kv=self.bias_k is not None,
            add_zero_attn=self.add_zero_attn,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=self.batch_first,
            device=weight.device,
            dtype=weight.dtype,
        )
        projections = (self.q_proj, self.k_proj, self.v_proj)
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                ws: list[torch.Tensor] = [p.weight for p in projections]
                mha.in_proj_weight.copy_(torch.cat(ws))
                mha.in_proj_weight.requires_grad_(any(w.requires_grad for w in ws))
            else:
                for name, proj in zip(("q", "k", "v"), projections, strict=True):
                    target = getattr(mha, f"{name}_proj_weight")
                    target.copy_(proj.weight)
                    target.requires_grad_(proj.weight.requires_grad)
            if mha.in_proj_bias is not None:
                bs: list[torch.Tensor] = [p.bias for p in projections if p.bias is not None]
                mha.in_proj_bias.copy_(torch.cat(bs))
                mha.in_proj_bias.requires_grad_(any(b.requires_grad for b in bs))
            pairs = [(mha.out_proj.weight, self.out_proj.weight)]
            if mha.out_proj.bias is not None and self.out_proj.bias is not None:
                pairs.append((mha.out_proj.bias, self.out_proj.bias))
            for theirs, ours in ((mha.bias_k, self.bias_k), (mha.bias_v, self.bias_v)):
                if theirs is not None and ours is not None:
                    pairs.append((theirs, ours))
            for target, value in pairs:
                target.copy_(value)
                target.requires_grad_(value.requires_grad)
        return mha.train(self.training)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of ``query`` over ``key``/``value``, as ``nn.MultiheadAttention.forward``.

        Returns:
            (output, weights): output (N, L, E) if ``batch_first`` else (L, N, E),
            (L, E) unbatched; weights (N, L, S), per head (N, H, L, S), or None
            without ``need_weights``.
        """
        if query.is_nested or key.is_nested or value.is_nested:
            raise ValueError(
                "LinearMultiheadAttention takes no nested tensors (nn.MultiheadAttention takes "
                "them only on its fused inference path, which reads packed weights)"
            )
        batched = query.dim() == 3
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                "query, key and value must all be 3-D (batched) or all 2-D (unbatched); got "
                f"{query.dim()}-D, {key.dim()}-D and {value.dim()}-D"
            )
        q_in, k_in, v_in = self._batch_major(query, key, value, batched)
        n, tgt_len, _ = q_in.shape
        src_len = k_in.shape[1]
        if k_in.shape[:2] != v_in.shape[:2]:
            raise ValueError(
                f"key's batch and sequence dims {tuple(k_in.shape[:2])} do not match value's "
                f"{tuple(v_in.shape[:2])}"
            )
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention); "
                "nn.Transformer.generate_square_subsequent_mask makes one"
            )
        dtype = q_in.dtype
        padding = _padding_mask(key_padding_mask, batched, n, src_len, dtype)
        # nn.MultiheadAttention's rule: the hint replaces the mask only where SDPA sees no
        # other mask and no weights are wanted; a padding mask switches the hint off.
        causal = is_causal and padding is None and not need_weights
        mask = (
            None
            if causal
            else _attention_mask(attn_mask, n, self.num_heads, tgt_len, src_len, dtype)
        )

        q = self.q_proj(q_in)
        k = self.k_proj(k_in)
        v = self.v_proj(v_in)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(n, 1, self.embed_dim)], dim=1)
            v = torch.cat([v, self.bias_v.expand(n, 1, self.embed_dim)], dim=1)
            mask, padding = _pad_key(mask), _pad_key(padding)
        q, k, v = (self._heads(x) for x in (q, k, v))
        if self.add_zero_attn:
            zeros = k.new_zeros(n, self.num_heads, 1, self.head_dim)
            k = torch.cat([k, zeros], dim=2)
            v = torch.cat([v, zeros], dim=2)
            mask, padding = _pad_key(mask), _pad_key(padding)
        if padding is not None:
            mask = padding if mask is None else mask + padding
        dropout_p = self.dropout if self.training else 0.0

        weights: torch.Tensor | None = None
        if need_weights:
            scores = (q * math.sqrt(1.0 / self.head_dim)) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            attended = weights @ v
        else:
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal
            )
        out = self.out_proj(attended.transpose(1, 2).reshape(n, tgt_len, self.embed_dim))
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _batch_major(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batched: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs as (N, L, features), each tensor made once: a tensor passed as both
        query and key stays one tensor (the cost model counts a shared input once)."""
        if batched and self.batch_first:
            return query, key, value
        made: dict[int, torch.Tensor] = {}

        def major(x: torch.Tensor) -> torch.Tensor:
            if id(x) not in made:
                made[id(x)] = x.unsqueeze(0) if not batched else x.transpose(0, 1)
            return made[id(x)]

        return major(query), major(key), major(value)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(N, L, E) -> (N, heads, L, head_dim)."""
        n, length, _ = x.shape
        return x.view(n, length, self.num_heads, self.head_dim).transpose(1, 2)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}"
        )


def _float_mask(mask: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may not attend) as 0 / -inf; a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"only bool and floating-point {name} are supported, got {mask.dtype}")
    return mask.to(dtype)


def _padding_mask(
    mask: torch.Tensor | None, batched: bool, n: int, src_len: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """``key_padding_mask`` (N, S), or (S,) unbatched, as a float (N, 1, 1, S)."""
    if mask is None:
        return None
    expected = (n, src_len) if batched else (src_len,)
    if tuple(mask.shape) != expected:
        raise ValueError(f"key_padding_mask has shape {tuple(mask.shape)}, expected {expected}")
    return _float_mask(mask, "key_padding_mask", dtype).reshape(n, 1, 1, src_len)


def _attention_mask(
    mask: torch.Tensor | None, n: int, heads: int, tgt_len: int, src_len: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """``attn_mask`` (L, S) or (N·heads, L, S) as a float mask broadcast to (N, heads, L, S)."""
    if mask is None:
        return None
    if mask.dim() == 2:
        if tuple(mask.shape) != (tgt_len, src_len):
            raise RuntimeError(
                f"The shape of the 2D attn_mask is {tuple(mask.shape)}, but should be "
                f"{(tgt_len, src_len)}."
            )
        shaped = mask.reshape(1, 1, tgt_len, src_len)
    elif mask.dim() == 3:
        if tuple(mask.shape) != (n * heads, tgt_len, src_len):
            raise RuntimeError(
                f"The shape of the 3D attn_mask is {tuple(mask.shape)}, but should be "
                f"{(n * heads, tgt_len, src_len)}."
            )
        shaped = mask.reshape(n, heads, tgt_len, src_len)
    else:
        raise RuntimeError(f"attn_mask's dimension {mask.dim()} is not supported")
    return _float_mask(shaped, "attn_mask", dtype)


def _pad_key(mask: torch.Tensor | None) -> torch.Tensor | None:
    """One more key (bias_k or the zero key) that every query may attend to."""
    return None if mask is None else F.pad(mask, (0, 1))


def _load_packed(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Rewrite an ``nn.MultiheadAttention`` checkpoint's keys into this module's (see the
    table in :class:`LinearMultiheadAttention`); a checkpoint of this module passes as it is."""
    assert isinstance(module, LinearMultiheadAttention)
    e = module.embed_dim
    names = ("q", "k", "v")
    packed = state_dict.pop(prefix + "in_proj_weight", None)
    if packed is not None:
        for i, name in enumerate(names):
            state_dict[f"{prefix}{name}_proj.weight"] = packed[i * e : (i + 1) * e]
    for name in names:
        separate = state_dict.pop(f"{prefix}{name}_proj_weight", None)
        if separate is not None:
            state_dict[f"{prefix}{name}_proj.weight"] = separate
    bias = state_dict.pop(prefix + "in_proj_bias", None)
    if bias is not None:
        for i, name in enumerate(names):
            state_dict[f"{prefix}{name}_proj.bias"] = bias[i * e : (i + 1) * e]


def _has_hooks(module: nn.Module) -> bool:
    """Whether hooks are registered on ``module`` itself (they would not follow a swap)."""
    return any(
        len(getattr(module, attr, None) or {})
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
        )
    )


def _check_convertible(name: str, module: nn.MultiheadAttention) -> None:
    """Refuse what a copy cannot reproduce, naming the module."""
    shown = name or "<root>"
    if type(module) is not nn.MultiheadAttention:
        raise TypeError(
            f"split_attention: {shown!r} is a {type(module).__name__}, a subclass of "
            "nn.MultiheadAttention whose forward may differ; only nn.MultiheadAttention itself "
            "is converted (convert it with LinearMultiheadAttention yourself)"
        )
    if parametrize.is_parametrized(module) or parametrize.is_parametrized(module.out_proj):
        raise ValueError(
            f"split_attention: nn.MultiheadAttention {shown!r} has parametrized parameters, "
            "which a copy of the weights would drop; remove the parametrizations first"
        )
    hooked = [
        n for n, m in ((shown, module), (f"{shown}.out_proj", module.out_proj)) if _has_hooks(m)
    ]
    if hooked:
        raise ValueError(
            f"split_attention: {hooked} have hooks registered, which would not follow them to "
            "the new modules; call split_attention(model) before registering hooks (before "
            "building the KFACPreconditioner and before wrapping in DistributedDataParallel)"
        )


def split_attention(model: nn.Module) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` in ``model`` by an equal
    :class:`LinearMultiheadAttention`, so K-FAC preconditions its four projections.

    In place and recursive; returns ``model`` (or, when ``model`` itself is an
    ``nn.MultiheadAttention``, its replacement). Weights are copied (same
    device, dtype and ``requires_grad``); a module shared under several names
    stays shared. The new parameters are new tensors: call it before building
    the optimizer, the ``KFACPreconditioner`` and any ``DistributedDataParallel``
    wrapper. An ``nn.TransformerEncoder`` around a converted layer has its
    nested-tensor inference path turned off (``use_nested_tensor = False``),
    which would feed the attention nested tensors.

    Raises:
        TypeError: ``model`` is wrapped in ``DistributedDataParallel`` already, or
            a module is a subclass of ``nn.MultiheadAttention`` (its forward may
            differ).
        ValueError: a module has parametrizations or hooks, which a copy would drop.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "split_attention: the model is wrapped in DistributedDataParallel already, which "
            "holds its parameters; call split_attention(model) before wrapping it"
        )
    found = [
        (name, m)
        for name, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, nn.MultiheadAttention)
    ]
    for name, module in found:
        _check_convertible(name, module)
    converted: dict[int, LinearMultiheadAttention] = {}
    for name, module in found:
        if id(module) not in converted:
            converted[id(module)] = LinearMultiheadAttention.from_module(module)
        new = converted[id(module)]
        if not name:
            return new
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder) and any(
            isinstance(getattr(layer, "self_attn", None), LinearMultiheadAttention)
            for layer in m.layers
        ):
            m.use_nested_tensor = False
    return model


def merge_attention(model: nn.Module) -> nn.Module:
    """The inverse of :func:`split_attention`: every :class:`LinearMultiheadAttention` back to an
    equal ``nn.MultiheadAttention`` (:meth:`LinearMultiheadAttention.to_packed`), e.g. to save
    a checkpoint in the original format. In place; returns ``model`` (or the replacement of a
    root ``LinearMultiheadAttention``)."""
    found = [
        (name, m)
        for name, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, LinearMultiheadAttention)
    ]
    packed: dict[int, nn.MultiheadAttention] = {}
    for name, module in found:
        if id(module) not in packed:
            packed[id(module)] = module.to_packed()
        if not name:
            return packed[id(module)]
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, packed[id(module)])
    return model
