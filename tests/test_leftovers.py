"""Nothing outlives a command: its temporary folder and every process it started (torchrun's agent and workers, `accelerate launch`,
the TrainingArguments helper) are gone 1 s after it ends, whether it finished or was SIGKILLed. Every `fsdp-kit` run through
`conftest.run_cli` checks the normal end (train, hf --run, qlora, cp-eval, doctor, the tour); here `hf --check` ends normally, and each
command that starts processes is SIGKILLed once its workers run."""
import os, signal, subprocess, sys, time
import psutil, pytest
from tests.conftest import ROOT, left_behind, private_tmp, run_cli

pytestmark = pytest.mark.timeout(240)
CONFIGS = ROOT / "examples" / "fsdp_configs"
JSON = CONFIGS / "transformers_fsdp_config.json"
COMMANDS = {  # the smallest run of each; SIGKILLed once this many processes besides the janitor run under it
    "train": (["train", "--steps", 1000, "--seq-len", 16], 3),
    "hf-run": (["hf", "--fsdp-config", JSON, "--run", "trainer", "--steps", 2, "--batch", 1, "--seq-len", 16], 3),
    "hf-check": (["hf", "--fsdp-config", JSON, "--check"], 3),
    "doctor": (["doctor", "--model", ROOT / "examples" / "configs" / "qwen2-tiny" / "config.json", "--fsdp-config",
                CONFIGS / "accelerate_fsdp_qlora.yaml",
                "--method", "qlora", "--steps", 1], 3),
    "qlora": (["qlora", "--steps", 1000, "--batch", 1, "--seq-len", 16], 3),
    "cp-eval": (["cp-eval", "--seq-len", 8, "--batch", 1], 3),
}


def _tree(pid) -> set:
    try: return {p for p in psutil.Process(pid).children(recursive=True) if "-I" not in p.cmdline()[1:3]}  # not the janitor
    except psutil.Error: return set()


def test_hf_check_leaves_nothing():
    """hf --check reads the file with TrainingArguments in a helper process: it ends with the command, not 2.5 s later. Its progress:
    a line on stderr per path it ran (accelerate, the Trainer, both with accelerate's FSDP branch opened on CPU, the kit)."""
    res = run_cli("hf", "--fsdp-config", JSON, "--check")  # run_cli fails if anything is left 1 s after the end
    assert res.returncode == 0 and "fsdp_kit.wrap.apply_fsdp: FSDP2" in res.stdout, res.stderr[-2000:]
    lines = [l for l in res.stderr.splitlines() if l.startswith("hf --check ")]
    assert [l.split(":")[0] for l in lines] == ["hf --check 1/5 accelerate", "hf --check 2/5 trainer", "hf --check 3/5 accelerate_cpu_fsdp",
                                                "hf --check 4/5 trainer_cpu_fsdp", "hf --check 5/5 kit"], res.stderr[-2000:]
    assert all(" s elapsed, about " in l and l.endswith(" s left") for l in lines) and "hf --check" not in res.stdout


def test_a_failed_hf_run_leaves_nothing():
    """A Trainer run that fails inside its workers (the JSON names LlamaDecoderLayer, the model is a Qwen2) exits 1 naming the cause,
    and leaves no temporary folder and no process 1 s after it ends (run_cli); --quiet prints no progress line."""
    res = run_cli("hf", "--fsdp-config", JSON, "--run", "trainer", "--model", ROOT / "examples" / "configs" / "qwen2-tiny" / "config.json",
                  "--steps", 2, "--batch", 1, "--seq-len", 16, "--quiet")
    assert res.returncode == 1 and "LlamaDecoderLayer" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "hf --run" not in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("name", COMMANDS)
def test_a_sigkilled_command_leaves_nothing(name):
    args, workers = COMMANDS[name]
    tmp = private_tmp()
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_kit", *map(str, args)], cwd=ROOT, env=os.environ | {"TMPDIR": str(tmp)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    seen, start = set(), time.monotonic()
    try:
        while len([p for p in seen if p.is_running()]) < workers:
            assert proc.poll() is None, f"{name} ended before its workers ran: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() - start < 180, f"{name}: no workers after 180 s"
            seen |= _tree(proc.pid)
            time.sleep(0.05)
        seen |= _tree(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # the command alone, as the out-of-memory killer or `kill -9 PID` would
        proc.wait(10)
        left = left_behind(tmp, seen)
    finally:
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"{name}: 1 s after a SIGKILL of the command, {left}"
