"""How much LPT load balancing lowers DP-KFAC's busiest rank, vs round robin.

DP-KFAC gives every K-FAC layer one owner that builds its factors from the
local batch, decomposes them and preconditions the layer. The released code
assigns owners round robin over module order; :mod:`dpkfac.assignment` can
instead balance a cost model with greedy longest-processing-time (LPT). The
step waits for the busiest rank, so this script reports the busiest rank's
cost under both, for the paper's two largest settings:

* ResNet-50 on ImageNet (224x224, local batch 32): shapes from forward hooks
  on a ``meta``-device model (no weights are allocated, nothing is computed).
* BERT-base for SQuAD (sequence 384, local batch 4): 12 encoder layers with
  Q, K, V, O (768x768), FFN in (768x3072) and out (3072x768), plus the QA
  head (768x2); every Linear has a bias, ``T`` = sequence length.

Usage::

    python -m experiments.balance_report [--cost compute|compute_inverse|memory]

Compute costs are printed in 1e9 multiply-adds, memory in 1e6 elements.
``method="best"`` in :func:`dpkfac.assignment.assign_layers` would take the
smaller of the two columns.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dpkfac.assignment import (
    COSTS,
    LayerShape,
    assign_layers,
    load_imbalance,
    rank_loads,
)

WORLD_SIZES = (4, 16, 64)
UNITS = {
    "compute": (1e9, "1e9 multiply-adds"),
    "compute_inverse": (1e9, "1e9 multiply-adds"),
    "memory": (1e6, "1e6 elements"),
}


def resnet50_shapes(batch_size: int = 32, image_size: int = 224) -> list[LayerShape]:
    """K-FAC layer shapes of torchvision's ResNet-50, in module order.

    Runs a forward pass on the ``meta`` device with hooks on every Conv2d and
    Linear to read each layer's output size, so positions ``T`` follow the
    real strides and paddings.
    """
    import torch
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
        x = torch.empty(batch_size, 3, image_size, image_size)
    out_shapes: dict[str, tuple[int, ...]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d | torch.nn.Linear):

            def hook(mod: object, inp: object, out: torch.Tensor, name: str = name) -> None:
                out_shapes[name] = tuple(out.shape)

            handles.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()

    shapes: list[LayerShape] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d):
            out = out_shapes[name]
            shapes.append(
                LayerShape.conv2d(
                    name,
                    module.in_channels,
                    module.out_channels,
                    module.kernel_size,
                    (out[2], out[3]),
                    bias=module.bias is not None,
                    groups=module.groups,
                    batch_size=batch_size,
                )
            )
        elif isinstance(module, torch.nn.Linear):
            positions = 1
            for d in out_shapes[name][1:-1]:
                positions *= d
            shapes.append(
                LayerShape.linear(
                    name,
                    module.in_features,
                    module.out_features,
                    bias=module.bias is not None,
                    batch_size=batch_size,
                    positions=positions,
                )
            )
    return shapes


def bert_base_shapes(
    batch_size: int = 4, seq_len: int = 384, num_layers: int = 12, hidden: int = 768
) -> list[LayerShape]:
    """K-FAC layer shapes of BERT-base for question answering, in module order.

    Names follow Hugging Face's ``BertForQuestionAnswering``. Embeddings are
    not Linear layers and take no part; the QA head maps hidden -> 2.
    """
    ffn = 4 * hidden

    def lin(name: str, d_in: int, d_out: int) -> LayerShape:
        return LayerShape.linear(
            name, d_in, d_out, bias=True, batch_size=batch_size, positions=seq_len
        )

    shapes: list[LayerShape] = []
    for i in range(num_layers):
        p = f"bert.encoder.layer.{i}"
        shapes += [
            lin(f"{p}.attention.self.query", hidden, hidden),
            lin(f"{p}.attention.self.key", hidden, hidden),
            lin(f"{p}.attention.self.value", hidden, hidden),
            lin(f"{p}.attention.output.dense", hidden, hidden),
            lin(f"{p}.intermediate.dense", hidden, ffn),
            lin(f"{p}.output.dense", ffn, hidden),
        ]
    shapes.append(lin("qa_outputs", hidden, 2))
    return shapes


def balance_rows(
    model: str,
    shapes: Sequence[LayerShape],
    world_sizes: Sequence[int] = WORLD_SIZES,
    cost: str = "compute",
) -> list[dict[str, float | int | str]]:
    """Busiest-rank cost under round robin and LPT, for each world size."""
    fn = COSTS[cost]
    costs = [fn(s) for s in shapes]
    rows: list[dict[str, float | int | str]] = []
    for p in world_sizes:
        rr = rank_loads(assign_layers(shapes, p, method="round_robin"), costs, p)
        lpt = rank_loads(assign_layers(shapes, p, cost=fn, method="lpt"), costs, p)
        rows.append(
            {
                "model": model,
                "P": p,
                "layers": len(shapes),
                "total": sum(costs),
                "rr_max": max(rr),
                "lpt_max": max(lpt),
                "lower_bound": max(max(costs), sum(costs) / p),
                "rr_imbalance": load_imbalance(rr),
                "lpt_imbalance": load_imbalance(lpt),
            }
        )
    return rows


def markdown_table(rows: Sequence[dict[str, float | int | str]], scale: float = 1e9) -> str:
    """Render :func:`balance_rows` output as a markdown table."""
    lines = [
        "| model | P | layers | round robin max | LPT max | RR/LPT | reduction "
        "| lower bound | RR max/mean | LPT max/mean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rr, lpt = float(r["rr_max"]), float(r["lpt_max"])
        lines.append(
            f"| {r['model']} | {r['P']} | {r['layers']} | {rr / scale:.2f} | {lpt / scale:.2f} "
            f"| {rr / lpt:.2f}x | {100 * (1 - lpt / rr):.1f}% "
            f"| {float(r['lower_bound']) / scale:.2f} "
            f"| {float(r['rr_imbalance']):.2f} | {float(r['lpt_imbalance']):.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the balance table for ResNet-50 and BERT-base."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost", choices=sorted(COSTS), default="compute")
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=list(WORLD_SIZES),
        help="numbers of ranks P to report (default: 4 16 64)",
    )
    args = parser.parse_args(argv)
    models = [
        ("ResNet-50 (N=32, 224px)", resnet50_shapes()),
        ("BERT-base (N=4, seq 384)", bert_base_shapes()),
    ]
    rows = []
    for name, shapes in models:
        rows += balance_rows(name, shapes, world_sizes=args.world_sizes, cost=args.cost)
    scale, unit = UNITS.get(args.cost, (1.0, "cost units"))
    print(f"Busiest rank's `{args.cost}` cost per K-FAC update ({unit})\n")
    print(markdown_table(rows, scale=scale))


if __name__ == "__main__":
    main()
