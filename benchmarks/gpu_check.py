"""One GPU check: every CUDA path of fsdp_kit in one command, each step with its own time limit and one line of result.

    python benchmarks/gpu_check.py                # on a GPU machine: writes fsdp_kit/examples/gpu/<gpu-name>-<date>.json
    python benchmarks/gpu_check.py --cpu --out check.json     # the same harness on CPU: gloo, tiny model, every step on 2 ranks

Steps: env, train --check-parity (and on 2+ GPUs an HSDP mesh), train with CPU offload (04c_ac's GPU cell: pinned host memory),
qlora (bitsandbytes' CUDA 4-bit kernels, bf16 storage), hf --check (09_hf's GPU cell), hf --run trainer|sft|qlora|native (09a_hf_run's;
native needs 2 GPUs), cp-eval (06_cp's: both rotations on 2+ GPUs), doctor, plan --validate (08b_plan_gpu's numbers). Each step runs
in a process group of its own, is stopped with the whole group when it passes its time limit, and is reported as passed, failed,
timed_out or skipped (with why). Steps run in the order listed, within --budget seconds in all (under 8 minutes on one GPU).
"""
import argparse, datetime, json, math, os, re, signal, subprocess, sys, tempfile, time
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "fsdp_kit" / "examples"
OFFLOAD_CONFIG = dict(version=2, reshard_after_forward=True, cpu_offload=True, auto_wrap_policy="TRANSFORMER_BASED_WRAP")
STATUSES = ("passed", "failed", "timed_out", "skipped")


def plan(cpu: bool, ranks: int) -> list:
    "The steps for this machine, in order: dict(name, argv after `fsdp-kit`, limit_s, needs (packages), ranks (at least), why)."
    size = ["--model", "tiny", "--steps", "2", "--batch", "2", "--seq-len", "32"] if cpu else ["--model", "small", "--steps", "10"]
    hf = lambda run: ["hf", "--run", run, "--fsdp-config", str(EXAMPLES / "fsdp_configs" / HF_CONFIGS[run]), "--steps", "2" if cpu
                      else "10"]
    n = ["--nproc", str(ranks)]
    cp = ["--cp", "2", "--nproc", "2"] if ranks >= 2 else ["--cp", "1", "--nproc", "1"]
    cp_len = ["--seq-len", "64", "--batch", "2"] if cpu else ["--seq-len", "1024"]
    steps = [dict(name="env", argv=["env"], limit_s=60),
             dict(name="train", argv=["train", *n, *size, "--check-parity"], limit_s=150),
             dict(name="plan-validate", argv=["plan", "--validate", *n], limit_s=300),
             dict(name="qlora", argv=["qlora", *n, *size, "--quant-storage", "bfloat16"], limit_s=150, needs=("bitsandbytes",)),
             dict(name="ac-offload", argv=["train", *n, *size, "--fsdp-config", "{offload_config}"], limit_s=150),
             *[dict(name=f"cp-eval-{r}", argv=["cp-eval", *cp, *cp_len, "--rotate", r], limit_s=120) for r in ("allgather", "alltoall")],
             dict(name="hf-check", argv=["hf", "--check", "--fsdp-config", str(EXAMPLES / "fsdp_configs" / HF_CONFIGS["trainer"]), *n],
                  limit_s=150),
             dict(name="hf-trainer", argv=[*hf("trainer"), *n], limit_s=180),
             dict(name="hf-sft", argv=[*hf("sft"), *n], limit_s=240, needs=("trl",)),
             dict(name="hf-qlora", argv=[*hf("qlora"), *n], limit_s=240, needs=("trl", "bitsandbytes")),
             dict(name="hf-native", argv=[*hf("native"), *n], limit_s=180, ranks=2,
                  why="needs 2 GPUs: transformers' DistributedConfig does nothing at world size 1"),
             dict(name="train-hsdp", argv=["train", "--nproc", "2", "--dp-replicate", "2", "--dp-shard", "1", *size, "--check-parity"],
                  limit_s=150, ranks=2, why="an HSDP mesh (2 replicas) needs 2 ranks"),
             dict(name="doctor", argv=["doctor", "--model", str(EXAMPLES / "configs" / "qwen2-tiny"), "--fsdp-config",
                                       str(EXAMPLES / "doctor" / "healthy.yaml"), "--nproc", "2"], limit_s=240)]  # a twin on CPU ranks
    if ranks < 2: steps = [s for s in steps if s["name"] != "cp-eval-alltoall"]  # one rank: cp=1, no rotation to choose
    return steps


HF_CONFIGS = dict(trainer="transformers_fsdp_config.json", native="transformers_fsdp_config.json",
                  sft="accelerate_fsdp_lora.yaml", qlora="accelerate_fsdp_qlora.yaml")


def run_step(step: dict, ranks: int, folder: Path, env: dict, limit_s: float, left_s: float = math.inf) -> dict:
    "Run one step in a process group of its own; stop the group at its time limit. The step's record: status, seconds, its line, its JSON."
    out = dict(name=step["name"], command="fsdp-kit " + " ".join(step["argv"]), limit_s=limit_s, status="skipped", seconds=0.0)
    missing = [p for p in step.get("needs", ()) if find_spec(p) is None]
    if ranks < step.get("ranks", 1): return out | dict(line=f"skipped: {step['why']} ({ranks} here)")
    if missing: return out | dict(line=f"skipped: {', '.join(missing)} not installed")
    if left_s < 5: return out | dict(line="skipped: the run's --budget was spent")
    limit_s = out["limit_s"] = min(limit_s, left_s)
    result, log = folder / f"{step['name']}.json", folder / f"{step['name']}.log"
    argv = [a.replace("{offload_config}", str(folder / "offload.json")) for a in step["argv"]]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "fsdp_kit", *argv, "--json", str(result)], stdout=f, stderr=subprocess.STDOUT,
                                cwd=folder, env=env, start_new_session=True)
        try: rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired: rc = None; stop(proc)
    out["seconds"] = round(time.perf_counter() - start, 1)
    text = log.read_text(errors="replace")
    if rc is None: return out | dict(status="timed_out", line=f"stopped after its {limit_s:g} s limit; last output: {last_line(text)}")
    if rc or not result.exists(): return out | dict(status="failed", line=f"exit {rc}: {last_line(text)}", log_tail=text[-3000:])
    data = json.loads(result.read_text())
    try: line = SUMMARY.get(step["name"].rsplit("-", 1)[0] if step["name"].startswith("cp-eval") else step["name"], lambda d: "done")(data)
    except (KeyError, TypeError, IndexError, ValueError) as e: line = f"done; its JSON did not read as expected ({type(e).__name__}: {e})"
    return out | dict(status="passed", line=line, result=data)


def stop(proc):
    "SIGTERM to the step's whole process group (the command stops torchrun and its workers), SIGKILL if it lingers."
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try: os.killpg(proc.pid, sig)
        except ProcessLookupError: return
        try: proc.wait(timeout=wait); return
        except subprocess.TimeoutExpired: continue


def last_line(text: str) -> str:
    "The last line of a log that says something (a traceback's last line, the command's error)."
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _losses(d) -> str: return f"losses {d['losses'][0]:.4f} -> {d['losses'][-1]:.4f}" if d.get("losses") else "no losses"


def _validate_line(d) -> str:
    line = f"{len(d['runs'])} settings on {d['device']}, largest |error| of the tracked peak {d['max_abs_error'] * 100:.1f}%"
    gpu = [r["gpu"] for r in d["runs"] if r.get("gpu")]
    if gpu:
        line += (f"; allocated within 10%: {sum(abs(g['allocated_error']) <= 0.10 for g in gpu)}/{len(gpu)}, "
                 f"reserved inside the predicted range: {sum(g['reserved_inside'] for g in gpu)}/{len(gpu)}")
    return line


SUMMARY = {  # step -> one line from the JSON its command wrote
    "env": lambda d: (f"{d['device_type']}, backend {d['backend']}, " + (f"{d['gpu_count']} x {d['gpu_name']}" if d["gpu_count"]
                                                                         else "no GPU")
                      + f", torch {d['versions']['torch']}"),
    "train": lambda d: (f"{d['world_size']} ranks, {_losses(d)}, |sharded - one process| {d['max_param_diff']:.1e}, "
                        f"step {d['step_seconds'] * 1e3:.1f} ms, {d['tokens_per_second']:,.0f} tokens/s"),
    "train-hsdp": lambda d: f"{d['mesh']['dp_replicate']} x {d['mesh']['dp_shard']} mesh, {_losses(d)}, |sharded - one process| "
                            f"{d['max_param_diff']:.1e}",
    "ac-offload": lambda d: (f"cpu_offload={d['config']['cpu_offload']}, {d['world_size']} ranks, {_losses(d)}, step "
                             f"{d['step_seconds'] * 1e3:.1f} ms, "
                             f"{d['tokens_per_second']:,.0f} tokens/s"),
    "qlora": lambda d: (f"{d['world_size']} ranks, 4-bit base in {d['quant_storage']}, matmuls in {d['compute_dtype']}, "
                        f"|sharded - one process| loss {d['sharded_vs_unsharded_loss_diff']:.1e}, adapter reload "
                        f"{d['adapter']['reload_loss_diff']:.1e}"),
    "cp-eval": lambda d: (f"{d['world_size']} ranks, cp={d['cp_size']} {d['rotate_method']}, eval_loss |diff| {d['loss_diff']:.1e}, "
                     f"predictions match: {d['predictions_match_reference']}, peak {d['peak_bytes'][0] / 2**20:.1f} MiB, {d['attention']}"),
    "hf-check": lambda d: " | ".join(d["check"][k]["verdict"] for k in ("accelerate", "trainer", "kit")),
    "plan-validate": _validate_line,
    "doctor": lambda d: ", ".join(f"{n} {s}" for s, n in sorted(_count(d).items())),
    **{f"hf-{w}": (lambda d: f"{'FSDP2' if d['sharded'] else 'NOT sharded'}, {d['fsdp_units']} units, {d['param_type']}, "
                             f"{d['world_size']} ranks, {d['distributed_type']}, {_losses(d)}")
                             for w in ("trainer", "sft", "qlora", "native")},
}


def _count(d) -> dict:
    "The doctor's verdicts counted: PASS, WARN, FAIL -> how many."
    out = {}
    for c in d.get("checks", []): out[c["status"]] = out.get(c["status"], 0) + 1
    return out


def device_info(cpu: bool) -> dict:
    "What the record was measured on."
    import torch
    from fsdp_kit.launch import environment
    env = environment()
    info = dict(gpu_name=env["gpu_name"], gpu_count=env["gpu_count"], cpu_count=env["cpu_count"], cuda=torch.version.cuda)
    if not cpu:
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try: info["driver"] = __import__("pynvml").nvmlSystemGetDriverVersion() if find_spec("pynvml") else None
        except Exception: info["driver"] = None  # NVML not initialised or absent: the record carries the CUDA version instead
    return dict(device=info, versions=env["versions"], backend="gloo" if cpu else env["backend"], python=env["python"])


def check(cpu: bool = False, ranks: int = None, only: list = None, limits: dict = None, budget_s: float = 480, say=print) -> dict:
    "Run every step (or `only` these), each within its limit and all within `budget_s`; the record."
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}))
    record = dict(mode="cpu" if cpu else "gpu", date=datetime.date.today().isoformat(),
                  started=datetime.datetime.now().isoformat(timespec="seconds"))
    record |= device_info(cpu)
    ranks = ranks or (2 if cpu else record["device"]["gpu_count"])  # CPU mode: 2 ranks, so that every step runs
    steps = plan(cpu, ranks)
    known = [s["name"] for s in steps]
    for name in [*(only or []), *(limits or {})]:
        if name not in known: raise SystemExit(f"gpu_check: error: step {name!r} is not allowed: one of {', '.join(known)}")
    start, record["steps"] = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        folder = Path(tmp)
        (folder / "offload.json").write_text(json.dumps(OFFLOAD_CONFIG))
        for step in steps:
            if only and step["name"] not in only: continue
            left = budget_s - (time.perf_counter() - start)
            r = run_step(step, ranks, folder, env, (limits or {}).get(step["name"], step["limit_s"]), left)
            say(f"{r['name']:<18}{r['status']:<10}{r['seconds']:>7.1f} s  {r['line']}")
            record["steps"].append(r)
    record |= dict(ranks=ranks, budget_s=budget_s, seconds=round(time.perf_counter() - start, 1))
    return record


def default_out(record: dict) -> Path:
    "examples/gpu/<gpu-name>-<date>.json for a GPU record; the current folder for a CPU-mode one (never shown as GPU numbers)."
    if record["mode"] == "cpu": return Path(f"cpu-mode-{record['date']}.json")
    name = re.sub(r"[^a-z0-9]+", "-", record["device"]["gpu_name"].lower()).strip("-")
    return EXAMPLES / "gpu" / f"{name}-{record['date']}.json"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU mode: gloo, the tiny model, a few steps (the harness's own test)")
    p.add_argument("--nproc", type=int, help="ranks per step (default: every GPU; 2 in CPU mode, where every step then runs)")
    p.add_argument("--only", help="run only these steps, comma-separated")
    p.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="another time limit for one step")
    p.add_argument("--budget", type=float, default=480, help="seconds for all steps together")
    p.add_argument("--out",
                   help="the record's path (default: fsdp_kit/examples/gpu/<gpu-name>-<date>.json; CPU mode: ./cpu-mode-<date>.json)")
    a = p.parse_args(argv)
    if not a.cpu:
        import torch
        if not torch.cuda.is_available(): p.error("--cpu is needed here: no CUDA device on this machine")
    limits = {}
    for item in a.limit:
        name, _, seconds = item.partition("=")
        try: limits[name] = float(seconds)
        except ValueError: p.error(f"--limit={item!r} is not allowed: STEP=SECONDS")
    record = check(a.cpu, a.nproc, a.only.split(",") if a.only else None, limits, a.budget)
    out = Path(a.out) if a.out else default_out(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1).replace(str(ROOT) + "/", "") + "\n")  # paths inside the checkout, relative to it
    counts = {s: sum(r["status"] == s for r in record["steps"]) for s in STATUSES}
    print(f"{', '.join(f'{n} {s}' for s, n in counts.items())} in {record['seconds']:.0f} s; wrote {out}")
    return 1 if counts["failed"] or counts["timed_out"] else 0


if __name__ == "__main__":
    sys.exit(main())
