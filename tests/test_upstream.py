"""`fsdp-kit hf --fsdp-config FILE --json` reports what accelerate launch / TrainingArguments build from FILE."""
# checked here against accelerate and transformers called directly, for every upstream-style file.
import json, os, subprocess, sys
from unittest import mock
import pytest
import yaml
from fsdp_kit.cli import main
from fsdp_kit.upstream import FIELDS
from tests.conftest import ROOT

FILES = sorted((ROOT / "examples" / "upstream_configs").iterdir()) + sorted((ROOT / "examples" / "fsdp_configs").iterdir())
FRESH = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))}
TRAINING_ARGUMENTS = """import json, sys, tempfile
from transformers import TrainingArguments
out = {}
for path in sys.argv[1:]:
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), fsdp=True, fsdp_config=path, use_cpu=True, report_to="none")
    out[path] = [args.fsdp_plugin_args, args.mixed_precision]
# the other direction: TrainingArguments accept what the kit's training_arguments(cfg) spells, and read back as cfg
from fsdp_kit.config import FSDPConfig
from fsdp_kit.hf import training_arguments, from_training_arguments, _same
cfg = FSDPConfig(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000, reshard_after_forward=False, mixed_precision="bf16")
args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to=[], **training_arguments(cfg))
out["kit"] = dict(fsdp_config={k: args.fsdp_config[k] for k in ("reshard_after_forward", "min_num_params")}, bf16=args.bf16,
                  same=_same(from_training_arguments(args), cfg))
print(json.dumps(out))
"""  # in a process of its own: importing TrainingArguments imports peft and bitsandbytes, which would stop later tests from forking


def is_accelerate(path) -> bool:
    data = yaml.safe_load(path.read_text())
    return "distributed_type" in data or "fsdp_config" in data


@pytest.fixture(scope="module")
def training_arguments_process():
    "A process computing TrainingArguments for every JSON file, started before the reports so that the two overlap."
    paths = [str(p) for p in FILES if not is_accelerate(p)]
    proc = subprocess.Popen([sys.executable, "-c", TRAINING_ARGUMENTS, *paths], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=FRESH)
    yield proc
    proc.kill(); proc.wait()


@pytest.fixture(scope="module")
def trainer_args(training_arguments_process):
    "TrainingArguments(fsdp=True, fsdp_config=FILE).fsdp_plugin_args and .mixed_precision for every JSON file."
    out, err = training_arguments_process.communicate(timeout=300)
    assert training_arguments_process.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reports(training_arguments_process, tmp_path_factory):
    "What `fsdp-kit hf --fsdp-config FILE --json OUT` writes, for every file (in process)."
    out = {}
    for path in FILES:
        dest = tmp_path_factory.mktemp("hf") / "out.json"
        assert main(["hf", "--fsdp-config", str(path), "--json", str(dest)]) in (0, None), path
        out[path.name] = json.loads(dest.read_text())
    return out


def a_gpu_for_fsdp1():
    "FSDP1 with sync_module_states asks for the current GPU."
    # accelerate <= 1.15 through is_cuda_available, >= 1.16 through get_torch_accelerator_backend.
    import contextlib, torch
    import accelerate.utils.dataclasses as dc
    stack = contextlib.ExitStack()
    if hasattr(dc, "get_torch_accelerator_backend"):
        stack.enter_context(mock.patch.object(dc, "get_torch_accelerator_backend", return_value=("cuda", torch.cuda)))
    else: stack.enter_context(mock.patch.object(dc, "is_cuda_available", return_value=True))
    stack.enter_context(mock.patch("torch.cuda.current_device", return_value=0))
    return stack


def upstream_plugin(path, trainer_args):
    "accelerate's FSDP plugin as the file's entry point builds it, with accelerate's and transformers' own calls."
    # a GPU lookup is stubbed for FSDP1
    from accelerate.commands.launch import launch_command_parser, _validate_launch_command
    from accelerate.utils.launch import prepare_multi_gpu_env
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.parallelism_config import ParallelismConfig
    with mock.patch.dict(os.environ, FRESH, clear=True):
        if is_accelerate(path):
            extra = [] if yaml.safe_load(path.read_text()).get("num_processes") else ["--num_processes", "2"]
            args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), *extra, "train.py"]))
            env, kwargs, mixed = prepare_multi_gpu_env(args), {}, None
            mixed = env["ACCELERATE_MIXED_PRECISION"]
        else:
            env, (kwargs, mixed) = dict(FRESH), trainer_args[str(path)]
    with mock.patch.dict(os.environ, env, clear=True), a_gpu_for_fsdp1():
        plugin = FullyShardedDataParallelPlugin(**kwargs)
        if mixed != "no": plugin.set_mixed_precision(mixed)
        parallelism = ParallelismConfig() if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true" else None
    return plugin, mixed, parallelism


def expected_reading(plugin, mixed, parallelism) -> dict:
    "The plugin's fields under FSDPConfig's names."
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY
    v2 = plugin.fsdp_version == 2
    policy = {transformer_auto_wrap_policy: "TRANSFORMER_BASED_WRAP", size_based_auto_wrap_policy: "SIZE_BASED_WRAP",
              None: "NO_WRAP"}[plugin.auto_wrap_policy]
    mp = plugin.mixed_precision_policy
    names = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
    return dict(fsdp_version=plugin.fsdp_version,
                reshard_after_forward=plugin.reshard_after_forward if v2
                else FSDP_SHARDING_STRATEGY[(plugin.sharding_strategy or plugin.reshard_after_forward).value - 1],
                auto_wrap_policy=policy, transformer_layer_cls_to_wrap=list(plugin.transformer_cls_names_to_wrap or []),
                min_num_params=plugin.min_num_params if policy == "SIZE_BASED_WRAP" else 0,
                cpu_offload=isinstance(plugin.cpu_offload, CPUOffloadPolicy) if v2 else plugin.cpu_offload.offload_params,
                mixed_precision=mixed, reduce_dtype=None if mp is None or mp.reduce_dtype == mp.param_dtype
                else names[str(mp.reduce_dtype)],
                activation_checkpointing=plugin.activation_checkpointing, state_dict_type=plugin.state_dict_type.name,
                cpu_ram_efficient_loading=plugin.cpu_ram_efficient_loading,
                parallelism_config=None if parallelism is None
                else {k: getattr(parallelism, k) for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")})


def test_enough_upstream_style_files():
    assert len(FILES) >= 15 and {p.suffix for p in FILES} == {".yaml", ".json"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_hf_reports_what_upstream_builds_and_notes_every_difference(path, reports, trainer_args):
    report = reports[path.name]
    expected = expected_reading(*upstream_plugin(path, trainer_args))
    assert {k: report["upstream"][k] for k in expected} == expected
    noted = {name for name in FIELDS if any(n.startswith(f"{name}=") for n in report["notes"])}
    differing = {name for name in FIELDS if report["config"][name] != report["upstream"][name]}
    assert differing <= noted, (differing - noted, report["notes"])
    if differing: assert expected["fsdp_version"] == 1 and any("runs this file with FSDP1" in n for n in report["notes"])


def test_training_arguments_accept_what_the_kit_spells(trainer_args):
    assert trainer_args["kit"] == dict(fsdp_config=dict(reshard_after_forward=False, min_num_params=1000), bf16=True, same=True)


def test_the_helper_keeps_peft_out_of_this_process(reports):
    assert [lib for lib in ("peft", "bitsandbytes") if lib in sys.modules] == []


def test_commands_share_one_helper_and_an_interrupted_question_ends_it(reports):
    "Every in-process command of this process asked the same helper; a question interrupted before its answer ends that helper."
    from fsdp_kit import upstream
    path = str(ROOT / "examples" / "fsdp_configs" / "transformers_fsdp_config.json")
    import psutil, time
    began = time.time()
    helpers = lambda: [p.pid for p in psutil.Process().children() if "serve_plugin_args" in " ".join(p.cmdline())]
    helper = upstream.transformers_helper()
    # one for every command the reports ran, left alive by their janitors
    assert helpers() == [helper.pid] and psutil.Process(helper.pid).create_time() < began
    assert upstream.trainer_plugin_args(path) == upstream.trainer_plugin_args(path)
    assert upstream.transformers_helper() is helper and helpers() == [helper.pid]

    class Interrupted:
        def readline(self): raise KeyboardInterrupt  # Ctrl-C while the helper computes
    with mock.patch.object(helper, "stdout", Interrupted()), pytest.raises(KeyboardInterrupt):
        upstream.trainer_plugin_args(path)
    assert helper.poll() is not None  # ended: its answer can reach no later question
    assert upstream.trainer_plugin_args(path)[0]["fsdp_version"] == 2 and upstream.transformers_helper() is not helper
