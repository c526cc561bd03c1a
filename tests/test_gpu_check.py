"""benchmarks/gpu_check.py in its CPU mode (gloo, the tiny model, a few steps): the harness end to end, its record's shape, each step's
status, a step over its time limit stopped and reported, and the notebooks' stored-record path on that record. Also: train, qlora and
hf --run trainer run FSDP2 over a 1-rank mesh (a single-GPU user's case), and native is refused there before launching."""
import json, sys, time
import pytest
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # benchmarks/gpu_check.py
from fsdp_kit.measure import stored_gpu_lines, gpu_records

RECORD_KEYS = {"mode", "date", "started", "device", "versions", "backend", "python", "steps", "ranks", "budget_s", "seconds"}
pytestmark = pytest.mark.timeout(300)  # the check stops each step at its limit; a hang past that fails here
STEP_KEYS = {"name", "command", "limit_s", "status", "seconds", "line"}


def run(tmp_path, *args) -> tuple:
    "gpu_check in CPU mode with `args`; its exit status, its record, and the record's steps by name."
    out = tmp_path / "records" / "cpu-mode.json"
    rc = gpu_check.main(["--cpu", "--out", str(out), *args])
    record = json.loads(out.read_text())
    assert RECORD_KEYS <= set(record) and record["mode"] == "cpu" and record["backend"] == "gloo" and record["ranks"] == 1
    for s in record["steps"]:
        assert STEP_KEYS <= set(s) and s["status"] in gpu_check.STATUSES and s["line"] and "\n" not in s["line"], s
    return rc, record, {s["name"]: s for s in record["steps"]}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    "One CPU-mode check on 1 rank, as on one GPU: env, train, qlora, hf-trainer; plan-validate stopped at 4 s; hf-native skipped."
    tmp, start = tmp_path_factory.mktemp("gpu_check"), time.perf_counter()
    rc, record, steps = run(tmp, "--nproc", "1", "--only", "env,train,plan-validate,qlora,hf-trainer,hf-native",
                            "--limit", "plan-validate=4")
    return tmp, rc, record, steps, time.perf_counter() - start


def test_cpu_mode_end_to_end(checked):
    tmp_path, rc, record, steps, took = checked
    assert list(steps) == ["env", "train", "plan-validate", "qlora", "hf-trainer", "hf-native"]  # the plan's order, the steps asked for
    assert rc == 1  # a step timed out: the check as a whole did not pass
    assert (steps["env"]["status"] == "passed" and steps["env"]["result"]["device_type"] == "cpu"
            and steps["env"]["line"].startswith("cpu, backend gloo"))
    train = steps["train"]
    assert train["status"] == "passed" and train["command"].startswith("fsdp-kit train --nproc 1 --model tiny")
    # FSDP2 on 1 rank
    assert train["result"]["world_size"] == 1 and train["result"]["max_param_diff"] < 1e-6 and len(train["result"]["units"]) > 1
    # stopped, not waited on
    pv = steps["plan-validate"]
    assert pv["status"] == "timed_out" and pv["limit_s"] == 4 and pv["seconds"] < 4 + 25
    assert steps["hf-native"]["status"] == "skipped" and "needs 2 GPUs" in steps["hf-native"]["line"]
    assert record["seconds"] < took + 1
    # the notebooks' stored-record path, on this record: labelled as CPU mode, never as GPU numbers
    lines = stored_gpu_lines(["train", "hf-native", "hf-sft"], tmp_path / "records")
    assert (lines[0].startswith("stored CPU-mode record cpu-mode.json") and "NOT GPU numbers" in lines[0]
            and record["versions"]["torch"] in lines[0])
    assert lines[1].startswith("  train: passed") and "1 ranks" in lines[1] and lines[3] == "  hf-sft: not in this record"
    assert stored_gpu_lines(["train"], tmp_path / "empty")[0].startswith("no GPU record exists yet")
    # a GPU record, older or not, is shown before any CPU-mode one (its fields here only test the order)
    (tmp_path / "records" / "h200-2000-01-01.json").write_text(json.dumps(record | dict(mode="gpu", date="2000-01-01")))
    assert [r["mode"] for r in gpu_records(tmp_path / "records")] == ["gpu", "cpu"]


def test_one_rank_runs_fsdp2(checked):
    "qlora and hf --run trainer on 1 rank: FSDP2 over a 1-rank mesh, as on one GPU."
    _, _, _, steps, _ = checked
    assert (steps["qlora"]["status"], steps["hf-trainer"]["status"]) == ("passed", "passed"), steps
    q, t = steps["qlora"]["result"], steps["hf-trainer"]["result"]
    assert q["world_size"] == 1 and q["sharded_vs_unsharded_loss_diff"] < 1e-5 and q["adapter"]["every_rank_share_saved"]
    assert t["world_size"] == 1 and t["sharded"] and t["fsdp_units"] > 1 and t["parity"]["max_loss_diff"] < 1e-5


def test_cpu_mode_plans_every_step_on_two_ranks():
    "By default CPU mode runs 2 ranks, so no step is left out for want of ranks (the doctor's twin always runs on 2 CPU ranks)."
    one, two = gpu_check.plan(True, 1), gpu_check.plan(True, 2)
    assert [s for s in two if s.get("ranks", 1) > 2] == [] and {s["name"] for s in one} < {s["name"] for s in two}
    assert {"hf-native", "train-hsdp", "cp-eval-alltoall", "doctor"} <= {s["name"] for s in two}
    doctor = next(s for s in one if s["name"] == "doctor")
    assert doctor["argv"][-2:] == ["--nproc", "2"]


def test_a_step_name_is_checked(tmp_path, capsys):
    with pytest.raises(SystemExit, match="step 'trian' is not allowed: one of env, train"):
        gpu_check.main(["--cpu", "--out", str(tmp_path / "x.json"), "--only", "trian"])
