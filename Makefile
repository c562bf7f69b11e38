# The two commands a newcomer needs (README.md, "Two commands"):
#   make lab    set up a virtual environment and open the quickstart in JupyterLab
#   make test   set up and run the whole test suite (unit, notebooks, browser),
#               then the engine's tests again on the oldest supported TF/Keras,
#               then the JAX half in an environment without TensorFlow

PYTHON ?= python3
VENV ?= .venv
OLDEST_VENV ?= .venv-oldest
JAX_VENV ?= .venv-jax
BIN := $(VENV)/bin
PYTEST_ARGS ?=
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: bench-jax lab screenshot test test-current test-oldest test-jax test-jax-oldest unit notebooks browser-deps demo bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[tensorflow,notebook,test]"
	touch $@

# scripts/lab.sh adds --allow-root as root and --no-browser without a display;
# JupyterLab prints the URL to open (with its token). More options: LAB_ARGS=...
LAB_ARGS ?=
lab: $(BIN)/.installed
	JUPYTER=$(BIN)/jupyter sh scripts/lab.sh $(LAB_ARGS)

# The README's picture (docs/dashboard.png): the browser test photographs the
# Dashboard while the quickstart trains in Notebook 7.
screenshot: $(BIN)/.installed browser-deps
	TRAINING_LAB_SCREENSHOT=docs/dashboard.png $(BIN)/python -m pytest tests/browser/test_frontends_browser.py \
	  -k notebook7 -q $(PYTEST_ARGS)

# Debian's chromium drives the browser tests (Playwright never downloads one).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	  else sudo apt-get update -q && sudo apt-get install -y -q chromium; fi; }

test: test-current test-oldest test-jax test-jax-oldest

# The engine's and the widgets' tests run in two processes (pytest-xdist), so
# that a machine's second core trains too; --dist loadfile keeps each test file
# in one process, so a file's shared fixtures and caches are made once
# (docs/testing.md: what each part runs and how long it takes).
# The end-to-end tests (a JupyterLab with Chromium, real kernels) and the
# notebooks follow in one process: each starts servers and kernels of its
# own, which must not compete for the cores with other tests.
PARALLEL ?= -n 2 --dist loadfile
END_TO_END := tests/browser tests/kernel
JAX_ONLY := tests/jax

# Both parts run whatever the first gives; the target fails if either does.
test-current: $(BIN)/.installed browser-deps
	status=0; \
	$(BIN)/python -m pytest tests $(END_TO_END:%=--ignore=%) --ignore=$(JAX_ONLY) $(PARALLEL) $(PYTEST_ARGS) || status=$$?; \
	JUPYTER_PATH=jupyter $(BIN)/python -m pytest $(END_TO_END) notebooks --ignore=$(JAX_NOTEBOOK) --nbval \
	  --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=600 $(PYTEST_ARGS) || status=$$?; \
	exit $$status

unit: $(BIN)/.installed
	$(BIN)/python -m pytest tests --ignore=$(JAX_ONLY) -m "not browser" $(PYTEST_ARGS)

notebooks: $(BIN)/.installed
	JUPYTER_PATH=jupyter $(BIN)/python -m pytest notebooks --ignore=$(JAX_NOTEBOOK) --nbval --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=600

# The lowest supported TensorFlow/Keras: the engine's tests run there too,
# because the lab leans on Keras internals that move between releases.
$(OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install --upgrade pip
	$(OLDEST_VENV)/bin/pip install -e ".[tensorflow]" pytest pytest-xdist "tensorflow==2.16.2" "keras==3.5.0" "numpy<2"
	touch $@

# Every engine test but the sweeps' variants marked newest_only (docs/testing.md).
test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest tests/lab -m "not newest_only" $(PARALLEL) $(PYTEST_ARGS)

# Keras on JAX, in an environment where TensorFlow is not installed, so that
# nothing on the JAX path can lean on it: the JAX tests and the engine's
# backend-neutral tests (run files, versions, weights files, compare, layer norms).
JAX_NEUTRAL := tests/lab/test_norms_every.py tests/lab/test_runfile.py tests/lab/test_run_file_fuzz.py tests/lab/test_versions.py \
  tests/lab/test_weights_formats.py tests/lab/test_compare.py tests/lab/test_layer_norms.py
$(JAX_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(JAX_VENV)
	$(JAX_VENV)/bin/pip install --upgrade pip
	$(JAX_VENV)/bin/pip install -e ".[jax]" pytest pytest-xdist nbval ipykernel
	@! $(JAX_VENV)/bin/python -c "import tensorflow" 2>/dev/null || { echo "TensorFlow is installed in $(JAX_VENV)"; exit 1; }
	touch $@

# The tutorials on JAX: the JAX one checked in full; those whose code is not
# TensorFlow's run unchanged, their cells executed (their figures differ from
# TensorFlow's stored ones: Keras' initial weights come from another generator).
JAX_NOTEBOOK := notebooks/13_keras_on_jax_and_a_colab_tpu.ipynb
JAX_UNCHANGED := notebooks/00_tour.ipynb notebooks/01_quickstart.ipynb notebooks/02_gradients.ipynb
test-jax: $(JAX_VENV)/.installed
	status=0; \
	KERAS_BACKEND=jax $(JAX_VENV)/bin/python -m pytest $(JAX_ONLY) $(JAX_NEUTRAL) $(PARALLEL) $(PYTEST_ARGS) || status=$$?; \
	KERAS_BACKEND=jax JUPYTER_PATH=jupyter $(JAX_VENV)/bin/python -m pytest $(JAX_NOTEBOOK) --nbval \
	  --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=600 $(PYTEST_ARGS) || status=$$?; \
	KERAS_BACKEND=jax JUPYTER_PATH=jupyter $(JAX_VENV)/bin/python -m pytest $(JAX_UNCHANGED) --nbval-lax \
	  --nbval-cell-timeout=600 $(PYTEST_ARGS) || status=$$?; \
	exit $$status

# The lowest supported Keras and JAX: the JAX tests run there too.
JAX_OLDEST_VENV ?= .venv-jax-oldest
$(JAX_OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(JAX_OLDEST_VENV)
	$(JAX_OLDEST_VENV)/bin/pip install --upgrade pip
	$(JAX_OLDEST_VENV)/bin/pip install -e ".[jax]" pytest pytest-xdist "keras==3.11.0" "jax==0.7.2" "jaxlib==0.7.2"
	touch $@

test-jax-oldest: $(JAX_OLDEST_VENV)/.installed
	KERAS_BACKEND=jax $(JAX_OLDEST_VENV)/bin/python -m pytest $(JAX_ONLY) $(PARALLEL) $(PYTEST_ARGS)

demo: $(BIN)/.installed
	$(BIN)/training-lab demo

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/overhead.py

bench-jax: $(JAX_VENV)/.installed
	KERAS_BACKEND=jax $(JAX_VENV)/bin/python benchmarks/overhead_jax.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(JAX_VENV) $(JAX_OLDEST_VENV) artifacts training-lab-demo
