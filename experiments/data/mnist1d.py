"""MNIST-1D, generated locally by the ``mnist1d`` package and cached under the data directory.

MNIST-1D (Greydanus & Kobak, "Scaling Down Deep Learning with MNIST-1D", ICML 2024)
turns ten hand-made 1D digit templates into 40-sample signals with random padding,
scaling, translation, correlated and white noise and shear. It is small enough for
a CPU, yet an MLP and a small CNN train on it like on a real data set: tens of
epochs, accuracy well below 100%. The package generates any number of samples
from a seed, which is what a study of convergence at many ranks needs.

Nothing is downloaded: the samples come from the package's own generator,
``mnist1d.data.make_dataset`` (never ``get_dataset``, which downloads by
default). Generating 100,000 samples takes about 40 s on one CPU core, so the
result is cached as ``.npz`` under ``data.root`` (``<paths.data_dir>/mnist1d``),
in a file named after a hash of every generation argument and the package's
version: the same arguments load the cache, any other size, seed or generator
argument generates (and caches) again. The train/validation/test split is cut
from the cached samples at load time, so changing it costs no regeneration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from experiments.config import ExperimentError
from experiments.data.loading import DataModule
from experiments.distributed import DistEnv
from experiments.tasks.base import Task
from experiments.tasks.classification import ClassificationTask

log = logging.getLogger(__name__)

NUM_CLASSES = 10
#: Samples generated for ``data.fake=true`` (smoke runs): a second, not 40.
FAKE_SAMPLES = 400
#: Arguments of ``mnist1d.data.get_dataset_args()`` that ``data.generator_args`` may
#: not set, and where they are set instead.
_NOT_GENERATOR_ARGS = {
    "num_samples": "data.num_samples",
    "seed": "data.seed",
    "train_split": "data.val_fraction and data.test_fraction",
    "url": "nothing is downloaded",
}
#: Generated data sets kept in memory, by cache file: the ranks of one process
#: (an in-process launcher's threads) share one copy instead of one each.
_MEMORY: OrderedDict[Path, tuple[np.ndarray, np.ndarray]] = OrderedDict()
_MEMORY_SIZE = 4
_LOCK = threading.Lock()


def _invalid(key: str, value: Any, expected: str) -> ExperimentError:
    """The config checks' message (:mod:`experiments.config`): key, value, what is allowed."""
    return ExperimentError(f"invalid value {key}={value!r}: expected {expected}")


def _integer(key: str, value: Any, expected: str, ok: Callable[[int], bool]) -> int:
    """``value`` if it is an int (not a bool) that passes ``ok``; else the named error."""
    if not (isinstance(value, int) and not isinstance(value, bool) and ok(value)):
        raise _invalid(key, value, expected)
    return value


def _fraction(key: str, value: Any, expected: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a float if it is a number in [0, 1) that passes ``ok``; else the named error."""
    if not (
        isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1
    ) or not ok(float(value)):
        raise _invalid(key, value, expected)
    return float(value)


def generation_args(
    num_samples: int, seed: int, generator_args: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Every argument of the package's generator, as plain JSON-able values.

    The package's defaults (``get_dataset_args``) with the size, the seed and the
    overrides of ``data.generator_args``; ``train_split`` is 1 (all samples come
    back in one array: the split is cut here, at load time) and the download URL
    is dropped.

    Raises:
        ExperimentError: An override the generator does not have, or one set elsewhere.
    """
    from mnist1d.data import get_dataset_args

    args: dict[str, Any] = get_dataset_args(as_dict=True)
    for key, value in (generator_args or {}).items():
        if key in _NOT_GENERATOR_ARGS:
            raise _invalid(
                f"data.generator_args.{key}",
                value,
                f"no such key here ({_NOT_GENERATOR_ARGS[key]})",
            )
        if key not in args:
            known = ", ".join(sorted(k for k in args if k not in _NOT_GENERATOR_ARGS))
            raise _invalid(f"data.generator_args.{key}", value, f"one of the generator's: {known}")
        args[key] = list(value) if isinstance(value, (list, tuple)) else value
    args.pop("url")
    args.update(num_samples=num_samples, seed=seed, train_split=1.0)
    # The config's lists arrive as ListConfig, tuples as lists: one canonical JSON form.
    return json.loads(json.dumps(args, default=list))


def cache_path(root: Path, args: Mapping[str, Any]) -> Path:
    """The cache file of these generation arguments (and this version of the package)."""
    key = json.dumps({"mnist1d": metadata.version("mnist1d"), **args}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return root / f"mnist1d-{args['num_samples']}-seed{args['seed']}-{digest}.npz"


def generate(args: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Run the package's generator: signals (float32, N x length) and labels (int64).

    ``make_dataset`` reseeds python's and numpy's global generators
    (``set_seed``); their states are restored afterwards, so a run draws the
    same random numbers whether its data came from the cache or from here.
    """
    from mnist1d.data import make_dataset
    from mnist1d.utils import ObjectView

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(ObjectView(dict(args)))
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return data["x"].astype(np.float32), data["y"].astype(np.int64)


def _save(path: Path, x: np.ndarray, y: np.ndarray, args: Mapping[str, Any]) -> None:
    """Write the cache through a temporary file in the same folder, then rename it.

    Concurrent writers (ranks of several jobs) each write a file of their own, and
    a reader never sees half a file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, x=x, y=y, args=np.array(json.dumps(args, sort_keys=True)))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared data folder's cache
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load(path: Path, args: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached arrays, or None when the file is missing, unreadable or of other arguments."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as cached:
            if json.loads(str(cached["args"])) != json.loads(json.dumps(args, sort_keys=True)):
                log.warning("%s holds other generation arguments: generating again", path)
                return None
            return cached["x"], cached["y"]
    except (OSError, ValueError, KeyError) as exc:
        log.warning("cannot read %s (%s): generating again", path, exc)
        return None


def load_or_generate(root: Path, args: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The samples of ``args``: from memory, from the cache under ``root``, or generated.

    Generated samples are written to the cache. The lock makes the ranks of one
    process (threads) wait for the first one instead of generating each.
    """
    path = cache_path(root, args)
    with _LOCK:
        if path in _MEMORY:
            _MEMORY.move_to_end(path)
            return _MEMORY[path]
        arrays = _load(path, args)
        if arrays is None:
            started = time.perf_counter()
            arrays = generate(args)
            log.info(
                "generated %d MNIST-1D samples in %.1f s -> %s",
                len(arrays[1]),
                time.perf_counter() - started,
                path,
            )
            _save(path, *arrays, args)
        _MEMORY[path] = arrays
        while len(_MEMORY) > _MEMORY_SIZE:
            _MEMORY.popitem(last=False)
        return arrays


def clear_memory() -> None:
    """Forget the data sets held in memory (the files stay): the next load reads the cache."""
    with _LOCK:
        _MEMORY.clear()


def split_sizes(total: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """(train, validation, test) sample counts; validation and test are rounded down."""
    val, test = int(total * val_fraction), int(total * test_fraction)
    return total - val - test, val, test


class MNIST1DData(DataModule):
    """MNIST-1D from ``mnist1d.data.make_dataset``, split into train, validation and test.

    The samples are in the generator's (shuffled) order; the first share is the
    training set, then the validation set, then the test set. The trainer scores
    the test set as ``accuracy`` and the validation set as ``val_accuracy``: a
    learning-rate grid chooses on the latter, never on the test set. Signals are
    ``(40,)`` float32 vectors (the generator normalises them to mean 0, std 1);
    the models reshape them as they need.

    Args:
        num_samples: Samples generated in all (the generator makes
            ``num_samples / 10`` of each digit, so a multiple of 10).
        seed: The generator's seed (the package's default is 42).
        val_fraction: Share of the samples held out for validation (0: none).
        test_fraction: Share of the samples held out for the test.
        generator_args: Other arguments of ``mnist1d.data.get_dataset_args()``
            to change (``shuffle_seq``, ``iid_noise_scale``, ...); empty: the
            package's defaults, those of the published data set.
        **kwargs: See :class:`~experiments.data.loading.DataModule`; ``root`` is
            the cache folder, ``fake`` generates :data:`FAKE_SAMPLES` samples
            into the run's scratch folder instead.

    Raises:
        ExperimentError: A missing or invalid value, named with its key (the
            defaults are None so that a key deleted from the config,
            ``~data.num_samples``, is named too instead of ending in a TypeError).
    """

    name = "mnist1d"

    def __init__(
        self,
        num_samples: int | None = None,
        seed: int | None = None,
        val_fraction: float | None = None,
        test_fraction: float | None = None,
        generator_args: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.num_samples = _integer(
            "data.num_samples",
            num_samples,
            "a positive multiple of 10",
            lambda n: n > 0 and n % 10 == 0,
        )
        self.seed = _integer("data.seed", seed, "an integer", lambda _: True)
        self.val_fraction = _fraction(
            "data.val_fraction", val_fraction, "a number in [0, 1)", lambda _: True
        )
        self.test_fraction = _fraction(
            "data.test_fraction", test_fraction, "a number in (0, 1)", lambda f: f > 0
        )
        if split_sizes(self.num_samples, self.val_fraction, self.test_fraction)[0] <= 0:
            raise _invalid(
                "data.val_fraction",
                val_fraction,
                f"a value that leaves training samples (data.test_fraction={test_fraction!r})",
            )
        if generator_args is not None and not isinstance(generator_args, Mapping):
            raise _invalid(
                "data.generator_args", generator_args, "a mapping of generator arguments"
            )
        if not self.fake and self.root is None:
            raise _invalid("data.root", None, "the folder that caches the generated samples")
        self.generator_args = dict(generator_args or {})
        self.length = 0

    def generation_args(self) -> dict[str, Any]:
        """The generator's arguments for this run (fake runs: :data:`FAKE_SAMPLES` samples)."""
        size = min(self.num_samples, FAKE_SAMPLES) if self.fake else self.num_samples
        return generation_args(size, self.seed, self.generator_args)

    def load(self, root: Path | None, env: DistEnv) -> tuple[Dataset, Dataset]:
        """Load (or generate and cache) the samples and cut the three splits.

        Rank 0 goes first, so a cold cache is generated once, not once per rank;
        the others then read it (or generate it themselves when ``root`` is not
        shared between their machines). Sets :attr:`val_dataset` too.
        """
        folder = root if root is not None else Path(str(self.root)).expanduser()
        args = self.generation_args()
        if env.distributed and not env.is_main:
            env.barrier()
        x, y = load_or_generate(folder, args)
        if env.distributed and env.is_main:
            env.barrier()
        self.length = x.shape[1]
        n_train, n_val, _ = split_sizes(len(y), self.val_fraction, self.test_fraction)
        signals, labels = torch.from_numpy(x), torch.from_numpy(y)  # views, no copies

        def part(start: int, stop: int) -> TensorDataset:
            return TensorDataset(signals[start:stop], labels[start:stop])

        self.val_dataset = part(n_train, n_train + n_val) if n_val else None
        return part(0, n_train), part(n_train + n_val, len(y))

    def build_task(self) -> Task:
        """Ten-way classification."""
        return ClassificationTask(NUM_CLASSES)

    def model_kwargs(self) -> dict[str, Any]:
        """The number of classes and the signal's length (``d_in``)."""
        assert self.length, "call setup() first"
        return {"num_classes": NUM_CLASSES, "d_in": self.length}
