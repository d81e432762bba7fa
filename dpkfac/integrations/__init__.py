"""Training frameworks' entry points to dpkfac, each one or two lines for the user.

* :mod:`dpkfac.integrations.huggingface`: ``KFACCallback`` for ``transformers.Trainer``;
* :mod:`dpkfac.integrations.accelerate`: ``prepare(accelerator, model, ...)``;
* :mod:`dpkfac.integrations.lightning`: ``KFACCallback`` for ``lightning.Trainer``.

Each module imports its framework when it is imported itself (``import dpkfac`` needs only
torch; the extras ``dpkfac[hf]``, ``dpkfac[accelerate]`` and ``dpkfac[lightning]`` install
the frameworks). Each builds the preconditioner on the model the framework wrapped (DDP,
where there is one), takes the accumulation steps from the framework's setting (and, under
fp16, its loss scaler: Hugging Face and Lightning; accelerate refuses fp16), makes the KL clip
follow the optimizer's learning rate (the scheduler's), and keeps the preconditioner's state
in the framework's checkpoints. docs/integrations.md says what each does where.
"""
