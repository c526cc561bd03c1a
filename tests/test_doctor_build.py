"""`fsdp-kit doctor --gpus N`'s full-size build: your model prepared by accelerate's own FSDP2 code on N fake ranks, in a process of its
own. PASS with its numbers; FAIL with what torch or accelerate refused as they said it: a size threshold that splits Gemma-3-270M's tied
embeddings at its full size (its twin's scaled threshold selects nothing: nbs/12_doctor.ipynb shows both), a parallelism_config whose
sizes do not multiply to N; SKIP where nothing is built. No twin runs here: the three builds run at once, the check reads each."""
from contextlib import ExitStack
import pytest
from fsdp_kit.config import EXAMPLES
from fsdp_kit.doctor import DoctorSpec, building_beside, check_full_scale, not_built

GEMMA = str(EXAMPLES / "doctor" / "gemma-3-270m" / "config.json")  # the checkpoint's config.json: tied, 268,098,176 parameters
pytestmark = pytest.mark.timeout(300)


def spec(fsdp_config:str, model:str=GEMMA, **kw) -> DoctorSpec:
    return DoctorSpec(model=model, fsdp_config=str(EXAMPLES / fsdp_config), gpus=8, gpu_mem_gb=80, timeout=240, **kw)


SETTINGS = dict(healthy=spec("doctor/healthy.yaml"), tied=spec("doctor/size_tied.yaml"),
                mesh=spec("upstream_configs/accelerate_v2_parallelism.yaml", str(EXAMPLES / "configs" / "qwen2-tiny" / "config.json")))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    "Each setting of SETTINGS built on 8 fake ranks, all at once: name -> the build's dict."
    with ExitStack() as stack:
        waits = {k: stack.enter_context(building_beside(s, {}, str(tmp_path_factory.mktemp(k)))) for k, s in SETTINGS.items()}
        return {k: wait() for k, wait in waits.items()}


def check(built:dict, name:str, **upstream):
    return check_full_scale(dict(full_scale=built[name], spec=SETTINGS[name], upstream=upstream))


def test_a_model_that_builds_passes_with_its_numbers(built):
    "The decoder layer class on 8 ranks: 18 layers, the tail holding the tied weight once, the root; rank 0 holds an eighth in fp32."
    c, b = check(built, "healthy"), built["healthy"]
    assert c.status == "PASS", c
    assert c.reason.startswith("268,098,176 parameters prepared by accelerate on 8 fake ranks (dp_shard=8) in "), c.reason
    assert "20 units (18 decoder layers); rank 0 holds parameters 0.134 GB, gradients 0.134 GB, AdamW state 0.268 GB" in c.reason
    assert c.reason.endswith("model.embed_tokens.weight = lm_head.weight: one tensor, in tail"), c.reason
    s = b["states"]  # no padding: every dim 0 divides by 8; AdamW: two fp32 moments and a 4-byte step per tensor (236 of them)
    assert s["sharded_params"] == s["sharded_grads"] == 268_098_176 * 4 // 8 and s["optimizer_state"] == 2 * s["sharded_params"] + 4 * 236
    assert [u["cls"] for u in b["units"] if u["name"] == "tail"] == ["Gemma3TextScaledWordEmbedding"] and b["refused"] is None
    # accelerate's tail (the final norm and the tied embedding) is sharded with reshard_after_forward=False, whatever the file says:
    # between forward and backward every rank holds it whole, in fp32 here (640 + 262,144 x 640 parameters)
    assert b["kept"] == [dict(unit="tail", bytes=(640 + 262_144 * 640) * 4)]
    assert "; after forward the tail keeps its parameters whole: 0.671 GB on every rank; model.embed_tokens" in c.reason


def test_a_size_threshold_that_splits_the_tied_pair_at_full_size_fails(built):
    "accelerate's size rule above 120,000,000 parameters selects embed_tokens, model and the tied lm_head; torch refuses the tail's carve."
    c = check(built, "tied", auto_wrap_policy="SIZE_BASED_WRAP")
    assert c.status == "FAIL" and c.reason.startswith("on 8 ranks your model's prepare is refused: torch ("), c
    assert "TypeError: Invariant encountered: value was None when it should not be (at accelerate's `fully_shard(tail, " in c.reason
    assert ("the wrap policy selects model.embed_tokens (Gemma3TextScaledWordEmbedding, 167,772,160 parameters), model (Gemma3TextModel, "
            "268,098,176 parameters), lm_head (Linear, 167,772,160 parameters)") in c.reason
    assert c.fix.startswith("TRANSFORMER_BASED_WRAP with the decoder layer class") and built["tied"]["units"] == []


def test_a_parallelism_config_that_does_not_divide_the_gpus_fails(built):
    "dp_shard_size 2 x cp_size 2 on 8 GPUs: accelerate's own check of the sizes refuses it, as its Accelerator would on every rank."
    c = check(built, "mesh", auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    assert c.status == "FAIL" and "accelerate (parallelism_config._validate_accelerator" in c.reason, c
    assert "ValueError: ParallelismConfig total_size (4) does not match num_processes (8)" in c.reason
    assert c.fix.startswith("what the error names")


def test_what_is_not_built_says_why():
    "No --gpus, a QLoRA base, a file that runs no FSDP2: nothing is started, and with --gpus the check is a SKIP that says why."
    assert not_built(DoctorSpec(model=GEMMA, fsdp_config="f.yaml"), {}) == "no --gpus given"
    qlora = spec("doctor/healthy.yaml", method="qlora")
    assert not_built(qlora, {}).startswith("a QLoRA base is 4-bit") and not_built(SETTINGS["tied"], dict(fsdp=False))
    assert not_built(spec("f.json"), dict(fsdp_version=1)) == "the file runs FSDP1 (see fsdp_version)"
    assert not not_built(SETTINGS["tied"], dict(fsdp_version=1))  # a YAML runs converted, as `accelerate to-fsdp2` does, like its twin
    with building_beside(qlora, {}, "unused") as wait:
        c = check_full_scale(dict(full_scale=wait(), spec=qlora, upstream={}))
    assert (c.status, c.reason) == ("SKIP", f"not built: {not_built(qlora, {})}")
