# make demo: set up and run the main job on the embedded corpus.  make test: set up and run the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TPU_STAMP := $(VENV)/.tpu-installed
EXPORT_STAMP := $(VENV)/.export-installed
EXTRAS_STAMP := $(VENV)/.extras-installed
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

.PHONY: demo test test-fast lint clean

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

# The hf and trackers extras (Hugging Face datasets, wandb, trackio) for their tests.
$(EXTRAS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,hf,trackers]'
	touch $(EXTRAS_STAMP)

# The main job: prepare the embedded corpus, train the config's fixed number of steps (a
# finished workdir is only re-evaluated), evaluate on the test split the better, by validation
# NLL, of the last checkpoint and the average of the run's final quarter (both printed), plot the
# curve.
demo: $(STAMP)
	$(BIN)/python -m t2t.data --config=configs/default.py
	$(BIN)/python train.py --config=configs/default.py --workdir=$(WORKDIR)
	$(BIN)/python evaluate.py --config=configs/default.py --workdir=$(WORKDIR) --average_final
	$(BIN)/python bench/learning_curve.py --workdir=$(WORKDIR)

# Four workers on two cores: the storage, chaos and hang must-shows spend much of their time
# waiting on purpose (outages, guards, other processes), and two more workers compile meanwhile
# (bench/RESULTS.md, "The test suite"). --max-worker-restart=0: a worker that crashes ends the
# run with its test named; a replacement worker would wait forever for the crashed one's group
# under --dist loadgroup.
test: $(STAMP) $(TPU_STAMP) $(GPU_AOT_STAMP) $(EXPORT_STAMP) $(EXTRAS_STAMP)
	JAX_PLATFORMS=cpu $(BIN)/pytest -n 4 --dist loadgroup --max-worker-restart=0 --durations=15 tests

# The core and what an edit of the model, the loss, decoding or the optimizer can break, in
# minutes (docs/development.md): the paper's reference, the layers' floor, the settings' wiring.
FAST_TESTS := tests/test_reference.py tests/test_model.py tests/test_loss_impl.py \
	tests/test_settings.py tests/test_decode.py tests/test_optim.py tests/test_dropout.py \
	tests/test_sharding.py tests/test_layers.py tests/test_function_length.py
test-fast: $(STAMP)
	JAX_PLATFORMS=cpu $(BIN)/pytest -n 2 --dist loadgroup --max-worker-restart=0 --durations=10 \
		$(FAST_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) workdirs
