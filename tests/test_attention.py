"""nn.MultiheadAttention made visible to K-FAC: dpkfac.split_attention and LinearMultiheadAttention.

* the converted module computes what nn.MultiheadAttention computes, over options drawn by
  hypothesis (self/cross attention, batch_first, masks, weights, kdim/vdim, biases), float64;
* a converted nn.TransformerEncoder classifier: equal outputs in train and eval mode (its
  fused inference paths are never taken), every q/k/v/out projection a captured K-FAC layer;
* unconverted, the functionally called out_proj is no K-FAC layer, and the report says to
  call split_attention (the cost model's shapes agree);
* the factors of the four projections equal those of the project's own attention
  (experiments/models/translation.py), float64, to 1e-10;
* checkpoints of nn.MultiheadAttention load into the converted module, and back;
* the never-captured warning points at the caller's pre.step().
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dpkfac
from dpkfac.attention import LinearMultiheadAttention, merge_attention, split_attention
from dpkfac.costmodel.shapes import shapes_from_model
from experiments.models.translation import MultiHeadAttention

E, H = 8, 2
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


@pytest.fixture(scope="module", autouse=True)
def _single_thread(single_thread: None) -> None:
    """Run this module with one intra-op thread (see conftest)."""


def rel_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    return float((actual - ref).norm() / ref.norm().clamp_min(1e-300))


# ------------------------------------------------------------ equal outputs
@settings(max_examples=25, deadline=None)
@given(
    batch_first=st.booleans(),
    cross=st.booleans(),
    kdim=st.sampled_from([None, 5]),
    vdim=st.sampled_from([None, 3]),
    bias=st.booleans(),
    add_bias_kv=st.booleans(),
    add_zero_attn=st.booleans(),
    need_weights=st.booleans(),
    average=st.booleans(),
    padding=st.booleans(),
    mask=st.sampled_from([None, "2d", "3d", "causal"]),
    boolean=st.booleans(),
    batched=st.booleans(),
    train=st.booleans(),
)
def test_converted_attention_equals_multihead_attention(
    batch_first: bool,
    cross: bool,
    kdim: int | None,
    vdim: int | None,
    bias: bool,
    add_bias_kv: bool,
    add_zero_attn: bool,
    need_weights: bool,
    average: bool,
    padding: bool,
    mask: str | None,
    boolean: bool,
    batched: bool,
    train: bool,
) -> None:
    if not cross:
        kdim = vdim = None  # self-attention reads one tensor
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(
        E,
        H,
        bias=bias,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        kdim=kdim,
        vdim=vdim,
        batch_first=batch_first,
        dtype=torch.float64,
    ).train(train)
    ours = LinearMultiheadAttention.from_module(ref)
    n, tgt, src = 3, 4, (6 if cross else 4)

    def tensor(length: int, dim: int) -> torch.Tensor:
        shape = (
            ((n, length, dim) if batch_first else (length, n, dim)) if batched else (length, dim)
        )
        return torch.randn(shape, dtype=torch.float64)

    query = tensor(tgt, E)
    key, value = (tensor(src, kdim or E), tensor(src, vdim or E)) if cross else (query, query)
    kwargs: dict[str, Any] = {"need_weights": need_weights, "average_attn_weights": average}
    if padding:  # the last key of the first sample is padding
        pad = torch.zeros((n, src) if batched else (src,), dtype=torch.bool)
        pad[..., -1] = True
        if batched:
            pad[1:] = False
        kwargs["key_padding_mask"] = (
            pad if boolean else torch.zeros(pad.shape).masked_fill(pad, -1e9).double()
        )
    if mask is not None:
        if mask == "3d":  # a mask per sample and head
            heads = n * H if batched else H
            drawn = torch.rand(heads, tgt, src) < 0.3
            drawn[..., 0] = False  # every query sees a key
        else:
            drawn = torch.ones(tgt, src, dtype=torch.bool).triu(1)  # causal
        kwargs["attn_mask"] = (
            drawn if boolean else torch.zeros(drawn.shape).masked_fill(drawn, -1e9).double()
        )
        kwargs["is_causal"] = mask == "causal"
    got, got_weights = ours(query, key, value, **kwargs)
    want, want_weights = ref(query, key, value, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if want_weights is None:
        assert got_weights is None
    else:
        assert got_weights is not None
        torch.testing.assert_close(got_weights, want_weights, rtol=0, atol=1e-12)


@pytest.mark.parametrize("need_weights", [True, False])
def test_float32_split_equals_to_1e6_in_train_and_eval(need_weights: bool) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, E))
    model.append(nn.MultiheadAttention(E, H, batch_first=True))
    ref = copy.deepcopy(model)
    split_attention(model)
    assert isinstance(model[1], LinearMultiheadAttention)
    x = torch.randn(3, 5, 4)
    for train in (True, False):
        model.train(train), ref.train(train)
        h, h_ref = model[0](x), ref[0](x)
        got = model[1](h, h, h, need_weights=need_weights)
        want = ref[1](h_ref, h_ref, h_ref, need_weights=need_weights)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)


def test_dropout_is_on_the_attention_weights_in_training_only() -> None:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True, dtype=torch.float64)
    ours = LinearMultiheadAttention.from_module(ref)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    for need_weights in (True, False):
        first, second = (ours(x, x, x, need_weights=need_weights)[0] for _ in range(2))
        assert not torch.allclose(first, second)  # random masks
    ours.eval(), ref.eval()
    torch.testing.assert_close(ours(x, x, x)[0], ref(x, x, x)[0], rtol=0, atol=1e-12)


def test_bad_arguments_are_refused_as_nn_multihead_attention_refuses_them() -> None:
    ours = LinearMultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 5, E)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        ours(x, x, x, is_causal=True)
    with pytest.raises(TypeError, match="only bool and floating-point attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="shape of the 2D attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask has shape"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="not divisible"):
        LinearMultiheadAttention(6, 4)


def test_split_attention_refuses_what_a_copy_cannot_reproduce() -> None:
    class Custom(nn.MultiheadAttention):
        pass

    with pytest.raises(TypeError, match=r"'1' is a Custom, a subclass"):
        split_attention(nn.Sequential(nn.Linear(E, E), Custom(E, H)))
    hooked = nn.Sequential(nn.MultiheadAttention(E, H))
    hooked[0].out_proj.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match=r"\['0.out_proj'\] have hooks registered"):
        split_attention(hooked)
    # The root itself is replaced by the returned module; a shared module stays shared.
    assert isinstance(split_attention(nn.MultiheadAttention(E, H)), LinearMultiheadAttention)
    shared = nn.MultiheadAttention(E, H)
    twice = split_attention(nn.ModuleDict({"a": shared, "b": shared}))
    assert isinstance(twice["a"], LinearMultiheadAttention) and twice["a"] is twice["b"]


# ------------------------------------------------------------------ a transformer classifier
class Classifier(nn.Module):
    """Linear embedding -> 2-layer nn.TransformerEncoder (batch first) -> mean -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, E)
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(E, 3)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), src_key_padding_mask=padding).mean(1))


def classifier(dtype: torch.dtype = torch.float32) -> Classifier:
    torch.manual_seed(0)
    return Classifier().to(dtype)


def expected_layers() -> list[str]:
    per_layer = [
        f"encoder.layers.{i}.{m}"
        for i in range(2)
        for m in (*(f"self_attn.{p}" for p in PROJECTIONS), "linear1", "linear2")
    ]
    return ["embed", *per_layer, "head"]


# The original's fused path makes nested tensors, which torch calls a prototype.
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_converted_encoder_equals_the_original_in_train_and_eval() -> None:
    ref = classifier()
    model = split_attention(copy.deepcopy(ref))
    calls = []
    for layer in model.encoder.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(3, 5, 4)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    for train in (True, False):
        model.train(train), ref.train(train)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-6)
        torch.testing.assert_close(model(x, padding), ref(x, padding), rtol=0, atol=1e-6)
    # Inference without autograd is where nn.TransformerEncoder(Layer) would take its fused
    # paths: the converted model runs its modules instead (the hooks fire), with equal
    # outputs at the positions that are not padding (the fused path zeroes the others).
    calls.clear()
    with torch.no_grad():
        for mask in (None, padding):
            hidden = model.encoder(model.embed(x), src_key_padding_mask=mask)
            want = ref.encoder(ref.embed(x), src_key_padding_mask=mask)
            keep = torch.ones(3, 5, 1) if mask is None else (~mask)[..., None].float()
            torch.testing.assert_close(hidden * keep, want * keep, rtol=0, atol=1e-6)
    assert len(calls) == 4  # two layers, two passes
    assert model.encoder.use_nested_tensor is False


def test_converted_encoder_projections_are_captured_k_fac_layers() -> None:
    model = split_attention(classifier(torch.float64))
    pre = dpkfac.KFACPreconditioner(model, kl_clip=None)
    assert list(pre.layers) == expected_layers()
    assert [s.name for s in shapes_from_model(model, torch.randn(2, 5, 4).double())] == list(
        pre.layers
    )
    summary = pre.summary()
    lines = summary.splitlines()
    for name in expected_layers():
        assert any(line.startswith(f"{name} ") for line in lines), name
    assert f"{len(expected_layers())} K-FAC layer(s)" in summary
    assert "self_attn" not in summary.split("not preconditioned:")[-1]
    x, y = torch.randn(4, 5, 4).double(), torch.randint(0, 3, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no never-captured warning
        F.cross_entropy(model(x), y).backward()
        pre.step()
    missing = [n for n, layer in pre.layers.items() if layer.a_factor is None]
    assert missing == []
    assert "never captured" not in pre.summary()


def test_unconverted_out_proj_is_no_layer_and_the_report_says_what_to_do() -> None:
    model = classifier(torch.float64)
    pre = dpkfac.KFACPreconditioner(model, kl_clip=None)
    names = ["embed", *(f"encoder.layers.{i}.linear{j}" for i in range(2) for j in (1, 2)), "head"]
    assert list(pre.layers) == names
    x = torch.randn(4, 5, 4).double()
    assert [s.name for s in shapes_from_model(model, x)] == names
    summary = pre.summary()
    out_proj = next(line for line in summary.splitlines() if "layers.0.self_attn.out_proj" in line)
    assert "called functionally by nn.MultiheadAttention 'encoder.layers.0.self_attn'" in out_proj
    assert "dpkfac.split_attention(model) makes its projections K-FAC layers" in out_proj
    in_proj = next(line for line in summary.splitlines() if "layers.1.self_attn (" in line)
    assert "in_proj_weight, in_proj_bias" in in_proj and "dpkfac.split_attention(model)" in in_proj
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing registered is uncaptured
        F.cross_entropy(model(x), torch.randint(0, 3, (4,))).backward()
        pre.step()


# ------------------------------------------------------------------ factors
class TorchSublayer(nn.Module):
    """The project's attention sublayer, ``LayerNorm(x + attention(x, memory))``, around a
    converted nn.MultiheadAttention."""

    def __init__(self, ours: MultiHeadAttention, batch_first: bool) -> None:
        super().__init__()
        mha = nn.MultiheadAttention(E, H, bias=False, batch_first=batch_first)
        mha = mha.to(ours.fc.weight.dtype)
        with torch.no_grad():
            mha.in_proj_weight.copy_(
                torch.cat([ours.w_qs.weight, ours.w_ks.weight, ours.w_vs.weight])
            )
            mha.out_proj.weight.copy_(ours.fc.weight)
        self.batch_first = batch_first
        self.attn = mha
        self.layer_norm = copy.deepcopy(ours.layer_norm)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        q, m = (x, memory) if self.batch_first else (x.transpose(0, 1), memory.transpose(0, 1))
        out, _ = self.attn(q, m, m, key_padding_mask=padding, need_weights=False)
        return self.layer_norm(x + (out if self.batch_first else out.transpose(0, 1)))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("weight_sharing", ["expand", "reduce"])
def test_factors_equal_the_projects_own_attention(batch_first: bool, weight_sharing: str) -> None:
    """Same weights, same input, same loss: the A and G factors of q/k/v/out agree (float64).

    The converted module runs its projections batch-major whatever batch_first is, so
    "reduce" averages over positions in both models."""
    torch.manual_seed(0)
    ours = MultiHeadAttention(E, H, dropout=0.0).double()
    theirs = split_attention(TorchSublayer(ours, batch_first))
    x, memory = torch.randn(3, 5, E).double(), torch.randn(3, 7, E).double()
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 4:] = True
    target = torch.randn(3, 5, E).double()
    options = {"factor_update_steps": 1, "kl_clip": None, "weight_sharing": weight_sharing}
    factors = []
    for model, mask in ((ours, ~padding[:, None, None, :]), (theirs, padding)):
        pre = dpkfac.KFACPreconditioner(model, **options)
        out = model(x, memory, mask)
        ((out - target) ** 2).sum(-1).mean().backward()
        pre.step()
        factors.append([(layer.a_factor, layer.g_factor) for layer in pre.layers.values()])
        assert len(pre.layers) == 4
    torch.testing.assert_close(
        theirs(x, memory, padding), ours(x, memory, ~padding[:, None, None, :])
    )
    for (a_ours, g_ours), (a_theirs, g_theirs) in zip(*factors, strict=True):
        assert a_ours is not None and a_theirs is not None
        assert g_ours is not None and g_theirs is not None
        assert rel_err(a_theirs, a_ours) <= 1e-10
        assert rel_err(g_theirs, g_ours) <= 1e-10


# ------------------------------------------------------------------ state dicts
@pytest.mark.parametrize(
    "options",
    [{}, {"kdim": 5, "vdim": 3}, {"bias": False}, {"add_bias_kv": True, "batch_first": True}],
    ids=["packed", "kdim-vdim", "no-bias", "bias-kv"],
)
def test_the_original_checkpoint_loads_and_round_trips(options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dtype=torch.float64, **options)
    torch.manual_seed(1)  # other weights, so loading must do the work
    ours = LinearMultiheadAttention(E, H, dtype=torch.float64, **options)
    bias = options.get("bias", True)
    keys = {f"{p}.weight" for p in PROJECTIONS} | {f"{p}.bias" for p in PROJECTIONS if bias}
    keys |= {"bias_k", "bias_v"} if options.get("add_bias_kv") else set()
    assert set(ours.state_dict()) == keys  # the keys the class docstring documents
    ours.load_state_dict(ref.state_dict())  # strict
    q = torch.randn(4, 2, E, dtype=torch.float64)
    k = torch.randn(6, 2, options.get("kdim", E), dtype=torch.float64)
    v = torch.randn(6, 2, options.get("vdim", E), dtype=torch.float64)
    if options.get("batch_first"):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    torch.testing.assert_close(ours(q, k, v)[0], ref(q, k, v)[0], rtol=0, atol=1e-12)
    # A checkpoint of the converted module loads as it is, and the inverse gives the original.
    again = LinearMultiheadAttention(E, H, dtype=torch.float64, **options)
    again.load_state_dict(ours.state_dict())
    torch.testing.assert_close(again(q, k, v)[0], ref(q, k, v)[0], rtol=0, atol=1e-12)
    packed = ours.to_packed().state_dict()
    assert packed.keys() == ref.state_dict().keys()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(packed[name], tensor), name


def test_a_model_checkpoint_loads_into_the_converted_model_and_merges_back() -> None:
    ref = classifier(torch.float64)
    model = split_attention(classifier(torch.float64))
    torch.manual_seed(3)
    for p in model.parameters():  # forget the weights
        p.data.normal_()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 4).double()
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=1e-12)
    merged = merge_attention(model)
    assert isinstance(merged.encoder.layers[0].self_attn, nn.MultiheadAttention)
    assert merged.state_dict().keys() == ref.state_dict().keys()
    torch.testing.assert_close(merged(x), ref(x), rtol=0, atol=1e-12)


# ------------------------------------------------------------------ the warning's call site
class FunctionalLinear(nn.Module):
    """A Linear whose weight the model applies with F.linear: registered, never captured."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(F.linear(x, self.inner.weight, self.inner.bias)))


def test_the_never_captured_warning_points_at_the_callers_step() -> None:
    torch.manual_seed(0)
    model = FunctionalLinear().double()
    pre = dpkfac.KFACPreconditioner(model, kl_clip=None)
    x, y = torch.randn(6, 4).double(), torch.randint(0, 2, (6,))
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"'inner' \(Linear\).*never captured") as record:
        pre.step()
    (warning,) = [w for w in record if "never captured" in str(w.message)]
    assert warning.filename == __file__
