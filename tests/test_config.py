"""FSDPConfig: the upstream files load as they are, FSDP1 keys are mapped or explained, bad input is refused naming the field."""
import json
import pytest
import yaml
from fsdp_kit.config import FSDPConfig, load_fsdp_config, from_transformers, from_accelerate, check_for_model
from fsdp_kit.errors import KitError
from fsdp_kit.models import build_model, model_config
from tests.conftest import ROOT

EXAMPLES = ROOT / "examples" / "fsdp_configs"
SHARED = ROOT.parent / "shared" / "examples"


def test_examples_are_the_shared_files():
    if not SHARED.exists():
        pytest.skip("no ../shared/examples beside this checkout")
    for f in SHARED.iterdir():
        assert (EXAMPLES / f.name).read_bytes() == f.read_bytes()


def test_transformers_json_loads_as_is():
    cfg = load_fsdp_config(EXAMPLES / "transformers_fsdp_config.json")
    assert cfg == FSDPConfig(reshard_after_forward=True, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                             transformer_layer_cls_to_wrap=["LlamaDecoderLayer"],
                             cpu_offload=False, state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=True,
                             ac="full",
                             source=str(EXAMPLES / "transformers_fsdp_config.json"))


@pytest.mark.parametrize("name, mixed, offload, processes",
                         [("accelerate_fsdp_lora.yaml", "bf16", False, 8), ("accelerate_fsdp_qlora.yaml", "no", True, 2)])
def test_accelerate_yaml_loads_as_is_and_explains_fsdp1_keys(name, mixed, offload, processes):
    cfg = load_fsdp_config(EXAMPLES / name)
    assert (cfg.auto_wrap_policy, cfg.reshard_after_forward, cfg.mixed_precision, cfg.cpu_offload) == (
        "TRANSFORMER_BASED_WRAP", True, mixed, offload)
    assert (cfg.state_dict_type, cfg.cpu_ram_efficient_loading) == ("SHARDED_STATE_DICT", True)
    notes = "\n".join(cfg.notes)
    for key in ("sharding_strategy: FULL_SHARD -> reshard_after_forward=True", "use_orig_params=False does not apply",
                "backward_prefetch='BACKWARD_PRE' does not apply", "forward_prefetch=False does not apply",
                "sync_module_states=True does not apply", "offload_params -> cpu_offload", f"num_processes={processes}"):
        assert key in notes, key


@pytest.mark.parametrize("strategy, reshard", [("FULL_SHARD", True), ("SHARD_GRAD_OP", False), ("HYBRID_SHARD", True), ("2", False),
                                               ("HYBRID_SHARD_ZERO2", False), ("_HYBRID_SHARD_ZERO2", False), ("NO_SHARD", False)])
def test_fsdp1_sharding_strategy_is_converted_as_accelerate_to_fsdp2_does(strategy, reshard):
    cfg = from_accelerate({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": strategy}})
    notes = "\n".join(cfg.notes)
    assert (cfg.reshard_after_forward is reshard and "sharding_strategy: " in notes
            and "accelerate launch runs this file with FSDP1" in notes)
    if strategy.startswith("HYBRID_SHARD"):
        assert "dp_replicate x dp_shard" in notes


def test_sharding_strategy_is_ignored_under_fsdp2_as_upstream_ignores_it():
    cfg = from_accelerate({"distributed_type": "FSDP", "num_processes": 2,
                           "fsdp_config": {"fsdp_version": 2, "fsdp_sharding_strategy": "SHARD_GRAD_OP"}})
    assert (cfg.reshard_after_forward is True
            and any(n.startswith("sharding_strategy='SHARD_GRAD_OP' is ignored under FSDP2") for n in cfg.notes))


def test_transformers_accepts_prefixed_keys_strings_and_ints():
    cfg = from_transformers({"fsdp_reshard_after_forward": "4", "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                             "cpu_offload": "True",
                             "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": "1000"})
    assert (cfg.reshard_after_forward, cfg.transformer_layer_cls_to_wrap, cfg.cpu_offload, cfg.min_num_params) == (
        4, ["LlamaDecoderLayer"], True, 1000)


BAD_FILES = [  # (file name, content, what the message must say)
    ("v3.json", {"version": 3}, "version=3 is not allowed"),
    ("policy.json", {"auto_wrap_policy": "TRANSFORMER_WRAP"},
     "auto_wrap_policy='TRANSFORMER_WRAP' is not allowed: one of TRANSFORMER_BASED_WRAP"),
    ("reshard.json", {"reshard_after_forward": "sometimes"}, "reshard_after_forward='sometimes' is not allowed"),
    ("offload.json", {"cpu_offload": "maybe"}, "cpu_offload='maybe' is not allowed: true or false"),
    ("fp8.yaml", {"distributed_type": "FSDP", "mixed_precision": "fp8", "fsdp_config": {}},
     "mixed_precision='fp8' is not allowed: one of no, bf16, fp16"),
    ("local.json", {"state_dict_type": "LOCAL_STATE_DICT"}, "state_dict_type='LOCAL_STATE_DICT' is not allowed"),
    ("negative.json", {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": -5}, "min_num_params=-5 is not allowed"),
    ("classes.json", {"transformer_layer_cls_to_wrap": [3]}, "transformer_layer_cls_to_wrap=[3] is not allowed"),
    ("strategy.yaml", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "HALF_SHARD"}},
     "sharding_strategy='HALF_SHARD' is not allowed"),
    ("xla.json", {"xla": True}, "xla=True is not allowed"),
    ("list.json", [1, 2], "holds a list, not a mapping"),
    ("ddp.yaml", {"distributed_type": "MULTI_GPU", "fsdp_config": {}}, "distributed_type='MULTI_GPU' is not allowed: FSDP"),
    ("toplevel.yaml", {"distributed_type": "FSDP", "fsdp_confg": {}}, "did you mean 'fsdp_config'"),
]


def _write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(json.dumps(content) if name.endswith(".json") else yaml.safe_dump(content))
    return path


@pytest.mark.parametrize("name, content, message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_config_files_are_refused_naming_the_field_and_file(tmp_path, name, content, message):
    path = _write(tmp_path, name, content)
    with pytest.raises(KitError) as info:
        load_fsdp_config(path)
    assert message in str(info.value) and str(path) in str(info.value)


ACCEPTED_NOW = [  # (file name, content, field values, a note) that were refused before: transformers and accelerate run them
    ("v1.json", {"version": 1}, {"reshard_after_forward": True}, "TrainingArguments(fsdp=True) runs this file with FSDP1"),
    ("noshard.json", {"sharding_strategy": "NO_SHARD"}, {"reshard_after_forward": True},
     "sharding_strategy='NO_SHARD' is ignored under FSDP2"),
    ("disagree.json", {"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False}, {"reshard_after_forward": False},
     "is ignored under FSDP2"),
    ("fp8.json", {"mixed_precision": "fp8"}, {"mixed_precision": "no"},
     "mixed_precision='fp8' in fsdp_config is not read: transformers never reads"),
    ("null.yaml", {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2, "fsdp_ignored_modules": None}},
     {"auto_wrap_policy": "NO_WRAP"},
     "ignored_modules=None changes nothing"),
]


@pytest.mark.parametrize("name, content, values, note", ACCEPTED_NOW, ids=[a[0] for a in ACCEPTED_NOW])
def test_files_upstream_runs_are_accepted(tmp_path, name, content, values, note):
    cfg = load_fsdp_config(_write(tmp_path, name, content))
    assert {k: getattr(cfg, k) for k in values} == values and any(note in n for n in cfg.notes), cfg.notes


def test_malformed_files_name_the_file(tmp_path):
    (tmp_path / "broken.json").write_text('{"version": 2,,}')
    with pytest.raises(KitError, match=r"broken.json is not valid JSON: .* line 1"):
        load_fsdp_config(tmp_path / "broken.json")
    (tmp_path / "broken.yaml").write_text("fsdp_config: [unclosed\n  x: 1")
    with pytest.raises(KitError, match=r"broken.yaml is not valid YAML"):
        load_fsdp_config(tmp_path / "broken.yaml")
    with pytest.raises(KitError, match=r"fsdp_config_file='.*missing.json' is not allowed: an existing"):
        load_fsdp_config(tmp_path / "missing.json")


def test_model_checks():
    model = build_model(model_config("small"), device="meta")
    with pytest.raises(KitError,
                       match=r"transformer_layer_cls_to_wrap='Qwen2DecoderLayer' is not allowed: a layer class of LlamaForCausalLM: "
                             r".*LlamaDecoderLayer"):
        check_for_model(FSDPConfig(transformer_layer_cls_to_wrap=["Qwen2DecoderLayer"]), model)
    with pytest.raises(KitError, match="activation_checkpointing=True together with gradient checkpointing is refused"):
        check_for_model(FSDPConfig(ac="full"), model, gradient_checkpointing=True)
    assert check_for_model(FSDPConfig(), model).auto_wrap_policy == "TRANSFORMER_BASED_WRAP"


@pytest.mark.parametrize("name, content, default, near", [
    ("typo.json", {"version": 2, "reshard_after_foward": False}, ("reshard_after_forward", True), "reshard_after_forward"),
    ("innerkey.yaml", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_polcy": "TRANSFORMER_BASED_WRAP"}},
     ("auto_wrap_policy", "NO_WRAP"), "auto_wrap_policy"),
])
def test_a_misspelt_key_is_run_as_upstream_runs_it_and_named(tmp_path, name, content, default, near):
    "Upstream runs a file with a key it does not know and never reads the key."
    # the kit runs it the same way, with a note that names the key.
    cfg = load_fsdp_config(_write(tmp_path, name, content))
    assert getattr(cfg, default[0]) == default[1]
    assert any(n.startswith("IGNORED: unknown key") and f"did you mean {near!r}" in n for n in cfg.notes), cfg.notes


def test_many_unknown_keys_are_one_note(tmp_path):
    """A file of 1,000 unknown keys gets one IGNORED note that counts them (was a note per key, each with a nearest-key search: over
    300 s for 3 million); up to five keep a note each, with the nearest known key."""
    many = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, **{f"fsdp_key_{i}": i for i in range(1000)}}}
    notes = [n for n in load_fsdp_config(_write(tmp_path, "many.yaml", many)).notes if n.startswith("IGNORED")]
    assert (len(notes) == 1 and notes[0].startswith("IGNORED: 1,000 unknown keys in ")
            and "('key_0', 'key_1', 'key_10', ...)" in notes[0]), notes
    few = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forwrd": True, "fsdp_key_1": 1}}
    notes = [n for n in load_fsdp_config(_write(tmp_path, "few.yaml", few)).notes if n.startswith("IGNORED")]
    assert len(notes) == 2 and "did you mean 'reshard_after_forward'?" in notes[1], notes  # the file's keys, sorted


def test_a_file_is_parsed_once_per_version(tmp_path):
    "Every reader of a file in one command gets it from one parse (a copy each, so no reader changes another's); an edit is read again."
    from fsdp_kit.upstream import _parsed, parse_fsdp_file
    path = _write(tmp_path, "once.json", {"version": 2, "cpu_offload": False})
    _parsed.cache_clear()
    first = parse_fsdp_file(path)
    first["cpu_offload"] = True
    assert parse_fsdp_file(path) == {"version": 2, "cpu_offload": False} and _parsed.cache_info().misses == 1
    path.write_text(json.dumps({"version": 2, "cpu_offload": True, "x": 1}))
    assert parse_fsdp_file(path)["cpu_offload"] is True and _parsed.cache_info().misses == 2
