"""The command line: env, and the tour (the kit's main job on its defaults)."""
import json, re
import pytest

pytestmark = pytest.mark.timeout(480)


def test_env_json(tmp_path):
    "In this process: the command's main()."
    from tests.badinput import Case, run_case
    code, out, err = run_case(Case("env", ["env", "--json"], 0, ""), tmp_path)
    assert code == 0, err
    env = json.loads(out)
    assert env["backend"] in ("gloo", "nccl") and env["versions"]["transformers"]


def test_tour_writes_figures_and_json(cli, tmp_path):
    out = cli("tour", "--out", tmp_path / "tour", timeout=420)
    assert out.returncode == 0, out.stderr
    files = {p.name for p in (tmp_path / "tour").iterdir()}
    assert {"report.json", "summary.md", "train.png", "mesh.png", "train.json"} <= files
    report = json.loads((tmp_path / "tour" / "report.json").read_text())
    assert report["mesh"]["data"]["grid"] == [[0, 1], [2, 3]]
    train = report["train"]["data"]
    assert train["losses"][-1] < train["losses"][0] and train["max_param_diff"] <= 1e-4
    assert (tmp_path / "tour" / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    qlora = report["qlora"]["data"]
    assert "qlora.png" in files and qlora["losses"][-1] < qlora["losses"][0] and qlora["sharded_vs_unsharded_loss_diff"] < 3e-3
    assert all(q < b for q, b in zip(qlora["peak_bytes"]["qlora"], qlora["peak_bytes"]["bf16_lora"]))
    # the wrap lab's trade-offs, from the tour's compare step (the same CompareSpec `fsdp-kit compare` runs by default)
    from fsdp_kit.config import POLICIES
    runs = report["compare"]["data"]["runs"]
    assert len(runs) == 8 and {r["policy"] for r in runs} == set(POLICIES) and "compare.png" in files
    get = {(r["policy"], r["reshard_after_forward"]): r for r in runs}
    layer_t, layer_f, nowrap = get["TRANSFORMER_BASED_WRAP", True], get["TRANSFORMER_BASED_WRAP", False], get["NO_WRAP", True]
    # NO_WRAP's root keeps the layers; keep-all keeps everything
    assert layer_t["peak_bytes"]["total"] < nowrap["peak_bytes"]["total"] < layer_f["peak_bytes"]["total"]
    # 4 layers and the embeddings gather again for backward
    assert layer_t["collectives"]["all_gather"]["count"] == layer_f["collectives"]["all_gather"]["count"] + 5
    assert get["PER_LINEAR", True]["collectives"]["reduce_scatter"]["count"] > layer_t["collectives"]["reduce_scatter"]["count"]
    assert [u["module"] for u in layer_t["units"]] == [f"model.layers.{i}" for i in (3, 2, 1, 0)] + [
        "model.embed_tokens", "model.norm+lm_head", ""]
    assert all(r["world_size"] == 2 and r["step_seconds"] > 0 for r in runs)
    cp = report["cp_eval"]["data"]
    assert cp["cp_size"] == 2 and abs(cp["eval_loss"] - cp["eval_loss_reference"]) < 1e-5 and cp["predictions_match_reference"]
    assert report["checkpoint"]["data"]["bit_identical"] is True
    hf = report["hf_trainer"]["data"]  # an unmodified Trainer through accelerate's FSDP branch, opened on CPU
    assert (hf["sharded"] and hf["param_type"] == "DTensor" and hf["load_check"]["max_weight_diff"] == 0
            and hf["parity"]["max_loss_diff"] < 1e-5)
    # the units accelerate made, made by apply_fsdp too
    assert "the kit's recipe on the same file: the same units True, loss diff" in out.stderr
    doctor = {c["name"]: c["status"] for c in report["doctor"]["data"]["checks"]}  # the seeds' QLoRA YAML through accelerate launch
    assert [k for k, v in doctor.items() if v == "FAIL"] == ["fsdp_version", "quant_storage", "saving"] and len(doctor) == 12
    assert "FAIL: fsdp_version, quant_storage, saving" in out.stdout
    # one stream each: the ten results on stdout (so `fsdp-kit tour > log` keeps them all), the progress of every step on stderr
    assert [l.split(" ", 2)[:2] for l in out.stdout.splitlines() if l.startswith("[")] == [
        [f"[{i}/10]", n] for i, n in enumerate(report, 1)]
    assert [l for l in out.stderr.splitlines() if re.match(r"\[\d+/10\] ", l)] == [f"[{i}/10] {n} ..." for i, n in enumerate(report, 1)]
    # the steps that share one launch each print their result as they end, not all at once after the launch
    lines = out.stderr.splitlines()
    for i, (name, start) in enumerate([("train", "tiny Llama"), ("compare", "small Llama"), ("qlora", "LoRA on a 4-bit"),
                                       ("cp_eval", "context-parallel eval"), ("checkpoint", "sharded checkpoint"),
                                       ("hf_trainer", "unmodified Trainer")], 3):
        after = lines[lines.index(f"[{i}/10] {name} ..."):]
        result = next(k for k, l in enumerate(after) if l.startswith("      "))
        assert (after[result].startswith(f"      {start}")
                and not any(l.startswith(f"[{i + 1}/10]") for l in after[:result])), after[:result + 1]


def test_no_subcommand_is_a_usage_error(cli):
    out = cli(timeout=60)
    assert out.returncode == 2 and "usage: fsdp-kit" in out.stderr
