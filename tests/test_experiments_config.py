"""Every config of the tree composes, every group option instantiates; bad input fails clearly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dpkfac.plan.configs import CONFIGS
from experiments.config import ExperimentError, validate
from experiments.preconditioning import uses_preconditioner

CONF = Path(__file__).parents[1] / "conf"
REPO = CONF.parent


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


PRESETS = options("experiment")
# Sizes a data module would hand to each model.
MODEL_KWARGS = {
    "digits_cnn": {"num_classes": 10},
    "mlp": {"num_classes": 10},
    "mnist1d_mlp": {"num_classes": 10, "d_in": 40},
    "mnist1d_cnn": {"num_classes": 10, "d_in": 40},
    "resnet32": {"num_classes": 10},
    "resnet110": {"num_classes": 10, "depth": 8},
    "resnet50": {"num_classes": 5, "width_divisor": 16},
    "bert_base": {"vocab_size": 100, "tiny": True},
    "bert_large": {"vocab_size": 100, "tiny": True},
    "transformer": {"vocab_size": 100, "d_model": 32, "nhead": 2, "dim_feedforward": 64},
}


def test_all_groups_and_presets_exist():
    for group in ("model", "data", "optimizer", "scheduler", "strategy", "logger", "trainer"):
        assert options(group), group
    for group in ("paths", "hydra", "workload", "setting", "table"):
        assert options(group), group
    assert set(options("strategy")) == set(CONFIGS)  # and equal: tests/test_configs.py
    assert set(options("model")) == set(MODEL_KWARGS)
    assert not (CONF / "bench").exists()
    assert {"sgd", "adamw"} <= set(options("optimizer"))
    assert {"wandb", "none"} <= set(options("logger"))
    assert {
        "digits_cnn",
        "mnist1d_mlp",
        "mnist1d_cnn",
        "cifar10_resnet32",
        "cifar10_resnet110",
        "imagenet_resnet50",
        "squad_bert",
        "multi30k_transformer",
    } <= set(PRESETS)


def test_default_is_digits_with_dp_kfac(compose):
    cfg = compose()
    assert cfg.name == "digits_cnn"
    assert (cfg.strategy.name, cfg.strategy.algorithm) == ("dp_kfac", "dp_kfac")
    assert cfg.strategy._target_ == "experiments.preconditioning.build_preconditioner"
    assert cfg.logger.mode == "offline"


@pytest.mark.parametrize("option", options("strategy"))
def test_strategy_configs_are_named_as_their_files(compose, option):
    """Rows, tables, logs and W&B report ``strategy.name``: it must be the option's name."""
    node = compose(f"strategy={option}").strategy
    assert node.name == option
    if option != "none":
        from dpkfac.strategies import STRATEGIES

        assert node.algorithm in STRATEGIES


def test_dp_kfac_owner_is_dp_kfac_with_owner_reduction(compose):
    owner = compose("strategy=dp_kfac_owner").strategy
    plain = compose("strategy=dp_kfac").strategy
    assert owner.algorithm == "dp_kfac" and owner.grad_reduction == "owner"
    differing = {k for k in plain if plain[k] != owner[k]}
    assert differing == {"name", "grad_reduction"}


@pytest.mark.parametrize("strategy", options("strategy"))
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_with_every_strategy(compose, preset, strategy):
    cfg = compose(f"experiment={preset}", f"strategy={strategy}", "output_dir=/tmp/x")
    validate(cfg)
    assert uses_preconditioner(cfg.strategy) == (strategy != "none")
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def test_published_hyperparameters(compose):
    cifar = compose("experiment=cifar10_resnet110")
    assert (cifar.model.depth, cifar.data.batch_size, cifar.optimizer.lr) == (110, 128, 0.1)
    assert cifar.trainer.scale_lr and cifar.trainer.max_epochs == 100
    assert list(cifar.scheduler.milestones) == [35, 75, 90] and cifar.scheduler.warmup_epochs == 1
    assert (cifar.optimizer.weight_decay, cifar.strategy.damping) == (5e-4, 0.03)
    assert (cifar.strategy.factor_decay, cifar.strategy.kl_clip) == (0.95, 0.001)
    imagenet = compose("experiment=imagenet_resnet50")
    assert (imagenet.data.batch_size, imagenet.optimizer.lr, imagenet.scheduler.warmup_epochs) == (
        32,
        0.0125,
        5,
    )
    assert list(imagenet.scheduler.milestones) == [25, 35, 40, 45, 50]
    assert imagenet.trainer.max_epochs == 55 and imagenet.data.label_smoothing == 0.1
    damping = imagenet.strategy.damping  # the authors' damping decay, a schedule of the step
    assert imagenet.optimizer.weight_decay == 5e-5
    assert (damping.base, list(damping.milestones), damping.gamma, damping.unit) == (
        0.002,
        [40, 80],
        0.5,
        "epoch",
    )
    squad = compose("experiment=squad_bert")
    assert (squad.data.max_seq_length, squad.data.doc_stride, squad.data.batch_size) == (
        384,
        128,
        4,
    )
    assert (squad.trainer.max_epochs, squad.optimizer.lr, squad.strategy.kl_clip) == (3, 5e-6, None)
    assert squad.optimizer._target_ == "torch.optim.SGD"
    assert compose("experiment=squad_bert_adamw").optimizer._target_ == "torch.optim.AdamW"
    m30k = compose("experiment=multi30k_transformer")
    assert (m30k.model.d_model, m30k.model.nhead, m30k.model.num_encoder_layers) == (512, 8, 2)
    assert m30k.data.batch_size == 128 and m30k.scheduler.warmup_steps == 4000
    assert "generator" in m30k.strategy.skip_layers and "embed" in m30k.strategy.skip_layers


@pytest.mark.parametrize("option", options("model"))
def test_every_model_instantiates(compose, option):
    cfg = compose("~experiment", f"model={option}")
    model = instantiate(cfg.model, **MODEL_KWARGS[option])
    assert isinstance(model, torch.nn.Module)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("option", options("data"))
def test_every_data_module_instantiates(compose, option):
    from experiments.data.loading import DataModule

    assert isinstance(instantiate(compose("~experiment", f"data={option}").data), DataModule)


@pytest.mark.parametrize("option", options("optimizer"))
@pytest.mark.parametrize("schedule", options("scheduler"))
def test_every_optimizer_and_schedule_instantiates(compose, option, schedule):
    # Without a preset, whose schedule keys belong to the preset's own schedule.
    cfg = compose("~experiment", f"optimizer={option}", f"scheduler={schedule}")
    model = torch.nn.Linear(3, 2)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    scheduler = instantiate(cfg.scheduler)(optimizer, steps_per_epoch=10, total_steps=100)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] > 0


@pytest.mark.parametrize("option", options("strategy"))
def test_every_strategy_instantiates(compose, option):
    from dpkfac import KFACPreconditioner
    from dpkfac.strategies import strategy_class

    cfg = compose("~experiment", f"strategy={option}")
    if not uses_preconditioner(cfg.strategy):
        assert option == "none"
        return
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    pre = instantiate(cfg.strategy, model=model, lr=lambda _step: 0.1)
    assert isinstance(pre, KFACPreconditioner)
    assert isinstance(pre.strategy, strategy_class(cfg.strategy.algorithm))
    assert pre.options.damping == cfg.strategy.damping
    assert set(pre.layers) == {"0", "2"}
    model(torch.randn(5, 4)).square().mean().backward()
    pre.step()


def test_every_logger_instantiates(compose, tmp_path):
    for option in options("logger"):
        cfg = compose(f"logger={option}")
        logger = instantiate(cfg.logger, _partial_=True)(name="t", dir=str(tmp_path), run_config={})
        logger.log({"x": 1.0}, step=1)
        logger.finish()


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.max_steps=-3", "trainer.max_steps=-3"),
        ("trainer.max_epochs=0", "trainer.max_epochs=0"),
        ("strategy.damping=0", "strategy.damping=0"),
        ("strategy.compute_method=cholesky", "strategy.compute_method='cholesky'"),
        ("strategy.factor_decay=1.0", "strategy.factor_decay=1.0"),
        ("strategy.weight_sharing=sum", "strategy.weight_sharing='sum'"),
        ("strategy.inv_update_steps=0", "strategy.inv_update_steps=0"),
        ("strategy.kl_clip=-1", "strategy.kl_clip=-1"),
        ("strategy.bucket_cap_mb=0", "strategy.bucket_cap_mb=0"),
        ("strategy.assignment=random", "strategy.assignment='random'"),
        ("strategy.grad_reduction=gather", "strategy.grad_reduction='gather'"),
        ("strategy.algorithm=nope", "strategy.algorithm='nope'"),
        ("++strategy.skip_layers=[1]", "strategy.skip_layers=[1]"),
        ("++strategy.skip_layers=['(']", "strategy.skip_layers=['(']"),
        ("++strategy.factor_dtype=float16x", "strategy.factor_dtype='float16x'"),
        ("+strategy.fusion=dynamic", "strategy.fusion='dynamic'"),
        ("optimizer.lr=-0.1", "optimizer.lr=-0.1"),
        ("data.batch_size=0", "data.batch_size=0"),
    ],
)
def test_bad_values_are_named(compose, override, named):
    with pytest.raises(ExperimentError, match=f"^invalid value {re.escape(named)}: ") as info:
        validate(compose(override))
    assert "\n" not in str(info.value)


def test_a_misspelt_strategy_key_or_algorithm_gets_the_closest_name(compose):
    with pytest.raises(ExperimentError) as raised:
        validate(compose("+strategy.dampening=0.003"))
    assert str(raised.value).startswith(
        "invalid value strategy.dampening=0.003: unknown option 'dampening' for strategy "
        "'dp_kfac'; did you mean 'damping'? Accepted: common options: ['accumulation_steps', "
    )
    with pytest.raises(ExperimentError) as raised:
        validate(compose("strategy.algorithm=dp-kfca"))
    assert str(raised.value) == (
        "invalid value strategy.algorithm='dp-kfca': unknown strategy 'dp-kfca'; did you mean "
        "'dp_kfac'? Expected one of ['d_kfac', 'dp_kfac', 'grouped', 'kaisa', 'spd_kfac'], in "
        "any case, with '-' or '_'"
    )
    validate(compose("strategy.algorithm=DP-KFAC"))  # the papers' spelling is read


def test_strategy_options_mixing_badly_are_named(compose):
    """Options that are only wrong together are named from the library's message."""
    with pytest.raises(
        ExperimentError, match=r"^invalid value strategy.pi_damping=True: .*inverse"
    ):
        validate(compose("+strategy.pi_damping=true"))


def test_library_values_pass(compose):
    # A string is one skip regex for the library; a dtype name becomes a torch dtype.
    validate(compose("strategy.skip_layers=fc", "+strategy.factor_dtype=bfloat16"))
    validate(compose("strategy=none", "++strategy.damping=0"))  # first order: ignored
    # Schedules (``_target_`` nodes) are built and checked by their value at step 0.
    validate(
        compose(
            "++strategy.damping={_target_:experiments.schedules.kfac_schedule,base:0.01}",
        )
    )
    with pytest.raises(ExperimentError, match=r"^invalid value strategy.damping=.*optimizer"):
        validate(
            compose("++strategy.damping={_target_:experiments.schedules.constant,_partial_:true}")
        )


def test_missing_dataset_names_the_path(train, tmp_path):
    root = tmp_path / "nowhere"
    missing = re.escape(f"{root}/cifar-10-batches-py/data_batch_1 does not exist")
    with pytest.raises(ExperimentError, match=missing):
        train("experiment=cifar10_resnet32", "data.fake=false", f"data.root={root}")
    with pytest.raises(ExperimentError, match=r"train-v1\.1\.json does not exist.*rajpurkar"):
        train("experiment=squad_bert", "data.fake=false", f"data.root={root}")


def test_optimizer_mismatch_is_named(train):
    with pytest.raises(ExperimentError, match=r"cannot build optimizer .*momentum"):
        train("optimizer=adamw", "+optimizer.momentum=0.9", "trainer.max_steps=1")


def _cli(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("strategy=nope", "Could not find 'strategy/nope'"),
        ("trainer.max_steps=-3", "invalid value trainer.max_steps=-3"),
        ("trainer.no_such_key=1", "trainer.no_such_key"),
        ("strategy.assignment=random", "invalid value strategy.assignment='random'"),
    ],
)
def test_cli_rejects_bad_overrides_without_traceback(override, message, tmp_path):
    proc = _cli(override, "logger=none", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("+trainer.max_epoch=2", "unknown key trainer.max_epoch (no config of conf/trainer/"),
        ("+data.batchsize=4", "did you mean data.batch_size"),
        ("+logger.projekt=x", "unknown key logger.projekt"),
        ("+paths.extra=1", "unknown key paths.extra"),
    ],
)
def test_added_keys_no_config_defines_are_refused(compose, override, named):
    from experiments.config import ExperimentError, validate

    with pytest.raises(ExperimentError, match=re.escape(named)):
        validate(compose(override))


def test_an_added_unknown_key_exits_2_naming_it(tmp_path):
    proc = _cli("+trainer.max_epoch=2", "logger=none", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert "trainer.max_epoch" in proc.stderr and "trainer.max_epochs" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_preset_uses_only_known_keys(compose):
    from experiments.config import check_keys

    for preset in sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")):
        check_keys(compose(f"experiment={preset}"))
