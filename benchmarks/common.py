"""What every benchmark script shares: where the checkout is, a logged subprocess, the machine's description and the bootstrap
interval of a median. `run.py` and `step_cost.py` both import from here, so neither imports the other back."""
import datetime, os, platform, random, statistics, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict:
    "What the numbers were measured on."
    import torch
    cpu = (next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")),
                platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor())
    mem = (next((int(l.split()[1]) // 1024 // 1024 for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")),
                None) if Path("/proc/meminfo").exists() else None)
    return dict(cpu=cpu, cores=os.cpu_count(), memory_gib=mem, python=platform.python_version(), torch=torch.__version__,
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, date=datetime.date.today().isoformat())


def run(cmd, **kw):
    "Run `cmd` in the checkout; its output, or a RuntimeError with the end of its stderr."
    cmd = [str(c) for c in cmd]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)
    if out.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{out.stderr[-3000:]}")
    return out


def median_ci(values, level=0.95, draws=2000, seed=0) -> list:
    "A bootstrap confidence interval for the median of `values` (resampled with a fixed seed, so the same values give the same interval)."
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return [meds[int(draws * (1 - level) / 2)], meds[int(draws * (1 + level) / 2) - 1]]
