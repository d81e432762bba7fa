"""``python -m dpkfac.costmodel [table|calibrate|balance]``: predictions without a cluster.

``table`` (default) prints every configuration's predicted costs for ResNet-50,
BERT-large and the Transformer at ``--world-size`` ranks on a hardware
preset or a calibrated JSON file. With ``--format csv`` it prints one
machine-readable row per model and strategy instead, for the models of
``--models`` (the papers' sizes of ``resnet32``, ``resnet50``, ``bert_base``,
``bert_large``, ``transformer``) and the strategies of ``--strategies``: configuration
names (:data:`dpkfac.plan.configs.CONFIGS`, as Hydra's ``strategy=`` spells them) or
scheme names (``KFACPreconditioner``'s, each with its default options)::

    python -m dpkfac.costmodel table --format csv --world-size 64 \\
        --models resnet32,bert_base --strategies d_kfac,spd_kfac

``calibrate`` measures this machine and prints (or writes) the fitted
:class:`~dpkfac.costmodel.Hardware` as JSON; ``balance`` prints how evenly
DP-KFAC's layer assignments split the models' work (busiest rank over the
mean, per assignment).
"""

from __future__ import annotations

import argparse
import csv
import sys

from dpkfac.costmodel import PAPER_MODELS, PRESETS, Hardware, format_table, predicted_table
from dpkfac.costmodel.balance import balance_rows, format_balance
from dpkfac.costmodel.calibration import calibrate_local
from dpkfac.costmodel.zoo import ZOO
from dpkfac.plan import SCHEMES, canonical_name, name_key
from dpkfac.plan.assignment import COSTS
from dpkfac.plan.configs import kfac_configs

#: ``table --format csv``'s figures: column -> (key of a ``predicted_table`` row, scale).
_CSV_FIGURES = {
    "computation_ms": ("computation_s", 1e3),
    "communication_ms": ("communication_s", 1e3),
    "memory_mib": ("memory_mb", 1.0),
    "wire_mib": ("kfac_wire_mb", 1.0),
    "iteration_ms": ("iteration_s", 1e3),
}
#: Columns of ``table --format csv``.
CSV_COLUMNS = ("model", "strategy", "world_size", *_CSV_FIGURES)


def _names(text: str, known: list[str], what: str) -> list[str]:
    """A comma-separated list, every entry checked against ``known``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"error: unknown {what} {unknown or text!r}; expected some of {known}")
    return names


def csv_rows(
    models: list[str], strategies: list[str], world_size: int, hardware: Hardware
) -> list[dict[str, object]]:
    """One row per model and strategy (``CSV_COLUMNS``), predicted at the papers' sizes."""
    configs = kfac_configs()
    variants = {s: configs.get(s) or (canonical_name(s), {}) for s in strategies}
    rows = predicted_table(
        {name: ZOO[name] for name in models}, world_size, hardware, variants=variants
    )
    return [
        {
            "model": row["model"],
            "strategy": row["strategy"],
            "world_size": world_size,
            **{col: round(row[key] * scale, 3) for col, (key, scale) in _CSV_FIGURES.items()},
        }
        for row in rows
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dpkfac.costmodel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command", nargs="?", default="table", choices=("table", "calibrate", "balance")
    )
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument(
        "--hardware", default="v100_ib100", help=f"preset ({', '.join(PRESETS)}) or JSON file"
    )
    parser.add_argument("--format", choices=("markdown", "csv"), default="markdown")
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma-separated, of {', '.join(ZOO)} (table --format csv, balance); "
        "default: the paper table's ResNet-50, BERT-large, Transformer",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(SCHEMES),
        help="comma-separated strategy names (table --format csv)",
    )
    parser.add_argument("--threads", type=int, default=1, help="calibrate: threads per rank")
    parser.add_argument("--out", default=None, help="calibrate: write the JSON here")
    parser.add_argument(
        "--cost", choices=sorted(COSTS), default="compute", help="balance: layer cost"
    )
    args = parser.parse_args(argv)
    if args.world_size < 1:
        raise SystemExit(f"error: --world-size must be >= 1, got {args.world_size}")
    if args.command == "calibrate":
        hw = calibrate_local(args.world_size if args.world_size <= 8 else 2, args.threads)
        print(hw.to_json(args.out))
        return
    chosen = _names(args.models or "resnet50,bert_large,transformer", list(ZOO), "model")
    if args.command == "balance":
        print(
            f"DP-KFAC layer placement at P = {args.world_size}: busiest rank's `{args.cost}` "
            "cost over the mean (1.000 is a perfect split)\n"
        )
        models = {name: ZOO[name][0] for name in chosen}
        print(format_balance(balance_rows(models, args.world_size, args.cost)))
        return
    hw = PRESETS.get(args.hardware) or Hardware.from_json(args.hardware)
    if args.format == "csv":
        strategies = _names(
            ",".join(name_key(n) for n in args.strategies.split(",")),
            [*SCHEMES, *(n for n in kfac_configs() if n not in SCHEMES)],
            "strategy",
        )
        writer = csv.DictWriter(sys.stdout, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(csv_rows(chosen, strategies, args.world_size, hw))
        return
    print(
        f"Predicted cost per second-order update, P = {args.world_size}, hardware {hw.name} "
        "(factors and decompositions every step; busiest rank)\n"
    )
    for name, (shapes, kfac) in PAPER_MODELS.items():
        print(
            f"- {name}: {len(shapes)} K-FAC layers, {shapes.num_params / 1e6:.1f}M parameters, "
            f"local batch {shapes[0].batch_size}, compute_method={kfac.compute_method}, "
            f"kl_clip={kfac.kl_clip}, weight_sharing={kfac.weight_sharing}"
        )
    print()
    print(format_table(predicted_table(PAPER_MODELS, args.world_size, hw)))
    print("\nThe paper's headline, dp_kfac against the best baseline: results/paper.md")


if __name__ == "__main__":
    main()
