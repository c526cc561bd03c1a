"""The order `make test` hands files to its two xdist workers: the longest first, test files and notebooks alike.

`make test` runs `tests/` and every notebook in one pytest session (`-p tests.schedule`), each file whole on one worker
(--dist loadfile) in the order collected (--no-loadscope-reorder). Longest first, so that the two workers end together: the
short files fill in around the long ones, and neither core idles while the other finishes a long notebook at the end.
SECONDS is each file's summed test time on 2 cores, from one `make test` run with `--durations=0`; a file not in it goes last,
in the order collected. Written again from such a run's output by `python -m tests.schedule DURATIONS.txt`."""
import re, sys
from collections import Counter
import pytest

SECONDS = {"12_doctor": 116, "08c_plan_build": 95, "test_doctor": 90, "test_leftovers": 84, "test_cli": 75,
           "test_cli_contract": 70, "test_docs": 67, "test_checkpoint": 64, "test_launch": 61, "test_fsdp_config_runs": 56,
           "test_hf": 55, "test_checkpoint_faults": 55, "test_lifecycle": 47, "test_gpu_check": 45, "07_checkpoint": 44,
           "03b_versions": 42, "04_wrap": 41, "04c_ac": 39, "test_bad_input": 38, "test_wrap": 37, "test_qlora": 36,
           "test_scale_out": 35, "test_doctor_runs": 34, "09a_hf_run": 33, "test_plan": 33, "test_build": 32, "05_qlora": 29,
           "05b_peft": 29, "08a_plan_validate": 28, "10_launch": 26, "04b_reshard": 25, "11_scale": 24, "test_upstream": 20,
           "08_plan": 18, "05a_lora": 17, "09_hf": 17, "01_train": 17, "test_spec_tree": 15, "03a_upstream": 14,
           "test_benchmarks": 14, "06_cp": 14, "09b_moe": 13, "06a_cp_trainer": 12, "03_config": 10, "test_doctor_build": 10,
           "test_structure": 9, "04a_measure": 9, "index": 9, "08b_plan_gpu": 8, "test_train": 8, "02_mesh": 6,
           "test_lora_merge": 6, "01b_spec": 6, "10a_ranks": 5, "test_bad_models": 5, "01a_models": 5, "test_mesh": 5,
           "test_cp": 3, "test_versions": 3, "benchmarks": 2, "test_stored_outputs": 2, "14_commands": 1, "test_unit_map": 1,
           "test_figures": 1, "test_config": 1, "test_flags": 1, "13_seeds": 1, "10b_errors": 1, "01c_flags": 1,
           "test_measure": 1}


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
