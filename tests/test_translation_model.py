"""The Transformer K-FAC trains, measures and predicts is one model with one layer list.

The DP-KFAC papers precondition every attention projection of their
Transformer. These tests pin that down for the three places the model
appears: the training preset (``multi30k_transformer``), the benchmark's
workload (``conf/workload/transformer.yaml``) and the cost model's analytic
zoo (:func:`dpkfac.costmodel.zoo.transformer`), and check that the explicit
attention computes what ``torch.nn.MultiheadAttention`` computes.
"""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from dpkfac import KFACPreconditioner
from dpkfac.costmodel import shapes_from_model
from dpkfac.costmodel.zoo import PAPER_MODELS, transformer
from experiments.bench.predict import row_shapes
from experiments.bench.run import compose_config, job_spec
from experiments.bench.workloads import build
from experiments.models.translation import MultiHeadAttention, TranslationTransformer

PROJECTIONS = ("w_qs", "w_ks", "w_vs", "fc")


def _workload_row() -> dict:
    """What a benchmark row of ``model=transformer`` records about its model."""
    spec = job_spec(compose_config("benchmark", ["model=transformer", "strategy=dp_kfac"]))
    (member,) = spec["strategies"]
    return {
        "model_config": spec["model"]["config"],
        "model_batch": spec["model"]["batch"],
        "model_paper": spec["model"]["paper"],
        "skip_layers": member["view"]["skip_layers"],
        "weight_sharing": member["view"]["weight_sharing"],
    }


def _attention_projections(model: nn.Module) -> set[str]:
    return {
        f"{name}.{p}"
        for name, module in model.named_modules()
        if isinstance(module, MultiHeadAttention)
        for p in PROJECTIONS
    }


def test_benchmark_model_has_the_cost_models_layer_list() -> None:
    """Measured (paper size and CPU size) and zoo shapes are equal: names, dims, N, T, bias."""
    row = _workload_row()
    zoo, kfac = PAPER_MODELS["Transformer"]
    paper, sharing = row_shapes(row, paper=True)
    assert [s.name for s in paper] == [s.name for s in zoo]
    assert paper == zoo  # layers, biases, captured, and the other parameters
    assert len(paper) == 6 * 6 + 6 * 10 == 96
    assert sharing == kfac.weight_sharing
    measured, _ = row_shapes(row)
    assert measured == transformer(batch_size=16, d_model=128, d_inner=512, vocab=1000)
    # Every attention projection of the measured model is one of its K-FAC layers.
    with torch.device("meta"):
        bench = build(row["model_config"], row["model_batch"])
    names = {s.name for s in measured}
    assert _attention_projections(bench.model) <= names
    assert len(_attention_projections(bench.model)) == 4 * (6 + 2 * 6)


@pytest.mark.parametrize("source", ["preset", "workload"])
def test_preconditioner_captures_every_attention_projection(source: str, compose) -> None:
    """With the preset's (or the workload's) ``skip_layers``, K-FAC holds all but the vocabulary."""
    if source == "preset":
        cfg = compose("experiment=multi30k_transformer")
        skip, layers = list(cfg.strategy.skip_layers), (2, 2)
    else:
        skip, layers = _workload_row()["skip_layers"], (6, 6)
        cfg = compose_config("benchmark", ["model=transformer"])
    torch.manual_seed(0)
    model = instantiate(
        cfg.model, vocab_size=40, d_model=16, nhead=2, dim_feedforward=32, dropout=0.0
    )
    assert (len(model.encoder.layer_stack), len(model.decoder.layer_stack)) == layers
    pre = KFACPreconditioner(model, skip_layers=skip)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(pre.layers) == linears - {"generator"}
    assert _attention_projections(model) <= set(pre.layers)
    assert len(pre.layers) == 6 * layers[0] + 10 * layers[1]
    # Their hooks fire: one step builds factors for every layer (one rank owns all).
    source_ids = torch.randint(1, 40, (3, 7))
    target = torch.randint(1, 40, (3, 6))
    logits = model(source_ids, target[:, :-1])
    nn.functional.cross_entropy(logits.reshape(-1, 40), target[:, 1:].reshape(-1)).backward()
    pre.step()
    missing = [n for n, layer in pre.layers.items() if layer.a_factor is None]
    assert missing == []


def test_attention_equals_torch_multihead_attention() -> None:
    """Separate projections + SDPA compute what nn.MultiheadAttention (no bias) computes."""
    torch.manual_seed(0)
    ours = MultiHeadAttention(16, 4, dropout=0.0).eval()
    ref = nn.MultiheadAttention(16, 4, bias=False, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.w_qs.weight, ours.w_ks.weight, ours.w_vs.weight]))
        ref.out_proj.weight.copy_(ours.fc.weight)
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 4:] = True
    got = ours(x, memory, ~padding[:, None, None, :])
    attended, _ = ref(x, memory, memory, key_padding_mask=padding, need_weights=False)
    assert torch.allclose(got, ours.layer_norm(x + attended), atol=1e-5)


def test_padding_and_causal_masks() -> None:
    """Padding the source changes nothing; a target token sees only its prefix."""
    torch.manual_seed(0)
    model = TranslationTransformer(vocab_size=30, d_model=16, nhead=2, dim_feedforward=32).eval()
    source = torch.tensor([[2, 5, 6, 3]])
    padded = torch.tensor([[2, 5, 6, 3, 0, 0]])
    target = torch.tensor([[2, 7, 8, 9]])
    with torch.no_grad():
        logits = model(source, target)
        assert torch.allclose(logits, model(padded, target), atol=1e-5)
        changed = model(source, torch.tensor([[2, 7, 11, 12]]))
    assert torch.allclose(logits[:, :2], changed[:, :2], atol=1e-5)
    assert not torch.allclose(logits[:, 2:], changed[:, 2:], atol=1e-5)


def test_zoo_matches_a_small_model_read_by_its_hooks() -> None:
    """At small sizes with source and target of different lengths (T of the cross-attention)."""
    model = TranslationTransformer(
        vocab_size=50,
        d_model=32,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=1,
        dim_feedforward=64,
    )
    src, tgt = torch.ones(3, 9, dtype=torch.long), torch.ones(3, 5, dtype=torch.long)
    got = shapes_from_model(model, (src, tgt), skip_layers=["embed", "generator"])
    want = transformer(
        batch_size=3,
        src_len=9,
        tgt_len=5,
        d_model=32,
        heads=4,
        d_inner=64,
        encoder_layers=2,
        decoder_layers=1,
        vocab=50,
    )
    assert got == want
