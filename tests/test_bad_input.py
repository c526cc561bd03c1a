"""Bad input at the command line, as a table: what the user typed, the exit code, and a phrase the one-line message holds.
Every row is refused before any process starts; none prints a traceback (see tests/badinput.py)."""
import pytest
from tests.badinput import Case, check_case

pytestmark = pytest.mark.timeout(60)
EP = "127.0.0.1:29400"
TRAIN = ["train", "--steps", "4"]
HF = ["hf", "--fsdp-config", "examples/fsdp_configs/transformers_fsdp_config.json"]


def rows():
    c = []
    # --json: where the result goes is checked before the run it would record
    c += [Case("json-folder", [*TRAIN, "--json", "{tmp}/d"], 2, "--json=", files={"d": None}),
          Case("json-under-a-file", [*TRAIN, "--json", "{tmp}/f/out.json"], 2, "--json=", files={"f": "x"}),
          Case("json-folder-env", ["env", "--json", "{tmp}/d"], 2, "a file path (this is a folder)", files={"d": None}),
          Case("json-folder-plan", ["plan", "--model", "tiny", "--json", "{tmp}/d"], 2, "--json=", files={"d": None})]
    # the planner's checkpointing policy
    c += [Case("plan-ac-unknown", ["plan", "--model", "tiny", "--ac", "selective"], 2,
               "--ac='selective' is not allowed: none, full, selective-layer:K"),
          Case("plan-ac-layer-0", ["plan", "--model", "tiny", "--ac", "selective-layer:0"], 2, "--ac='selective-layer:0' is not allowed"),
          Case("plan-ac-and-grad-ckpt", ["plan", "--model", "tiny", "--ac", "selective-op", "--grad-ckpt"], 2,
               "--ac='selective-op' is not allowed with --grad-ckpt"),
          Case("plan-ac-lora", ["plan", "--model", "tiny", "--ac", "selective-op", "--method", "lora"], 2,
               "none or full for a LoRA or QLoRA run")]
    # the planner's other terms: contradictions and settings it does not model
    P8 = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu-mem-gb", "96", "--batch", "2", "--seq-len", "8192"]
    c += [Case("plan-chunked-ce-no-logits", [*P8, "--chunked-ce", "99999"], 2,
               "--chunked-ce=99999 is not allowed: at most the 16384 tokens"),
          Case("plan-chunked-ce-0-tokens", [*P8, "--chunked-ce", "-1"], 2, "--chunked-ce="),
          Case("plan-fp8-fp32", [*P8, "--fp8-all-gather", "--precision", "fp32"], 2,
               "--fp8-all-gather=True is not allowed: False on an fp32"),
          Case("plan-fp8-lora", [*P8, "--fp8-all-gather", "--method", "lora"], 2, "--fp8-all-gather=True is not allowed"),
          Case("plan-precision-unknown", [*P8, "--precision", "fp16"], 2,
               "--precision='fp16' is not allowed: one of fp32, pure-bf16"),
          Case("plan-precision-contradicts", [*P8, "--precision", "pure-bf16", "--mixed-precision", "bf16"], 2,
               "is not allowed with --precision='pure-bf16'"),
          Case("plan-precision-lora", [*P8, "--precision", "pure-bf16", "--method", "qlora"], 2, "LoRA and QLoRA compute in bf16"),
          Case("plan-lora-targets", [*P8, "--method", "lora", "--lora-targets", "q_proj,lm_head"], 2,
               "--lora-targets='q_proj,lm_head' is not allowed: all-linear"),
          Case("plan-offload-activations-lora", [*P8, "--method", "lora", "--offload-activations"], 2,
               "--offload-activations=True is not allowed"),
          Case("plan-opt-in-bwd-qlora", [*P8, "--method", "qlora", "--optimizer-in-backward"], 2,
               "--optimizer-in-backward=True is not allowed")]
    # numbers of every launching command
    for cmd in ("train", "qlora", "cp-eval", "compare", "mesh"):
        c += [Case(f"{cmd}-timeout-{v}", [cmd, "--timeout", v], 2, "argument --timeout") for v in ("0", "-5", "nan", "inf", "abc")]
        c += [Case(f"{cmd}-nproc-{v}", [cmd, "--nproc", v], 2, "argument --nproc") for v in ("0", "-1", "abc", "1.5")]
    for opt, values in (("--steps", ("0", "-1")), ("--batch", ("0", "-3")), ("--seq-len", ("0",)), ("--lr", ("0", "-1", "inf", "nan")),
                        ("--seed", ("-1", str(2**70))), ("--warmup", ("-1",)), ("--lora", ("-1",))):
        c += [Case(f"train{opt}-{v}", [*TRAIN, opt, v], 2, f"{opt}=") for v in values]
    c += [Case("train-steps-text", [*TRAIN, "--steps", "ten"], 2, "--steps='ten' is not allowed: a whole number"),
          Case("train-mixed-precision-fp8", [*TRAIN, "--mixed-precision", "fp8"], 2, "--mixed-precision='fp8'"),
          Case("train-parity-bf16", [*TRAIN, "--check-parity", "--mixed-precision", "bf16"], 2, "--check-parity=True"),
          Case("train-parity-lora", [*TRAIN, "--check-parity", "--lora", "4"], 2, "--check-parity=True"),
          Case("train-lora-r-negative", [*TRAIN, "--lora-r", "-1"], 2, "--lora-r=-1"),
          Case("train-resume-no-ckpt", [*TRAIN, "--resume"], 2, "--resume needs --ckpt DIR"),
          Case("train-save-every-no-ckpt", [*TRAIN, "--save-every", "2"], 2, "--save-every needs --ckpt DIR"),
          Case("train-state-dict", [*TRAIN, "--ckpt", "{tmp}/ck", "--state-dict", "LOCAL"], 2, "--state-dict='LOCAL'"),
          Case("train-save-every-negative", [*TRAIN, "--ckpt", "{tmp}/ck", "--save-every", "-1"], 2, "--save-every=-1"),
          Case("train-keep-0", [*TRAIN, "--ckpt", "{tmp}/ck", "--keep", "0"], 2, "--keep=0"),
          Case("train-ckpt-is-a-file", [*TRAIN, "--ckpt", "{tmp}/f"], 2, "--ckpt=", files={"f": "x"}),
          # refused in the worker: 1 rank launched
          Case("train-batch-huge", [*TRAIN, "--batch", "100000000", "--nproc", "1"], 2, "--batch=100000000"),
          Case("train-model-unknown", [*TRAIN, "--model", "huge"], 2, "--model='huge'"),
          Case("train-model-missing-file", [*TRAIN, "--model", "{tmp}/none/config.json"], 2, "--model="),
          Case("train-unknown-option", [*TRAIN, "--stepz", "3"], 2, "unrecognized arguments: --stepz"),
          Case("train-ac-unknown", [*TRAIN, "--ac", "some"], 2, "--ac='some' is not allowed: none, full, selective-layer:K"),
          Case("train-layout-unknown", [*TRAIN, "--layout", "fsdp1"], 2, "--layout='fsdp1' is not allowed: one of accelerate, layers"),
          Case("train-ac-beside-the-config",
               [*TRAIN, "--ac", "selective-op", "--fsdp-config", "examples/fsdp_configs/transformers_fsdp_config.json"], 2,
               "--ac='selective-op' is not allowed: 'full' when the FSDP config sets activation_checkpointing=True")]
    # several nodes: the rendezvous settings
    NODES = [*TRAIN, "--nnodes", "2"]
    c += [Case("nodes-no-endpoint", NODES, 2, "--rdzv-endpoint=None"),
          Case("nodes-node-rank-2", [*NODES, "--node-rank", "2", "--rdzv-endpoint", EP], 2, "--node-rank=2"),
          Case("nodes-node-rank-neg", [*NODES, "--node-rank", "-1", "--rdzv-endpoint", EP], 2, "--node-rank=-1"),
          Case("nodes-nnodes-0", [*TRAIN, "--nnodes", "0"], 2, "argument --nnodes"),
          Case("nodes-rdzv-id-empty", [*NODES, "--rdzv-endpoint", EP, "--rdzv-id", ""], 2, "--rdzv-id=''"),
          Case("nodes-rdzv-id-blank", [*NODES, "--rdzv-endpoint", EP, "--rdzv-id", "  "], 2, "--rdzv-id='  '"),
          Case("nodes-rdzv-timeout-0", [*NODES, "--rdzv-endpoint", EP, "--rdzv-timeout", "0"], 2, "argument --rdzv-timeout"),
          Case("nodes-max-restarts-neg", [*TRAIN, "--max-restarts", "-1"], 2, "--max-restarts=-1")]
    c += [Case(f"nodes-endpoint-{i}", [*NODES, "--rdzv-endpoint", ep], 2, f"--rdzv-endpoint={ep!r}")
          for i, ep in enumerate(("notahost:abc", "127.0.0.1:0", "127.0.0.1:70000", "nohostcolon", ":29400", "host.invalid:29400"))]
    # injected faults
    c += [Case("fault-kind", [*TRAIN, "--inject-fault", "boom"], 2, "argument --inject-fault: invalid choice"),
          Case("fault-rank", [*TRAIN, "--inject-fault", "crash", "--fault-rank", "5"], 2, "--fault-rank=5"),
          Case("fault-step-0", [*TRAIN, "--inject-fault", "crash", "--fault-step", "0"], 2, "--fault-step=0"),
          Case("fault-step-last", [*TRAIN, "--inject-fault", "hang", "--fault-step", "4"], 2, "--fault-step=4")]
    # qlora
    Q = ["qlora", "--steps", "2"]
    c += [Case("qlora-storage", [*Q, "--quant-storage", "int4"], 2, "--quant-storage='int4'"),
          Case("qlora-mixed-precision", [*Q, "--mixed-precision", "fp8"], 2, "--mixed-precision='fp8'"),
          Case("qlora-autocast", [*Q, "--autocast", "bfloat16"], 2, "--autocast='bfloat16' is not allowed: no, bf16 or fp16"),
          Case("qlora-float32-under-bf16", [*Q, "--quant-storage", "float32", "--mixed-precision", "bf16"], 2,
               "--quant-storage=float32 --mixed-precision=no --autocast=bf16"),
          Case("qlora-8bit", [*Q, "--load-in-8bit"], 2, "--load-in-8bit=True"),
          Case("qlora-lora-r-0", [*Q, "--lora-r", "0"], 2, "--lora-r=0"),
          Case("qlora-steps-0", [*Q, "--steps", "0"], 2, "--steps=0"),
          Case("qlora-lr-nan", [*Q, "--lr", "nan"], 2, "--lr=nan"),
          Case("qlora-seed-neg", [*Q, "--seed", "-1"], 2, "--seed=-1"),
          Case("qlora-batch-huge", [*Q, "--batch", "100000000", "--nproc", "1"], 2, "--batch=100000000"),
          Case("qlora-model-unknown", [*Q, "--model", "huge"], 2, "--model='huge'")]
    # cp-eval
    CP = ["cp-eval"]
    c += [Case("cp-size-3", [*CP, "--cp", "3"], 2, "--cp"),
          Case("cp-rotate", [*CP, "--rotate", "ring"], 2, "--rotate='ring'"),
          Case("cp-seq-len-130", [*CP, "--seq-len", "130"], 2, "--seq-len=130"),
          Case("cp-seq-len-0", [*CP, "--seq-len", "0"], 2, "--seq-len=0"),
          Case("cp-mask", [*CP, "--mask", "padding"], 2, "padding"),
          Case("cp-rows-0", [*CP, "--rows", "0"], 2, "--rows=0"),
          Case("cp-rows-not-a-multiple", [*CP, "--nproc", "4", "--rows", "3"], 2,
               "--rows=3 is not allowed: a whole number >= 1, a multiple of the data-parallel size"),
          Case("cp-batch-0", [*CP, "--batch", "0"], 2, "--batch=0"),
          Case("cp-dp-shard-3", [*CP, "--dp-shard", "3"], 2, "--dp-shard=3"),
          Case("cp-sp-2", [*CP, "--sp", "2"], 2, "--sp=2"),
          Case("cp-seed-neg", [*CP, "--seed", "-1"], 2, "--seed=-1")]
    # mesh, compare
    c += [Case("mesh-dp-shard-3", ["mesh", "--dp-shard", "3"], 2, "--dp-shard=3"),
          Case("mesh-cp-3", ["mesh", "--cp", "3"], 2, "--cp=3"),
          Case("mesh-replicate-0", ["mesh", "--dp-replicate", "0"], 2, "--dp-replicate=0"),
          Case("compare-policy", ["compare", "--policies", "FOO"], 2, "--policies"),
          Case("compare-reshard", ["compare", "--reshard", "maybe"], 2, "reshard"),
          Case("compare-min-params", ["compare", "--min-num-params", "-1"], 2, "--min-num-params=-1"),
          Case("compare-batch-0", ["compare", "--batch", "0"], 2, "--batch=0"),
          Case("compare-fsdp-config-missing", ["compare", "--fsdp-config", "{tmp}/none.yaml"], 2, "none.yaml")]
    # slurm, hf, ckpt, the command itself
    S = ["slurm", "--nodes", "2", "--gpus-per-node", "8"]
    c += [Case("slurm-nodes-0", ["slurm", "--nodes", "0", "--gpus-per-node", "8", "--", "train"], 2, "--nodes=0"),
          Case("slurm-gpus-0", ["slurm", "--nodes", "2", "--gpus-per-node", "0", "--", "train"], 2, "--gpus-per-node=0"),
          Case("slurm-no-command", S, 2, "train ..."),
          Case("slurm-not-train", [*S, "--", "plan"], 2, "train ..."),
          Case("slurm-node-options", [*S, "--", "train", "--nnodes", "2"], 2, "no node options"),
          Case("slurm-no-nodes", ["slurm", "--gpus-per-node", "8"], 2, "the following arguments are required: --nodes"),
          Case("hf-missing-file", ["hf", "--fsdp-config", "{tmp}/none.json"], 2, "--fsdp-config='"),
          Case("hf-no-file", ["hf"], 2, "the following arguments are required: --fsdp-config"),
          Case("hf-run-unknown", [*HF, "--run", "dpo"], 2, "--run='dpo' is not allowed: one of trainer, sft, qlora, native"),
          Case("hf-run-sft-json", [*HF, "--run", "sft"], 2, "is not allowed: a .yaml or .yml file for sft"),
          Case("hf-run-trainer-1-step", [*HF, "--run", "trainer", "--steps", "1"], 2, "--steps=1 is not allowed: 2 or more for trainer"),
          Case("hf-run-and-check", [*HF, "--run", "trainer", "--check"], 2, "--check and --run: pick one"),
          Case("hf-run-native-1-rank", [*HF, "--run", "native", "--nproc", "1"], 2, "--nproc=1 is not allowed: 2 or more for native"),
          Case("ckpt-missing-folder", ["ckpt", "{tmp}/none"], 2, "error: DIR='"),
          Case("ckpt-a-file", ["ckpt", "{tmp}/f"], 2, "an existing checkpoint folder", files={"f": "x"}),
          Case("no-command", [], 2, "the following arguments are required: command"),
          Case("unknown-command", ["trian"], 2, "invalid choice: 'trian'"),
          Case("env-unknown-option", ["env", "--nproc", "2"], 2, "unrecognized arguments: --nproc")]
    # an empty or blank comma list is a bad value, not an option left out (plan --lora-targets '' planned all-linear)
    P = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--method", "lora"]
    c += [Case(f"{name}-{kind}", [*argv, value], 2, f"{argv[-1]}={value!r} is not allowed: one or more values joined by commas, none")
          for name, argv in (("plan-lora-targets", [*P, "--lora-targets"]), ("plan-settings", ["plan", "--validate", "--settings"]),
                             ("compare-policies", ["compare", "--policies"]),
                             ("compare-reshard-list", ["compare", "--reshard-after-forward"]),
                             ("train-layer-classes", [*TRAIN, "--transformer-layer-cls-to-wrap"]))
          for kind, value in (("empty", ""), ("blank", "  "), ("empty-item", "a,,b"))]
    # a checkpoint folder another run left checkpoints in: refused without --resume or --overwrite-ckpt (it lost them before)
    c += [Case("train-ckpt-another-run", [*TRAIN, "--ckpt", "{tmp}/ck"], 2,
               "holds 2 checkpoint(s) of another run (step-000002, step-000004): a new run there would put its own among them. Continue "
               "that run with --resume, replace its checkpoints with --overwrite-ckpt",
               files={"ck/step-000002": None, "ck/step-000004": None}),
          Case("train-overwrite-and-resume", [*TRAIN, "--ckpt", "{tmp}/ck", "--resume", "--overwrite-ckpt"], 2,
               "--overwrite-ckpt=True is not allowed: False with --resume=True"),
          Case("train-overwrite-no-ckpt", [*TRAIN, "--overwrite-ckpt"], 2, "--overwrite-ckpt needs --ckpt DIR")]
    # a result that cannot be written: one line and exit 74, not a traceback (the plan's text raised OSError under ulimit -f)
    c += [Case("plan-stdout-past-ulimit", ["plan", "--model", "llama-3-8b", "--gpus", "8"], 74,
               "plan: error: could not write the result to stdout (File too large: the file-size limit, ulimit -f)", fsize=1024),
          Case("plan-json-past-ulimit", ["plan", "--model", "tiny", "--gpus", "2", "--json", "{tmp}/p.json"], 74,
               "--json='{tmp}/p.json': could not write it (File too large: the file-size limit, ulimit -f)", fsize=2048)]
    c += file_rows()
    return c


QWEN = "examples/configs/qwen2-tiny/config.json"
GOOD = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
YAML = "distributed_type: FSDP\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 2\n"
LAUGHS = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"  fsdp_{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefghijklmno", "bcdefghijklmnop"))  # 9**16 strings once expanded
BROKEN = {  # a file the upstream runners would read, and a phrase of its one-line refusal; name -> (file, contents, phrase)
    "size": ("big.json", GOOD | {"pad": "x" * 2_000_000}, "a file of at most 1,048,576 bytes"),
    "unknown-keys": ("keys.json", {f"k{i}": 0 for i in range(100_000)} | GOOD, "a file of at most 1,048,576 bytes"),  # 1.5 MB
    "aliases": ("laughs.yaml", LAUGHS, "a YAML file without aliases (*name)"),
    "binary": ("bin.yaml", bytes(range(256)) * 4, "(a binary file?)"),
    "nul": ("nul.json", b'{"version": 2}\0\0', "is NUL (a binary file?)"),
    "empty": ("empty.yaml", "\n \n", "the file is empty"),
    "tabs": ("tabs.yaml", "distributed_type: FSDP\nfsdp_config:\n\tfsdp_version: 2\n", "(a tab: YAML indents with spaces)"),
    "deep": ("deep.json", '{"version": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "deeper than Python's parser goes"),
    "version-json": ("v3.json", GOOD | {"version": 3}, "version=3 is not allowed: 1 or 2"),
    "version-yaml": ("v3.yaml", YAML.replace("fsdp_version: 2", "fsdp_version: 3"), "version=3 is not allowed: 1 or 2"),
    "type-bool": ("offload.json", GOOD | {"cpu_offload": "maybe"}, "offload.json: cpu_offload='maybe' is not allowed: true or false"),
    "type-list": ("classes.json", GOOD | {"transformer_layer_cls_to_wrap": 5}, "classes.json: transformer_layer_cls_to_wrap=5 is not"),
    "type-top-level": ("procs.yaml", YAML + "num_processes: many\n", "num_processes='many' is not allowed: a whole number"),
    "type-section": ("section.yaml", "distributed_type: FSDP\nfsdp_config: [1, 2]\n", "fsdp_config=[1, 2] is not allowed: a mapping"),
    "unknown-top-level": ("top.yaml", YAML + "fsdp_confg: {}\n", "unknown key 'fsdp_confg'"),
}
COMMANDS = {  # the commands that hand a file to an upstream runner, with {file} for its path
    "hf-check": ["hf", "--fsdp-config", "{file}", "--check"],
    "hf-run": ["hf", "--fsdp-config", "{file}", "--run", "trainer"],
    "hf-run-sft": ["hf", "--fsdp-config", "{file}", "--run", "sft"],
    "doctor": ["doctor", "--model", QWEN, "--fsdp-config", "{file}"],
}


def file_rows() -> list:
    "Each broken file given to each command that hands it to an upstream runner: refused in the parent, one line, exit 2."
    c = []
    for cmd, argv in COMMANDS.items():
        for name, (file, content, phrase) in BROKEN.items():
            if cmd == "hf-run-sft" and file.endswith(".json") or cmd == "hf-run" and file.endswith(".yaml"): continue  # refused by suffix
            c.append(Case(f"{cmd}-file-{name}", [a.replace("{file}", f"{{tmp}}/{file}") for a in argv], 2, phrase, files={file: content}))
    # a value read from a file names the file and its key, never an option of the command (compare has --reshard and --min-num-params)
    c += [Case("compare-file-reshard", ["compare", "--fsdp-config", "{tmp}/r.json"], 2, "r.json: reshard_after_forward='sometimes' is not",
               files={"r.json": GOOD | {"reshard_after_forward": "sometimes"}}),
          Case("compare-file-min-num-params", ["compare", "--fsdp-config", "{tmp}/m.json"], 2, "m.json: min_num_params=-5 is not allowed",
               files={"m.json": GOOD | {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": -5}}),
          Case("train-file-mixed-precision", ["train", "--fsdp-config", "{tmp}/p.yaml"], 2, "p.yaml: mixed_precision='fp8' is not allowed",
               files={"p.yaml": YAML.replace("'no'", "fp8")}),
          Case("hf-check-file-is-a-folder", ["hf", "--fsdp-config", "{tmp}/d.json", "--check"], 2, "--fsdp-config=",
               files={"d.json": None}),
          Case("hf-check-missing-file", ["hf", "--fsdp-config", "{tmp}/none.json", "--check"], 2, "--fsdp-config='")]
    # the Trainer would build FSDP1 from this file; on CPU accelerate 1.16.0 stopped it inside the workers
    c += [Case("hf-run-fsdp1-json", ["hf", "--fsdp-config", "{tmp}/v1.json", "--run", "trainer"], 2, "builds FSDP1 from it",
               files={"v1.json": GOOD | {"version": 1}})]
    # output folders: checked before any work
    HF = ["hf", "--fsdp-config", "examples/fsdp_configs/transformers_fsdp_config.json", "--run", "trainer"]
    DOCTOR = ["doctor", "--model", QWEN, "--fsdp-config", "examples/fsdp_configs/accelerate_fsdp_qlora.yaml"]
    c += [Case("hf-run-out-under-a-file", [*HF, "--out", "{tmp}/f/out"], 2, "--out='", files={"f": "x"}),
          Case("hf-run-out-is-a-file", [*HF, "--out", "{tmp}/f"], 2, "a folder path (this is a file)", files={"f": "x"}),
          Case("hf-run-out-read-only", [*HF, "--out", "/proc/fsdp_kit_out"], 2,
               "--out='/proc/fsdp_kit_out' is not allowed: a folder that can be written"),  # /proc takes no files, even from root
          Case("doctor-out-under-a-file", [*DOCTOR, "--out", "{tmp}/f/out"], 2, "--out='", files={"f": "x"}),
          Case("doctor-out-read-only", [*DOCTOR, "--out", "/proc/fsdp_kit_out"], 2, "a folder that can be written")]
    return c


CASES = rows()


def test_the_table_has_unique_ids():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_in_one_line(case, tmp_path):
    check_case(case, tmp_path)


def test_json_onto_a_symlink_or_a_pipe_is_refused_and_left_as_it_was(tmp_path):
    "--json writes a regular file only: a rename over a symlink (or a device, as root /dev/null) would replace the link itself."
    import os
    from tests.badinput import refused
    (tmp_path / "target.json").write_text("keep")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    os.mkfifo(tmp_path / "pipe")
    refused(["env", "--json", tmp_path / "link.json"], "--json=", tmp_path)
    refused(["env", "--json", tmp_path / "link.json"], "this is a symbolic link", tmp_path)
    refused(["env", "--json", tmp_path / "pipe"], "this is not a regular file", tmp_path)
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "target.json").read_text() == "keep"


@pytest.mark.parametrize("name", ["size", "aliases", "three-million-keys"])
def test_huge_or_expanding_files_are_refused_fast(name, tmp_path):
    """A 50 MB config (was parsed 11 times: over 300 s), a JSON of 3 million unknown keys (a note per key: over 300 s) and a
    billion-laughs YAML (MemoryError) are refused by the command in one line, exit 2, before anything is parsed at length."""
    import json, subprocess, sys, time
    path = tmp_path / ("laughs.yaml" if name == "aliases" else "big.json")
    if name == "aliases": path.write_text(LAUGHS)
    elif name == "size": path.write_text(json.dumps(GOOD | {"pad": "x" * 50_000_000}))
    else: path.write_text(json.dumps(GOOD)[:-1] + "".join(f', "k{i}": 0' for i in range(3_000_000)) + "}")  # 44 MB
    start = time.monotonic()
    workflow = "trainer" if path.suffix == ".json" else "sft"
    res = subprocess.run([sys.executable, "-m", "fsdp_kit", "hf", "--fsdp-config", str(path), "--run", workflow],
                         capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - start
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "a YAML file without aliases" in res.stderr if name == "aliases" else "a file of at most 1,048,576 bytes" in res.stderr
    assert seconds < 10, f"refused after {seconds:.1f} s"  # 0.3-0.4 s measured on 2 shared cores (load 10); room for a busier machine
