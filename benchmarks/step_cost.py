"""What a train step costs, in two parts: the kit's own (fsdp-kit train against the plain loop in the same FSDP units) and the layout's
(the plain loop in pytorch/examples' units, per decoder layer then the root, against accelerate's, which the kit makes by default).

    python benchmarks/step_cost.py --pairs 6 --json step_cost.json

Whole runs, alternating which side goes first (A B, B A, ...), so that a shared machine's drift hits both; each pair gives a ratio of
median step times (the first step, warm-up, left out), and the part reports the median ratio, its bootstrap 95% interval, the spread
(min-max) and the 1-minute load average as each pair ended. The plain runs count the all-gathers of one step and track its peak memory
after their timed loop (benchmarks/plain_fsdp.py). run.py runs both parts as its `train` and `layout` steps.
"""
import argparse, json, os, statistics, sys, tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import PY, run, log, median_ci, machine

MODEL = "benchmarks/llama-4x256.json"  # Llama-shaped: 4 layers, hidden 256, untied embeddings
SHAPE = dict(model=MODEL, batch=4, seq_len=128, steps=30)  # per rank; 2 gloo ranks


def kit_run(tmp:str, layout:str, model:str, batch:int, seq_len:int, steps:int) -> dict:
    "One `fsdp-kit train` run on 2 ranks in `layout`; its JSON result."
    run([PY, "-m", "fsdp_kit", "train", "--nproc", 2, "--model", model, "--batch", batch, "--seq-len", seq_len, "--steps", steps,
         "--layout", layout, "--quiet", "--json", f"{tmp}/kit.json"])
    return json.load(open(f"{tmp}/kit.json"))


def plain_run(tmp:str, layout:str, model:str, batch:int, seq_len:int, steps:int) -> dict:
    "One run of the plain loop (benchmarks/plain_fsdp.py) on 2 ranks in `layout`; its JSON result."
    run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, "benchmarks/plain_fsdp.py", "--model", model,
         "--batch", batch, "--seq-len", seq_len, "--steps", steps, "--layout", layout, "--out", f"{tmp}/plain.json"],
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.load(open(f"{tmp}/plain.json"))


def alternate(pairs:int, sides:dict, name:str) -> dict:
    "Run the two `sides` ({label: fn() -> result}) in alternating order `pairs` times; the first's median step time / the second's."
    (a, run_a), (b, run_b) = sides.items()
    out, ratios, loads = {a: [], b: []}, [], []
    for i in range(pairs):
        for label, fn in ((a, run_a), (b, run_b)) if i % 2 == 0 else ((b, run_b), (a, run_a)):
            out[label].append(fn())
        ratios.append(out[a][-1]["step_seconds"] / out[b][-1]["step_seconds"]); loads.append(os.getloadavg()[0])
        log(f"{name} pair {i + 1}/{pairs}: {a} {out[a][-1]['step_seconds'] * 1e3:.1f} ms, {b} {out[b][-1]['step_seconds'] * 1e3:.1f} ms, "
            f"ratio {ratios[-1]:.3f}, load {loads[-1]:.1f}")
    seconds = {f"{k}_step_seconds": [r["step_seconds"] for r in v] for k, v in out.items()}
    return dict(**seconds, ratios=ratios, ratio=statistics.median(ratios), ratio_ci95=median_ci(ratios), spread=[min(ratios), max(ratios)],
                load_averages=loads, load_average_max=max(loads), cores=os.cpu_count(), runs=out)


def own_cost(pairs:int, layout:str="accelerate", **shape) -> dict:
    "(a) fsdp-kit train against the plain loop, both in `layout`'s units: the kit's own cost (throughput kit / plain, target >= 0.99)."
    shape = {**SHAPE, **shape}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"kit": lambda: kit_run(tmp, layout, **shape), "plain": lambda: plain_run(tmp, layout, **shape)}
        out = alternate(pairs, sides, f"own cost ({layout})")
    runs = out.pop("runs")
    throughput = [1 / r for r in out["ratios"]]
    return dict(**shape, layout=layout, **out, throughput_ratios=throughput, throughput_ratio=statistics.median(throughput),
                throughput_ratio_ci95=median_ci(throughput), kit_tokens_per_second=[r["tokens_per_second"] for r in runs["kit"]],
                plain_tokens_per_second=[r["tokens_per_second"] for r in runs["plain"]], target=0.99)


def layout_cost(pairs:int, **shape) -> dict:
    "(b) the plain loop in accelerate's units against pytorch/examples' (per layer, the root): step time ratio, all-gathers, peak MiB."
    shape = {**SHAPE, **shape}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"accelerate": lambda: plain_run(tmp, "accelerate", **shape), "layers": lambda: plain_run(tmp, "layers", **shape)}
        out = alternate(pairs, sides, "layout cost")
    runs = out.pop("runs")
    per_layout = {k: dict(all_gathers_per_step=v[-1]["all_gathers_per_step"], reduce_scatters_per_step=v[-1]["reduce_scatters_per_step"],
                          peak_mib=round(v[-1]["peak_mib"], 2), step_seconds=statistics.median(r["step_seconds"] for r in v))
                  for k, v in runs.items()}
    return dict(**shape, **out, layouts=per_layout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=6, help="alternating pairs per part (default 6)")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    results = dict(machine=machine(), own=own_cost(a.pairs), layout=layout_cost(a.pairs))
    Path(a.json).write_text(json.dumps(results, indent=2))
    own, acc, per_layer = results["own"], results["layout"]["layouts"]["accelerate"], results["layout"]["layouts"]["layers"]
    print(f"kit / plain throughput, same units: {own['throughput_ratio']:.3f} (spread "
          f"{1 / own['spread'][1]:.3f}-{1 / own['spread'][0]:.3f}); "
          f"accelerate / layers step time: {results['layout']['ratio']:.3f}; all-gathers {acc['all_gathers_per_step']} vs "
          f"{per_layer['all_gathers_per_step']}; peak MiB {acc['peak_mib']} vs {per_layer['peak_mib']}")


if __name__ == "__main__":
    main()
