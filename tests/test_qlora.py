"""QLoRA under FSDP2: packing checked against bitsandbytes itself, the guards, and real runs on 2 ranks.

bitsandbytes and peft are imported only in subprocesses: imported here, they would make every later
`launch(..., launcher="notebook")` in this pytest process refuse to fork.
"""
import json, math, subprocess, sys
import pytest
from fsdp_kit.errors import KitError
from fsdp_kit.qlora import params_per_element, packed_shape, quant_state_bytes, check_quantization, pack_codes, unpack_codes, QLoRASpec
from fsdp_kit.qlora import nf4, lora_fsdp_config
from fsdp_kit.spec import StepSpec
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)

SHAPES = [(64, 64), (32, 64), (176, 64), (64, 176), (3, 5), (5, 3), (7, 7), (2, 3), (33, 17), (1, 1), (10,), (4, 6), (256, 257), (1000, 70)]
STORAGES = ["uint8", "bfloat16", "float16", "float32"]

BNB_PROBE = r"""
import json, sys, torch, bitsandbytes as bnb
shapes, storages = json.loads(sys.argv[1])
out = []
for shape in shapes:
    for storage in storages:
        torch.manual_seed(0)
        weight = torch.randn(shape)
        try:
            p = bnb.nn.Params4bit(weight, requires_grad=False, quant_storage=getattr(torch, storage), compress_statistics=True,
                                  quant_type="nf4")._quantize("cpu")
        except RuntimeError as e:
            out.append(dict(shape=shape, storage=storage, error=str(e)[:200])); continue
        s = p.quant_state
        state = dict(absmax=s.absmax.nbytes, quant_map=s.code.nbytes, nested_absmax=s.state2.absmax.nbytes,
                     nested_quant_map=s.state2.code.nbytes, offset=s.offset.nbytes)
        raw = p.data.reshape(-1).view(torch.uint8)
        nibbles = torch.stack([raw >> 4, raw & 0xF], 1).reshape(-1)
        out.append(dict(shape=shape, storage=storage, stored=list(p.shape), dtype=str(p.dtype), state=state,
                        nibbles=nibbles.tolist(), raw=raw.tolist()))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bnb_storage():
    "What bitsandbytes really stores for each shape and storage dtype, measured in a subprocess."
    proc = subprocess.run([sys.executable, "-c", BNB_PROBE, json.dumps([SHAPES, STORAGES])], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return {(tuple(r["shape"]), r["storage"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def test_params_per_element():
    assert {s: params_per_element(s) for s in STORAGES} == {"uint8": 2, "bfloat16": 4, "float16": 4, "float32": 8}
    assert params_per_element("torch.bfloat16") == 4 and params_per_element("bf16") == 4


@pytest.mark.parametrize("storage", STORAGES)
def test_packed_shape_equals_bitsandbytes(bnb_storage, storage):
    odd_seen = refused_seen = 0
    for shape in SHAPES:
        real = bnb_storage[shape, storage]
        if "error" in real:  # bitsandbytes cannot view these bytes as the storage dtype: packed_shape refuses them too
            with pytest.raises(KitError, match=r"weight_shape=.*quant_storage="):
                packed_shape(shape, storage)
            refused_seen += 1
            continue
        assert list(packed_shape(shape, storage)) == real["stored"], (shape, storage)
        assert real["dtype"] == f"torch.{storage}"
        odd_seen += math.prod(shape) % 2
    assert odd_seen >= 1  # odd code counts, whose last byte is half padding, were compared
    assert refused_seen == (0 if storage == "uint8"
                            else sum(1 for s in SHAPES if ((math.prod(s) + 1) // 2) % (params_per_element(storage) // 2)))


def test_quant_state_bytes_equal_bitsandbytes(bnb_storage):
    for shape in SHAPES:
        assert bnb_storage[shape, "uint8"]["state"] == quant_state_bytes(shape), shape
    assert quant_state_bytes((256, 257))["nested_absmax"] == 4 * 5  # 1028 blocks of 64 -> 5 nested blocks of 256


def test_pack_codes_is_bitsandbytes_layout(bnb_storage):
    import torch
    for shape in [(64, 64), (3, 5), (33, 17)]:
        real = bnb_storage[shape, "uint8"]
        n = math.prod(shape)
        codes = torch.tensor(real["nibbles"][:n])
        assert pack_codes(codes, "uint8").reshape(-1).tolist() == real["raw"]
        assert unpack_codes(pack_codes(codes, "bfloat16" if (n + 1) // 2 % 2 == 0 else "uint8"), n).tolist() == codes.tolist()


def test_module_imports_neither_peft_nor_bitsandbytes():
    code = "import sys, fsdp_kit.qlora; print(sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.stdout.strip() == "[]", proc.stderr


@pytest.mark.parametrize("args, text", [
    (("float32", "bfloat16"), "quant_storage='float32' is not allowed: only param_dtype='bfloat16'"),
    (("bfloat16", "float32"), "quant_storage='bfloat16' is not allowed: only param_dtype='float32'"),
    (("uint8", "bf16"), "quant_storage='uint8' is not allowed: a floating dtype equal to param_dtype='bfloat16'"),
    (("bfloat16", "bfloat16", True), "load_in_8bit=True is not allowed"),
    (("int4", "bfloat16"), "quant_storage='int4' is not allowed: one of uint8, bfloat16, float16, float32"),
    (("bfloat16", "fp8"), "param_dtype='fp8' is not allowed: one of uint8, bfloat16, float16, float32"),
])
def test_guards_name_quant_storage_and_param_dtype(args, text):
    with pytest.raises(KitError) as e: check_quantization(*args)
    assert text in str(e.value) and "quant_storage" in str(e.value) and "param_dtype" in str(e.value)


def test_guards_allow_matching_storage():
    assert check_quantization("bfloat16", "bf16") == ("bfloat16", "bfloat16")
    assert check_quantization(__import__("torch").float32, "fp32") == ("float32", "float32")
    assert check_quantization("uint8", None) == ("uint8", None)
    assert QLoRASpec(lora=nf4("uint8")).check().param_dtype is None


@pytest.mark.parametrize("args, text", [
    (["--quant-storage", "float32", "--mixed-precision", "bf16"], "--quant-storage='float32' is not allowed: only param_dtype='bfloat16'"),
    (["--quant-storage", "uint8", "--mixed-precision", "bf16"], "--quant-storage='uint8' is not allowed"),
    (["--load-in-8bit"], "--load-in-8bit=True is not allowed"),
    (["--quant-storage", "int4"], "--quant-storage='int4' is not allowed"),
    (["--mixed-precision", "fp8"], "--mixed-precision='fp8' is not allowed"),
    (["--autocast", "fp32"], "--autocast='fp32' is not allowed: no, bf16 or fp16"),
])
def test_cli_guards_exit_2_without_traceback(tmp_path, args, text):
    from tests.badinput import run_case, Case
    code, _, err = run_case(Case("qlora", ["qlora", "--nproc", "2", *args], 2, text), tmp_path)
    assert code == 2, err
    assert text in err and "Traceback" not in err
    if args[0] != "--mixed-precision" and args[0] != "--autocast":  # the storage guards name both sides of the rule
        assert ("--quant-storage" in err or "quant_storage" in err) and "param_dtype" in err
    if args[:2] == ["--quant-storage", "float32"]:  # PEFT's rule in the kit's terms, and both ways out, as options
        assert "the storage dtype is the dtype the other parameters are in" in err and "float32 under autocast" in err
        assert ("Type --quant-storage=bfloat16 --mixed-precision=bf16, or" in err
                and "--quant-storage=float32 --mixed-precision=no --autocast=bf16" in err)


def test_autocast_spec():
    assert QLoRASpec(lora=nf4("float32"), autocast="bf16").check().param_dtype == "float32"
    assert QLoRASpec(lora=nf4("float32"), autocast="bf16").config.mixed_precision == "no"  # FSDP casts nothing
    # accelerate's bf16: both
    assert QLoRASpec(fsdp=lora_fsdp_config("bfloat16"), autocast="bf16").check().param_dtype == "bfloat16"
    with pytest.raises(KitError, match="Did you mean 'bf16'"): QLoRASpec(autocast="torch.bfloat16").check()
    with pytest.raises(KitError, match="autocast=bf16"):
        QLoRASpec(lora=nf4("float32"), fsdp=lora_fsdp_config("bfloat16"), autocast="bf16").check()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three storages in one launch: bfloat16 (10 steps, adapter saved to a folder), uint8 and float32 (2 steps each).
    Then float32 under bf16 autocast. The command line's `fsdp-kit qlora` (with --adapter-dir) is run by
    tests/test_fsdp_config_runs.py::test_qlora_and_cp_eval_run_the_users_config."""
    from dataclasses import asdict
    from fsdp_kit.launch import launch
    from tests.helpers import qlora_each
    adapter = tmp_path_factory.mktemp("qlora") / "adapter"
    lab = dict(step=StepSpec(lr=1e-2))  # the lab's learning rate (fsdp-kit qlora --lr)
    specs = [QLoRASpec(model="tiny", lora=nf4("bfloat16"), steps=10, adapter_dir=str(adapter), **lab),
             QLoRASpec(lora=nf4("uint8"), steps=2, **lab), QLoRASpec(lora=nf4("float32"), fsdp=lora_fsdp_config(None), steps=2, **lab),
             QLoRASpec(lora=nf4("float32"), autocast="bf16", steps=2, **lab)]
    results = launch(qlora_each, specs, nprocs=2, timeout=240)
    return adapter, [json.loads(json.dumps(asdict(r))) for r in results], specs


def test_bfloat16_trains_matches_saves_and_saves_memory(runs):
    adapter, (r, *_), _ = runs
    assert r["packing"] == {"uint8": 2, "bfloat16": 4, "float32": 8}
    assert r["world_size"] == 2 and r["quant_storage"] == "bfloat16" and r["param_dtype"] == "bfloat16"
    # losses fall; every step equals one process on the whole batch, to bf16 rounding (a tenth of bf16's step near 5.5)
    assert len(r["losses"]) == 10 and r["losses"][-1] < r["losses"][0] - 0.1
    assert len(r["unsharded_losses"]) == 10 and r["sharded_vs_unsharded_loss_diff"] < 3e-3
    assert r["sharded_vs_unsharded_loss_diff"] == max(abs(a - b) for a, b in zip(r["losses"], r["unsharded_losses"]))
    # only LoRA parameters train: exactly the trainable ones changed, all of them LoRA
    assert len(r["trainable_parameters"]) == 2 * 7 * 2  # 2 layers x 7 linears x (lora_A, lora_B)
    assert sorted(r["changed_parameters"]) == sorted(r["trainable_parameters"])
    assert all("lora_" in n for n in r["changed_parameters"])
    # stored shapes equal packed_shape, and each rank holds half of each
    shapes = r["storage_shapes"]
    assert len(shapes) == 14 and all(s["stored"] == s["predicted"] == list(packed_shape(s["weight"], "bfloat16")) for s in shapes.values())
    assert all(sum(rows for rows, _ in ranks) == shapes[name]["stored"][0] for name, ranks in r["shard_shapes"].items())
    assert r["quant_state_bytes"]["held"] == r["quant_state_bytes"]["predicted"]
    # what FSDP gathers for the forward is what was stored, byte for byte; the 4-bit matmuls ran in bf16
    assert r["gathered_codes"]["intact"] == r["gathered_codes"]["weights"] == 14 and r["gathered_codes"]["gathered_dtypes"] == ["bfloat16"]
    assert r["compute_dtype"] == "bfloat16" and r["autocast"] == "no"
    # the 4-bit base uses less memory per rank than the bf16 base, measured
    for rank in range(2):
        assert r["peak_bytes"]["qlora"][rank] < r["peak_bytes"]["bf16_lora"][rank]
        q, b = r["peak_by_category"]["qlora"][rank], r["peak_by_category"]["bf16_lora"][rank]
        assert q["sharded_params"] < b["sharded_params"] and q["total"] == r["peak_bytes"]["qlora"][rank]
    # the adapter holds every rank's share and reloads with the same loss
    a = r["adapter"]
    assert a["every_rank_share_saved"] and a["tensors"] == 28 and a["path"] == str(adapter)
    assert a["reload_loss_diff"] < 1e-4
    assert all(len(rows) == 2 and min(rows) > 0 and sum(rows) == a["shapes"][k][0] for k, rows in a["rows_per_rank"].items())
    from safetensors.torch import load_file
    saved = load_file(adapter / "adapter_model.safetensors")
    assert saved["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (64, 8)
    assert saved["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (8, 176)
    assert all(v.abs().sum() > 0 for v in saved.values())  # lora_B starts at zero: every tensor was trained and saved
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8


def test_other_storages(runs):
    "uint8 storage without mixed precision (bf16 compute), and float32 storage with no mixed precision (fp32 compute)."
    # both pack, shard, match one process at every step and save their adapter.
    _, results, specs = runs
    for spec, r in zip(specs[1:3], results[1:3]):
        assert r["param_dtype"] is None  # uint8: no mixed precision; fp32 is accelerate's "no"
        storage = spec.adapters.quant_storage
        assert len(r["unsharded_losses"]) == 2 and r["sharded_vs_unsharded_loss_diff"] < (1e-5 if storage == "float32" else 3e-3)
        assert all(s["dtype"] == storage and s["stored"] == s["predicted"] for s in r["storage_shapes"].values())
        assert r["adapter"]["every_rank_share_saved"] and r["adapter"]["reload_loss_diff"] < 1e-4 and r["adapter"]["path"] is None


def test_float32_storage_under_autocast(runs):
    "PEFT's 'float32 storage for automatic mixed precision'."
    # float32 parameters and storage, FSDP casts nothing, the forward under bf16 autocast.
    _, results, specs = runs
    r = results[3]
    assert (specs[3].autocast == "bf16" and r["autocast"] == "bf16" and r["param_dtype"] == "float32"
            and r["config"]["mixed_precision"] == "no")
    assert r["compute_dtype"] == "bfloat16"  # autocast ran the 4-bit matmuls in bf16
    g = r["gathered_codes"]
    assert (g["intact"] == g["weights"] == 14 and g["bytes_gathered"] == g["bytes_before"]
            and g["gathered_dtypes"] == g["stored_dtypes"] == ["float32"])
    assert sorted(r["changed_parameters"]) == sorted(r["trainable_parameters"]) and all("lora_" in n for n in r["changed_parameters"])
    assert len(r["unsharded_losses"]) == 2 and r["sharded_vs_unsharded_loss_diff"] < 3e-3 and r["adapter"]["reload_loss_diff"] < 1e-4
    assert r["peak_bytes"]["qlora"][0] > results[0]["peak_bytes"]["qlora"][0]  # float32 storage costs more memory than bfloat16


def test_the_qlora_lr_and_warmup_reach_the_optimizer():
    "QLoRASpec's step section carries its lr and warm-up: the training loop's optimizer (train.make_optimizer) is built with them."
    from fsdp_kit.qlora import QLoRASpec
    from fsdp_kit.spec import StepSpec
    from fsdp_kit.train import make_optimizer
    from fsdp_kit.models import build_model, model_config
    optim, schedule = make_optimizer(build_model(model_config("tiny")), QLoRASpec(step=StepSpec(lr=0.05, warmup=4)).check())
    assert schedule.base_lrs == [0.05] and optim.param_groups[0]["lr"] == 0.05 / 4
