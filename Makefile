# The two commands a newcomer needs:
#   make lab    set up a virtual environment and open the quickstart in JupyterLab
#   make test   set up and run the whole test suite (unit, notebooks, browser),
#               then the engine's tests again on the oldest supported TF/Keras

PYTHON ?= python3
VENV ?= .venv
OLDEST_VENV ?= .venv-oldest
BIN := $(VENV)/bin
PYTEST_ARGS ?=
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: lab screenshot test test-current test-oldest unit notebooks browser-deps demo bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[notebook,test]"
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

test: test-current test-oldest

test-current: $(BIN)/.installed browser-deps
	JUPYTER_PATH=tests/notebooks/jupyter $(BIN)/python -m pytest tests notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg \
	  --nbval-cell-timeout=600 $(PYTEST_ARGS)

unit: $(BIN)/.installed
	$(BIN)/python -m pytest tests -m "not browser" $(PYTEST_ARGS)

notebooks: $(BIN)/.installed
	JUPYTER_PATH=tests/notebooks/jupyter $(BIN)/python -m pytest notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=600

# The lowest supported TensorFlow/Keras: the engine's tests run there too,
# because the lab leans on Keras internals that move between releases.
$(OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install --upgrade pip
	$(OLDEST_VENV)/bin/pip install -e . pytest "tensorflow==2.16.2" "keras==3.5.0" "numpy<2"
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -m pytest tests/lab $(PYTEST_ARGS)

demo: $(BIN)/.installed
	$(BIN)/training-lab demo

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) artifacts training-lab-demo
