"""Shared test setup: offline libraries, and composing the Hydra configs in-process."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Nothing may reach the network in tests (W&B, Hugging Face hub and datasets).
for _var, _value in (
    ("WANDB_MODE", "offline"),
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_var, _value)

# Under pytest-xdist (`make test`) the workers share the cores: one worker's torch takes its
# share of them, so tiny tensors do not wait on threads another worker's tests hold.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


@pytest.fixture
def compose() -> Callable[..., object]:
    """``compose(*overrides)`` -> the composed config, as ``experiments.train`` gets it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    def _compose(*overrides: str) -> object:
        # One thread per rank for tiny models on a shared 2-core machine (a test's
        # own trainer.threads comes later and wins).
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose("config", overrides=["trainer.threads=1", *overrides])

    return _compose


# Per preset: overrides that keep a fake-data smoke run to seconds on a CPU while
# going through the preset's real model class, data path and strategy settings.
_TINY: dict[str, list[str]] = {
    "digits_cnn": ["data.batch_size=16"],
    # Fake MNIST-1D: 400 samples generated into the run's scratch folder (a tenth of a second).
    "mnist1d_mlp": ["data.batch_size=16"],
    "mnist1d_cnn": ["data.batch_size=16"],
    "cifar10_resnet32": ["data.batch_size=4", "data.num_workers=0"],
    "cifar10_resnet110": ["data.batch_size=4", "data.num_workers=0"],
    # ResNet-50 keeps its architecture; K-FAC covers the stem and layer1 only, since
    # decomposing its 2048- and 4608-dimensional factors takes minutes on a CPU.
    "imagenet_resnet50": [
        "data.batch_size=4",
        "data.eval_batch_size=8",
        "data.num_workers=0",
        "data.image_size=32",
        "++strategy.skip_layers=[layer2,layer3,layer4,fc]",
    ],
    "squad_bert": ["data.batch_size=4"],
    "squad_bert_adamw": ["data.batch_size=4"],
    "multi30k_transformer": [
        "data.batch_size=8",
        "data.decode_extra_tokens=5",
        "model.d_model=32",
        "model.nhead=2",
        "model.dim_feedforward=64",
    ],
    "multi30k_transformer_adam": [
        "data.batch_size=8",
        "data.decode_extra_tokens=5",
        "model.d_model=32",
        "model.nhead=2",
        "model.dim_feedforward=64",
    ],
}


@pytest.fixture
def tiny() -> dict[str, list[str]]:
    """Preset name -> overrides for a seconds-long fake-data run."""
    return _TINY


@pytest.fixture
def train(compose: Callable[..., object], tmp_path: Path) -> Callable[..., dict]:
    """``train(*overrides, out=PATH)`` runs ``experiments.train.run`` on fake data, no logger."""
    from experiments.train import run

    def _train(*overrides: str, out: Path | None = None) -> dict:
        out = out or tmp_path / "run"
        cfg = compose(
            "data.fake=true",
            "logger=none",
            "trainer.progress_bar=false",
            f"output_dir={out}",
            *overrides,
        )
        return run(cfg)

    return _train


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """One intra-op thread for modules of tiny tensors.

    On a busy 2-core machine extra threads only add wake-up latency (about
    20 ms per tiny conv instead of 20 µs); the previous setting is restored.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def project_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The parameters the project's own trainer ends the integration case with
    (tests/integration_cases.py), shared by the Hugging Face, accelerate and Lightning tests."""
    from integration_cases import project_params, train_case

    out = tmp_path_factory.mktemp("project_reference")
    train_case(out)
    return project_params(out)


@pytest.fixture(scope="session")
def project_fp16_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same in fp16 (autocast and a GradScaler, on the CPU)."""
    from integration_cases import project_params, train_case

    out = tmp_path_factory.mktemp("project_fp16_reference")
    train_case(out, "trainer.precision=fp16")
    return project_params(out)
