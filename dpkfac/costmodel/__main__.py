"""``python -m dpkfac.costmodel [table|calibrate|balance]``: predictions without a cluster.

``table`` (default) prints the DP-KFAC paper's table for ResNet-50,
BERT-large and the Transformer at ``--world-size`` ranks on a hardware
preset or a calibrated JSON file; ``calibrate`` measures this machine and
prints (or writes) the fitted :class:`~dpkfac.costmodel.Hardware` as JSON;
``balance`` prints how evenly DP-KFAC's layer assignments split the same
models' work (busiest rank over the mean, per assignment).
"""

from __future__ import annotations

import argparse

from dpkfac.assignment import COSTS
from dpkfac.costmodel import PAPER_MODELS, PRESETS, Hardware, format_table, predicted_table
from dpkfac.costmodel.balance import balance_rows, format_balance
from dpkfac.costmodel.calibration import calibrate_local


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dpkfac.costmodel", description=__doc__)
    parser.add_argument(
        "command", nargs="?", default="table", choices=("table", "calibrate", "balance")
    )
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument(
        "--hardware", default="v100_ib100", help=f"preset ({', '.join(PRESETS)}) or JSON file"
    )
    parser.add_argument("--threads", type=int, default=1, help="calibrate: threads per rank")
    parser.add_argument("--out", default=None, help="calibrate: write the JSON here")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(PAPER_MODELS),
        default=list(PAPER_MODELS),
        help="balance: models to report",
    )
    parser.add_argument(
        "--cost", choices=sorted(COSTS), default="compute", help="balance: layer cost"
    )
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        hw = calibrate_local(args.world_size if args.world_size <= 8 else 2, args.threads)
        print(hw.to_json(args.out))
        return
    if args.command == "balance":
        models = {name: PAPER_MODELS[name][0] for name in args.models}
        print(
            f"DP-KFAC layer placement at P = {args.world_size}: busiest rank's `{args.cost}` "
            "cost over the mean (1.000 is a perfect split)\n"
        )
        print(format_balance(balance_rows(models, args.world_size, args.cost)))
        return
    hw = PRESETS.get(args.hardware) or Hardware.from_json(args.hardware)
    print(
        f"Predicted cost per second-order update, P = {args.world_size}, hardware {hw.name} "
        "(factors and decompositions every step; busiest rank)\n"
    )
    for name, (shapes, kfac) in PAPER_MODELS.items():
        s = shapes[0]
        print(
            f"- {name}: {len(shapes)} K-FAC layers, {shapes.num_params / 1e6:.1f}M parameters, "
            f"local batch {s.batch_size}, compute_method={kfac.compute_method}, "
            f"kl_clip={kfac.kl_clip}, weight_sharing={kfac.weight_sharing}"
        )
    print()
    print(format_table(predicted_table(PAPER_MODELS, args.world_size, hw)))


if __name__ == "__main__":
    main()
