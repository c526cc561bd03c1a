# The checks CI runs (.ci/run calls `make test`). Each target is one step, runnable alone.
.PHONY: test test-torch-newest export sync nbdev-test pytest nbval tour

# One pytest session, two workers (pytest-xdist), each file whole on one worker (--dist loadfile) in the order tests/schedule.py
# gives (longest first, --no-loadscope-reorder); the notebooks run from a copy outside the checkout, so that they may read only
# what the installed package ships, and nbval compares the outputs marked NBVAL_CHECK_OUTPUT. --rootdir=/ keeps the copy's
# notebooks and tests/ apart in the test ids; -c reads pyproject.toml's settings (timeout) all the same.
RUN = python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -p tests.schedule -p no:cacheprovider --rootdir=/ \
      -c pyproject.toml --nbval-lax --nbval-cell-timeout=300 --durations=15
COPY_NBS = copy=$$(mktemp -d) && cp -r nbs $$copy/ && echo "notebooks run from $$copy/nbs"

test: sync         ## what CI runs: the sync check, then tests/ and every notebook together in one session (two files at a time)
	@$(COPY_NBS) && $(RUN) tests --ignore=tests/test_sync.py $$copy/nbs; rc=$$?; rm -rf $$copy; exit $$rc

test-torch-newest: ## the whole suite again on the newest torch pip installs here (2.14.1 on 2026-12-07), in a virtual environment of its own
	python3 -m venv .venv-torch-newest
	.venv-torch-newest/bin/pip install -q --upgrade torch -e ".[dev]"
	.venv-torch-newest/bin/python -c "import torch; print('torch', torch.__version__)"
	PATH="$(CURDIR)/.venv-torch-newest/bin:$$PATH" VIRTUAL_ENV="$(CURDIR)/.venv-torch-newest" $(MAKE) test

export:            ## notebooks -> fsdp_kit/ (then commit both)
	nbdev-export && nbdev-clean

sync:              ## the committed library and notebooks are what nbdev-export / nbdev-clean produce
	python -m pytest -q tests/test_sync.py

nbdev-test:        ## nbdev's own runner over every notebook (cells flagged notest / gpu / slow skipped); not in `test`: nbval executes the same cells and more
	nbdev-test --n-workers 1 --timing --cell-timeout 300 --file-re '^(0[1-5]|10[ab]_|benchmarks|index)'  # the cheap ones in one process
	@for nb in nbs/0[6-9]*.ipynb nbs/10_*.ipynb nbs/11*.ipynb; do nbdev-test --n-workers 1 --timing --cell-timeout 300 $$nb || exit 1; done  # the heavy ones (cp, checkpoint, plan*, hf, launch, scale), a fresh process each

pytest:            ## tests/ alone: real multi-process runs and bad-input cases
	$(RUN) tests --ignore=tests/test_sync.py

nbval:             ## every notebook alone, run again from a copy and compared where marked
	@$(COPY_NBS) && $(RUN) $$copy/nbs; rc=$$?; rm -rf $$copy; exit $$rc

tour:
	fsdp-kit tour --out tour
