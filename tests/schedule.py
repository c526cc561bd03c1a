"""The order `make test` hands files to its two xdist workers: the longest first, test files and notebooks alike.

`make test` runs `tests/` and every notebook in one pytest session (`-p tests.schedule`), each file whole on one worker
(--dist loadfile) in the order collected (--no-loadscope-reorder). Longest first, so that the two workers end together: the
short files fill in around the long ones, and neither core idles while the other finishes a long notebook at the end.
SECONDS is each file's summed test time on 2 cores, from one `make test` run with `--durations=0`; a file not in it goes last,
in the order collected. Written again from such a run's output by `python -m tests.schedule DURATIONS.txt`."""
import re, sys
from collections import Counter
import pytest

SECONDS = {"test_cli": 105, "test_cli_contract": 105, "08c_plan_build": 96, "12_doctor": 92, "test_leftovers": 89,
           "test_doctor": 86, "test_docs": 74, "03b_versions": 73, "test_fsdp_config_runs": 71, "test_checkpoint": 71,
           "test_hf": 71, "04c_ac": 69, "test_launch": 69, "04_wrap": 68, "test_lifecycle": 65, "05_qlora": 56, "11_scale": 54,
           "07_checkpoint": 53, "05b_peft": 50, "test_gpu_check": 48, "test_checkpoint_faults": 47, "test_bad_input": 44,
           "08a_plan_validate": 44, "test_plan": 41, "test_doctor_runs": 40, "05a_lora": 38, "test_qlora": 38, "10_launch": 38,
           "test_scale_out": 37, "09_hf": 37, "test_build": 36, "09a_hf_run": 35, "01_train": 32, "08_plan": 32,
           "03a_upstream": 32, "04b_reshard": 31, "test_wrap": 26, "09b_moe": 25, "06a_cp_trainer": 25, "06_cp": 24,
           "08b_plan_gpu": 21, "test_spec_tree": 19, "04a_measure": 18, "test_upstream": 17, "03_config": 15, "10a_ranks": 15,
           "test_benchmarks": 13, "index": 12, "01a_models": 12, "01b_spec": 11, "02_mesh": 9, "test_structure": 8,
           "test_train": 7, "benchmarks": 6, "test_lora_merge": 6, "test_mesh": 5, "test_bad_models": 5, "14_commands": 4,
           "test_versions": 3, "test_cp": 3, "13_seeds": 2, "10b_errors": 2, "test_unit_map": 1, "01c_flags": 1,
           "test_flags": 1, "test_figures": 1}


@pytest.hookimpl(trylast=True)  # after the conftests' own hooks (nbs/conftest.py gives cells their execution counts)
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -SECONDS.get(item.path.stem, 0))  # a stable sort: a file's tests and cells keep their order


def seconds_per_file(durations:str) -> dict:
    "Summed seconds per file stem from pytest's `--durations=0` lines (`12.3s call tests/test_x.py::test_y`)."
    out = Counter()
    for secs, path in re.findall(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::", durations, flags=re.M):
        out[path.rsplit("/", 1)[-1].rsplit(".", 1)[0]] += float(secs)
    return {k: round(v) for k, v in out.most_common() if round(v) > 0}


if __name__ == "__main__":
    print("SECONDS =", seconds_per_file(open(sys.argv[1]).read()))
