# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: train test test-gpu gpu-report smoke-report notebook fuzz lint venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# torch/torchvision first: this pair is served from the machine's disk.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -e '.[experiments,dev]' --config-settings editable_mode=compat
	touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(PY) -m experiments.train

# The suite on every core (pytest-xdist; a worker steals tests when it runs dry, so a module's
# tests mostly stay on one worker and share its fixtures); a plain `pytest` runs in one process.
test: $(STAMP)
	$(PY) -m ruff check dpkfac experiments tests
	$(PY) -m mypy
	$(PY) -m pytest -q -n auto --dist worksteal

# The CUDA paths (skipped without a GPU): every strategy on a GPU, ranks sharing one, NCCL, AMP.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# On a machine with a GPU: the gpu tests, every strategy at P=1 against the CPU, host reads,
# and ResNet-32 side by side with CUDA events and peak memory -> results/gpu.{md,csv}.
gpu-report: $(STAMP)
	-$(PY) -m pytest -q -m gpu --junitxml=$(VENV)/gpu-tests.xml
	$(PY) -m experiments.bench.gpu_report --junit $(VENV)/gpu-tests.xml

# The training presets' 2-step smoke runs (every preset x strategy, fake data) as a JUnit
# report, which the convergence table's status section reads; then that table is rewritten
# from its saved rows (results/raw/convergence.csv) -> results/convergence.{md,csv,png}.
smoke-report: $(STAMP)
	-$(PY) -m pytest -q -p no:cacheprovider tests/test_experiments_smoke.py::test_preset_runs_two_steps --junitxml=results/raw/smoke_junit.xml
	$(PY) -m experiments.bench.tables convergence

# After results/ changes: the README headline and the generated doc blocks, then the
# results notebook re-executed in place (a test compares its saved outputs with the tables).
notebook: $(STAMP)
	$(PY) -m experiments.bench.takeaways
	$(PY) -m experiments.bench.results_index
	MPLBACKEND=Agg $(PY) -m nbconvert --to notebook --execute --inplace notebooks/results.ipynb

# The long profile of the property-based differential test (tests/test_differential.py):
# random examples, FUZZ_EXAMPLES per strategy kind and world size per round, rounds with a new
# seed until FUZZ_SECONDS have passed; stops at the first failure, which hypothesis prints as a
# minimal example with the @reproduce_failure line that replays it (docs/reproduction.md, "Fuzzing").
FUZZ_SECONDS ?= 600
FUZZ_EXAMPLES ?= 40
fuzz: $(STAMP)
	@end=$$(( $$(date +%s) + $(FUZZ_SECONDS) )); round=0; \
	while [ $$(date +%s) -lt $$end ]; do \
	  round=$$((round + 1)); seed=$$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); \
	  echo "fuzz round $$round, --hypothesis-seed=$$seed"; \
	  DPKFAC_HYPOTHESIS_PROFILE=long DPKFAC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) \
	    $(PY) -m pytest -q -x -p no:cacheprovider tests/test_differential.py \
	    --hypothesis-seed=$$seed --hypothesis-show-statistics || exit 1; \
	done

lint: $(STAMP)
	$(PY) -m ruff check dpkfac experiments tests
	$(PY) -m mypy
	$(PY) -m ruff format --check dpkfac experiments tests

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
