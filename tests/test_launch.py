"""launch(): real process groups from a script, failures that name the rank, hangs that end, nothing left behind."""
import inspect, os, pickle, re, signal, subprocess, sys, time
import psutil, pytest
from fsdp_kit.errors import KitError
from fsdp_kit.launch import WorkerError, launch, torchrun_command, fork_traps, environment, agent_command, PRELOAD, STOP_SIGNALS
from tests.helpers import rank_info, fails_on_rank, hangs_on_rank_0, started_with, started_with_and_rank_info
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(180)


def _children():
    "This process's live children, except the kit's one TrainingArguments helper (fsdp_kit.upstream)."
    # that helper lives as long as this process, on purpose
    def helper(p):
        try: return "serve_plugin_args" in " ".join(p.cmdline())
        except psutil.NoSuchProcess: return True
    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not helper(p)]


@pytest.fixture(scope="module")
def torchrun_started():
    "One torchrun launch for two tests: what each rank held before its function ran, and rank_info() under 'info'."
    out = launch(started_with_and_rank_info, nprocs=2, launcher="torchrun", timeout=60)
    assert _children() == []
    return out


@pytest.mark.parametrize("launcher", ["notebook", "torchrun"])
def test_launch_returns_rank0_value_from_a_real_group(launcher, request):
    if launcher == "notebook":
        handlers = {s: signal.getsignal(getattr(signal, s)) for s in STOP_SIGNALS}
        started = launch(started_with_and_rank_info, nprocs=2, launcher=launcher)
        # this process keeps its own handlers (torch's launcher installs its own): Ctrl-C here still raises KeyboardInterrupt
        assert {s: signal.getsignal(getattr(signal, s)) for s in STOP_SIGNALS} == handlers
        # forked from this process after it imported PRELOAD (once: the next launch forks it again without importing)
        assert (started["forked"], started["preloaded"]) == (True, list(PRELOAD))
    out = (started if launcher == "notebook" else request.getfixturevalue("torchrun_started"))["info"]
    assert out["rank"] == 0 and out["world_size"] == 2 and out["backend"] == "gloo"
    assert out["rank_sum"] == 1.0  # 0 + 1, summed by a real all_reduce
    assert out["env"] == {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert _children() == []


def test_torchrun_forks_workers_that_start_with_torch_and_transformers_imported(torchrun_started):
    started = {k: v for k, v in torchrun_started.items() if k != "info"}
    assert started == dict(forked=True, preloaded=list(PRELOAD), session_leaders=2)  # each rank its own session (autogroup), as torchrun's
    assert _children() == []


_PEFT_FIRST = ("import sys, peft\nfrom fsdp_kit.launch import launch, fork_traps, agent_main\nfrom fsdp_kit.errors import KitError\n"
               "print(len(fork_traps()), flush=True)\n"
               "try: launch(print, nprocs=2)\nexcept KitError as e: print('REFUSED', e, flush=True)\n"
               "agent_main(sys.argv[1:])\n")


@pytest.fixture(scope="module")
def peft_first(tmp_path_factory):
    """One process that imported peft (which imports bitsandbytes), for two tests: a forked launch() there, then torchrun's agent
    there (as `launch(launcher='torchrun')` runs it) starting 2 workers running started_with: (its stdout, the agent's result)."""
    tmp = tmp_path_factory.mktemp("agent")
    (tmp/"call.pkl").write_bytes(pickle.dumps((started_with, (), "gloo", 60)))
    cmd = agent_command(str(tmp), 2)
    out = subprocess.run([sys.executable, "-c", _PEFT_FIRST, *cmd[4:]], timeout=150, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, pickle.loads((tmp/"result.pkl").read_bytes())


def test_the_agent_starts_fresh_workers_when_a_fork_would_be_unsafe(peft_first):
    "peft imported in torchrun's process is a fork trap: the agent spawns fresh interpreters, which have imported none of PRELOAD."
    assert peft_first[1] == dict(forked=True, preloaded=[], session_leaders=2)


@pytest.mark.parametrize("launcher", ["notebook", "torchrun"])
def test_worker_exception_names_rank_and_message(launcher):
    start = time.time()
    with pytest.raises(WorkerError) as info:
        launch(fails_on_rank, 1, nprocs=2, launcher=launcher)
    assert time.time() - start < 60
    err = info.value
    assert err.rank == 1
    assert "rank 1 failed" in str(err) and "ValueError: rank 1 ran out of data" in str(err)
    assert "fails_on_rank" in err.worker_traceback
    time.sleep(0.5)
    assert _children() == []


def test_rank_0_failure_is_named_too():
    with pytest.raises(WorkerError) as info:
        launch(fails_on_rank, 0, nprocs=2)
    assert info.value.rank == 0 and "rank 0 ran out of data" in str(info.value)


def test_hang_in_a_collective_fails_after_the_timeout():
    start = time.time()
    with pytest.raises(WorkerError) as info:
        launch(hangs_on_rank_0, nprocs=2, timeout=5)
    elapsed = time.time() - start
    assert 4 < elapsed < 60
    # rank 0's all_reduce timed out; rank 1, which never joined, is the one named, with where it was and what rank 0 waited in
    assert info.value.rank == 1 and "rank 1 hung; rank(s) 0 waited for it in all_reduce. Rank 1 was in hangs_on_rank_0" in str(info.value)
    brief = info.value.brief()  # the user's frames only (a forked rank's stack starts in the caller's: this test), innermost last
    src, first = inspect.getsourcelines(hangs_on_rank_0)
    asleep = first + next(i for i, line in enumerate(src) if "time.sleep" in line)  # where rank 1 waits
    assert (brief.splitlines()[-1] == f"  tests/helpers.py:{asleep} in hangs_on_rank_0" and "site-packages" not in brief
            and "fsdp_kit/launch.py" not in brief), brief
    time.sleep(0.5)
    assert _children() == []


def test_nccl_without_a_gpu_and_a_spec_of_another_type_are_refused_in_one_line():
    from fsdp_kit.train import train_worker
    from fsdp_kit.qlora import QLoRASpec
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(KitError, match=r"backend='nccl' is not allowed: 'gloo' or None on a machine without a CUDA GPU"):
            launch(rank_info, nprocs=2, backend="nccl")
    with pytest.raises(KitError, match=r"spec='QLoRASpec' is not allowed: a TrainSpec: train_worker runs one"):
        launch(train_worker, QLoRASpec(), nprocs=2)
    with pytest.raises(KitError, match=r"spec='dict' is not allowed: a TrainSpec"):
        launch(train_worker, dict(model="tiny"), nprocs=2, launcher="torchrun")
    from fsdp_kit.launch import check_arg_types
    from fsdp_kit.scale import scale_train_worker
    from fsdp_kit.train import TrainSpec
    check_arg_types(scale_train_worker, (TrainSpec(), None, 60))  # an optional spec left out is no wrong type (11_scale passes fault=None)
    with pytest.raises(KitError, match=r"fault='TrainSpec' is not allowed: a FaultSpec"):
        check_arg_types(scale_train_worker, (TrainSpec(), TrainSpec()))
    assert _children() == []


def test_bad_arguments_are_refused_before_launching():
    with pytest.raises(KitError, match=r"nprocs=0 is not allowed"):
        launch(rank_info, nprocs=0)
    with pytest.raises(KitError, match=r"launcher='mpi' is not allowed: 'notebook' or 'torchrun'"):
        launch(rank_info, launcher="mpi")
    with pytest.raises(KitError, match=r"backend='mpi'"):
        launch(rank_info, backend="mpi")


@pytest.mark.parametrize("call, phrase", [
    (lambda: launch(rank_info, timeout=0), "timeout=0 is not allowed: a finite number > 0"),
    (lambda: launch(rank_info, timeout=float("nan")), "timeout=nan is not allowed"),
    (lambda: launch(rank_info, timeout="5"), "timeout='5' is not allowed"),
    (lambda: launch(42), "fn=42 is not allowed: a function"),
    (lambda: launch(rank_info, nprocs=True), "nprocs=True is not allowed"),
    (lambda: launch(rank_info, nprocs=2.0), "nprocs=2.0 is not allowed"),
    (lambda: launch(rank_info, launcher="torchrun", nnodes=2, rdzv_endpoint="127.0.0.1:29400", rdzv_id=""), "rdzv_id='' is not allowed"),
    (lambda: launch(rank_info, launcher="torchrun", nnodes=2, rdzv_endpoint="127.0.0.1:29400", rdzv_timeout=0), "rdzv_timeout=0"),
    (lambda: launch(rank_info, rdzv_timeout=10), "launcher='notebook' is not allowed"),
])
def test_launch_refuses_bad_arguments_before_starting_anything(call, phrase):
    with pytest.raises(KitError, match=re.escape(phrase)): call()


@pytest.mark.parametrize("spec, phrase", [
    (dict(steps=0), "steps=0 is not allowed"), (dict(steps=True), "steps=True is not allowed"), (dict(model=None), "model=None"),
    (dict(lr="0.1"), "lr='0.1' is not allowed"), (dict(lr=None), "lr=None"), (dict(lr=float("inf")), "lr=inf"),
    (dict(seed=2**70), "seed=1180591620717411303424"), (dict(ckpt="dir"), "ckpt='dir' is not allowed: None or a checkpoint.CheckpointSpec"),
    (dict(check_parity="yes"), "check_parity='yes'"),
])
def test_launch_checks_the_spec_it_is_given(spec, phrase):
    "launch() calls the spec's check(): a spec built by hand is refused before any process starts, as the command line's is."
    from fsdp_kit.train import TrainSpec, train_worker
    from fsdp_kit.spec import StepSpec
    step = {k: spec.pop(k) for k in list(spec) if k == "lr"}  # the learning rate is the step section's
    with pytest.raises(KitError, match=re.escape(phrase)):
        launch(train_worker, TrainSpec(**spec, **({"step": StepSpec(**step)} if step else {})), nprocs=2)


def test_torchrun_launcher_refuses_a_function_workers_cannot_import():
    def local(): return 1
    with pytest.raises(KitError, match=r"fn=.*local.* importable module"):
        launch(local, launcher="torchrun")


def test_fork_traps_are_named_before_forking(peft_first):
    "Importing peft (which imports bitsandbytes) in the launching process makes a forked launch refuse, saying what to do."
    out = peft_first[0]  # what the process that imported peft printed before it ran torchrun's agent
    assert "REFUSED launch() cannot fork this process safely" in out
    assert "`peft` is already imported" in out and "`bitsandbytes` is already imported" in out
    assert "import peft inside the launched function" in out
    assert fork_traps() == []  # this test process stays clean


def test_torchrun_command_single_and_multi_node():
    assert torchrun_command("fsdp_kit", ["train", "--steps", 3], nproc=2) == [
        "torchrun", "--standalone", "--nproc-per-node", "2", "-m", "fsdp_kit", "train", "--steps", "3"]
    cmd = torchrun_command("fsdp_kit", ["train"], nproc=4, nnodes=2, node_rank=1, rdzv_endpoint="node0:29400", rdzv_id="job7")
    assert cmd == ["torchrun", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400",
                   "--rdzv-id", "job7", "--nproc-per-node", "4", "-m", "fsdp_kit", "train"]
    assert torchrun_command("fsdp_kit", python="/usr/bin/python3")[:3] == ["/usr/bin/python3", "-m", "torch.distributed.run"]


@pytest.mark.parametrize("kwargs, field", [(dict(nproc=0), "nproc=0"), (dict(nnodes=0), "nnodes=0"),
                                           (dict(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "node_rank=2"),
                                           (dict(nnodes=2), "rdzv_endpoint=None")])
def test_torchrun_command_refuses_bad_values(kwargs, field):
    with pytest.raises(KitError, match=field):
        torchrun_command("fsdp_kit", **kwargs)


def test_environment_reports_versions_and_backend():
    env = environment()
    assert env["backend"] == ("nccl" if env["device_type"] == "cuda" else "gloo")
    assert set(env["versions"]) == {"torch", "transformers", "accelerate", "peft", "trl", "bitsandbytes"}
    assert env["versions"]["torch"].startswith("2.")


def test_one_process_still_gets_a_process_group():
    import os
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = launch(rank_info, nprocs=1)
    assert out["world_size"] == 1 and out["rank_sum"] == 0.0 and out["backend"] == "gloo"
    assert {k: os.environ.get(k) for k in before} == before  # the environment is restored
    with pytest.raises(WorkerError) as info:
        launch(fails_on_rank, 0, nprocs=1)
    assert info.value.rank == 0


def test_one_rank_then_two_in_one_process():
    "Issue 50: a one-rank launch ran its backward in the launching process, and on a CUDA build of torch every later fork failed."
    # ("Unable to handle autograd's threading in combination with fork-based multiprocessing"). Now one rank is forked too.
    import torch
    from fsdp_kit.launch import autograd_threads
    from fsdp_kit.train import TrainSpec, train_worker
    torch.set_num_threads(2)  # OpenMP's pool started here, as a notebook's ops start it: a forked rank on 2 threads then hung
    (torch.randn(512, 512) @ torch.randn(512, 512)).sum()
    assert launch(rank_info, nprocs=1)["pid"] != os.getpid()  # the rank ran in a child
    one = launch(train_worker, TrainSpec(model="tiny", steps=2, batch=8), nprocs=1)
    assert autograd_threads() == 0  # this process ran no backward: it can still fork ranks that do
    two = launch(train_worker, TrainSpec(model="tiny", steps=2, batch=4), nprocs=2)  # the same global batches of 8
    assert (one.world_size, two.world_size, len(one.losses), len(two.losses)) == (1, 2, 2, 2)
    assert one.losses == pytest.approx(two.losses, abs=1e-4) and 4 < one.losses[0] < 7
    assert _children() == []


_BACKWARD_FIRST = """
import sys, time, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from fsdp_kit import launch as L
from fsdp_kit.errors import KitError
from fsdp_kit.train import TrainSpec, train_worker
with FakeTensorMode(): pass  # as DTensor does in every FSDP2 step; on a CUDA build without a GPU it makes the backward start threads
a = torch.ones(2, requires_grad=True); (a * 2).sum().backward()  # on a GPU machine any backward does
time.sleep(0.2)
print("threads", L.autograd_threads(), "cuda build", torch.backends.cuda.is_built(), flush=True)
if not L.autograd_threads(): L.autograd_threads = lambda: 8  # a CPU-only build never starts them: take the same path anyway
two = L.launch(train_worker, TrainSpec(model="tiny", steps=2, batch=4), nprocs=2)
one = L.launch(train_worker, TrainSpec(model="tiny", steps=2, batch=8), nprocs=1)
print("sizes", two.world_size, one.world_size, "losses", two.losses, one.losses, flush=True)
def mine(): return 1
try: L.launch(mine, nprocs=2)
except KitError as e: print("REFUSED", e, flush=True)
"""


def test_a_process_that_ran_a_backward_starts_its_ranks_unforked():
    "Where autograd's threads already run, a fork could not run a backward: torchrun's fresh interpreters (or this process) instead."
    out = subprocess.run([sys.executable, "-c", _BACKWARD_FIRST], capture_output=True, text=True, timeout=150, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    threads, cuda_build = re.search(r"threads (\d+) cuda build (\w+)", out.stdout).groups()
    if cuda_build == "True": assert int(threads) > 0  # the state that broke every later fork
    said = [l for l in out.stderr.splitlines() if l.startswith("launch: ")]
    assert len(said) == 2, out.stderr[-3000:]  # one line a launch that started anything
    assert said[0].startswith("launch: starting the 2 ranks with launcher='torchrun' (fresh interpreters), not by fork: autograd's threads")
    assert said[1].startswith("launch: running the 1 rank in this process, not a forked one: autograd's threads")
    sizes, losses = re.search(r"sizes (\d+ \d+) losses (.*)", out.stdout).groups()
    assert sizes == "2 1"
    two, one = (eval(l) for l in re.findall(r"\[[^\]]*\]", losses))
    assert len(two) == 2 and two == pytest.approx(one, abs=1e-4)
    assert "REFUSED launch() cannot start 2 ranks of mine: autograd's threads already run" in out.stdout
    assert "fresh interpreters cannot import mine" in out.stdout and "Restart the kernel" in out.stdout
    assert "Unable to handle autograd's threading" not in out.stdout + out.stderr


def test_many_forked_launches_in_a_row_never_hang():
    "Forking next to torchelastic's store thread once hung a worker in glibc's resolver; workers now start together first."
    for i in range(25):
        out = launch(rank_info, nprocs=4, timeout=30)
        assert out["world_size"] == 4 and out["rank_sum"] == 6.0, i


def test_an_interrupted_wait_kills_the_forked_workers():
    "A BaseException in the caller while it waits (Ctrl-C in a notebook, pytest's timeout) ends the forked workers too."
    # none is left for exit to wait on.
    import multiprocessing, signal
    from tests.helpers import hangs_on_rank_0

    import threading

    class Interrupted(BaseException): pass

    def interrupt(*_): raise Interrupted()

    def once_forked(caller=threading.get_ident()):
        "SIGALRM to the caller 1 s after both workers are forked (rank 0 then waits in its all_reduce, rank 1 sleeps)."
        deadline = time.monotonic() + 60
        while len(_children()) < 2 and time.monotonic() < deadline: time.sleep(0.05)
        time.sleep(1)
        signal.pthread_kill(caller, signal.SIGALRM)
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(60)  # the caller is interrupted even if the workers never show
    try:
        threading.Thread(target=once_forked, daemon=True).start()
        with pytest.raises(Interrupted): launch(hangs_on_rank_0, nprocs=2, launcher="notebook", timeout=100)
    finally:
        signal.alarm(0); signal.signal(signal.SIGALRM, old)
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(180)
def test_kernel_interrupt_during_a_launch_says_so_in_one_line(tmp_path):
    "Kernel > Interrupt signals the kernel's whole process group, forked workers included."
    # the kernel reports it in one line, no rank's traceback, and nothing is left running.
    from jupyter_client.manager import start_new_kernel
    started = tmp_path / "started"
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        cell = ("from fsdp_kit.launch import launch\nfrom tests.helpers import all_reduce_forever\nlaunch(all_reduce_forever, "
                f"{str(started)!r}, nprocs=2)")
        msg_id, deadline = kc.execute(cell), time.monotonic() + 120
        while not started.exists():
            assert time.monotonic() < deadline, "the workers never started their loop"
            time.sleep(0.2)
        km.interrupt_kernel()  # what JupyterLab's Kernel > Interrupt does: SIGINT to the kernel's process group
        out = []
        while True:
            m = kc.get_iopub_msg(timeout=60)
            if m["parent_header"].get("msg_id") != msg_id: continue
            if m["msg_type"] == "stream": out.append(m["content"]["text"])
            elif m["msg_type"] == "error": out.append("\n".join(m["content"]["traceback"]))
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle": break
        text = re.sub(r"\x1b\[[0-9;]*m", "", "".join(out))
        assert text.rstrip().endswith("KeyboardInterrupt: all_reduce_forever on 2 process(es) was interrupted (SIGINT); every worker was "
                                      "stopped"), text[-3000:]
        assert "WorkerError" not in text and "SignalException" not in text and "death signal" not in text, text[-3000:]
        assert len(text.splitlines()) < 20, text  # the cell's line and the kit's, not a traceback per rank
        time.sleep(1)
        assert psutil.Process(km.provisioner.process.pid).children(recursive=True) == []
        assert kc.execute_interactive("print(6 * 7)", timeout=60)["content"]["status"] == "ok"  # the kernel goes on
    finally:
        km.shutdown_kernel(now=True)


def test_sweep_tolerates_a_run_folder_removed_meanwhile(tmp_path, monkeypatch):
    "Launches run side by side (nbval runs two notebooks at once)."
    # a folder listed by the sweep may be removed by its own launch before it is looked at.
    import tempfile
    from fsdp_kit import launch as launch_module
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(launch_module.Path, "glob", lambda self, pattern: iter([tmp_path / "fsdp_kit_run_gone"]))  # listed, then gone
    launch_module.sweep_run_dirs()  # FileNotFoundError from stat() before
    assert not (tmp_path / "fsdp_kit_run_gone").exists()
