"""``python -m dpkfac.costmodel [table|calibrate]``: the predicted 64-GPU table, or calibrate here.

``table`` (default) prints the DP-KFAC paper's table for ResNet-50,
BERT-large and the Transformer at ``--world-size`` ranks on a hardware
preset or a calibrated JSON file; ``calibrate`` measures this machine and
prints (or writes) the fitted :class:`~dpkfac.costmodel.Hardware` as JSON.
"""

from __future__ import annotations

import argparse

from dpkfac.costmodel import PAPER_MODELS, PRESETS, Hardware, format_table, predicted_table
from dpkfac.costmodel.calibration import calibrate_local


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dpkfac.costmodel", description=__doc__)
    parser.add_argument("command", nargs="?", default="table", choices=("table", "calibrate"))
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument(
        "--hardware", default="v100_ib100", help=f"preset ({', '.join(PRESETS)}) or JSON file"
    )
    parser.add_argument("--threads", type=int, default=1, help="calibrate: threads per rank")
    parser.add_argument("--out", default=None, help="calibrate: write the JSON here")
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        hw = calibrate_local(args.world_size if args.world_size <= 8 else 2, args.threads)
        print(hw.to_json(args.out))
        return
    hw = PRESETS.get(args.hardware) or Hardware.from_json(args.hardware)
    print(
        f"Predicted cost per second-order update, P = {args.world_size}, hardware {hw.name} "
        "(factors and decompositions every step; busiest rank)\n"
    )
    for name, (shapes, opts) in PAPER_MODELS.items():
        s = shapes[0]
        print(
            f"- {name}: {len(shapes)} K-FAC layers, {shapes.num_params / 1e6:.1f}M parameters, "
            f"local batch {s.batch_size}, " + ", ".join(f"{k}={v}" for k, v in opts.items())
        )
    print()
    print(format_table(predicted_table(PAPER_MODELS, args.world_size, hw)))


if __name__ == "__main__":
    main()
