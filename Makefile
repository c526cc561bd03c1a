# The checks CI runs (.ci/run calls `make test`). Each target is one step, runnable alone.
.PHONY: test test-torch-newest export sync nbdev-test pytest nbval tour

test: sync pytest nbval

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

pytest:            ## the test suite: real multi-process runs and bad-input cases (pytest-xdist: two files at a time, each file in one process)
	python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests --ignore=tests/test_sync.py  # two test files at a time: their launches wait as much as they compute

nbval:             ## run every notebook again, from a copy outside the checkout (so they may read only what the installed package ships), and compare the outputs marked NBVAL_CHECK_OUTPUT
	@copy=$$(mktemp -d) && cp -r nbs $$copy/ && cd $$copy && echo "nbval in $$copy/nbs" && \
	python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --nbval-lax --nbval-cell-timeout=300 --timeout=300 -p no:cacheprovider nbs; \
	rc=$$?; rm -rf $$copy; exit $$rc  # two notebooks at a time, each in its own kernel

tour:
	fsdp-kit tour --out tour
