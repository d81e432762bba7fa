"""Hydra experiments for dpkfac: training entry point, models, data, metrics, logging.

Nothing here may download at run time (datasets are read from local paths,
pretrained models from local directories), so the Hugging Face libraries are
put in offline mode before anything imports them; an explicit environment
setting still wins.
"""

from __future__ import annotations

import os

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
# Tokenizers are used before loader workers fork; their thread pool must not be.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
