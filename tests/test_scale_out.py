"""Scale-out from the command line: crashes and hangs fail fast naming the rank with nothing left behind; the sbatch script runs.
Two loopback nodes giving one node's losses, and a SIGKILLed worker restarted by torchrun resuming bit for bit, are asserted
by the scale-out lesson (nbs/11_scale.ipynb), which runs them."""
import inspect, json, os, signal, subprocess, sys, threading, time
from pathlib import Path
import psutil, pytest
from tests.conftest import ROOT
from tests.badinput import refused
from fsdp_kit.launch import free_port
from fsdp_kit.scale import inject_fault

pytestmark = pytest.mark.timeout(400)
TRAIN = ("train", "--model", "tiny", "--seq-len", 32)


def _watched(args, tmp, name, deadline):
    "Start `fsdp-kit ARGS` and watch it from a thread; return a function that waits."
    # (exit code, stderr, seconds, processes of the run still alive).
    out, err = open(tmp / f"{name}.out", "w"), open(tmp / f"{name}.err", "w")
    start, seen, box = time.monotonic(), set(), {}
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_kit", *map(str, args)], cwd=ROOT, stdout=out, stderr=err, start_new_session=True)

    def watch():
        while proc.poll() is None:
            try: seen.update(psutil.Process(proc.pid).children(recursive=True))  # torchrun and its workers, as they come
            except psutil.NoSuchProcess: pass
            if len(seen) >= 4 and "workers" not in box: box["workers"] = time.monotonic() - start  # the janitor, torchrun, 2 workers
            if time.monotonic() - start > deadline: os.killpg(proc.pid, signal.SIGKILL); box["killed"] = True
            time.sleep(0.2)
        box["seconds"] = time.monotonic() - start
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def wait():
        thread.join()
        assert "killed" not in box, f"fsdp-kit {' '.join(map(str, args))} still running after {deadline} s"
        time.sleep(1)
        alive = [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        wait.workers_started = box.get("workers")
        return proc.returncode, (tmp / f"{name}.err").read_text(), box["seconds"], alive
    return wait


@pytest.fixture(scope="module")
def hang(tmp_path_factory):
    "A run whose rank 1 hangs after step 2, with --timeout 15: started first, checked after the crash, so the two waits overlap."
    return _watched([*TRAIN, "--nproc", 2, "--steps", 6, "--inject-fault", "hang", "--fault-rank", 1, "--fault-step", 2, "--timeout", 15],
                    tmp_path_factory.mktemp("hang"), "hang", 150)


def test_slurm_script_names_its_pieces_and_its_launch_line_runs(cli, tmp_path):
    res = cli("slurm", "--nodes", 4, "--gpus-per-node", 8, "--partition", "gpu", "--time", "01:00:00", "--", "train", "--steps", 10)
    assert res.returncode == 0, res.stderr
    script = res.stdout
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    for piece in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --time=01:00:00", "srun --nodes=4",
                  'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', "torchrun --nnodes 4 --node-rank $SLURM_NODEID",
                  "--rdzv-backend c10d --rdzv-endpoint $head_node:$rdzv_port",
                  '--node-rank "$SLURM_NODEID" --rdzv-endpoint "$head_node:$rdzv_port"'):
        assert piece in script, piece
    # run it on one loopback node: SLURM's variables set by hand, scontrol and srun stood in for by two-line scripts
    res = cli("slurm", "--nodes", 1, "--gpus-per-node", 2, "--", *TRAIN, "--steps", 2, "--json", tmp_path / "slurm.json")
    (tmp_path / "job.sh").write_text(res.stdout)
    bin_dir = tmp_path / "bin"; bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    for f in ("scontrol", "srun"): (bin_dir / f).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[001]",
           "SLURM_JOB_ID": "4242", "SLURM_NODEID": "0", "RDZV_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["bash", tmp_path / "job.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads((tmp_path / "slurm.json").read_text())
    assert r["world_size"] == 2 and len(r["losses"]) == 2 and r["scale"]["nodes"] == 1


@pytest.mark.parametrize("args,message", [
    (("slurm", "--nodes", 0, "--gpus-per-node", 8, "--", "train"), "nodes=0 is not allowed: a whole number >= 1"),
    (("slurm", "--nodes", 2, "--gpus-per-node", 8, "--", "mesh"), "command='mesh' is not allowed: train ..."),
    (("slurm", "--nodes", 2, "--gpus-per-node", 8, "--", "train", "--nproc", 4), "command='--nproc' is not allowed: no node options"),
    (("train", "--inject-fault", "crash", "--fault-rank", 2), "--fault-rank=2 is not allowed: 0 <= fault_rank < 2"),
    (("train", "--nnodes", 2), "--rdzv-endpoint=None is not allowed: HOST:PORT of the first node"),
])
def test_bad_scale_options_are_refused(tmp_path, args, message):
    refused(list(args), message, tmp_path)


def test_crash_and_hang_fail_fast_naming_the_rank_leaving_nothing(tmp_path, hang):
    crash = _watched([*TRAIN, "--nproc", 2, "--steps", 6, "--inject-fault", "crash", "--fault-rank", 0, "--fault-step", 2], tmp_path,
                     "crash", 90)
    code, err, seconds, alive = crash()
    assert code == 1 and seconds < 90 and alive == [], (seconds, err[-3000:])  # fails fast: within the default --timeout 120
    assert ("rank 0 died without reporting an error" in err and "step 2 was its last finished step" in err
            and "Traceback" not in err), err[-3000:]
    code, err, seconds, alive = hang()
    assert code == 1 and seconds < 120 and alive == [], (seconds, err[-3000:])
    assert "rank 1 hung: it finished step 2 but did not start step 3; rank(s) 0 waited for it in foreach_all_gather" in err, err[-3000:]
    assert "(no progress for 15 s). Rank 1 was in inject_fault" in err, err[-3000:]
    # the hung rank's own frames (the kit's and the user's code), not torch's and runpy's; the whole trace only with --debug
    assert len(err.strip().splitlines()) <= 15 and "Traceback" not in err and "runpy" not in err, err[-3000:]
    src, first = inspect.getsourcelines(inject_fault)
    asleep = first + next(i for i, line in enumerate(src) if "time.sleep" in line)  # where the hung rank waits, wherever the line moves
    assert f"fsdp_kit/scale.py:{asleep} in inject_fault" in err and "(--debug prints the whole trace)" in err, err[-3000:]
    # ended within --timeout + 10 s of the workers' start (the fault comes two tiny steps later)
    assert hang.workers_started is not None and seconds - hang.workers_started < 15 + 10, (seconds, hang.workers_started)


def test_a_sigkilled_worker_is_named_within_a_second():
    "torchrun's agent exits without an interpreter shutdown (1.9-2.4 s with transformers loaded): the command names the rank right after."
    args = [*TRAIN, "--nproc", 2, "--steps", 6, "--inject-fault", "crash", "--fault-rank", 1, "--fault-step", 2]
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_kit", *map(str, args)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    stamped = []
    try:
        for line in proc.stderr: stamped.append((time.monotonic(), line))  # rank 1 kills itself right after rank 0 prints step 2
        proc.wait(60)
    finally:
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL)
    step = next(t for t, l in stamped if l.startswith("step 2/6"))
    named = next(t for t, l in stamped if "rank 1 died without reporting an error" in l)
    assert proc.returncode == 1 and named - step < 1.5, (named - step, "".join(l for _, l in stamped)[-2000:])
