"""fsdp_kit benchmarks: the kit against hand-written FSDP2 and bare torchrun, measured side by side.

    python benchmarks/run.py --json examples/benchmarks/results.json

Each comparison alternates its two sides (A, B, B, A, ...) so that machine noise hits both, and reports the median of
the per-pair ratios with a bootstrap 95% interval. The train step is compared twice, both sides in the same FSDP units:
whole `fsdp-kit train` runs against whole plain-loop runs (`step_cost.py`), and, because a shared machine drifts more
between runs than the kit could add, step by step inside one job (`same_window.py`). What the layout itself costs
(accelerate's units against pytorch/examples') is measured apart, on the plain loop alone
(`step_cost.py`). Where CUDA is available it adds tokens/s and MFU in bf16. Writes the machine it ran on, and a
summary of every ratio against its target. About 9 minutes on 2 CPU cores (4 without --skip-labs' part).
"""
import argparse, json, os, statistics, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import ROOT, PY, log, machine, run, median_ci


def bench_train(pairs: int) -> dict:
    "fsdp-kit train against the plain loop in the same FSDP units (accelerate's, the kit's default), alternating sides (step_cost.py)."
    from step_cost import own_cost
    return own_cost(pairs)


def bench_layout(pairs: int) -> dict:
    "The plain loop in accelerate's units against pytorch/examples' (per layer, then the root): what the layout costs (step_cost.py)."
    from step_cost import layout_cost
    return layout_cost(pairs)


def bench_same_window(rounds: int, model="small", batch=4, seq_len=128) -> dict:
    "The kit's step and the plain loop's alternated step by step in one job (benchmarks/same_window.py)."
    # the per-step cost of the kit alone.
    with tempfile.TemporaryDirectory() as tmp:
        run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "benchmarks/same_window.py", "--model", model,
             "--batch", str(batch), "--seq-len", str(seq_len), "--rounds", str(rounds), "--out", f"{tmp}/sw.json"],
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        out = json.load(open(f"{tmp}/sw.json"))
    out.update(ratio_ci95=median_ci(out["ratios"]), target=1.02, model=model, batch=batch, seq_len=seq_len)
    log(f"same window, {rounds} rounds: kit {out['kit_step_seconds'] * 1e3:.1f} ms, plain {out['plain_step_seconds'] * 1e3:.1f} ms, "
        f"median ratio {out['ratio']:.3f} (95% CI {out['ratio_ci95'][0]:.3f} to {out['ratio_ci95'][1]:.3f})")
    return out


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
                first_collective_ratio_notebook=ratio("launch_notebook", "first"), exit_ratio_script=ratio("launch_script", "exit"),
                target=1.1)


def overhead_worker(steps: int):
    "Time plain steps, steps under the memory tracker and steps under the collective counter, interleaved."
    import torch, torch.distributed as dist
    from fsdp_kit.measure import _timeline_tracker, comm_counter, quiet_hook_warnings
    from fsdp_kit.models import model_config, build_model, synthetic_tokens, rank_rows
    from fsdp_kit.config import FSDPConfig
    from fsdp_kit.wrap import apply_fsdp
    from fsdp_kit.mesh import build_mesh
    model, _ = apply_fsdp(build_model(model_config("small")), FSDPConfig(), build_mesh())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = rank_rows(synthetic_tokens(1024, 8, 128), dist.get_rank(), dist.get_world_size())
    def step():
        model(input_ids=tokens, labels=tokens).loss.backward(); optim.step(); optim.zero_grad()
    step()
    times = {"off": [], "memory": [], "comm": []}
    with quiet_hook_warnings():
        for _ in range(steps):
            for kind in times:
                mode = {"off": None, "memory": _timeline_tracker(model, optim), "comm": comm_counter()}[kind]
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
    "Wall time of each notebook under nbval (one pytest run, as CI does; `nbtimes.py` clocks each notebook), and of fsdp-kit tour."
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        run([PY, "-m", "pytest", "-q", "--nbval-lax", "--nbval-cell-timeout=300", "-p", "no:cacheprovider", "-p", "nbtimes", "nbs/"],
            env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks"), "NBTIMES_OUT": f"{tmp}/nb.json"})
        total = round(time.time() - start, 1)
        times = dict(sorted(json.load(open(f"{tmp}/nb.json")).items()))
        log(f"nbval: {total} s for {len(times)} notebooks, the slowest {max(times, key=times.get)} {max(times.values())} s")
        start = time.time()
        run([PY, "-m", "fsdp_kit", "tour", "--out", f"{tmp}/tour"])
    tour = round(time.time() - start, 1)
    log(f"tour: {tour} s")
    return dict(nbval_seconds=times, nbval_total_seconds=total, tour_seconds=tour, slowest_notebook=max(times, key=times.get),
                target_per_notebook=120, target_total=600)


# dense bf16 tensor-core peak per GPU, from the vendors' data sheets (FLOP/s); MFU is left out for a GPU not listed
PEAK_BF16 = {"H200": 989e12, "H100 SXM": 989e12, "H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12,
             "L40S": 362e12, "L4": 121e12}


def peak_flops(name: str):
    "The bf16 peak of the GPU called `name`, or None."
    return next((v for k, v in PEAK_BF16.items() if k.lower() in name.lower()), None)


def flops_per_token(config_path: str, seq_len: int) -> tuple:
    "(training FLOPs per token, parameters)."
    # 6 x parameters for the matmuls, plus 12 x layers x hidden x sequence for attention (as in PaLM's MFU).
    from fsdp_kit.models import model_config, build_model
    cfg = model_config(config_path)
    n = sum(p.numel() for p in build_model(cfg, device="meta").parameters())  # shapes only: no memory, no random init
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len, n


def bench_gpu(pairs: int = 2, model="benchmarks/llama-1b.json", batch=4, seq_len=2048, steps=20) -> dict:
    "Where CUDA is available: tokens/s and MFU of fsdp-kit train in bf16 against the plain loop, on every GPU of the machine."
    import torch
    gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    per_token, n_params = flops_per_token(model, seq_len)
    peak = peak_flops(name)
    kit, plain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        def run_kit():
            run([PY, "-m", "fsdp_kit", "train", "--nproc", gpus, "--model", model, "--batch", batch, "--seq-len", seq_len, "--steps", steps,
                 "--mixed-precision", "bf16", "--reduce-dtype", "fp32", "--json", f"{tmp}/kit.json"])
            kit.append(json.load(open(f"{tmp}/kit.json"))["tokens_per_second"])

        def run_plain():
            run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), "benchmarks/plain_fsdp.py", "--model",
                 model,
                 "--batch", str(batch), "--seq-len", str(seq_len), "--steps", str(steps), "--bf16", "--out", f"{tmp}/plain.json"])
            plain.append(json.load(open(f"{tmp}/plain.json"))["tokens_per_second"])

        for i in range(pairs):
            for side in ((run_kit, run_plain) if i % 2 == 0 else (run_plain, run_kit)):
                side()
            log(f"gpu pair {i + 1}/{pairs}: kit {kit[-1]:,.0f} tokens/s, plain {plain[-1]:,.0f} tokens/s")
    mfu = (lambda tps: tps * per_token / (gpus * peak)) if peak else (lambda tps: None)
    k, p = statistics.median(kit), statistics.median(plain)
    return dict(device=name, gpus=gpus, model=model, n_params=n_params, batch=batch, seq_len=seq_len, steps=steps, mixed_precision="bf16",
                kit_tokens_per_second=kit, plain_tokens_per_second=plain, kit_mfu=mfu(k), plain_mfu=mfu(p), ratio=p / k,
                peak_flops_per_gpu=peak, flops_per_token=per_token, target=1.02)


def summary(results: dict) -> dict:
    "Each ratio with its target, and whether it was met."
    rows = {}
    def add(name, value, target, ci=None):
        if value is not None: rows[name] = dict(ratio=round(value, 4), target=target, met=value <= target, ci95=ci)
    t, w, l, o, g, lay = (results.get(k, {}) for k in ("train", "same_window", "launch", "overhead", "gpu", "layout"))
    if t.get("throughput_ratio") is not None:  # a throughput: higher is better, so its target is a floor
        rows["train throughput, kit / plain loop, same units (alternating)"] = dict(
            ratio=round(t["throughput_ratio"], 4), target=t["target"], met=t["throughput_ratio"] >= t["target"],
            ci95=t["throughput_ratio_ci95"], at_least=True)
    if lay.get("ratio") is not None:
        rows["train step, accelerate's units / per layer (plain loop)"] = dict(
            ratio=round(lay["ratio"], 4), target=None, met=None, ci95=lay["ratio_ci95"])
    add("train step, kit / plain (same window, step by step)", w.get("ratio"), 1.02, w.get("ratio_ci95"))
    add("first collective, launch() from a script / torchrun", l.get("first_collective_ratio_script"), 1.1)
    add("first collective, launch() in a notebook kernel / torchrun", l.get("first_collective_ratio_notebook"), 1.1)
    add("exit, launch() from a script / torchrun", l.get("exit_ratio_script"), 1.1)
    for k in ("memory_tracking_ratio", "comm_counting_ratio"):
        if k in o:
            rows[f"step with {k.split('_')[0]} {'tracking' if 'memory' in k else 'counting'} on / off"] = dict(
                ratio=round(o[k], 3), target=None, met=None)
    add("GPU step, plain tokens/s / kit tokens/s", g.get("ratio"), 1.02)
    labs = results.get("labs", {})
    if "nbval_seconds" in labs:
        rows["slowest notebook under nbval, seconds"] = dict(value=max(labs["nbval_seconds"].values()), target=120,
                                                             met=max(labs["nbval_seconds"].values()) <= 120)
        rows["all notebooks under nbval, seconds"] = dict(value=labs["nbval_total_seconds"], target=600,
                                                          met=labs["nbval_total_seconds"] <= 600)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="examples/benchmarks/results.json")
    p.add_argument("--pairs", type=int, default=6,
                   help="alternating pairs of fsdp-kit train and the plain loop, and of the two layouts (default 6)")
    p.add_argument("--rounds", type=int, default=100, help="rounds of the same-window step comparison (default 100)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the launch comparison (default 3)")
    p.add_argument("--skip-labs", action="store_true", help="leave out the notebooks under nbval and the tour (about 6 minutes)")
    p.add_argument("--only", help="run only these parts, comma-separated (train, layout, same_window, launch, overhead, gpu, labs), "
                                  "replacing them in an existing --json file and keeping its other parts")
    a = p.parse_args()
    start = time.time()
    results = dict(machine=machine())
    if a.only and Path(a.json).exists():
        results = {**json.loads(Path(a.json).read_text()), "machine": machine()}
    part_seconds = results.setdefault("part_seconds", {})
    import torch
    steps = [("train", f"train step: fsdp-kit train vs a plain fully_shard loop in the same units, {a.pairs} alternating pairs",
              lambda: bench_train(a.pairs)),
             ("layout", f"train step: accelerate's units vs per layer, the plain loop, {a.pairs} alternating pairs",
              lambda: bench_layout(a.pairs)),
             ("same_window", f"train step: the kit's step vs the plain loop's, alternated for {a.rounds} rounds in one job",
              lambda: bench_same_window(a.rounds)),
             ("launch", "launch: launch() vs bare torchrun", lambda: bench_launch(a.repeats)),
             ("overhead", "measurement overhead", lambda: bench_overhead(5))]
    if torch.cuda.is_available():
        steps.append(("gpu", "GPU: tokens/s and MFU in bf16, fsdp-kit train vs the plain loop", bench_gpu))
    else:
        results["gpu"] = dict(available=False,
                              note="no GPU on this machine; the GPU benchmark (bench_gpu) runs where torch.cuda.is_available()")
    if not a.skip_labs:
        steps.append(("labs", "labs: every notebook under nbval, then the tour", bench_labs))
    if a.only:
        wanted = set(a.only.split(","))
        if unknown := wanted - {key for key, _, _ in steps} - {"gpu"}:
            p.error(f"--only {a.only}: unknown part(s) {sorted(unknown)}; "
                    "choose from train, layout, same_window, launch, overhead, gpu, labs")
        steps = [s for s in steps if s[0] in wanted]
    for i, (key, title, fn) in enumerate(steps, 1):
        log(f"[{i}/{len(steps)}] {title}")
        try:
            t0 = time.time()
            results[key] = fn()
            part_seconds[key] = round(time.time() - t0, 1)
        except Exception as e:  # keep what was measured; say what failed
            results[key] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
            log(f"{key} failed: {results[key]['error'][:300]}")
    results["summary"] = summary(results)
    if not a.only: results["seconds"] = round(time.time() - start, 1)  # the whole benchmark; a partial rerun keeps the last full run's
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(results, indent=2))
    log(f"wrote {a.json}; this run took {time.time() - start:.0f} s")
    for name, row in results["summary"].items():
        value = row.get("ratio", row.get("value"))
        bound = ">=" if row.get("at_least") else "<="
        verdict = "" if row["target"] is None else f"  target {bound} {row['target']}: {'met' if row['met'] else 'NOT met'}"
        print(f"  {name:<66} {value}{verdict}")
    if any("error" in v for v in results.values() if isinstance(v, dict)):
        sys.exit(1)


if __name__ == "__main__":
    main()
