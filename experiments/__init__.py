"""Hydra experiments for dpkfac: training and benchmark entry points, models, data, logging.

Nothing here may download at run time (datasets are read from local paths,
pretrained models from local directories), so the Hugging Face libraries are
put in offline mode before anything imports them; an explicit environment
setting still wins.

``DPKFAC_ROOT`` (the repository) is set here too: ``conf/paths/default.yaml``
places outputs, data and results under it, so they do not depend on the
working directory the command was started from.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("DPKFAC_ROOT", str(Path(__file__).resolve().parents[1]))

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
# Tokenizers are used before loader workers fork; their thread pool must not be.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
