"""The planner: exact parameter counts from the meta device, predictions beside real runs (forked workers: a QLoRA setting
imports peft and bitsandbytes in them, never in this process), the stored full matrix, GPU plans for large models without real
memory, refusals, and the CLI."""
import json, resource
import pytest
from fsdp_kit.errors import KitError
from fsdp_kit.plan import PlanSpec, predict_peak, predict_comm, plan_config, count_parameters, units, model_tensors, MODEL_PRESETS
from fsdp_kit.plan_validate import validate
from fsdp_kit.plan_gpu import plan_gpu, recommend, published_table, GB
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def test_parameter_counts_exact():
    "Counts from meta-device models equal the published sizes of these architectures."
    assert count_parameters("llama-2-7b") == 6_738_415_616
    assert count_parameters("llama-3-8b") == 8_030_261_248
    assert count_parameters("mistral-7b") == 7_241_732_096
    assert len(MODEL_PRESETS) >= 8


def test_unknown_model_refused():
    with pytest.raises(KitError) as e: plan_config("llama-9")
    assert "model='llama-9'" in str(e.value) and all(name in str(e.value) for name in MODEL_PRESETS)


def test_predictions_beside_real_runs():
    "Five settings on 2 ranks in one launch (each checkpointing policy among them): totals within 5%, collective bytes exact."
    specs = [PlanSpec("small", 2, reshard_after_forward=False), PlanSpec("tiny", 2, activation_checkpointing=True), PlanSpec("tiny", 2, method="lora"),
             PlanSpec("tiny", 2, ac="selective-layer:2"), PlanSpec("tiny", 2, mixed_precision="bf16", ac="selective-op")]
    result = validate(specs, launcher="notebook", timeout=120)
    assert [r["config"]["label"] for r in result["runs"]] == [s.label() for s in specs]
    for r in result["runs"]:
        assert abs(r["predicted_bytes"] - r["measured_bytes"]) <= 0.05 * r["measured_bytes"], r
        assert r["predicted_comm_bytes"] == r["measured_comm_bytes"] > 0, r
        assert r["predicted_comm"] == r["measured_comm"], r


def test_stored_matrix_matches_planner():
    "The stored `plan --validate --nproc 4` result: 20+ settings within 5%, comm exact, and its predictions are today's."
    stored = json.loads((ROOT / "examples" / "plan" / "validation.json").read_text())
    assert len(stored["runs"]) >= 20 and stored["comm_exact"]
    assert {r["config"]["world_size"] for r in stored["runs"]} == {1, 2, 4}
    assert {r["config"]["method"] for r in stored["runs"]} == {"full", "lora", "qlora"}
    policies = {PlanSpec(**{k: v for k, v in r["config"].items() if k != "label"}).policy_ac for r in stored["runs"]}
    assert policies == {"none", "full", "selective-layer:2", "selective-op"}  # every kind of activation checkpointing, measured
    for r in stored["runs"]:
        spec = PlanSpec(**{k: v for k, v in r["config"].items() if k != "label"})
        config = plan_config(spec.model)
        assert predict_peak(config, spec)[1]["total"] == r["predicted_bytes"], r["config"]["label"]
        comm = predict_comm(config, spec)
        assert sum(comm.get(k, {}).get("bytes", 0) for k in ("all_gather", "reduce_scatter")) == r["predicted_comm_bytes"]
        assert abs(r["error"]) < 0.05, r["config"]["label"]


def test_units_follow_the_wrap_plan():
    "Per-layer units hold each layer's parameters; their shards add up to the padded model."
    config = plan_config("small")
    spec = PlanSpec("small", 4)
    us = units(model_tensors(config, spec), spec)
    assert list(us)[0] == "root" and len(us) == 1 + config.num_hidden_layers
    assert sum(u.sharded for u in us.values()) * 4 == sum(t.padded_numel(4) * 4 for t in model_tensors(config, spec))


def test_70b_plan_uses_no_real_memory():
    "A 70B QLoRA plan from meta-device shapes: breakdown adds up, fits as the numbers say, and the process stays small."
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    p = plan_gpu("llama-2-70b", gpus=2, gpu_mem_gb=24, method="qlora", batch=2, seq_len=2048, grad_ckpt=True, offload=True)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 1024, grown_mb
    assert p.parameters == 68_976_648_192
    assert sum(p.breakdown.values()) == p.per_gpu_peak_bytes and p.fits == (p.per_gpu_peak_bytes <= 24 * GB)
    assert p.breakdown["quant_state"] > 0 and "sharded_params" not in p.breakdown and p.host_bytes > 0
    no_offload = plan_gpu("llama-2-70b", gpus=2, gpu_mem_gb=24, method="qlora", batch=2, seq_len=2048, grad_ckpt=True)
    assert no_offload.per_gpu_peak_bytes > p.per_gpu_peak_bytes and no_offload.host_bytes == 0
    more_gpus = plan_gpu("llama-2-70b", gpus=8, gpu_mem_gb=24, method="qlora", batch=2, seq_len=2048, grad_ckpt=True)
    assert more_gpus.breakdown["sharded_params"] * 4 == pytest.approx(no_offload.breakdown["sharded_params"], rel=1e-3)


def test_recommend_fits_and_explains():
    r = recommend("llama-2-7b", gpus=2, gpu_mem_gb=40, method="full", batch=2, seq_len=2048)
    assert r["fits"] and r["plan"]["fits"] and r["plan"]["per_gpu_peak_bytes"] <= 40 * GB
    assert r["fitting"] <= r["candidates"] and any("chosen" in line for line in r["explanation"])
    none = recommend("llama-2-70b", gpus=1, gpu_mem_gb=8, method="full", seq_len=2048)
    assert not none["fits"] and "nothing fits" in none["explanation"]


def test_recommend_says_which_criterion_decided():
    "A tie in bytes names the criterion that broke it; a batch at the top of the search is not called the best that fits."
    lines = recommend("llama-3-8b", gpus=8, gpu_mem_gb=80, method="lora", batch=8, seq_len=2048)["explanation"]
    ckpt = next(l for l in lines if l.startswith("activation checkpointing=False"))
    assert "the same bytes; without checkpointing wins the tie" in ckpt
    reshard = next(l for l in lines if l.startswith("reshard_after_forward="))
    assert "on 1 GPU nothing is gathered" in reshard and "(2 vs 2)" not in reshard
    assert lines[-1].startswith("batch 2 per GPU: the largest that fits with these settings")  # batch 8 fits only with checkpointing
    top = recommend("llama-3-8b", gpus=2, gpu_mem_gb=80, method="full", batch=2, seq_len=4096)["explanation"]
    assert top[-1].startswith("batch 2 per GPU, the largest searched") and "but offloading copies" in top[2] and "1 GPUs" not in "".join(top)


def test_bad_settings_refused():
    for kwargs, field in ((dict(method="sft"), "method"), (dict(gpus=0), "gpus"), (dict(gpus=4, cp=3), "cp"), (dict(mixed_precision="fp8"), "mixed_precision"),
                          (dict(gpu_mem_gb=0), "gpu_mem_gb"), (dict(base_dtype="int8"), "base_dtype"), (dict(ac="selective"), "ac"),
                          (dict(ac="selective-op", grad_ckpt=True), "ac"), (dict(ac="selective-layer:2", method="qlora"), "ac")):
        with pytest.raises(KitError, match=field): plan_gpu("llama-2-7b", **kwargs)


def test_published_rows_explained():
    rows = published_table()
    assert len(rows) >= 4 and all(r["source"].startswith("https://") for r in rows)
    assert all(r["miss"] for r in rows if abs(r["error"]) > 0.15)


def test_cli(cli, tmp_path):
    from tests.badinput import Case, run_case, refused
    out = tmp_path / "models.json"
    code, _, err = run_case(Case("list-models", ["plan", "--list-models", "--json", out], 0, ""), tmp_path)  # in this process
    assert code == 0, err
    models = {m["name"]: m["parameters"] for m in json.loads(out.read_text())["models"]}
    assert models["llama-2-7b"] == 6_738_415_616 and len(models) >= 8
    out = tmp_path / "plan.json"  # the installed command, in a process of its own
    r = cli("plan", "--model", "llama-3-8b", "--gpus", "4", "--gpu-mem-gb", "24", "--method", "lora", "--grad-ckpt", "--json", out, timeout=120)
    assert r.returncode == 0, r.stderr
    p = json.loads(out.read_text())
    assert p == json.loads(json.dumps(vars(plan_gpu("llama-3-8b", gpus=4, gpu_mem_gb=24, method="lora", grad_ckpt=True))))
    refused(["plan", "--model", "llama-9"], "llama-2-7b", tmp_path)


def test_checkpointing_policies_order_the_plan():
    "On a GPU plan (the 8B shape torchtitan publishes, batch 2 x 8192): activations fall from none through selective-op and every 2nd layer to full, and the plan names its policy."
    kw = dict(gpus=8, gpu_mem_gb=96, batch=2, seq_len=8192)
    plans = {ac: plan_gpu("llama-3-8b", ac=ac, **kw) for ac in ("none", "selective-layer:2", "selective-op", "full")}
    act = {ac: p.breakdown.get("activations", 0) for ac, p in plans.items()}
    assert act["full"] < act["selective-op"] < act["selective-layer:2"] < act["none"], act
    assert plans["full"].breakdown == plan_gpu("llama-3-8b", grad_ckpt=True, **kw).breakdown  # --grad-ckpt is the policy full
    assert [p.settings["ac"] for p in plans.values()] == list(plans)
