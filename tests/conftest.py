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
LEFTOVERS = ("fsdp_kit_run_*", "torchelastic_*")  # a launch's run folder, torchrun's log folder

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "configs"


def run_cli(*args, timeout=240):
    "Run `fsdp-kit ARGS` in a subprocess; a hang fails after `timeout` seconds."
    import subprocess
    return subprocess.run([sys.executable, "-m", "fsdp_kit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


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
    "Once every test has run (in the process that started the xdist workers, after they are all done): fail the session if any launch left its folder behind."
    if os.environ.get("PYTEST_XDIST_WORKER"): return
    left = sorted(str(p.relative_to(TESTS_TMP)) for pattern in LEFTOVERS for p in TESTS_TMP.glob(f"*/{pattern}"))
    if left:
        print(f"\nFAILED: launches left their folders behind in {TESTS_TMP}: {left}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# `make pytest` gives each xdist worker whole files (--dist loadfile) in the order collected (--no-loadscope-reorder: xdist would
# otherwise start the files with the most tests first, which put the few long multi-process files last and left one core idle
# while the other finished them). The longest files first, in the order of their measured wall time on 2 cores (pytest's --durations); the rest
# follow in name order and fill in around them. The files whose tests mostly wait (for a rendezvous timeout, a hang's timeout, a
# killed launcher: test_lifecycle, test_launch, test_scale_out) sit between files that compute, so the two workers rarely wait at once.
LONGEST_FIRST = ("test_cli", "test_fsdp_config_runs", "test_hf", "test_lifecycle", "test_checkpoint", "test_doctor", "test_launch",
                 "test_docs", "test_scale_out", "test_doctor_runs", "test_wrap", "test_bad_input", "test_plan", "test_qlora", "test_upstream")


def pytest_collection_modifyitems(items):
    rank = lambda item: LONGEST_FIRST.index(item.path.stem) if item.path.stem in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # a stable sort: the tests of a file keep their order
