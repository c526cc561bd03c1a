"""fsdp_kit benchmarks: the kit against hand-written FSDP2 and bare torchrun, measured side by side.

    python benchmarks/run.py --json benchmarks/results.json

Each comparison alternates its two sides (A, B, A, B, ...) so that machine noise hits both, and reports the
median of the per-pair ratios. Runs in about 6 to 9 minutes on 2 CPU cores. Writes the machine it ran on.
"""
import argparse, datetime, json, os, platform, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict:
    "What the numbers were measured on."
    import torch
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    mem = next((int(l.split()[1]) // 1024 // 1024 for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    return dict(cpu=cpu, cores=os.cpu_count(), memory_gib=mem, python=platform.python_version(), torch=torch.__version__,
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, date=datetime.date.today().isoformat())


def run(cmd, **kw):
    cmd = [str(c) for c in cmd]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)
    if out.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{out.stderr[-3000:]}")
    return out


def bench_train(pairs: int, model="small", batch=4, seq_len=128, steps=30) -> dict:
    "fsdp-kit train against the plain loop, alternating which goes first; ratio of median step times per pair."
    ratios, kit, plain = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        def run_kit():
            run([PY, "-m", "fsdp_kit", "train", "--nproc", "2", "--model", model, "--batch", batch, "--seq-len", seq_len, "--steps", steps,
                 "--json", f"{tmp}/kit.json"])

        def run_plain():
            run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "benchmarks/plain_fsdp.py", "--model", model,
                 "--batch", str(batch), "--seq-len", str(seq_len), "--steps", str(steps), "--out", f"{tmp}/plain.json"],
                env={**os.environ, "OMP_NUM_THREADS": "1"})

        for i in range(pairs):
            for side in ((run_kit, run_plain) if i % 2 == 0 else (run_plain, run_kit)):  # A B, B A, ...: no side always goes first
                side()
            k, p = json.load(open(f"{tmp}/kit.json"))["step_seconds"], json.load(open(f"{tmp}/plain.json"))["step_seconds"]
            kit.append(k); plain.append(p); ratios.append(k / p)
            log(f"train pair {i + 1}/{pairs}: kit {k * 1e3:.1f} ms, plain {p * 1e3:.1f} ms, ratio {k / p:.3f}")
    return dict(model=model, batch=batch, seq_len=seq_len, steps=steps, kit_step_seconds=kit, plain_step_seconds=plain,
                ratios=ratios, ratio=statistics.median(ratios), target=1.02)


SCRIPT = """import json, sys, time
start = float(sys.argv[1])
from fsdp_kit.launch import launch
sys.path.insert(0, "benchmarks")
from first_collective import first_collective
out = launch(first_collective, nprocs=2)
json.dump(dict(first=out["done"] - start), open(sys.argv[2], "w"))
"""

CELL = """import json, time
_start = time.time()
from fsdp_kit.launch import launch
def _first():
    import torch, torch.distributed as dist
    t = torch.ones(1); dist.all_reduce(t)
    return time.time()
_done = launch(_first, nprocs=2)
print(json.dumps(dict(first=_done - _start, exit=time.time() - _start)))
"""


def _torchrun_once(tmp) -> dict:
    start = time.time()
    run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "benchmarks/first_collective.py", f"{tmp}/tr.json"],
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    return dict(first=json.load(open(f"{tmp}/tr.json"))["done"] - start, exit=time.time() - start)


def _script_once(tmp) -> dict:
    start = time.time()
    run([PY, "-c", SCRIPT, str(start), f"{tmp}/sc.json"])
    return dict(first=json.load(open(f"{tmp}/sc.json"))["first"], exit=time.time() - start)


def _notebook_once(kernel) -> dict:
    "Time a launch() cell in a running kernel (the kernel itself is already up, as in a notebook)."
    kernel.execute(CELL)
    out = ""
    while True:
        msg = kernel.get_iopub_msg(timeout=120)
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out += msg["content"]["text"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle" and out:
            break
        if msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
    return json.loads(out.strip().splitlines()[-1])


def bench_launch(repeats: int) -> dict:
    "launch() from a script and from a notebook kernel against bare torchrun: to the first collective, and to exit."
    from jupyter_client.manager import start_new_kernel
    sides = {"torchrun": [], "launch_script": [], "launch_notebook": []}
    with tempfile.TemporaryDirectory() as tmp:
        km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
        try:
            for i in range(repeats):
                sides["torchrun"].append(_torchrun_once(tmp))
                sides["launch_script"].append(_script_once(tmp))
                sides["launch_notebook"].append(_notebook_once(kc))
                log(f"launch round {i + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]['first']:.2f} s" for k, v in sides.items()))
        finally:
            kc.stop_channels(); km.shutdown_kernel(now=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("first", "exit")} for k, v in sides.items()}
    ratio = lambda side, m: statistics.median(a[m] / b[m] for a, b in zip(sides[side], sides["torchrun"]))
    return dict(seconds=med, rounds=sides, first_collective_ratio_script=ratio("launch_script", "first"),
                first_collective_ratio_notebook=ratio("launch_notebook", "first"), exit_ratio_script=ratio("launch_script", "exit"), target=1.1)


def overhead_worker(steps: int):
    "Time plain steps, steps under the memory tracker and steps under the collective counter, interleaved."
    import torch, torch.distributed as dist
    from fsdp_kit.measure import _timeline_tracker, _comm_counter, _quiet_hook_warnings
    from fsdp_kit.models import model_config, build_model, synthetic_tokens, rank_rows
    from fsdp_kit.train import shard_per_layer
    from fsdp_kit.mesh import build_mesh
    model = shard_per_layer(build_model(model_config("small")), build_mesh())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = rank_rows(synthetic_tokens(1024, 8, 128), dist.get_rank(), dist.get_world_size())
    def step():
        model(input_ids=tokens, labels=tokens).loss.backward(); optim.step(); optim.zero_grad()
    step()
    times = {"off": [], "memory": [], "comm": []}
    with _quiet_hook_warnings():
        for _ in range(steps):
            for kind in times:
                mode = {"off": None, "memory": _timeline_tracker(model, optim), "comm": _comm_counter()}[kind]
                start = time.perf_counter()
                if mode is None: step()
                else:
                    with mode: step()
                times[kind].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_overhead(steps: int) -> dict:
    "What observing costs: a step with memory tracking or collective counting on, against off."
    from fsdp_kit.launch import launch
    t = launch(overhead_worker, steps, nprocs=2)
    return dict(step_seconds=t, memory_tracking_ratio=t["memory"] / t["off"], comm_counting_ratio=t["comm"] / t["off"])


def bench_labs() -> dict:
    "Wall time of each notebook under nbval, and of fsdp-kit tour."
    times = {}
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        if nb.name == "11_benchmarks.ipynb":
            continue  # it shows the results this run is producing
        start = time.time()
        run([PY, "-m", "pytest", "-q", "--nbval-lax", "--nbval-cell-timeout=300", "-p", "no:cacheprovider", str(nb)])
        times[nb.name] = round(time.time() - start, 1)
        log(f"nbval {nb.name}: {times[nb.name]} s")
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        run([PY, "-m", "fsdp_kit", "tour", "--out", f"{tmp}/tour"])
    tour = round(time.time() - start, 1)
    log(f"tour: {tour} s")
    return dict(nbval_seconds=times, nbval_total_seconds=round(sum(times.values()), 1), tour_seconds=tour,
                slowest_notebook=max(times, key=times.get), target_per_notebook=120, target_total=600)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="benchmarks/results.json")
    p.add_argument("--pairs", type=int, default=6, help="alternating pairs for the train-step comparison")
    p.add_argument("--repeats", type=int, default=5, help="rounds of the launch comparison")
    p.add_argument("--skip-labs", action="store_true")
    a = p.parse_args()
    start = time.time()
    results = dict(machine=machine())
    steps = [("train", "train step: fsdp-kit train vs a plain fully_shard loop", lambda: bench_train(a.pairs)),
             ("launch", "launch: launch() vs bare torchrun", lambda: bench_launch(a.repeats)),
             ("overhead", "measurement overhead", lambda: bench_overhead(5))]
    if not a.skip_labs:
        steps.append(("labs", "labs under nbval, and the tour", bench_labs))
    for key, title, fn in steps:
        log(title)
        try:
            results[key] = fn()
        except Exception as e:  # keep what was measured; say what failed
            results[key] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
            log(f"{key} failed: {results[key]['error'][:300]}")
    results["gpu"] = dict(available=False, note="no GPU on this machine; the GPU benchmark runs where torch.cuda.is_available()") \
        if results["machine"]["gpu"] is None else dict(available=True, note="GPU benchmark not yet implemented")
    results["seconds"] = round(time.time() - start, 1)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(results, indent=2))
    log(f"wrote {a.json} in {results['seconds']} s: train ratio {results['train'].get('ratio')}, launch first-collective ratio "
        f"{results['launch'].get('first_collective_ratio_script')} (script), {results['launch'].get('first_collective_ratio_notebook')} (notebook)")
    if any("error" in v for v in results.values() if isinstance(v, dict)):
        sys.exit(1)


if __name__ == "__main__":
    main()
