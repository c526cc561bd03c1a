import os, sys, tempfile
from pathlib import Path
import pytest

# every temporary folder of this session (ours, torch's, torchrun's, the workers') under one fresh root, a folder per pytest
# process (the xdist workers of `make pytest` inherit the root from the process that started them), so that the end of the
# session can check that nothing the kit made was left behind
TESTS_TMP = Path(os.environ.get("FSDP_KIT_TESTS_TMP") or tempfile.mkdtemp(prefix="fsdp_kit_tests_"))
os.environ["FSDP_KIT_TESTS_TMP"] = str(TESTS_TMP)
SESSION_TMP = TESTS_TMP / os.environ.get("PYTEST_XDIST_WORKER", "main")
SESSION_TMP.mkdir(exist_ok=True)
os.environ["TMPDIR"] = str(SESSION_TMP)
tempfile.tempdir = None  # gettempdir() reads TMPDIR again
assert tempfile.gettempdir() == str(SESSION_TMP)
LEFTOVERS = ("fsdp_kit_run_*", "torchelastic_*", "fsdp_kit_cmd_*")  # a launch's run folder, torchrun's log folder, a command's own

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "configs"


def private_tmp() -> Path:
    "A fresh folder to be one command's TMPDIR, so that what it leaves behind is found (`left_behind`)."
    return Path(tempfile.mkdtemp(prefix="cmd_", dir=SESSION_TMP))


def left_behind(tmp: Path, seen=(), wait: float = 1.0) -> dict:
    """What a command run with TMPDIR=`tmp` left `wait` s after it ended: the entries of `tmp`, and the live processes among `seen`
    (its tree while it ran) and among those whose TMPDIR lies in `tmp` (its descendants, reparented or not); {} when nothing."""
    import psutil, time
    deadline = time.monotonic() + wait
    while True:
        procs = set(seen)
        for p in psutil.process_iter():
            try:
                if p.environ().get("TMPDIR", "").startswith(str(tmp)): procs.add(p)
            except (psutil.Error, OSError): pass
        live = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE: live.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.Error: pass
        left = dict(files=sorted(p.name for p in tmp.iterdir()), processes=live) if tmp.exists() else dict(processes=live)
        left = {k: v for k, v in left.items() if v}
        if not left or time.monotonic() > deadline: return left
        time.sleep(0.05)


def run_cli(*args, timeout=240):
    "Run `fsdp-kit ARGS` in a subprocess, with a TMPDIR of its own."
    # a hang fails after `timeout` seconds, and so does anything left 1 s after it.
    import shutil, subprocess
    tmp = private_tmp()
    res = subprocess.run([sys.executable, "-m", "fsdp_kit", *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT, env=os.environ | {"TMPDIR": str(tmp)})
    left = left_behind(tmp)
    assert not left, f"fsdp-kit {' '.join(map(str, args))[:200]} left behind, 1 s after it ended: {left}"
    shutil.rmtree(tmp)
    return res


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(autouse=True)
def _forkable():
    "Every test leaves this process able to fork workers: peft / bitsandbytes imported here would make later launches refuse."
    yield
    from fsdp_kit.launch import fork_traps
    assert fork_traps() == [], "this test imported peft or bitsandbytes into the test process; do that in a subprocess"


def pytest_sessionfinish(session, exitstatus):
    "Once every test has run (in the process that started the xdist workers, after they are all done)."
    # fail the session if any launch left its folder behind.
    if os.environ.get("PYTEST_XDIST_WORKER"): return
    left = sorted(str(p.relative_to(TESTS_TMP)) for pattern in LEFTOVERS for p in TESTS_TMP.glob(f"*/{pattern}"))
    if left:
        print(f"\nFAILED: launches left their folders behind in {TESTS_TMP}: {left}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
