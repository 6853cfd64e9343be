# The two commands of the README. Both build what they need on a fresh machine:
#   make example   profile a 2-rank DDP job of a bundled model; show what was recorded, analyze and optimize it
#   make test      run the test suite (real multi-process jobs)
#   make test-fast the tests that run no multi-process job (the inner loop; make test still runs everything)
#   make fuzz      the fuzz campaign over every reader (bench/fuzz.py; FUZZ_INPUTS=1000)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpro-installed
HVD_STAMP := $(VENV)/.horovod-installed
MXNET_VENV := .venv-mxnet
MXNET_STAMP := $(MXNET_VENV)/.dpro-installed
RUNS := dpro-runs
# the tests also run in the MXNet venv (numpy 1.23, no torch or TensorFlow): the core's and the MXNet plugin's, every
# test outside tests/conftest.py's FRAMEWORK_BOUND folders, which it marks "core"

.PHONY: example test test-fast fuzz lint venv horovod mxnet sshd chromium

venv: $(STAMP)

# torch==2.13.0 is pinned: pip takes the CPU wheel that lies on these machines' disk.
# tf_keras (Keras 2 for TF_USE_LEGACY_KERAS=1) goes in with --no-deps: its dependencies would pull the full
# tensorflow package next to tensorflow-cpu. mlc-chakra (Chakra's ET schema and reader, for dpro export --format
# chakra) too: its declared dependencies (HTA, graphviz, pydot) serve only its own converters.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" tensorflow-cpu keras pytorch-lightning lightning transformers accelerate numpy networkx orjson pyyaml hypothesis pytest ruff
	$(PY) -m pip install -q --no-deps "tf_keras~=2.21.0"
	$(PY) -m pip install -q --no-deps mlc-chakra protobuf
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

example: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 \
		-m dpro.plugins.torch.example --model transformer --steps 30 --profile 10:20 --run-dir $(RUNS)/example-$$(date +%Y%m%d-%H%M%S)
	$(VENV)/bin/dpro info $$(ls -d $(RUNS)/example-* | tail -n 1)
	$(VENV)/bin/dpro analyze $$(ls -d $(RUNS)/example-* | tail -n 1)
	$(VENV)/bin/dpro optimize $$(ls -d $(RUNS)/example-* | tail -n 1)

# horovod 0.28.1 (PyTorch + Gloo) built from its sdist once into ~/.cache/dpro/wheels (~4 min), then installed
horovod: $(HVD_STAMP)

$(HVD_STAMP): $(STAMP) scripts/build_horovod.sh
	bash scripts/build_horovod.sh $(VENV)

# MXNet 1.9.1 needs numpy < 1.24 (it uses np.bool), TensorFlow 2.21 numpy 2: MXNet gets its own venv, with dpro in it
# (the core runs on either numpy). pip keeps the 300 MB wheel in its cache, so a rebuild does not download it again.
mxnet: $(MXNET_STAMP)

$(MXNET_STAMP): setup.cfg pyproject.toml
	test -x $(MXNET_VENV)/bin/python || $(PYTHON) -m venv $(MXNET_VENV)
	$(MXNET_VENV)/bin/python -m pip install -q --upgrade pip
	$(MXNET_VENV)/bin/python -m pip install -q "mxnet==1.9.1" "numpy<1.24" networkx hypothesis pytest
	$(MXNET_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(MXNET_STAMP)

# the launcher's ssh test needs an sshd; installed when the machine lets us (otherwise that test is skipped)
sshd:
	@test -x /usr/sbin/sshd || command -v sshd >/dev/null || \
		( command -v apt-get >/dev/null && apt-get update -q >/dev/null 2>&1 && \
		  apt-get install -y -q --no-install-recommends openssh-server openssh-client >/dev/null 2>&1 ) || \
		echo "note: no sshd here; the launcher's ssh test will be skipped"

# dpro report's browser tests render the page in a headless Chromium; installed when the machine lets us
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		( command -v apt-get >/dev/null && apt-get update -q >/dev/null 2>&1 && \
		  apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >/dev/null 2>&1 ) || \
		echo "note: no Chromium here; the report's browser tests will be skipped"

test: $(STAMP) $(HVD_STAMP) $(MXNET_STAMP) sshd chromium
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests
	OMP_NUM_THREADS=1 $(MXNET_VENV)/bin/python -m pytest -q -m "core and not slow" tests

# the fuzz campaign: mutated inputs to the real commands, each in its own process (1 GB, 30 s); a table per seed
fuzz: $(STAMP) $(HVD_STAMP)
	OMP_NUM_THREADS=1 $(PY) bench/fuzz.py --inputs $${FUZZ_INPUTS:-1000}

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
