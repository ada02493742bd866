# make demo: set up and run the main job on the embedded corpus.  make test: set up and run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TPU_STAMP := $(VENV)/.tpu-installed
EXPORT_STAMP := $(VENV)/.export-installed
GPU_AOT_STAMP := $(VENV)/.gpu-aot-installed
# torch's CPU-only build for the export extra: a 190 MB wheel, ~750 MB installed, ~40 s. PyPI's
# Linux torch is the CUDA build, which does not import without its ~3 GB of nvidia-* wheels; pip
# finds the CPU build where this machine keeps it, or with TORCH_PIP_ARGS='--index-url URL'
# (PyTorch's CPU wheel index). Without either, PyPI's CUDA build is the fallback.
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_PIP_ARGS ?=
WORKDIR ?= workdirs/default
# glibc's malloc backs its large blocks with transparent huge pages (THP mode 'madvise'): XLA's
# CPU backend allocates a step's temporaries afresh every step, which with 4 KiB pages cost
# ~300k page faults a step, a fifth of the CPU step time (bench/RESULTS.md). Ignored by
# glibc < 2.35 and where THP is off; an environment that sets GLIBC_TUNABLES keeps its own.
GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1
export GLIBC_TUNABLES

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# XLA's TPU compiler (libtpu) for the ahead-of-time compile tests: jax[tpu] pinned to the jax in
# the venv (jax's own extra pins the libtpu of that release). Without TPU chips t2t never starts
# the TPU backend, so nothing else changes (t2t/infra/platforms.py).
$(TPU_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check \
		"jax[tpu]==$$($(BIN)/python -c 'import jax; print(jax.__version__)')"
	touch $(TPU_STAMP)

# XLA's CUDA compiler for the GPU ahead-of-time compile tests (the gpu-aot extra): jax[cuda12]
# pinned to the jax in the venv, ~2.5 GB of NVIDIA wheels. It compiles without a GPU or driver;
# the entry points' platform choice keeps CPU-only hosts on the CPU (t2t/infra/platforms.py).
$(GPU_AOT_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check \
		"jax[cuda12]==$$($(BIN)/python -c 'import jax; print(jax.__version__)')"
	touch $(GPU_AOT_STAMP)

# The export extra (transformers, CTranslate2, torch) for t2t.export's parity tests.
$(EXPORT_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH_PIP_ARGS) "$(TORCH_CPU)" \
		|| $(BIN)/pip install --quiet --disable-pip-version-check "torch>=2.4,<3"
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,export]'
	touch $(EXPORT_STAMP)

# The main job: prepare the embedded corpus, train within the config's time budget (a workdir
# that already spent it is only re-evaluated), evaluate the average of the last 5 checkpoints
# (the paper's averaging for base models) on the test split, plot the curve.
demo: $(STAMP)
	$(BIN)/python -m t2t.data --config=configs/default.py
	$(BIN)/python train.py --config=configs/default.py --workdir=$(WORKDIR)
	$(BIN)/python evaluate.py --config=configs/default.py --workdir=$(WORKDIR) --average_last=5
	$(BIN)/python bench/learning_curve.py --workdir=$(WORKDIR)

# --max-worker-restart=0: a worker that crashes ends the run with its test named; a replacement
# worker would wait forever for the crashed one's group under --dist loadgroup.
test: $(STAMP) $(TPU_STAMP) $(GPU_AOT_STAMP) $(EXPORT_STAMP)
	JAX_PLATFORMS=cpu $(BIN)/pytest -n 2 --dist loadgroup --max-worker-restart=0 --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) workdirs
