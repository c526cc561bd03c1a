import os, sys, tempfile
from pathlib import Path
import pytest

# every temporary folder of this session (ours, torch's, torchrun's, the workers') under one fresh root, so that
# tests/test_zz_leftovers.py can check that nothing the kit made was left behind
SESSION_TMP = Path(tempfile.mkdtemp(prefix="fsdp_kit_tests_"))
os.environ["TMPDIR"] = str(SESSION_TMP)
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

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
