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
    c += [Case("plan-ac-unknown", ["plan", "--model", "tiny", "--ac", "selective"], 2, "--ac='selective' is not allowed: none, full, selective-layer:K"),
          Case("plan-ac-layer-0", ["plan", "--model", "tiny", "--ac", "selective-layer:0"], 2, "--ac='selective-layer:0' is not allowed"),
          Case("plan-ac-and-grad-ckpt", ["plan", "--model", "tiny", "--ac", "selective-op", "--grad-ckpt"], 2, "--ac='selective-op' is not allowed with --grad-ckpt"),
          Case("plan-ac-lora", ["plan", "--model", "tiny", "--ac", "selective-op", "--method", "lora"], 2, "none or full for a LoRA or QLoRA run")]
    # the planner's other terms: contradictions and settings it does not model
    P8 = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu-mem-gb", "96", "--batch", "2", "--seq-len", "8192"]
    c += [Case("plan-chunked-ce-no-logits", [*P8, "--chunked-ce", "99999"], 2, "--chunked-ce=99999 is not allowed: at most the 16384 tokens"),
          Case("plan-chunked-ce-0-tokens", [*P8, "--chunked-ce", "-1"], 2, "--chunked-ce="),
          Case("plan-fp8-fp32", [*P8, "--fp8-all-gather", "--precision", "fp32"], 2, "--fp8-all-gather=True is not allowed: False on an fp32"),
          Case("plan-fp8-lora", [*P8, "--fp8-all-gather", "--method", "lora"], 2, "--fp8-all-gather=True is not allowed"),
          Case("plan-precision-unknown", [*P8, "--precision", "fp16"], 2, "--precision='fp16' is not allowed: one of fp32, accelerate-bf16, bf16-fp32-reduce, pure-bf16"),
          Case("plan-precision-contradicts", [*P8, "--precision", "pure-bf16", "--mixed-precision", "bf16"], 2, "is not allowed with --precision='pure-bf16'"),
          Case("plan-precision-lora", [*P8, "--precision", "pure-bf16", "--method", "qlora"], 2, "LoRA and QLoRA compute in bf16"),
          Case("plan-lora-targets", [*P8, "--method", "lora", "--lora-targets", "q_proj,lm_head"], 2, "--lora-targets='q_proj,lm_head' is not allowed: all-linear"),
          Case("plan-offload-activations-lora", [*P8, "--method", "lora", "--offload-activations"], 2, "--offload-activations=True is not allowed"),
          Case("plan-opt-in-bwd-qlora", [*P8, "--method", "qlora", "--optimizer-in-backward"], 2, "--optimizer-in-backward=True is not allowed")]
    # numbers of every launching command
    for cmd in ("train", "qlora", "cp-eval", "compare", "mesh"):
        c += [Case(f"{cmd}-timeout-{v}", [cmd, "--timeout", v], 2, "argument --timeout") for v in ("0", "-5", "nan", "inf", "abc")]
        c += [Case(f"{cmd}-nproc-{v}", [cmd, "--nproc", v], 2, "argument --nproc") for v in ("0", "-1", "abc", "1.5")]
    for opt, values in (("--steps", ("0", "-1")), ("--batch", ("0", "-3")), ("--seq-len", ("0",)), ("--lr", ("0", "-1", "inf", "nan")),
                        ("--seed", ("-1", str(2**70))), ("--warmup", ("-1",)), ("--lora", ("-1",))):
        c += [Case(f"train{opt}-{v}", [*TRAIN, opt, v], 2, f"{opt}=") for v in values]
    c += [Case("train-steps-text", [*TRAIN, "--steps", "ten"], 2, "argument --steps"),
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
          Case("train-batch-huge", [*TRAIN, "--batch", "100000000", "--nproc", "1"], 2, "--batch=100000000"),  # refused in the worker: 1 rank launched
          Case("train-model-unknown", [*TRAIN, "--model", "huge"], 2, "--model='huge'"),
          Case("train-model-missing-file", [*TRAIN, "--model", "{tmp}/none/config.json"], 2, "--model="),
          Case("train-unknown-option", [*TRAIN, "--stepz", "3"], 2, "unrecognized arguments: --stepz"),
          Case("train-ac-unknown", [*TRAIN, "--ac", "some"], 2, "--ac='some' is not allowed: none, full, selective-layer:K"),
          Case("train-ac-beside-the-config", [*TRAIN, "--ac", "selective-op", "--fsdp-config", "examples/fsdp_configs/transformers_fsdp_config.json"], 2,
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
          Case("qlora-float32-under-bf16", [*Q, "--quant-storage", "float32", "--mixed-precision", "bf16"], 2, "--quant-storage=float32 --mixed-precision=no --autocast=bf16"),
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
          Case("cp-rows-not-a-multiple", [*CP, "--nproc", "4", "--rows", "3"], 2, "--rows=3 is not allowed: a whole number >= 1, a multiple of the data-parallel size"),
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
          Case("hf-missing-file", ["hf", "--fsdp-config", "{tmp}/none.json"], 2, "none.json"),
          Case("hf-no-file", ["hf"], 2, "the following arguments are required: --fsdp-config"),
          Case("hf-run-unknown", [*HF, "--run", "dpo"], 2, "--run='dpo' is not allowed: one of trainer, sft, qlora, native"),
          Case("hf-run-sft-json", [*HF, "--run", "sft"], 2, "is not allowed: a .yaml or .yml file for sft"),
          Case("hf-run-trainer-1-step", [*HF, "--run", "trainer", "--steps", "1"], 2, "--steps=1 is not allowed: 2 or more for trainer"),
          Case("hf-run-and-check", [*HF, "--run", "trainer", "--check"], 2, "--check and --run: pick one"),
          Case("hf-run-native-1-rank", [*HF, "--run", "native", "--nproc", "1"], 2, "--nproc=1 is not allowed: 2 or more for native"),
          Case("ckpt-missing-folder", ["ckpt", "{tmp}/none"], 2, "an existing checkpoint folder"),
          Case("ckpt-a-file", ["ckpt", "{tmp}/f"], 2, "an existing checkpoint folder", files={"f": "x"}),
          Case("no-command", [], 2, "the following arguments are required: command"),
          Case("unknown-command", ["trian"], 2, "invalid choice: 'trian'"),
          Case("env-unknown-option", ["env", "--nproc", "2"], 2, "unrecognized arguments: --nproc")]
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
