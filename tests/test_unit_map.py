"""One unit map: the planner's units (names, parameters per unit) are the ones `apply_fsdp` builds with `fully_shard` on a real
1-rank gloo group, for every policy, one the test registers, tied and untied models; LoRA adapters in their Linear's unit."""
from dataclasses import replace
import pytest
import torch.distributed as dist
from fsdp_kit.config import FSDPConfig, POLICIES
from fsdp_kit.errors import KitError
from fsdp_kit.models import build_model, model_config
from fsdp_kit.plan import PlanSpec, BASE, LORA, plan_config, units, model_tensors, predict_peak
from fsdp_kit.wrap import apply_fsdp, register_policy, unit_map, size_floor
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.timeout(120)

MODELS = ["tiny", "small", str(EXAMPLES / "qwen2-tied" / "config.json"), str(EXAMPLES / "mistral-tiny" / "config.json")]
register_policy("MLP_ONLY", lambda name, module: name.endswith(".mlp"))  # a policy the kit does not ship: each decoder layer's MLP


@pytest.fixture(scope="module")
def mesh():
    "A real 1-rank gloo process group, for this module's tests."
    from torch.distributed.device_mesh import init_device_mesh
    ours = not dist.is_initialized()
    if ours: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if ours: dist.destroy_process_group()


def built_units(model) -> dict:
    "{parameter name: sorted names of the modules fully_shard was called on together}, read from the FSDP state after sharding."
    from torch.distributed.fsdp import FSDPModule
    groups = {}
    for name, m in model.named_modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        if group is not None: groups.setdefault(id(group), (group, []))[1].append(name)
    owner = {id(fp.sharded_param): tuple(sorted(names)) for group, names in groups.values() for fp in group.fsdp_params}
    return {n: owner[id(p)] for n, p in model.named_parameters()}


def readable(modules:tuple) -> str:
    "The planner's name for a unit built of `modules`: root, embed, tail (holds the final norm), layers.N, or the module's name."
    if modules == ("",): return "root"
    if "model.norm" in modules: return "tail"
    if modules == ("model.embed_tokens",): return "embed"
    (name,) = modules
    return "layers." + name.split(".")[-1] if name.startswith("model.layers.") and name.count(".") == 2 else name


@pytest.mark.parametrize("model, layout", [(m, "accelerate") for m in MODELS] + [("small", "layers")],
                         ids=lambda m: m.split("/")[-2] if "/" in m else m)
def test_planner_units_are_the_built_units(model, layout, mesh):
    config = model_config(model)
    for policy in (*POLICIES, "MLP_ONLY"):
        spec = PlanSpec(model, 1, fsdp=FSDPConfig(auto_wrap_policy=policy, layout=layout))
        built = built_units(apply_fsdp(build_model(config), spec.wrap_config, mesh, edge_units=layout == "accelerate")[0])
        planned = {t.name: t.unit for t in model_tensors(plan_config(model), spec)}
        assert planned == {n: readable(m) for n, m in built.items()}, policy
        held, meta = {}, build_model(config, device="meta")
        for n, m in built.items(): held[readable(m)] = held.get(readable(m), 0) + meta.get_parameter(n).numel()
        assert {n: u.unsharded // 4 for n, u in units(model_tensors(plan_config(model), spec), spec).items() if u.unsharded} == held, policy


def test_size_based_wrap_planned_as_wrapped():
    "SIZE_BASED_WRAP reaches the planner with its threshold: at small's floor accelerate's rule wraps no layer, so neither does the plan."
    config, meta = plan_config("small"), build_model(model_config("small"), device="meta")
    assert replace(BASE, fsdp=FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP")).wrap_config.min_num_params == size_floor(meta) == 869_504
    size, none = (replace(BASE, fsdp=FSDPConfig(auto_wrap_policy=p, min_num_params=10**9)) for p in ("SIZE_BASED_WRAP", "NO_WRAP"))
    assert set(units(model_tensors(config, size), size)) == {"root", "embed", "tail"}
    assert predict_peak(config, size) == predict_peak(config, none) != predict_peak(config, BASE)
    assert size.label() == "small w2 full SIZE_BASED_WRAP reshard fp32 min1000000000"
    with pytest.raises(KitError, match="min_num_params=10000 is not allowed: 869,504 or more"):
        model_tensors(config, replace(BASE, fsdp=FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=10_000)))


@pytest.mark.parametrize("policy", ["PER_LINEAR", "MLP_ONLY", "TRANSFORMER_BASED_WRAP"])
def test_lora_adapters_in_their_linear_unit(policy):
    config = plan_config("tiny")
    spec = PlanSpec("tiny", 2, fsdp=FSDPConfig(auto_wrap_policy=policy), lora=LORA)
    tensors = {t.name: t.unit for t in model_tensors(config, spec)}
    adapters = [n for n in tensors if ".lora_" in n]
    assert len(adapters) == 2 * 7 * config.num_hidden_layers
    assert all(tensors[n] == tensors[n.rsplit(".", 1)[0] + ".weight"] for n in adapters)
    assert unit_map(build_model(config, device="meta"), spec.config) == {n: u for n, u in tensors.items() if ".lora_" not in n}


def test_refusals():
    "An added policy cannot replace a built-in one; unknown policies and thresholds are refused naming the field."
    with pytest.raises(KitError, match="min_num_params=-1 is not allowed"):
        replace(BASE, fsdp=FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=-1)).check()
    with pytest.raises(KitError, match="policy='MLP' is not allowed: one of .*PER_LINEAR, MLP_ONLY"):
        replace(BASE, fsdp=FSDPConfig(auto_wrap_policy="MLP")).check()
    with pytest.raises(KitError, match="name='NO_WRAP' is not allowed"): register_policy("NO_WRAP", lambda n, m: False)
    with pytest.raises(KitError, match="auto_wrap_policy='MLP_ONCE' is not allowed: one of .*MLP_ONLY"):
        FSDPConfig(auto_wrap_policy="MLP_ONCE").check()
