"""What is preconditioned, what is not and why: the layer report, summary() and warnings."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkfac


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def test_a_transformer_layer_report(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    with caplog.at_level(logging.INFO, logger="dpkfac"):
        pre = dpkfac.KFACPreconditioner(model)
    text = caplog.text
    for name in ("encoder.linear1", "encoder.linear2", "head"):
        assert f"K-FAC layer {name} " in text, name
    assert "K-FAC layer head (Linear): A 9 x 9, G 3 x 3" in text
    assert "not preconditioned: embed (Embedding): unsupported type Embedding" in text
    # nn.MultiheadAttention applies its in-projection and out_proj functionally: neither is a
    # K-FAC layer, and the report says how to make them ones (tests/test_attention.py).
    split = "dpkfac.split_attention(model) makes its projections K-FAC layers"
    assert "K-FAC layer encoder.self_attn.out_proj" not in text
    assert "not preconditioned: encoder.self_attn (MultiheadAttention): nn.Multihead" in text
    assert (
        "not preconditioned: encoder.self_attn.out_proj (NonDynamicallyQuantizableLinear): "
        "called functionally by nn.MultiheadAttention 'encoder.self_attn'"
    ) in text
    assert text.count(split) == 2
    assert "not preconditioned: encoder.norm1 (LayerNorm)" in text
    tokens = torch.randint(0, 11, (4, 5))
    model.zero_grad()
    F.cross_entropy(model(tokens), torch.randint(0, 3, (4,))).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every layer is captured
        pre.step()
    summary = pre.summary()
    out_proj = next(line for line in summary.splitlines() if "out_proj" in line)
    assert split in out_proj
    assert "not preconditioned:" in summary and "embed (Embedding)" in summary
    assert "time per phase since reset_stats(), ms:" in summary
    assert "not_preconditioned=5" in repr(pre)  # embed, self_attn, its out_proj, norm1, norm2


def test_a_layer_never_captured_is_marked_in_the_summary() -> None:
    """A Linear applied with F.linear is registered (nothing says it is called so), warned
    about once and marked."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(F.linear(x, self.inner.weight, self.inner.bias))

    torch.manual_seed(0)
    model = Functional()
    pre = dpkfac.KFACPreconditioner(model)
    F.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 2, (4,))).backward()
    with pytest.warns(RuntimeWarning, match="'inner'.*never captured"):
        pre.step()
    inner = next(line for line in pre.summary().splitlines() if line.startswith("inner "))
    assert "never captured: called functionally" in inner


def test_resnet18_warns_of_its_wide_factors(caplog: pytest.LogCaptureFixture) -> None:
    from torchvision.models import resnet18

    with (
        caplog.at_level(logging.INFO, logger="dpkfac"),
        pytest.warns(RuntimeWarning, match=r"layer4\.\d\.conv\d A 4608-wide \(~\d+ s\)") as seen,
    ):
        dpkfac.KFACPreconditioner(resnet18(num_classes=10), inv_update_steps=1)
    assert "raise inv_update_steps (now 1)" in str(seen[0].message)
    assert "not preconditioned: bn1 (BatchNorm2d): unsupported type BatchNorm2d" in caplog.text
    assert "K-FAC layer layer4.1.conv2 (Conv2d): A 4608 x 4608, G 512 x 512" in caplog.text
    # An interval given as a schedule is named as one, not by its repr (a function's address).
    with pytest.warns(RuntimeWarning, match=r"raise inv_update_steps \(now a schedule\)"):
        dpkfac.KFACPreconditioner(resnet18(num_classes=10), inv_update_steps=lambda s: 1)


def test_skipped_and_frozen_layers_are_named_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 4), nn.Conv2d(4, 4, 1, groups=2), nn.Linear(4, 2)
    )
    model[1].requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="dpkfac"):
        pre = dpkfac.KFACPreconditioner(model, skip_layers=["^3$"])
    assert "not preconditioned: 1 (Linear): frozen at construction (weight, bias" in caplog.text
    assert "not preconditioned: 2 (Conv2d): grouped convolution (groups=2)" in caplog.text
    assert "not preconditioned: 3 (Linear): skipped by skip_layers '^3$'" in caplog.text
    assert list(pre.layers) == ["0"]


def test_the_wide_factor_warning_and_spd_kfac_price_a_decomposition_alike() -> None:
    """One decomposition-time estimate: the warning's is SPD-KFAC's placement's, on the
    device's preset (a GPU's for cuda, this project's CPU machine's otherwise)."""
    from dpkfac.plan.assignment import decomposition_seconds
    from dpkfac.plan.presets import PRESETS, device_preset
    from dpkfac.report import slow_factors

    with pytest.warns(RuntimeWarning, match="0 A 2048-wide"):  # on this CPU
        pre = dpkfac.KFACPreconditioner(nn.Sequential(nn.Linear(2047, 3), nn.Linear(3, 2)))
    for device_type, preset in (("cpu", "cpu_gloo_local"), ("cuda", "v100_ib100")):
        assert device_preset(device_type) is PRESETS[preset]
        expected = decomposition_seconds(PRESETS[preset], 2048)  # A: 2047 inputs and the bias
        slow = slow_factors(pre.layers.values(), device_type, limit_s=0.0)
        assert (slow[0][:3], slow[0][3]) == (("0", "A", 2048), pytest.approx(expected))
    assert decomposition_seconds(PRESETS["cpu_gloo_local"], 2048) > 1.0  # warned on a CPU
    assert decomposition_seconds(PRESETS["v100_ib100"], 2048) < 1.0  # not on a GPU
