"""The benchmark's own parts: its baseline trains the same numbers as the kit, its statistics, FLOP counts and summary are right,
and the published results cover every notebook."""
import json, os, subprocess, sys
import pytest
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import run as bench  # benchmarks/run.py
import common  # benchmarks/common.py

pytestmark = pytest.mark.timeout(240)


def test_plain_loop_trains_the_same_numbers_as_the_kit(tmp_path):
    "The baseline does the same work as fsdp-kit train (its worker, forked here)."
    # same model, data, AdamW and sharding give the same losses.
    from dataclasses import asdict
    from fsdp_kit.launch import launch
    from fsdp_kit.train import TrainSpec, train_worker
    kit = asdict(launch(train_worker, TrainSpec(model="tiny", steps=3, batch=2, seq_len=32), nprocs=2))
    # bare torchrun's log folder
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "benchmarks/plain_fsdp.py",
                            "--model", "tiny", "--steps", "3", "--batch", "2", "--seq-len", "32", "--out", str(tmp_path / "plain.json")],
                           cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert plain.returncode == 0, plain.stderr
    base = json.loads((tmp_path / "plain.json").read_text())
    assert len(base["losses"]) == 3 and base["losses"][-1] < base["losses"][0]
    assert kit["losses"] == pytest.approx(base["losses"], abs=1e-6)
    assert kit["step_seconds"] > 0 and kit["tokens_per_second"] == pytest.approx(2 * 2 * 32 / kit["step_seconds"])


@pytest.mark.parametrize("layout", ["layers", "accelerate"])
def test_plain_loop_units_are_the_kits(layout):
    "plain_fsdp.py's hand-written units are apply_fsdp's: per layer and the root (edge_units=False), or accelerate's (the default)."
    import plain_fsdp
    from fsdp_kit.config import FSDPConfig
    from fsdp_kit.models import model_config, build_model
    from fsdp_kit.wrap import plan_units
    meta = build_model(model_config(str(ROOT / "benchmarks" / "llama-4x256.json")), device="meta")
    plain = [("+".join(name for name, _ in group), reshard) for group, reshard in plain_fsdp.units(meta, layout)]
    kit = [(u.module, u.reshard_after_forward) for u in plan_units(meta, FSDPConfig(), edge_units=layout == "accelerate")]
    assert sorted(plain) == sorted(kit) and plain[-1] == kit[-1] == ("", layout == "layers")  # the same units (in any order), the root last
    assert len(kit) == {"layers": 5, "accelerate": 7}[layout]


def test_median_ci():
    values = [0.9, 1.0, 1.1, 0.95, 1.05, 1.2, 0.8]
    lo, hi = common.median_ci(values)
    assert min(values) <= lo <= 1.0 <= hi <= max(values)
    assert common.median_ci(values) == [lo, hi]  # seeded: the same values give the same interval
    assert common.median_ci([1.5] * 5) == [1.5, 1.5]


def _script_imports(path) -> set:
    "The benchmarks/ scripts that `path` imports, at any depth (a function's own import counts)."
    import ast
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import): found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module: found.add(node.module.split(".")[0])
    return found & scripts - {path.stem}


def _cycles(graph: dict) -> list:
    "Every import cycle of `graph` ({script: scripts it imports}), each as the path that closes it."
    cycles, state = [], {}
    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open": cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state: visit(dep, path + [dep])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state: visit(node, [node])
    return cycles


def test_no_import_cycle_in_benchmarks():
    "No script under benchmarks/ imports one that imports it back, directly or through others (the shared helpers live in common.py)."
    graph = {p.stem: _script_imports(p) for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    assert graph["step_cost"] >= {"common"} and "run" not in graph["step_cost"] and "step_cost" in graph["run"]
    assert _cycles(graph) == []
    assert _cycles(dict(run={"step_cost"}, step_cost={"common", "run"}, common=set())) == [["run", "step_cost", "run"]]


def test_flops_per_token_and_peaks():
    per_token, n = bench.flops_per_token(str(ROOT / "benchmarks" / "llama-1b.json"), 2048)
    assert n == 1_100_048_384  # TinyLlama-1.1B's shape
    assert per_token == 6 * n + 12 * 22 * 2048 * 2048
    assert bench.peak_flops("NVIDIA H200") == 989e12 and bench.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert bench.peak_flops("Tesla T4") is None


def test_summary_marks_each_target():
    rows = bench.summary(dict(train=dict(throughput_ratio=0.98, throughput_ratio_ci95=[0.96, 1.01], target=0.99),
                              layout=dict(ratio=1.05, ratio_ci95=[1.0, 1.1]), same_window=dict(ratio=1.004, ratio_ci95=[0.99, 1.01]),
                              launch=dict(first_collective_ratio_script=0.5, first_collective_ratio_notebook=1.2, exit_ratio_script=0.6),
                              labs=dict(nbval_seconds={"a.ipynb": 30.0, "b.ipynb": 130.0}, nbval_total_seconds=160.0)))
    met = {name: row["met"] for name, row in rows.items()}
    assert met["train throughput, kit / plain loop, same units (alternating)"] is False  # a floor: 0.98 < 0.99
    assert rows["train throughput, kit / plain loop, same units (alternating)"]["at_least"] is True
    assert met["train step, accelerate's units / per layer (plain loop)"] is None  # shown, no target
    assert met["train step, kit / plain (same window, step by step)"] is True
    assert met["first collective, launch() in a notebook kernel / torchrun"] is False
    assert met["slowest notebook under nbval, seconds"] is False and met["all notebooks under nbval, seconds"] is True


def test_nbtimes_clocks_each_notebook(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--nbval-lax", "-p", "no:cacheprovider", "-p", "nbtimes",
                          "nbs/10b_errors.ipynb"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "benchmarks"), "NBTIMES_OUT": str(tmp_path / "nb.json")})
    assert out.returncode == 0, out.stdout[-2000:]
    times = json.loads((tmp_path / "nb.json").read_text())
    assert list(times) == ["10b_errors.ipynb"] and 0 < times["10b_errors.ipynb"] < 120


def _runs_code(notebook) -> bool:
    "Whether nbval has a cell of `notebook` to run (a page of prose alone, such as command_line, has none to time)."
    return any(c["cell_type"] == "code" for c in json.loads(notebook.read_text())["cells"])


def test_published_results_cover_the_kit():
    "examples/benchmarks/results.json, which the docs show, has the machine, every ratio, and every notebook's time."
    results = json.loads((ROOT / "examples" / "benchmarks" / "results.json").read_text())
    assert {"cpu", "cores", "memory_gib", "torch", "gpu", "date"} <= set(results["machine"])
    for key in ("train", "layout", "same_window", "launch", "overhead"):
        assert "error" not in results[key], results[key]
    assert len(results["train"]["ratios"]) >= 6 and len(results["same_window"]["ratios"]) >= 100
    assert results["train"]["layout"] == "accelerate" and results["train"]["throughput_ratio"] >= 0.99  # the kit's own cost, same units
    lay = results["layout"]
    assert len(lay["ratios"]) >= 6 and len(lay["load_averages"]) == len(lay["ratios"])  # the machine's load, recorded with each pair
    assert lay["layouts"]["accelerate"]["all_gathers_per_step"] > lay["layouts"]["layers"]["all_gathers_per_step"]
    assert sorted(results["labs"]["nbval_seconds"]) == sorted(p.name for p in (ROOT / "nbs").glob("*.ipynb") if _runs_code(p))
    assert all(row.get("ratio", row.get("value")) is not None for row in results["summary"].values())


def test_train_refuses_an_unknown_mixed_precision(tmp_path):
    from tests.badinput import refused
    refused(["train", "--nproc", 2, "--mixed-precision", "fp8"], "--mixed-precision='fp8' is not allowed: one of no, bf16, fp16", tmp_path)
