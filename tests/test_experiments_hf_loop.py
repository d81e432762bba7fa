"""``experiments.train`` through Hugging Face Trainer and dpkfac's KFACCallback
(``trainer.loop=hf``): what it refuses.

That it trains the project loop's updates, is scored by the project's task, writes
``metrics.json`` and resumes bitwise from its Trainer checkpoints is
tests/test_integration_huggingface.py's first test (one process) and
tests/test_integration_distributed.py's (two).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_hf_loop_refuses_fp16_on_a_cpu(train, tiny) -> None:
    """accelerate makes no loss scaler on a CPU: Trainer would train in float32, not the
    project loop's fp16 run."""
    from experiments.config import ExperimentError

    with pytest.raises(ExperimentError, match=r"fp16 on a CPU.*trainer\.precision=bf16"):
        train(
            "experiment=squad_bert",
            "trainer.loop=hf",
            "trainer.precision=fp16",
            "trainer.max_steps=1",
            *tiny["squad_bert"],
        )
