# Quickstart: `make demo` and `make test`. Each creates ./.venv and installs the project when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo ablation test test-slow rl-frameworks bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m launch.demo --workdir=runs/demo

ablation: $(STAMP)
	$(BIN)/python -m launch.ablate --workdir=runs/ablation

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

test-slow: $(STAMP) rl-frameworks
	$(BIN)/python -m pytest -q -n 2 -m slow

# verl and OpenRLHF's reward-client code (tests/test_serve_frameworks.py), without their GPU stacks.
rl-frameworks: $(STAMP)
	$(BIN)/pip install -q -e '.[test,rl]'
	$(BIN)/pip install -q --no-deps verl==0.9.1 openrlhf==0.11.2 tensordict==0.10.0 pyvers==0.1.0

BENCHMARKS := data_throughput forward_vs_hf moe_flops train_vs_hf score_vs_hf memory_plan gdn_vs_hf serve_load gpu_check

bench: $(STAMP)
	for b in $(BENCHMARKS); do $(BIN)/python -m benchmarks.$$b || exit 1; done

clean:
	rm -rf runs .pytest_cache

.PHONY: rm-demo
rm-demo: $(STAMP)
	$(BIN)/python -m launch.rm_demo --workdir=runs/rm_demo
