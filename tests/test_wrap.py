"""Wrap plans and the measured comparison: units, sharded bytes per rank, collectives, and the compare command."""
import json, math, os, re
import pytest
from fsdp_kit.config import FSDPConfig, POLICIES
from fsdp_kit.errors import KitError
from fsdp_kit.launch import launch
from fsdp_kit.models import build_model, model_config, count_params
from fsdp_kit.spec import StepSpec
from fsdp_kit.wrap import plan_units, CompareSpec, compare_worker, check_spec, runs_table, size_floor, size_policy, fsdp1_size_targets
from tests.conftest import EXAMPLES, ROOT
from tests.badinput import refused

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("arch, block", [("qwen2-tiny", "Qwen2DecoderLayer"), ("mistral-tiny", "MistralDecoderLayer")])
def test_transformer_wrap_picks_decoder_blocks(arch, block):
    model = build_model(model_config(EXAMPLES / arch / "config.json"), device="meta")
    units = plan_units(model, FSDPConfig())
    assert [u.cls for u in units[:2]] == [block, block] and units[-1].cls == type(model).__name__
    assert [u.module for u in units] == ["model.layers.1", "model.layers.0", "model.embed_tokens", "model.norm+lm_head", ""]
    assert [u.reshard_after_forward for u in units] == [True, True, True, False, False]  # the tail and the root keep their weights
    with pytest.raises(KitError, match=r"selects model.layers \(ModuleList"):
        plan_units(model, FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=10_000))
    size = plan_units(model, FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=size_floor(model)))
    # at its floor accelerate's size rule selects nothing below the root
    assert size == plan_units(model, FSDPConfig(auto_wrap_policy="NO_WRAP"))


@pytest.mark.parametrize("policy, min_num_params", [(p, m) for p in POLICIES if p != "SIZE_BASED_WRAP" for m in (0, 20_000, 100_000)]
                                                   + [("SIZE_BASED_WRAP", m) for m in (869_504, 10**6, 10**9)])
def test_every_parameter_is_in_exactly_one_unit(policy, min_num_params):
    model = build_model(model_config("small"), device="meta")
    units = plan_units(model, FSDPConfig(auto_wrap_policy=policy, min_num_params=min_num_params))
    assert sum(u.parameters for u in units) == count_params(model)
    assert len({u.module for u in units}) == len(units) and units[-1].module == ""


@pytest.mark.parametrize("policy", POLICIES)
def test_tied_embeddings_stay_in_one_unit(policy):
    "A module sharing a parameter with a module outside it (tied embed_tokens / lm_head) is never a unit of its own."
    # the tail holds the shared weight, as accelerate's.
    tied = build_model(model_config(EXAMPLES / "qwen2-tied" / "config.json"), device="meta")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    units = plan_units(tied, FSDPConfig(auto_wrap_policy=policy, min_num_params=size_floor(tied)))
    assert not {"lm_head", "model.embed_tokens", "model"} & {u.module for u in units}
    tail = units[-2]
    assert tail.module == "model.norm+model.embed_tokens+lm_head" and tail.reshard_after_forward is False
    assert sum(u.parameters for u in units) == count_params(tied) and tail.parameters >= tied.lm_head.weight.numel()
    meta = build_model(model_config(EXAMPLES / "qwen2-tiny" / "config.json"), device="meta")
    untied = plan_units(meta, FSDPConfig(auto_wrap_policy=policy, min_num_params=size_floor(meta)))
    assert ("lm_head" in {u.module for u in untied}) == (policy == "PER_LINEAR")  # the policy that would split the tie


def test_units_include_every_block_accelerate_would_wrap():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
    for model in (build_model(model_config("small"), device="meta"),
                  build_model(model_config(EXAMPLES / "qwen2-tiny" / "config.json"), device="meta")):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP")
        plugin.set_auto_wrap_policy(model)
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        names = {id(m): n for n, m in model.named_modules()}
        theirs = {names[id(m)] for m in get_module_children_bottom_up(model)[:-1] if policy(m)}
        ours = {u.module for u in plan_units(model, FSDPConfig())}
        # the kit's extras, none of them a policy's: edge_groups' embeddings alone and [final norm, lm_head] tail, then the root ("")
        assert theirs and ours == theirs | {"model.embed_tokens", "model.norm+lm_head", ""}


def test_size_based_wrap_is_accelerates_fsdp2_rule():
    "SIZE_BASED_WRAP's units are those accelerate's own FSDP2 policy selects, bottom-up; FSDP1's rule is only a named comparison."
    from accelerate.utils.fsdp_utils import get_module_children_bottom_up
    model = build_model(model_config("small"), device="meta")
    assert size_floor(model) == count_params(model.model) == 869_504  # the base model holds the embeddings and the final norm
    for n in (869_504, 900_000):
        theirs = [m for m in get_module_children_bottom_up(model)[:-1] if size_policy(n)(m)]
        assert (theirs == []
                and plan_units(model, FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=n))[0].module == "model.embed_tokens")
    assert [n for n, _ in fsdp1_size_targets(model, 100_000)] == ["lm_head"] + [f"model.layers.{i}.mlp"
                                                                                for i in (3, 2, 1, 0)] + ["model.embed_tokens", "model"]
    assert "model.layers" in [n for n, m in model.named_modules() if size_policy(100_000)(m)]  # accelerate's rule selects the container
    # the default threshold: the floor
    assert CompareSpec(model="small", policies=["SIZE_BASED_WRAP"]).configs()[0].min_num_params == 869_504
    # the spec's fsdp is the template of every config compared: its other fields kept, its own threshold when it has one
    bf16 = CompareSpec("small", policies=["NO_WRAP", "SIZE_BASED_WRAP"], reshard=[False], fsdp=FSDPConfig(mixed_precision="bf16"))
    assert [(c.auto_wrap_policy, c.reshard_after_forward, c.mixed_precision) for c in bf16.configs()] == [
        ("NO_WRAP", False, "bf16"), ("SIZE_BASED_WRAP", False, "bf16")]
    assert CompareSpec("small", policies=["SIZE_BASED_WRAP"], fsdp=FSDPConfig(min_num_params=10**6)).configs()[0].min_num_params == 10**6


def test_plan_refusals():
    model = build_model(model_config("small"), device="meta")
    with pytest.raises(KitError, match=r"min_num_params=1000 is not allowed: 869,504 or more for this model, or TRANSFORMER_BASED_WRAP .*"
                                       r"selects model.layers \(ModuleList, 738,304 parameters\), a container without forward, which "
                                       r"fully_shard refuses"):
        plan_units(model, FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000))
    with pytest.raises(KitError, match=r"selects model \(LlamaModel, 869,504 parameters\), which holds model.embed_tokens, model.norm"):
        plan_units(model, FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=869_503))
    with pytest.raises(KitError, match=r"reshard_after_forward=3 is not allowed: .*divisor of the shard group size 4"):
        check_spec(CompareSpec(model="small", reshard=[3]), 4)
    with pytest.raises(KitError, match=r"policies='EVERYTHING' is not allowed"):
        check_spec(CompareSpec(policies=["EVERYTHING"]), 2)
    # the shared step's memory savers: the model's own gradient checkpointing is the one this lab runs
    assert CompareSpec(step=StepSpec(gradient_checkpointing=True)).check().step.gradient_checkpointing
    with pytest.raises(KitError, match=r"step=StepSpec\(.*ce_chunks=4.* is not allowed: .*what CompareSpec runs"):
        CompareSpec(step=StepSpec(ce_chunks=4)).check()


def _padded_shard_bytes(model, world):
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_parameter_bytes_are_total_over_world_size(world):
    spec = CompareSpec(model="tiny", policies=["TRANSFORMER_BASED_WRAP", "NO_WRAP"], reshard=[True], batch=2, steps=1)
    runs = launch(compare_worker, spec, nprocs=world)
    model = build_model(model_config("tiny"), device="meta")
    total = count_params(model) * 4
    for run in runs:
        sharded = run.peak_bytes["sharded_params"]
        assert sharded == _padded_shard_bytes(model, world)
        assert total / world <= sharded < total / world + 4 * world * 64  # only padding on top
        assert run.world_size == world
        assert run.timing["steps"] == 1 and run.timing["min_s"] == run.timing["max_s"] == run.step_seconds  # one timed step
    ms = round(runs[0].step_seconds * 1e3)
    assert runs_table(runs).splitlines()[1].endswith(f"{ms} ({ms}-{ms})")


def test_step_times_show_their_spread_and_a_busy_machine_is_named():
    from fsdp_kit.measure import step_timing, busy_note
    t = step_timing([0.3, 0.1, 0.2])
    assert (t["median_s"], t["min_s"], t["max_s"], t["steps"], t["cores"]) == (0.2, 0.1, 0.3, 3, os.cpu_count())
    assert busy_note([dict(t, load_average=t["cores"] - 0.5), None]) == ""
    note = busy_note([None, dict(t, load_average=2.5 * t["cores"]), dict(t, load_average=1.5 * t["cores"])])
    assert note.startswith(f"note: the machine was busy while steps were timed (load average {2.5 * t['cores']:.1f} on {t['cores']} cores)")


def test_cli_runs_an_example_config_unchanged(cli, tmp_path):
    "The compare command on an accelerate YAML as it is."
    # all three example files are run by `fsdp-kit train` in tests/test_fsdp_config_runs.py
    name = "accelerate_fsdp_lora.yaml"
    config = ROOT / "examples" / "fsdp_configs" / name
    out = cli("compare", "--nproc", 2, "--model", "tiny", "--fsdp-config", config, "--json", tmp_path / "o.json",
              "--quiet")  # also compare's --quiet case of test_cli_contract.test_long_labs_print_a_line_per_unit_and_quiet_silences_them
    assert out.returncode == 0, out.stderr
    assert not re.search(r"^setting \d/", out.stderr + out.stdout, re.M) and out.stdout.strip(), out.stderr  # --quiet: no progress line
    data = json.loads((tmp_path / "o.json").read_text())
    assert len(data["runs"]) == 1 and data["runs"][0]["peak_bytes"]["total"] > 0
    assert "state_dict_type=" in "\n".join(data["notes"])  # every field is accounted for
    if name.endswith(".yaml"):
        assert "use_orig_params=False does not apply to FSDP2" in out.stderr


CLI_BAD = [
    (("--policies", "EVERYTHING"), "policies='EVERYTHING' is not allowed"),
    (("--reshard", "3", "--nproc", "4"), "--reshard=3 is not allowed"),
    (("--reshard", "maybe"), "reshard='maybe' is not allowed"),
    (("--policies", "SIZE_BASED_WRAP", "--min-num-params", "1000"), "--min-num-params=1000 is not allowed: 869,504 or more"),
    (("--model", "nope"), "model='nope' is not allowed"),
    (("--fsdp-config", "no/such.yaml"), "--fsdp-config='no/such.yaml' is not allowed"),
    (("--fsdp-config", "examples/fsdp_configs/transformers_fsdp_config.json", "--gradient-checkpointing"),
     "together with gradient checkpointing is refused"),
    (("--fsdp-config", "examples/fsdp_configs/transformers_fsdp_config.json", "--model", "examples/configs/qwen2-tiny/config.json"),
     "transformer_layer_cls_to_wrap='LlamaDecoderLayer' is not allowed: a layer class of Qwen2ForCausalLM"),
]


@pytest.mark.parametrize("args, message", CLI_BAD, ids=[m.split(" ")[0] for _, m in CLI_BAD])
def test_cli_compare_refuses_bad_input_without_traceback(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    refused(["compare", *args], message, tmp_path)


def test_a_size_threshold_that_wraps_no_layer_is_said():
    "`fsdp-kit train` and `compare` add a line where SIZE_BASED_WRAP's threshold makes no decoder layer a unit of its own."
    from fsdp_kit.commands import size_note
    edges = [dict(module="model.embed_tokens"), dict(module="model.norm+lm_head"), dict(module="")]
    layers = [dict(module=f"model.layers.{i}") for i in range(2)] + edges
    size = dict(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=869_504)
    assert size_note(edges, size) == ("min_num_params=869,504 wraps no decoder layer: every layer stays in the root's unit, "
                                      "all-gathered whole for the step as under NO_WRAP")
    assert size_note(layers, size) == "" and size_note(edges, dict(size, auto_wrap_policy="NO_WRAP")) == ""
