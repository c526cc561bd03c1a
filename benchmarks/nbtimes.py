"""A pytest plugin for the benchmark: the wall time of each notebook under nbval, from the first cell's setup (which
starts the notebook's kernel) to the last cell's teardown (which shuts it down).

    python -m pytest --nbval-lax -p nbtimes nbs/   # with benchmarks/ on PYTHONPATH; writes $NBTIMES_OUT (JSON)
"""
import json, os, time

import pytest

_start, _end = {}, {}


def _file(item):
    return os.path.basename(str(item.fspath))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _start.setdefault(_file(item), time.time())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    _end[_file(item)] = time.time()


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("NBTIMES_OUT")
    if out:
        json.dump({f: round(_end[f] - _start[f], 1) for f in _start if f in _end}, open(out, "w"), indent=1)
