"Bad model config.json files, bad FSDP config files and bad plan options: each refused in one line before any process starts."
import json, math, subprocess, sys
import pytest
from fsdp_kit.errors import KitError
from fsdp_kit.models import PRESETS, check_model
from fsdp_kit.plan import check_fits, step_memory
from fsdp_kit.plan import PlanSpec, LORA
from fsdp_kit.plan_gpu import plan_gpu, recommend
from tests.badinput import Case, check_case
from tests.conftest import EXAMPLES, ROOT

GOOD = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
BAD_MODELS = [  # (id, config.json contents, phrase naming the key)
    ("heads-not-dividing", dict(GOOD, num_attention_heads=5), "num_attention_heads=5"),
    ("vocab-string", dict(GOOD, vocab_size="abc"), "vocab_size='abc'"),
    ("hidden-float", dict(GOOD, hidden_size=64.5), "hidden_size=64.5"),
    ("kv-heads-not-dividing", dict(GOOD, num_key_value_heads=3), "num_key_value_heads=3"),
    ("vocab-zero", dict(GOOD, vocab_size=0), "vocab_size=0"),
    ("hidden-negative", dict(GOOD, hidden_size=-64), "hidden_size=-64"),
    ("json-list", [GOOD], "holds a list"),
    ("not-utf8", b'{"model_type": "llama", "name": "\xff\xfe"}', "not UTF-8"),
    ("only-model-type", dict(model_type="llama"), "hidden_size=4096 (transformers' default)"),
    ("hidden-huge", dict(GOOD, hidden_size=1048576), "hidden_size=1048576"),
]
LAUNCHING = {  # command -> options that keep each row small; every row must be refused before launching
    "train": [], "qlora": [], "cp-eval": [], "compare": ["--policies", "NO_WRAP", "--reshard", "true"],
}
PLAN_FITS = {"only-model-type": "fits", "hidden-huge": "does NOT fit"}  # valid shapes: plan predicts GPUs, not this machine

BAD_FSDP = [  # (id, file name, contents, phrase)
    ("binary", "bin.yaml", b"\x00\x01\xff\xfe\x80", "not UTF-8"),
    ("folder", "dir.yaml", None, "it is a folder"),
    ("section-list", "list.yaml", "distributed_type: FSDP\nfsdp_config:\n  - a\n  - b\n", "fsdp_config=['a', 'b'] is not allowed"),
    ("section-string", "str.yaml", "distributed_type: FSDP\nfsdp_config: hello\n", "fsdp_config='hello' is not allowed"),
    ("section-number", "num.yaml", "distributed_type: FSDP\nfsdp_config: 3\n", "fsdp_config=3 is not allowed"),
    ("top-list", "top.yaml", "- fsdp_cpu_offload\n- true\n", "holds a list"),
    ("json-array", "arr.json", "[1, 2]", "holds a list"),
    ("json-string", "s.json", '"FULL_SHARD"', "holds a str"),
    ("empty-yaml", "empty.yaml", "", "the file is empty"),
    ("empty-json", "empty.json", "  \n", "the file is empty"),
    ("non-text-key", "key.yaml", "distributed_type: FSDP\n1: 2\n", "key 1 is not a name"),
]
BAD_PLAN = [  # (id, options, phrase)
    ("gpu-mem-nan", ["--gpu-mem-gb", "nan"], "--gpu-mem-gb=nan"),
    ("gpu-mem-inf", ["--gpu-mem-gb", "inf"], "--gpu-mem-gb=inf"),
    ("gpu-mem-negative", ["--gpu-mem-gb", "-1"], "--gpu-mem-gb=-1.0"),
    ("gpu-mem-zero", ["--gpu-mem-gb", "0"], "--gpu-mem-gb=0.0"),
    ("gpus-zero", ["--gpus", "0"], "--gpus=0"),
    ("gpus-negative", ["--gpus", "-2"], "--gpus=-2"),
    ("batch-zero", ["--batch", "0"], "--batch=0"),
    ("seq-zero", ["--seq", "0"], "--seq=0"),
    ("lora-r-zero", ["--method", "lora", "--lora-r", "0"], "--lora-r=0"),
    ("cp-zero", ["--cp", "0"], "--cp=0"),
    ("recommend-gpu-mem-inf", ["--recommend", "--gpu-mem-gb", "inf"], "--gpu-mem-gb=inf"),
    ("recommend-batch-negative", ["--recommend", "--batch", "-4"], "--batch=-4"),
    # a flag that would change nothing with the chosen method or mode, ignored before, is refused
    ("full-lora-targets", ["--method", "full", "--lora-targets", "q_proj,v_proj"],
     "--lora-targets='q_proj,v_proj' is not allowed: only with --method lora or qlora"),
    ("full-lora-r", ["--lora-r", "16"], "--lora-r=16 is not allowed: only with --method lora or qlora"),
    ("recommend-grad-ckpt", ["--recommend", "--grad-ckpt"],
     "--grad-ckpt='full' is not allowed: left out with --recommend: --recommend searches"),
    ("recommend-reshard", ["--recommend", "--reshard", "false"], "--reshard='false' is not allowed: left out with --recommend"),
    ("recommend-compile", ["--recommend", "--compile"],
     "--compile='true' is not allowed: left out with --recommend: --recommend does not plan with it"),
]

CASES = [Case(f"{cmd}-{name}", [cmd, "--model", "{tmp}/bad/config.json", *extra], 2, phrase, files={"bad/config.json": content})
         for cmd, extra in LAUNCHING.items() for name, content, phrase in BAD_MODELS]
CASES += [Case(f"plan-{name}", ["plan", "--model", "{tmp}/bad/config.json", "--json", "-"],
               *((0, PLAN_FITS[name]) if name in PLAN_FITS else (2, phrase)),
               files={"bad/config.json": content}) for name, content, phrase in BAD_MODELS]
CASES += [Case(f"{cmd}-fsdp-{name}", [cmd, "--fsdp-config", f"{{tmp}}/{file}"], 2, phrase, files={file: content})
          for cmd in ("hf", "compare") for name, file, content, phrase in BAD_FSDP]
CASES += [Case(f"plan-{name}", ["plan", "--model", "tiny", *options], 2, phrase) for name, options, phrase in BAD_PLAN]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused(case, tmp_path):
    check_case(case, tmp_path)


def test_the_table_is_large_and_its_ids_unique():
    assert len(CASES) >= 50 and len({c.id for c in CASES}) == len(CASES)


# plan --validate's CUDA matrix: 1.2 B parameters, ~23 GB per host at these defaults, at the edge of this machine's 24
GPU_SIZED = ("llama-3.2-1b",)


@pytest.mark.parametrize("model", [*PRESETS, *sorted(str(p) for p in EXAMPLES.glob("*/config.json") if p.parent.name not in GPU_SIZED),
                                   str(EXAMPLES / "qwen2-tiny")])
def test_good_models_pass_at_the_commands_defaults(model):
    assert check_model(model) == model
    for batch, seq_len in ((4, 64), (2, 64), (2, 128)):  # train and qlora, compare, cp-eval (4 rows over 2 ranks)
        assert check_fits(model, batch, seq_len, nproc=2)["per_host"] < 256 * 2**20


def test_the_estimate_is_small_for_tiny_and_large_for_7b_defaults(tmp_path):
    tiny = step_memory("tiny", 4, 64, nproc=2)
    assert tiny["parameters"] == 125_248 and tiny["per_host"] == 2 * tiny["per_rank"] and tiny["per_host"] < 64 * 2**20
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="llama")))
    big = step_memory(str(tmp_path), 1, 8)
    assert big["parameters"] == 6_738_415_616 and big["per_rank"] > 16 * 6.7e9  # fp32 params, grads and AdamW's two states
    assert check_model(str(tmp_path)) == str(tmp_path)  # it builds: a valid 7B Llama
    with pytest.raises(KitError, match="model=.* is not allowed: .*num_hidden_layers=32 \\(transformers' default\\)"):
        check_fits(str(tmp_path), 1, 8)  # but no step of it fits this machine


def test_a_huge_batch_is_refused_naming_the_option():
    with pytest.raises(KitError, match=r"--batch=100000000 is not allowed: .*GiB available"):
        check_fits("tiny", 100_000_000, 64, nproc=2)
    for kwargs, option in ((dict(batch=True), "--batch"), (dict(seq_len=0), "--seq-len"), (dict(nproc=1.5), "--nproc")):
        with pytest.raises(KitError, match=option): check_fits(**dict(dict(model="tiny", batch=4, seq_len=64), **kwargs))


def test_a_preset_is_checked_without_importing_transformers():
    code = "import sys; from fsdp_kit.models import check_model; check_model('tiny'); print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_config_errors_name_the_file_and_the_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(GOOD, num_attention_heads=5)))
    with pytest.raises(KitError) as e: check_model(str(tmp_path / "config.json"))
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg and "hidden_size=64, num_attention_heads=5" in msg and "not a multiple" in msg


@pytest.mark.parametrize("kwargs, option", [(dict(gpus=True), "--gpus"), (dict(gpu_mem_gb=True), "--gpu-mem-gb"),
                                            (dict(gpu_mem_gb=math.inf), "--gpu-mem-gb"), (dict(gpu_mem_gb="80"), "--gpu-mem-gb"),
                                            (dict(seq_len=2048.0), "--seq"), (dict(lora_r=False), "--lora-r")])
def test_plan_refuses_options_of_the_wrong_type(kwargs, option):
    from dataclasses import replace
    lora = replace(LORA, r=kwargs["lora_r"]) if "lora_r" in kwargs else None
    spec = PlanSpec("tiny", kwargs.get("gpus", 8), batch=1, seq_len=kwargs.get("seq_len", 2048), lora=lora)
    memory = kwargs.get("gpu_mem_gb", 80)  # the hardware: plan_gpu's and recommend's own, beside the spec
    with pytest.raises(KitError, match=option): plan_gpu(spec, gpu_mem_gb=memory)
    with pytest.raises(KitError, match=option): recommend(spec, gpus=kwargs.get("gpus", 8), gpu_mem_gb=memory)
