"""Hydra experiments for dpkfac: training and benchmark entry points, models, data, logging.

Nothing here may download at run time (datasets are read from local paths,
pretrained models from local directories), so the Hugging Face libraries are
put in offline mode before anything imports them; an explicit environment
setting still wins.

``DPKFAC_ROOT`` (the repository) is set here too: ``conf/paths/default.yaml``
places outputs, data and results under it, so they do not depend on the
working directory the command was started from.

``DPKFAC_RUN_ID`` names a single run's folder instead of the time stamp
(``conf/hydra/default.yaml``). Under torchrun it is the rendezvous id
(``TORCHELASTIC_RUN_ID``: ``--rdzv-id``, or the id ``--standalone`` draws once
per launch), which stays the same when torchrun restarts the workers, so a
restarted run finds its own checkpoints (``trainer.resume=auto``). The static
rendezvous's placeholder id ``none`` names no run and is ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("DPKFAC_ROOT", str(Path(__file__).resolve().parents[1]))

#: What torchrun's static rendezvous puts in TORCHELASTIC_RUN_ID: not a run id.
_STATIC_RENDEZVOUS_ID = "none"
_run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
if _run_id and _run_id != _STATIC_RENDEZVOUS_ID:
    os.environ.setdefault("DPKFAC_RUN_ID", _run_id)

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
# Tokenizers are used before loader workers fork; their thread pool must not be.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
