"""``experiments.train`` through Hugging Face Trainer and dpkfac's KFACCallback
(``trainer.loop=hf``): the SQuAD BERT preset trains, is scored by the project's task, and its
Trainer checkpoint carries the preconditioner's state."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dpkfac.integrations.huggingface import STATE_FILE


@pytest.mark.filterwarnings("error::RuntimeWarning")  # max_grad_norm=0 preconditions too
def test_squad_bert_runs_through_the_hf_integration(train, tiny, tmp_path) -> None:
    out = tmp_path / "run"
    result = train(
        "experiment=squad_bert",
        "trainer.loop=hf",
        "trainer.max_steps=2",
        "trainer.checkpoint_every_steps=2",
        "trainer.accumulate_grad_batches=2",
        *tiny["squad_bert"],
        out=out,
    )
    assert result["loop"] == "hf" and result["steps"] == 2
    assert math.isfinite(result["train_loss"]) and math.isfinite(result["f1"])
    assert json.loads((out / "metrics.json").read_text())["final"]["f1"] == result["f1"]
    assert (out / "hf" / "checkpoint-2" / STATE_FILE).is_file()


def test_hf_loop_refuses_fp16(train, tiny) -> None:
    from experiments.config import ExperimentError

    with pytest.raises(ExperimentError, match=r"trainer\.precision=bf16"):
        train(
            "experiment=squad_bert",
            "trainer.loop=hf",
            "trainer.precision=fp16",
            "trainer.max_steps=1",
            *tiny["squad_bert"],
        )
