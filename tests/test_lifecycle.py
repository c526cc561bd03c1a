"""Nothing outlives its launcher: SIGKILL, SIGTERM or SIGINT of `fsdp-kit train` stops every worker, nothing writes to the
checkpoint folder afterwards, and each leaves a complete checkpoint, from which --resume starts (that a resume after SIGKILL
finishes bit-identically to an uninterrupted run is asserted by test_checkpoint.py::test_sigkill_while_saving_three_times, which
SIGKILLs every process of a run, mid-save and between saves, and resumes it to the end). While a run writes a checkpoint folder, a
second run on it is refused. Silent waits are bounded."""
import json, os, signal, subprocess, sys, time
from pathlib import Path
import psutil, pytest
from tests.conftest import ROOT, SESSION_TMP
from fsdp_kit.launch import free_port, launch, WorkerError
from tests.helpers import exits_on_rank

pytestmark = pytest.mark.timeout(300)
RUN = ("train", "--model", "tiny", "--seq-len", 32, "--save-every", 4, "--keep", 3)


def _deaf():
    "Ignore and block SIGINT, as a service or a test runner's thread does; a child inherits both."
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _start(args, tmp, name, preexec_fn=None):
    out = open(tmp / f"{name}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "fsdp_kit", *map(str, args)], cwd=ROOT, stdout=out, stderr=out, start_new_session=True,
                            preexec_fn=preexec_fn)


def _alive(procs):
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if not p.is_symlink()}


def _kill_mid_training(proc, folder: Path, how: str, deadline=120, before=lambda: None) -> dict:
    "Wait for a checkpoint, call `before()`, send `how`, and return what was seen."
    # workers, seconds until they were gone, the checkpoint folder then (`_no_writes_since` compares it a while later).
    start, seen = time.monotonic(), set()
    while not (folder / "latest").exists() or len(seen) < 3:  # torchrun and its two workers, and a first checkpoint
        assert proc.poll() is None and time.monotonic() - start < deadline, f"{how}: the run ended or stalled before its first checkpoint"
        seen.update(psutil.Process(proc.pid).children(recursive=True))
        time.sleep(0.1)
    before()
    time.sleep(0.5)  # mid-training, between saves or inside one
    seen.update(psutil.Process(proc.pid).children(recursive=True))
    if how == "SIGKILL": os.killpg(proc.pid, signal.SIGKILL)  # the launcher's whole process group; the workers sit in their own sessions
    else: proc.send_signal(getattr(signal, how))  # the launcher alone
    killed = time.monotonic()
    while _alive(seen) and time.monotonic() - killed < 10: time.sleep(0.1)
    gone_after, alive = time.monotonic() - killed, _alive(seen)
    return dict(workers=len(seen), gone_after=gone_after, alive=alive, files=_snapshot(folder), code=proc.wait(30))


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Three runs of `fsdp-kit train` side by side, each stopped once it has a checkpoint: SIGKILL, SIGTERM, and SIGINT from a parent
    that ignored and blocked SIGINT (test_ctrl_c_is_answered_where_the_parent_ignored_and_blocked_sigint); during the SIGTERM one a
    second run on its folder. Then 3 s with every worker gone, and whether anything wrote to a checkpoint folder meanwhile."""
    tmp_path = tmp_path_factory.mktemp("killed")
    runs = {how: _start([*RUN, "--steps", 100_000, "--ckpt", tmp_path / how], tmp_path, how, _deaf if how == "SIGINT" else None)
            for how in ("SIGKILL", "SIGTERM", "SIGINT")}

    def second_run():
        "Two runs writing one folder would delete each other's checkpoints: the second is refused with the first one's pid."
        from tests.badinput import Case, check_case
        check_case(Case("second-run", ["train", "--steps", 4, "--ckpt", tmp_path / "SIGTERM", "--resume"], 2,
                        f"is in use by another run (pid {runs['SIGTERM'].pid})"), tmp_path)
    try:
        seen = {how: _kill_mid_training(proc, tmp_path / how, how, before=second_run if how == "SIGTERM" else lambda: None) for how,
                proc in runs.items()}
    finally:
        for proc in runs.values():
            if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(3)  # one wait for all three: each folder was read as its workers were gone, at least 3 s ago
    for how, s in seen.items(): s["writes"] = s.pop("files") != _snapshot(tmp_path / how)
    return tmp_path, seen


def test_killing_the_launcher_stops_every_worker_and_a_second_run_is_refused_meanwhile(killed):
    tmp_path, seen = killed
    for how, s in seen.items():
        assert s["alive"] == [] and s["gone_after"] < 10, f"{how}: {s}"
        assert not s["writes"], f"{how}: the checkpoint folder changed after the workers were gone"
    assert seen["SIGKILL"]["code"] == -signal.SIGKILL and seen["SIGTERM"]["code"] == 143 and seen["SIGINT"]["code"] == 130
    for how in ("SIGTERM", "SIGINT"):
        err = (tmp_path / f"{how}.err").read_text()
        assert f"interrupted ({how}): the workers were stopped" in err and "Traceback" not in err, err[-2000:]
    # every run left a complete latest checkpoint, the one --resume starts from (the check `fsdp-kit train --resume` makes before launching)
    from fsdp_kit.checkpoint import CheckpointSpec, check_resume, verify
    from fsdp_kit.train import TrainSpec
    for how in seen:
        latest = tmp_path / how / "latest"
        assert verify(latest) == [] and int(os.readlink(latest).removeprefix("step-")) >= 4
        spec = TrainSpec(model="tiny", seq_len=32, steps=100_000,
                         ckpt=CheckpointSpec(str(tmp_path / how), save_every=4, keep=3, resume=True))
        assert check_resume(spec)[0] == latest.resolve(), how
    # the SIGKILLed command could not remove its temporary folder: its janitor did (test_leftovers.py checks every command)
    assert list(SESSION_TMP.glob("fsdp_kit_cmd_*")) == [] and list(SESSION_TMP.glob("fsdp_kit_run_*")) == []
    assert sorted(SESSION_TMP.glob("fsdp_kit_run_*")) == []


def test_a_missing_node_fails_within_the_rendezvous_timeout_naming_it(cli):
    start = time.monotonic()
    out = cli("train", "--steps", 2, "--nnodes", 2, "--node-rank", 0, "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
              "--rdzv-timeout", 5, "--rdzv-id", "lonely", timeout=120)
    took = time.monotonic() - start
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "node 0: waiting for node(s) 1 of 2 at 127.0.0.1:" in out.stderr
    assert "node(s) 1 of 2 never joined the rendezvous" in out.stderr and "within 5 s" in out.stderr
    assert 5 <= took < 120  # bounded by --rdzv-timeout, far from torchrun's 600 s default (startup is slower on a busy machine)


@pytest.mark.parametrize("launcher", ["notebook", "torchrun"])
def test_a_rank_that_exits_quietly_is_the_one_named(launcher):
    with pytest.raises(WorkerError) as info:
        launch(exits_on_rank, 1, nprocs=2, launcher=launcher, timeout=30)
    assert info.value.rank == 1 and "rank 1 died without reporting an error" in str(info.value)


def test_a_torchrun_command_line_runs_one_job(tmp_path):
    "The `torchrun ... -m fsdp_kit train` line the launch lesson prints: each rank runs in place, and rank 0 alone reports."
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fsdp_kit",
           "train", "--steps", "3", "--seq-len", "32", "--json", str(tmp_path / "out.json")]
    # torchrun's own logs
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("2 ranks, steps 1-3") == 1 and out.stdout.count("wrote ") == 1
    assert json.loads((tmp_path / "out.json").read_text())["world_size"] == 2


def test_the_help_shows_every_option_with_its_default_and_hides_the_worker(cli):
    top = cli("--help", timeout=60).stdout
    assert "worker" not in top and "SUPPRESS" not in top
    from fsdp_kit.cli import parser
    for name, sub in parser()._subparsers._group_actions[0].choices.items():
        for a in sub._actions:
            assert a.help, f"fsdp-kit {name} {a.option_strings or a.dest} has no help text"
    train = cli("train", "--help", timeout=60).stdout
    assert "--steps STEPS" in train and "optimizer steps (default: 10)" in train and "(default: 180)" in train


@pytest.fixture
def full_disk(tmp_path):
    "A 1 MiB tmpfs filled to the brim (needs root, as CI has); skipped where it cannot be mounted."
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with open(mount / "fill", "wb") as f:
            try: f.write(b"\0" * 2**21)
            except OSError: pass
        yield mount
    finally: subprocess.run(["umount", str(mount)])


def test_json_on_a_full_disk_is_printed_not_lost(full_disk):
    from tests.badinput import Case, run_case
    code, out, err = run_case(Case("json-full-disk", ["plan", "--model", "tiny", "--gpus", "2", "--json", f"{full_disk}/plan.json"], 74,
                                   ""), full_disk)
    assert code == 74 and ("could not write it (No space left on device: no space left on the disk); the result was printed to stdout "
                           "instead") in err
    assert json.loads(out[out.index("\n{") + 1:])["model"] == "tiny"  # the JSON is on stdout, after the plan's text
    assert sorted(p.name for p in full_disk.iterdir()) == ["fill"]  # no empty or partial file


def test_a_closed_stdout_ends_the_command_without_a_traceback():
    "`fsdp-kit plan --json - | head -c 10`: the reader goes away; the command stops with 141 (128 + SIGPIPE), no traceback."
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_kit", "plan", "--model", "small", "--json", "-"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command writes: its first write finds no reader
    err = proc.stderr.read()
    assert proc.wait(60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]


def test_ctrl_c_is_answered_where_the_parent_ignored_and_blocked_sigint(killed):
    "A parent that ignores and blocks SIGINT (a service, a test runner's thread) passes both on: the command still stops at a SIGINT."
    # the fixture's SIGINT run was started by such a parent (_deaf), and sent SIGINT once it had a checkpoint
    tmp_path, seen = killed
    assert seen["SIGINT"]["code"] == 130, seen["SIGINT"]
    assert "interrupted (SIGINT): the workers were stopped" in (tmp_path / "SIGINT.err").read_text()
