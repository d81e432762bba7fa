"""Every preset with every strategy trains 2 steps on fake data, end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.train import run

CONF = Path(__file__).parents[1] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# Every strategy config of the group (the one the benchmark's tables use too).
STRATEGIES = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))
PRIMARY = {"squad": "f1", "multi30k": "bleu"}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_runs_two_steps(preset, strategy, train, tiny, tmp_path):
    out = tmp_path / "run"
    result = train(
        f"experiment={preset}",
        f"strategy={strategy}",
        "trainer.max_steps=2",
        *tiny[preset],
        out=out,
    )
    assert result["steps"] == 2
    assert math.isfinite(result["train_loss"])
    metric = next((m for k, m in PRIMARY.items() if preset.startswith(k)), "accuracy")
    assert metric in result and math.isfinite(result[metric])
    assert result["strategy"] == strategy
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["final"][metric] == result[metric]
    assert (out / "checkpoints" / "last.pt").resolve().name == "step_000000002.pt"


def test_wandb_logger_writes_an_offline_run(compose, tmp_path):
    out = tmp_path / "run"
    cfg = compose(
        "data.fake=true",
        "trainer.max_steps=4",
        "trainer.log_every_steps=2",
        "trainer.progress_bar=false",
        "logger=wandb",
        f"output_dir={out}",
    )
    assert cfg.logger.mode == "offline"
    run(cfg)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert any(runs[0].glob("*.wandb"))
