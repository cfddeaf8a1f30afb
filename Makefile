# Two commands: `make demo` and `make test`. Both set up .venv from scratch on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Per-run scratch: torchrun and matplotlib leave files in TMPDIR and HOME.
RUNDIR  := $(CURDIR)/.run
export TMPDIR := $(RUNDIR)/tmp
export HOME   := $(RUNDIR)/home
export MPLCONFIGDIR := $(RUNDIR)/mpl

.PHONY: setup demo test test-unit test-multiproc bench lint clean

$(STAMP): pyproject.toml constraints.txt
	@mkdir -p $(TMPDIR) $(HOME) $(MPLCONFIGDIR)
	@# the streaming tests and `phalanx demo --stream` need a real redis-server (skipped with a reason if absent)
	command -v redis-server >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update && apt-get install -y redis-server)
	@# tests/test_slurm.py runs a two-node SLURM cluster on this machine (skipped with a reason if absent or not root)
	@# tests/monitor/ keep a status page open in Debian's headless chromium (driven by playwright; nothing downloaded)
	command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update && apt-get install -y chromium)
	command -v slurmctld >/dev/null || [ -x /usr/sbin/slurmctld ] || [ "$$(id -u)" != 0 ] || (apt-get update && apt-get install -y slurm-wlm)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# .[dev]: every extra (bench: the demo's scikit-learn and matplotlib; ps, keras, stream) plus pytest and ruff
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	@touch $@

setup: $(STAMP)
	@mkdir -p $(TMPDIR) $(HOME) $(MPLCONFIGDIR)

demo: setup
	$(BIN)/phalanx demo

test: setup
	@# three test files at a time (pytest-xdist) on 2 cores: the suite is CPU-bound (1-2% idle), and a third file
	@# fills the moments when both others wait on their workers (7m13s against 7m38s with two, back to back, idle);
	@# a file's tests stay together (its module fixtures run once). Every multi-process test passes at this load.
	@# --no-loadscope-reorder: files start in tests/conftest.py's order (longest first), not by how many tests each has
	@# bytecode once, up front: every worker, launcher and fork server imports phalanx and the test helpers, and
	@# with PYTHONDONTWRITEBYTECODE set (as on this machine) each would compile them again (~0.2 CPU s a process)
	$(BIN)/python -m compileall -q -j 0 src tests benchmarks >/dev/null
	$(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder tests src/phalanx

bench: setup
	$(BIN)/phalanx bench --quick --out results/

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(RUNDIR) results build src/*.egg-info
