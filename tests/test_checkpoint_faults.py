"""Checkpoints under faults and bad input."""
# the folder lock, folder pre-checks, lying manifests, resume checks, fallback while loading, a full disk.
import contextlib, errno, json, os, shutil, subprocess, sys
from pathlib import Path
import pytest
from tests.badinput import Case, run_case
from tests.conftest import ROOT

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
MANIFEST = dict(format="fsdp_kit checkpoint 1", step=2, state_dict="sharded", world_size=2)


def fake_checkpoint(root, step=2, state=None, model="tiny", **manifest):
    "A checkpoint folder whose manifest verifies (no real weights): `state` is the trainer state (bytes: written as is)."
    import torch
    from fsdp_kit.checkpoint import FORMAT, _files, step_name, model_shape
    folder = Path(root) / step_name(step)
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "__0_0.distcp").write_bytes(b"shard")
    if isinstance(state, bytes): (folder / "trainer_state.pt").write_bytes(state)
    else: torch.save(dict(step=step, schedule={}, rng=[torch.get_rng_state()]) if state is None else state, folder / "trainer_state.pt")
    m = dict(format=FORMAT, step=step, state_dict="sharded", world_size=2, model=model, lora=0, seed=0,
             model_shape=model_shape(model)) | manifest
    m["files"] = _files(folder)
    (folder / "manifest.json").write_text(json.dumps(m))
    return folder


@contextlib.contextmanager
def read_only(folder:Path):
    "`folder` made read-only: a read-only tmpfs where we are root (root writes through chmod), else chmod 0o555."
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try: yield
        finally: folder.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("root, and cannot mount a read-only tmpfs")
    try: yield
    finally: subprocess.run(["umount", str(folder)], capture_output=True)


# ---- the CLI table: `fsdp-kit ckpt` prints problems (exit 0, on stdout), `fsdp-kit train` refuses before launching (exit 2)

def _resume_setup(**kw):
    return lambda tmp: fake_checkpoint(tmp / "ck", **kw)

def _edited_config(tmp):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text(json.dumps(TINY))
    fake_checkpoint(tmp / "ck", model=str(tmp / "m" / "config.json"))
    (tmp / "m" / "config.json").write_text(json.dumps(TINY | dict(intermediate_size=192)))  # edited between runs

def _link(name, target):
    return lambda tmp: os.symlink(target, tmp / name)

TRAIN = ["train", "--nproc", 2, "--model", "tiny", "--steps", 4]
LIST = lambda m: {"ck/step-000002/manifest.json": m, "ck/step-000002/trainer_state.pt": "x"}
CASES = [
    Case("ckpt-manifest-array", ["ckpt", "{tmp}/ck"], 0, "step-000002: DAMAGED: its manifest.json is an array, not an object",
         LIST([1, 2])),
    Case("ckpt-one-damaged-step", ["ckpt", "{tmp}/ck/step-000002"], 0, "step-000002: DAMAGED: its manifest.json is an array, not an object",
         LIST([1, 2])),
    Case("ckpt-manifest-null", ["ckpt", "{tmp}/ck"], 0, "its manifest.json is null, not an object", LIST("null")),
    Case("ckpt-manifest-not-utf8", ["ckpt", "{tmp}/ck"], 0, "its manifest.json is not valid JSON", LIST(b"\xff\xfe{")),
    Case("ckpt-no-files", ["ckpt", "{tmp}/ck"], 0, "its manifest has no 'files' table", LIST(MANIFEST)),
    Case("ckpt-files-array", ["ckpt", "{tmp}/ck"], 0, "its manifest's 'files' is an array, not a table", LIST(MANIFEST | dict(files=[]))),
    Case("ckpt-entry-no-hash", ["ckpt", "{tmp}/ck"], 0, "its manifest's entry for trainer_state.pt lacks bytes or sha256",
         LIST(MANIFEST | dict(files={"trainer_state.pt": dict(bytes=1)}))),
    Case("ckpt-entry-not-table", ["ckpt", "{tmp}/ck"], 0, "its manifest's entry for trainer_state.pt lacks bytes or sha256",
         LIST(MANIFEST | dict(files={"trainer_state.pt": 1}))),
    Case("ckpt-no-trainer-state", ["ckpt", "{tmp}/ck"], 0, "its manifest does not list trainer_state.pt", LIST(MANIFEST | dict(files={}))),
    Case("ckpt-outside", ["ckpt", "{tmp}/ck"], 0, "its manifest names '../../x', outside the checkpoint",
         LIST(MANIFEST | dict(files={"trainer_state.pt": dict(bytes=1, sha256="0"), "../../x": dict(bytes=1, sha256="0")}))),
    Case("ckpt-step-edited", ["ckpt", "{tmp}/ck"], 0, "its manifest says step 8 but the folder is step-000002 (edited or moved?)",
         LIST(MANIFEST | dict(step=8, files={}))),
    Case("ckpt-step-text", ["ckpt", "{tmp}/ck"], 0, "its manifest has step '2', not a whole number",
         LIST(MANIFEST | dict(step="2", files={}))),
    Case("ckpt-state-dict", ["ckpt", "{tmp}/ck"], 0, "its manifest says state_dict 'local', expected sharded or full",
         LIST(MANIFEST | dict(state_dict="local", files={}))),
    Case("train-ckpt-is-file", [*TRAIN, "--ckpt", "{tmp}/f"], 2, "ckpt='", {"f": "x"}),
    Case("train-ckpt-under-file", [*TRAIN, "--ckpt", "{tmp}/f/sub"], 2, "a part of the path is a file, not a folder", {"f": "x"}),
    Case("train-ckpt-symlink-loop", [*TRAIN, "--ckpt", "{tmp}/loop"], 2, "it is a symlink loop"),
    Case("train-ckpt-under-symlink-loop", [*TRAIN, "--ckpt", "{tmp}/loop/sub"], 2, "it is a symlink loop"),
    Case("train-ckpt-dangling-symlink", [*TRAIN, "--ckpt", "{tmp}/dangling"], 2, "it is a symlink to nothing"),
    Case("train-ckpt-read-only", [*TRAIN, "--ckpt", "{tmp}/ro/ck"], 2, "ckpt="),
    # an output folder it cannot write in is refused before any work (plan --export-table was refused after 119 s of planning)
    Case("ckpt-to-full-read-only", ["ckpt", "{tmp}/ck", "--to-full", "{tmp}/ro/full"], 2,
         "--to-full='{tmp}/ro/full' is not allowed: a path in a folder this process can create and write into (it is", {"ck": None}),
    Case("ckpt-to-full-under-file", ["ckpt", "{tmp}/ck", "--to-full", "{tmp}/f/full"], 2, "write into (it is a file, not a folder: ",
         {"f": "x", "ck": None}),
    Case("plan-export-table-read-only", ["plan", "--export-table", "{tmp}/ro/table.json"], 2,
         "--export-table='{tmp}/ro/table.json' is not allowed: a file path that can be written"),
    Case("plan-export-table-under-file", ["plan", "--export-table", "{tmp}/f/table.json"], 2, "A part of its folder path is a file",
         {"f": "x"}),
    Case("train-resume-list-manifest", [*TRAIN, "--ckpt", "{tmp}/ck", "--resume"], 2, "no complete checkpoint in", LIST([1])),
    Case("train-resume-step-edited", [*TRAIN, "--ckpt", "{tmp}/ck", "--resume"], 2, "says step 8 but the folder is step-000002",
         LIST(MANIFEST | dict(step=8, files={}))),
    Case("train-resume-garbage-state", [*TRAIN, "--ckpt", "{tmp}/ck", "--resume"], 2,
         "step-000002/trainer_state.pt does not load with torch.load"),
    Case("train-resume-state-no-rng", [*TRAIN, "--ckpt", "{tmp}/ck", "--resume"], 2, "trainer_state.pt lacks rng"),
    Case("train-resume-state-step", [*TRAIN, "--ckpt", "{tmp}/ck", "--resume"], 2, "trainer_state.pt says step 4, its manifest says 2"),
    Case("train-resume-state-not-dict", [*TRAIN, "--ckpt", "{tmp}/ck", "--resume"], 2, "trainer_state.pt holds list, not a dict"),
    Case("train-resume-model-reshaped", ["train", "--nproc", 2, "--model", "{tmp}/m/config.json", "--ckpt", "{tmp}/ck", "--resume"], 2,
         "written for a model of other parameter shapes (125,248 parameters; --model="),
]
SETUP = {"train-ckpt-symlink-loop": _link("loop", "loop"), "train-ckpt-under-symlink-loop": _link("loop", "loop"),
         "train-ckpt-dangling-symlink": _link("dangling", "nowhere"),
         "train-resume-garbage-state": _resume_setup(state=b"garbage whose hash the manifest was given"),
         "train-resume-state-no-rng": _resume_setup(state=dict(step=2, schedule={})),
         "train-resume-state-step": _resume_setup(state=dict(step=4, schedule={}, rng=[None])),
         "train-resume-state-not-dict": _resume_setup(state=[1, 2]), "train-resume-model-reshaped": _edited_config}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_checkpoint_input(case, tmp_path):
    "Each row ends with its exit code and phrase, never a traceback (`ckpt` prints problems on stdout, `train` refuses on stderr)."
    if case.id in SETUP: SETUP[case.id](tmp_path)
    with read_only(tmp_path / "ro") if case.id.endswith("-read-only") else contextlib.nullcontext():
        code, out, err = run_case(case, tmp_path)
    assert "Traceback" not in out + err, f"{case.id}: a traceback reached the user:\n{err[-2000:]}"
    assert code == case.code, f"{case.id}: exit {code}, expected {case.code}; stderr:\n{err[-2000:]}"
    assert case.phrase.format(tmp=tmp_path) in (out if case.code == 0
                                                else err), f"{case.id}: {case.phrase!r} not in:\n{out[-2000:]}{err[-2000:]}"
    if case.code == 2: assert len(err.strip().splitlines()) == 1 and not list(tmp_path.glob("**/.tmp-*"))


# ---- in process

@pytest.mark.timeout(30)
def test_spec_types_and_read_only(tmp_path):
    from fsdp_kit.checkpoint import CheckpointSpec
    from fsdp_kit.errors import KitError
    for bad, message in ((None, "ckpt=None is not allowed: a folder path"), (3, "ckpt=3 is not allowed: a folder path"),
                         ("", "ckpt='' is not allowed: a folder path")):
        with pytest.raises(KitError, match=message): CheckpointSpec(bad).check()
    with pytest.raises(KitError, match="resume='yes' is not allowed: True or False"): CheckpointSpec(str(tmp_path), resume="yes").check()
    # os.PathLike, parents made
    assert CheckpointSpec(tmp_path / "a" / "b").check().dir == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    assert os.listdir(tmp_path / "a" / "b") == []  # the probe is gone
    with read_only(tmp_path / "ro"):
        with pytest.raises(KitError,
                           match=r"ckpt='.*ro' is not allowed: a folder this process can create and write into \((it is read-only|it is on "
                                 r"a read-only file system)"):
            CheckpointSpec(str(tmp_path / "ro")).check()


@pytest.mark.timeout(30)
def test_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    from fsdp_kit.checkpoint import lock_checkpoint_dir, list_checkpoints, verify, _files
    from fsdp_kit.errors import KitError
    ck = tmp_path / "ck"
    code = (f"import time\nfrom fsdp_kit.checkpoint import lock_checkpoint_dir\nwith lock_checkpoint_dir({str(ck)!r}):\n    print('held', "
            "flush=True)\n    time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert (ck / ".lock").read_text().strip() == str(holder.pid)
        with pytest.raises(KitError) as e:
            with lock_checkpoint_dir(ck): pass
        assert str(e.value) == f"ckpt={str(ck)!r} is in use by another run (pid {holder.pid}): wait for it to finish or use another folder"
    finally:
        holder.kill(); holder.wait(10)
    with lock_checkpoint_dir(ck) as folder:  # the kernel released it when the holder died
        assert folder == ck and (ck / ".lock").read_text().strip() == str(os.getpid())
        folder = fake_checkpoint(ck)
        (folder / ".lock").write_text("1")  # a .lock is never a checkpoint file
        assert ".lock" not in _files(folder) and verify(folder) == []
        assert [c["name"] for c in list_checkpoints(ck)] == ["step-000002"] and list_checkpoints(ck)[0]["ok"]
    with lock_checkpoint_dir(ck): pass  # released on exit


@pytest.mark.timeout(60)
def test_check_resume(tmp_path):
    from fsdp_kit.checkpoint import CheckpointSpec, check_resume, find_checkpoint
    from fsdp_kit.errors import KitError
    from fsdp_kit.train import TrainSpec
    spec = lambda ck: TrainSpec(model="tiny", steps=4, ckpt=CheckpointSpec(str(ck), resume=True)).check()
    good = fake_checkpoint(tmp_path / "good")
    assert check_resume(spec(tmp_path / "good")) == (good, [])
    old = fake_checkpoint(tmp_path / "old")  # written before manifests had model_shape: not refused for it
    m = json.loads((old / "manifest.json").read_text()); del m["model_shape"]
    (old / "manifest.json").write_text(json.dumps(m))
    assert check_resume(spec(tmp_path / "old"))[0] == old
    fake_checkpoint(tmp_path / "other", model_shape=dict(sha256="0", parameters=99))
    with pytest.raises(KitError,
                       match=r"--resume: ckpt=.* holds step-000002, written for a model of other parameter shapes \(99 parameters; "
                             r"model='tiny' now has 125,248\)"):
        check_resume(spec(tmp_path / "other"))
    edited = fake_checkpoint(tmp_path / "edited", step=4)  # `step` edited to 6 and the folder renamed to match one of them
    m = json.loads((edited / "manifest.json").read_text()) | dict(step=6)
    (edited / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KitError, match="its manifest says step 6 but the folder is step-000004"): find_checkpoint(tmp_path / "edited")
    edited.rename(tmp_path / "edited" / "step-000006")  # a consistent name: the trainer state still says 4
    with pytest.raises(KitError, match="trainer_state.pt says step 4, its manifest says 6"): check_resume(spec(tmp_path / "edited"))


@pytest.mark.timeout(10)
def test_disk_full_and_size_limit_are_told_apart():
    import resource
    from fsdp_kit.checkpoint import _write_failure, _error_text
    torch_writer = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 512 vs 448")  # no errno: the limit decides
    assert _write_failure(OSError(errno.ENOSPC, "No space left on device")) == "space" and _write_failure(torch_writer) == "space"
    assert _write_failure(RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")) == "space"
    assert (_write_failure(OSError(errno.EFBIG, "File too large")) == "size"
            and _write_failure(RuntimeError("OSError: [Errno 27] File too large")) == "size")
    assert _write_failure(OSError(errno.EIO, "Input/output error")) == "" and _write_failure(ValueError("x")) == ""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**40, hard))  # a limit no file of this test reaches
    try: assert _write_failure(torch_writer) == "size"
    finally: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    dcp = RuntimeError("CheckpointException ranks:dict_keys([1])\nTraceback: ...\nOSError: [Errno 5] I/O error")
    assert _error_text(dcp) == "OSError: [Errno 5] I/O error"


# ---- two short real runs (2 ranks each)

def vanish_worker(ck:str) -> dict:
    "Save at steps 2 and 4; resume with step-000004 deleted by rank 0 after it was chosen: every rank must fall back to step 2."
    import torch.distributed as dist
    import fsdp_kit.checkpoint as checkpoint
    from fsdp_kit.checkpoint import CheckpointSpec
    from fsdp_kit.train import TrainSpec, train_worker
    from fsdp_kit.spec import StepSpec
    first = train_worker(TrainSpec(model="tiny", steps=4, step=StepSpec(warmup=2), ckpt=CheckpointSpec(ck, save_every=2)))
    real = checkpoint.load_checkpoint
    def load(folder, *args):
        if dist.get_rank() == 0 and Path(folder).name == "step-000004": shutil.rmtree(folder)  # another process deleted it
        dist.barrier()
        return real(folder, *args)
    checkpoint.load_checkpoint = load
    resume = CheckpointSpec(ck, save_every=2, resume=True)
    try: second = train_worker(TrainSpec(model="tiny", steps=6, step=StepSpec(warmup=2), ckpt=resume))
    finally: checkpoint.load_checkpoint = real
    return dict(first=first.losses, second=second.losses, first_step=second.first_step, notes=second.checkpoint["notes"])


@pytest.mark.timeout(120)
def test_checkpoint_vanishing_while_loading_falls_back(tmp_path):
    from fsdp_kit.launch import launch
    r = launch(vanish_worker, str(tmp_path / "ck"), nprocs=2, timeout=60)
    assert r["first_step"] == 2, r
    assert any(n.startswith("step-000004 vanished while loading: could not be read (rank ") and n.endswith("; resumed from step-000002")
               for n in r["notes"]), r["notes"]
    assert r["second"][:2] == r["first"][2:]  # steps 3 and 4 again, bit for bit: the fallback restored everything


def disk_full_worker(ck:str, simulate:bool) -> dict:
    "Save step 2; fill the disk (or make the writer raise ENOSPC); the save of step 4 must end with one KitError on every rank."
    import torch.distributed as dist
    import fsdp_kit.checkpoint as checkpoint
    from fsdp_kit.checkpoint import CheckpointSpec
    from fsdp_kit.errors import KitError
    from fsdp_kit.train import TrainSpec, train_worker
    train_worker(TrainSpec(model="tiny", steps=2, ckpt=CheckpointSpec(ck)))
    if dist.get_rank() == 0 and not simulate:
        with open(Path(ck) / "filler", "wb") as f:  # leave about 100 kB: less than one shard
            f.write(b"\0" * max(0, shutil.disk_usage(ck).free - 100_000))
    real = checkpoint._save_model_optim
    def no_space(*args):
        out = real(*args)
        if dist.get_rank() == 1: raise OSError(errno.ENOSPC, "No space left on device")  # one rank alone fails, after the collective
        return out
    if simulate: checkpoint._save_model_optim = no_space
    dist.barrier()
    try:
        train_worker(TrainSpec(model="tiny", steps=4, ckpt=CheckpointSpec(ck, resume=True)))
        error = None
    except KitError as e: error = str(e)
    finally: checkpoint._save_model_optim = real
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return dict(errors=errors)


@pytest.mark.timeout(120)
def test_disk_full_save_ends_cleanly(tmp_path):
    from fsdp_kit.checkpoint import verify, list_checkpoints
    from fsdp_kit.launch import launch
    ck = tmp_path / "ck"
    ck.mkdir()
    mounted = (os.geteuid() == 0
               and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(ck)], capture_output=True).returncode == 0)
    try:
        r = launch(disk_full_worker, str(ck), not mounted, nprocs=2, timeout=60)
        assert len(set(r["errors"])) == 1 and r["errors"][0], r  # the same one-line error on every rank
        message = r["errors"][0]
        assert (message.startswith(f"no space left on {'tmpfs at ' + str(ck) if mounted else ''}")
                and "for checkpoint step-000004 in ckpt=" in message)
        need = float(message.split("needs about ")[1].split(" MB")[0])
        assert 1.0 < need < 3.0, message  # the step-2 checkpoint's size
        assert [c["name"] for c in list_checkpoints(ck)] == ["step-000002"] and verify(ck / "step-000002") == []
        assert not list(ck.glob(".tmp-*")) and os.readlink(ck / "latest") == "step-000002"
    finally:
        if mounted: subprocess.run(["umount", str(ck)], capture_output=True)


def size_limit_worker(ck:str) -> dict:
    "Save step 2; then, under a 50 kB file-size limit (ulimit -f), the save of step 4 must say it hit the limit."
    # the disk is far from full: the message must not blame it
    import resource
    import torch.distributed as dist
    from fsdp_kit.checkpoint import CheckpointSpec
    from fsdp_kit.errors import KitError
    from fsdp_kit.train import TrainSpec, train_worker
    train_worker(TrainSpec(model="tiny", steps=2, ckpt=CheckpointSpec(ck)))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))  # a shard is larger
    try:
        train_worker(TrainSpec(model="tiny", steps=4, ckpt=CheckpointSpec(ck, resume=True)))
        error = None
    except KitError as e: error = str(e)
    finally: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return dict(errors=errors)


@pytest.mark.timeout(120)
def test_a_file_size_limit_is_not_called_a_full_disk(tmp_path):
    "With 'ulimit -f' set and the disk far from full the save was reported as 'no space left'; now the limit is named."
    from fsdp_kit.checkpoint import list_checkpoints
    from fsdp_kit.launch import launch
    ck = tmp_path / "ck"
    r = launch(size_limit_worker, str(ck), nprocs=2, timeout=60)
    assert len(set(r["errors"])) == 1 and r["errors"][0], r
    message = r["errors"][0]
    assert (message.startswith("a file of checkpoint step-000004 in ckpt=")
            and "outgrew this process's file-size limit (0.1 MB, ulimit -f), not the disk (" in message)
    assert "no space" not in message and [c["name"] for c in list_checkpoints(ck)] == ["step-000002"], message


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    "`train --steps 4 --save-every 2` into a folder: checkpoints step-000002 and step-000004 of one run, which each test below copies."
    from tests.conftest import run_cli
    ck = tmp_path_factory.mktemp("four") / "ck"
    res = run_cli(*TRAIN[:-2], "--quiet", "--steps", 4, "--save-every", 2, "--ckpt", ck)
    assert res.returncode == 0, res.stderr[-2000:]
    return ck


@pytest.mark.timeout(180)
def test_rotation_keeps_the_checkpoint_that_loads(cli, four_steps, tmp_path):
    "Resumed past a damaged newest checkpoint, keep=2 removes the damaged one and keeps the good one."
    # it used to remove the good one and keep the damaged
    ck = tmp_path / "ck"
    shutil.copytree(four_steps, ck, symlinks=True)  # a 4-step run that saved steps 2 and 4
    shard = next((ck / "step-000004" / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # damaged: its manifest's size and hash no longer hold
    res = cli(*TRAIN[:-2], "--steps", 5, "--save-every", 5, "--ckpt", ck, "--resume")  # resumes from step 2, saves step 5 alone
    assert res.returncode == 0 and "skipped step-000004" in res.stderr + res.stdout, res.stderr[-2000:]
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000002", "step-000005"] and os.readlink(ck / "latest") == "step-000005"


@pytest.mark.timeout(240)
def test_a_new_run_never_deletes_another_runs_checkpoints(cli, four_steps, tmp_path):
    """`train --steps 4 --save-every 2` then, without --resume and with another seed, `train --steps 2 --save-every 1` into the same
    folder deleted the first run's step-000004. Now the second run is refused before launch; rotation removes only the saving run's
    own checkpoints (another run's, put beside them, stays); --overwrite-ckpt replaces the other run's once it publishes its first."""
    from fsdp_kit.checkpoint import list_checkpoints, verify
    ck, other = tmp_path / "ck", tmp_path / "other"
    base = ["train", "--nproc", 2, "--model", "tiny", "--quiet"]
    shutil.copytree(four_steps, ck, symlinks=True)  # `train --steps 4 --save-every 2`'s folder
    first = {c["name"]: c["run"] for c in list_checkpoints(ck)}
    assert sorted(first) == ["step-000002", "step-000004"] and len(set(first.values())) == 1 and None not in first.values()
    # refused before launch: the command's main() in this process
    code, _, err = run_case(Case("another-run", [*base, "--steps", 2, "--ckpt", ck, "--save-every", 1, "--seed", 3], 2, ""), tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert "holds 2 checkpoint(s) of another run (step-000002, step-000004)" in err and "--resume" in err and "--overwrite-ckpt" in err
    assert {c["name"]: c["run"] for c in list_checkpoints(ck)} == first and all(verify(ck / n) == [] for n in first)
    # another run's checkpoint beside this run's: resuming this run rotates its own away (keep 2), never the other's
    res = cli(*base, "--steps", 1, "--ckpt", other, "--seed", 5)
    assert res.returncode == 0, res.stderr[-2000:]
    shutil.copytree(other / "step-000001", ck / "step-000001")
    res = cli(*base, "--steps", 8, "--ckpt", ck, "--save-every", 2, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    after = {c["name"]: c["run"] for c in list_checkpoints(ck)}
    assert sorted(after) == ["step-000001", "step-000006", "step-000008"], after
    assert after["step-000006"] == after["step-000008"] == first["step-000004"] and after["step-000001"] != first["step-000004"]
    # --overwrite-ckpt: the earlier runs' checkpoints go when this run publishes its first, and only then
    res = cli(*base, "--steps", 3, "--ckpt", ck, "--save-every", 1, "--seed", 3, "--overwrite-ckpt", "--json", tmp_path / "r.json")
    assert res.returncode == 0, res.stderr[-2000:]
    run = json.loads((tmp_path / "r.json").read_text())["checkpoint"]["run"]
    assert {c["name"]: c["run"] for c in list_checkpoints(ck)} == {"step-000002": run, "step-000003": run}
    assert run not in after.values()
