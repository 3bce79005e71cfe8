# Two commands do all the set-up from a fresh clone:
#   make lab   - virtualenv + pinned dependencies + helpers, then JupyterLab on notebooks/ (127.0.0.1)
#   make test  - the same set-up, then the linter and the whole suite (strict nbval over notebooks/ plus tests/)
# While you edit:
#   make test-fast - the linter and the tests that start no Ray and no kernel (a few minutes)
#   make record NOTEBOOK=...  - re-run a notebook top to bottom and keep its outputs
#   make refresh-sources      - after editing a helper a lesson shows: its show_source outputs, without re-running
# On a machine with an NVIDIA GPU:
#   make gpu-check [GPU_LANE_ARGS="--lessons 01 09"]  - every lesson that trains, in full mode on the GPU, one at a
#                     time within its budget; executed copies under runs/gpu-lane/, report in notebooks/results/gpu.json
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Re-install only when the pins change.
STAMP := $(VENV)/.installed-stamp
LAB_PORT ?= 8888
# JupyterLab refuses to run as root (as in containers) unless told to.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: install lab lint test-fast test record refresh-sources gpu-check clean

# JupyterLab's defaults for the course: no "get notified about Jupyter news?" prompt, no update check.
LAB_OVERRIDES := deploy/jupyterlab/default_setting_overrides.json

$(STAMP): pyproject.toml $(LAB_OVERRIDES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 14), \
		f"Python {sys.version.split()[0]} is not supported: use 3.11-3.13 (make PYTHON=python3.11 ...)"'
	$(BIN)/python -m pip install --disable-pip-version-check -e ".[lab,test]"
	$(BIN)/python -m helpers.tooling.kuberay --install-helm
	@mkdir -p $(VENV)/etc/jupyter/labconfig && cp $(LAB_OVERRIDES) $(VENV)/etc/jupyter/labconfig/
	@touch $(STAMP)

install: $(STAMP)

lab: install
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) --ServerApp.root_dir=notebooks $(ALLOW_ROOT)

# The lint step (each tool configured in pyproject.toml): ruff; deptry, every import declared and every declared package
# used, then no import in helpers/ or the lessons of a package that only the `test` extra installs, then the lessons
# as IPython runs them (`!cmd` and `%magic` made calls, so that deptry parses every lesson); mypy over helpers/;
# lint-imports, the layers of helpers/ (drivers above lesson modules above the foundation: no import runs back up).
lint: install
	$(BIN)/ruff check .
	$(BIN)/deptry .
	$(BIN)/deptry helpers notebooks --optional-dependencies-dev-groups test --ignore DEP001,DEP002,DEP003
	$(BIN)/python -m helpers.tooling.notebook_code
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo

test-fast: lint
	$(BIN)/python -m pytest tests -m "not ray and not notebook" $(PYTEST_ARGS)

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Re-record a notebook's committed outputs: one top-to-bottom run, in the current (full) mode.
record: install
	@test -n "$(NOTEBOOK)" || (echo "usage: make record NOTEBOOK=notebooks/NN_topic.ipynb" && exit 2)
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=-1 $(NOTEBOOK)

refresh-sources: install
	$(BIN)/python -m helpers.tooling.refresh_sources

gpu-check: install
	$(BIN)/python -m helpers.tooling.gpu_lane $(GPU_LANE_ARGS)

clean:
	rm -rf $(VENV)
