"""fsdp_kit.build: the real model sharded by apply_fsdp on fake ranks of the real world size, held to the planner to the byte;
`fsdp-kit plan --build`; what a build or a traced step refuses. LoRA and QLoRA run in a subprocess (peft, bitsandbytes)."""
import json, math, time
from dataclasses import replace
import pytest
from fsdp_kit.config import FSDPConfig
from fsdp_kit.errors import KitError
from fsdp_kit.mesh import MeshSpec
from fsdp_kit.spec import StepSpec
from fsdp_kit.plan import PlanSpec, plan_config, meta_shapes
from fsdp_kit.build import STATES, build, held_row, fake_world, trace_step, traced_record, traced_settings
from tests.badinput import refused, run_case, Case

pytestmark = pytest.mark.timeout(300)
BF16 = FSDPConfig(mixed_precision="bf16")
HELD = [PlanSpec("llama-2-7b", 48, fsdp=BF16), PlanSpec("qwen2-7b", 96, fsdp=replace(BF16, auto_wrap_policy="SIZE_BASED_WRAP")),
        PlanSpec("mistral-7b", 24, fsdp=replace(BF16, reshard_after_forward=False, layout="layers")),
        PlanSpec("llama-2-13b", 200, fsdp=FSDPConfig(), step=StepSpec(precision="pure-bf16"))]


@pytest.mark.parametrize("spec", HELD, ids=[s.label() for s in HELD])
def test_the_planners_bytes_are_the_builds(spec):
    "Per rank and per unit: parameter shards, gradient shards and AdamW's state, planned from shapes and built by torch."
    r = held_row(spec)
    assert r["refused"] is None and r["differ"] == [] and r["built"] == r["planned"]
    assert min(r["built"].values()) > 0 and r["units"] == {"SIZE_BASED_WRAP": 3}.get(spec.config.auto_wrap_policy, r["units"])


def test_the_last_rank_stores_padded_shards_and_adam_keeps_its_own_rows():
    "FSDP2 pads every rank's shard to ceil(rows / world): the last rank stores as much; AdamW's moments follow its real rows."
    spec, world = PlanSpec("llama-2-7b", 48), 48
    first, last = build(spec, rank=0), build(spec, rank=world - 1)
    assert [first.states[k] for k in STATES[:2]] == [last.states[k] for k in STATES[:2]]
    short = 0  # rows the last rank lacks, times the row's elements, for every parameter
    for _, shape in meta_shapes(plan_config("llama-2-7b"))[0]:
        rows = -(-shape[0] // world)
        short += (rows - max(0, shape[0] - (world - 1) * rows)) * math.prod(shape[1:])
    assert first.states["optimizer_state"] - last.states["optimizer_state"] == 2 * 4 * short > 0


def test_hsdp_holds_its_shard_groups_share_and_cp_shards_over_dp_shard_x_cp():
    on64, on16 = build(PlanSpec("llama-2-7b", 64)), build(PlanSpec("llama-2-7b", 16))
    hsdp, cp = build(PlanSpec("llama-2-7b", 64, mesh=MeshSpec(dp_replicate=4))), build(PlanSpec("llama-2-7b", 64, mesh=MeshSpec(cp=8)))
    assert (hsdp.mesh, cp.mesh) == ({"dp_replicate": 4, "dp_shard": 16}, {"dp_shard": 8, "cp": 8})
    assert hsdp.states == on16.states and cp.states == on64.states and len(cp.units) == len(on64.units) == 35


def test_what_torch_refuses_is_reported_as_it_says_it_and_the_world_is_gone():
    import torch.distributed as dist
    b = build(PlanSpec("llama-3-8b", 8, fsdp=FSDPConfig(transformer_layer_cls_to_wrap=["ModuleList"])))
    assert b.refused.startswith("torch (_fsdp_init._validate_module, called from fsdp_kit.wrap.apply_fsdp): ValueError: "
                                "fully_shard does not support containers that do not implement forward")
    assert b.units == [] and sum(b.states.values()) == 0 and len(b.refused) <= 300 and not dist.is_initialized()
    with pytest.raises(KitError, match="3 does not divide it"): build(PlanSpec("llama-3-70b", 64, mesh=MeshSpec(dp_replicate=3)))
    with pytest.raises(KitError, match="rank=8 is not allowed"): build(PlanSpec("llama-2-7b", 8), rank=8)
    with fake_world(4):
        with pytest.raises(KitError, match="already initialised"): build(PlanSpec("llama-2-7b", 4))
    assert not dist.is_initialized()


def test_a_traced_step_is_the_record_and_cp_is_not_traced():
    "The stored traces (TRACED) are what trace_step gives now, to the byte; the kit trains without context parallelism."
    stored = traced_record()
    assert [s.label() for s, _ in stored] == [s.label() for s in traced_settings()]
    spec, t = next((s, t) for s, t in stored if s.label() == "qwen2-7b w64 full layer reshard abf16 s4096")
    now = trace_step(spec)
    assert now.refused is None and now.peak == t.peak and now.sharded_grads == t.sharded_grads == build(spec).states["sharded_grads"]
    with pytest.raises(KitError, match="fsdp-kit train runs no context parallelism"): trace_step(replace(spec, mesh=MeshSpec(cp=2)))


@pytest.mark.timeout(120)
def test_plan_build_70b_on_64_gpus_in_a_minute(cli, tmp_path):
    "The issue's command, in a process of its own: units and per-rank bytes printed, exit 0, under 60 s."
    out, began = tmp_path / "build.json", time.monotonic()
    r = cli("plan", "--model", "llama-3-70b", "--gpus", "64", "--build", "--json", out, timeout=110)
    seconds = time.monotonic() - began
    assert r.returncode == 0 and seconds < 60, (seconds, r.stderr[-2000:])
    assert "layers.0..79 x80" in r.stdout and "per rank: parameters 4.410 GB, gradients 4.410 GB, optimizer state 8.819 GB" in r.stdout
    b = json.loads(out.read_text())
    assert b["states"] == dict(sharded_params=4_409_606_656, sharded_grads=4_409_606_656, optimizer_state=8_819_216_204)
    assert len(b["units"]) == 83 and b["mesh"] == {"dp_shard": 64} and b["refused"] is None


def test_plan_build_hsdp_cp_and_a_config_json_the_kit_does_not_ship(tmp_path):
    "In this process (no peft): --dp-replicate, --cp, and a tied config.json written here, each built and reported."
    config = dict(model_type="llama", vocab_size=1001, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    (tmp_path / "mine").mkdir(); (tmp_path / "mine" / "config.json").write_text(json.dumps(config))
    states = {}
    for name, flags in (("hsdp", ["--model", "llama-3-70b", "--gpus", "64", "--dp-replicate", "2"]),
                        ("cp", ["--model", "llama-3-70b", "--gpus", "64", "--cp", "4"]),
                        ("mine", ["--model", tmp_path / "mine" / "config.json", "--gpus", "24"])):
        code, out, err = run_case(Case(name, ["plan", *flags, "--build", "--json", tmp_path / f"{name}.json"], 0, ""), tmp_path)
        assert code == 0 and "per rank: parameters" in out, err
        states[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert states["hsdp"]["mesh"] == {"dp_replicate": 2, "dp_shard": 32} and states["cp"]["mesh"] == {"dp_shard": 16, "cp": 4}
    assert states["hsdp"]["states"]["sharded_params"] == 2 * states["cp"]["states"]["sharded_params"] == 70_553_706_496 * 4 // 32
    mine = states["mine"]
    assert mine["tied"] == [dict(names=["model.embed_tokens.weight", "lm_head.weight"], unit="tail")]
    assert mine["units"][-1]["sharded_params"] == 42 * 256 * 4 + 11 * 4  # 1,001 rows on 24 ranks: 42 each, padded; the norm's 11


@pytest.mark.timeout(180)
def test_plan_build_lora_builds_and_qlora_is_refused_with_what_bitsandbytes_did(tmp_path):
    "LoRA's adapters are built by peft on the meta device; a 4-bit base cannot be made of fake tensors: exit 1, and why."
    # both commands in turn in one process of their own (peft and bitsandbytes are imported there, never here)
    from tests.badinput import run_apart
    out = tmp_path / "lora.json"
    (code, _, err), (q_code, q_out, q_err) = run_apart([
        ["plan", "--model", "llama-3-8b", "--gpus", "48", "--method", "lora", "--build", "--json", out],
        ["plan", "--model", "llama-3-8b", "--gpus", "8", "--method", "qlora", "--build"]], tmp_path, timeout=170)
    assert code == 0, err[-2000:]
    assert json.loads(out.read_text())["states"] == held_states("llama-3-8b", 48)
    assert q_code == 1 and "the build was refused (exit 1)" in q_err
    assert ("refused: QLoRA's 4-bit base: torch (fake_impls.local_scalar_dense, called from "
            "bitsandbytes.functional.create_dynamic_map): DataDependentOutputException") in q_out


def held_states(model:str, gpus:int) -> dict:
    "plan_gpu's sharded states of `fsdp-kit plan --method lora` on `gpus` GPUs (planned: no peft in this process)."
    from fsdp_kit.plan import LORA
    from fsdp_kit.plan_gpu import plan_gpu
    return plan_gpu(PlanSpec(model, gpus, batch=1, seq_len=2048, fsdp=BF16, lora=LORA), _terms=False).sharded


def test_plan_build_refuses_what_it_cannot_build(tmp_path):
    refused(["plan", "--model", "llama-3-70b", "--gpus", "64", "--dp-replicate", "3", "--build"], "3 does not divide it", tmp_path)
    refused(["plan", "--model", "llama-3-70b", "--gpus", "64", "--dp-replicate", "2"], "1 without --build", tmp_path)
    refused(["plan", "--model", "llama-3-70b", "--gpus", "64", "--build", "--recommend"], "--build is not allowed with --recommend",
            tmp_path)
