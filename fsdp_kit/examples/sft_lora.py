"""LoRA or QLoRA supervised fine-tuning under FSDP2, after PEFT's examples/sft/train.py.

TRL's SFTTrainer, LoRA on all-linear:

    accelerate to-fsdp2 --config_file examples/fsdp_configs/accelerate_fsdp_lora.yaml --output_file runs/fsdp2.yaml
    accelerate launch --config_file runs/fsdp2.yaml --num_processes 2 examples/sft_lora.py \
        --model_name_or_path runs/base --dataset_path runs/data.jsonl --output_dir runs/sft --max_steps 10

QLoRA adds `--use_4bit_quantization True --bnb_4bit_compute_dtype bfloat16 --bnb_4bit_quant_storage_dtype bfloat16
--bf16 True` (the storage dtype matches the compute dtype, so FSDP2 can shard the packed 4-bit weights). `fsdp-kit hf
--run sft` (or `--run qlora`) makes the base folder and the data set locally and runs these two commands. On a machine
without CUDA the script calls `fsdp_kit.hf.enable_cpu_fsdp()`, which lets accelerate take its FSDP branch on CPU;
everything after it is accelerate's, transformers', TRL's and PEFT's own code.
"""
import json, os, sys
from dataclasses import dataclass, field, asdict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, HfArgumentParser, set_seed
from peft import LoraConfig, PeftModel
from trl import SFTConfig, SFTTrainer

from fsdp_kit.hf import enable_cpu_fsdp
from fsdp_kit.hf_run import HFRunResult, confirm_fsdp2, full_state_dict, trainer_losses
from fsdp_kit.ranks import gather_objects


@dataclass
class ModelArguments:
    "Which model to fine-tune and how (PEFT's example's names)."
    model_name_or_path: str = field(metadata={"help": "a pretrained model folder (here: made locally)"})
    lora_r: int = field(default=8)
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.0)
    lora_target_modules: str = field(default="all-linear",
                                     metadata={"help": "comma-separated module names, or all-linear"})
    use_4bit_quantization: bool = field(default=False)
    use_nested_quant: bool = field(default=False)
    bnb_4bit_compute_dtype: str = field(default="bfloat16")
    bnb_4bit_quant_type: str = field(default="nf4")
    bnb_4bit_quant_storage_dtype: str = field(default="bfloat16")


@dataclass
class DataArguments:
    "The text data set, and where the run's result goes."
    dataset_path: str = field(metadata={"help": "JSON lines with a 'text' field"})
    result_json: str = field(default=None, metadata={"help": "rank 0 writes what the run did here"})


def create_and_prepare_model(args: ModelArguments):
    "The base model (4-bit with bitsandbytes when asked), the LoRA config and the tokenizer."
    quantization = None
    if args.use_4bit_quantization:
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.bnb_4bit_quant_type,
                                          bnb_4bit_compute_dtype=getattr(torch, args.bnb_4bit_compute_dtype),
                                          bnb_4bit_use_double_quant=args.use_nested_quant,
                                          bnb_4bit_quant_storage=getattr(torch, args.bnb_4bit_quant_storage_dtype))
    dtype = getattr(torch, args.bnb_4bit_quant_storage_dtype) if quantization else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, quantization_config=quantization,
                                                 dtype=dtype)
    targets = args.lora_target_modules
    if targets != "all-linear": targets = targets.split(",")
    peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             target_modules=targets, task_type="CAUSAL_LM")
    return model, peft_config, AutoTokenizer.from_pretrained(args.model_name_or_path)


def unpacked_4bit(model):
    """Keep bitsandbytes' 4-bit layers in training mode (they hold no dropout, so their output is the same): on a CPU
    with avx512_bf16, an eval-mode, no-grad forward repacks their weights in place for its CPU kernel, which needs
    out_features divisible by its block size ("N must be divisible by block_n"): a tiny model's layers are not."""
    import bitsandbytes as bnb
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit): m.train()
    return model


def reload_check(model_args: ModelArguments, adapter_dir: str, trained: dict, batch) -> dict:
    """Load the saved adapter onto a fresh base with PeftModel.from_pretrained; compare its LoRA weights with the
    trained ones."""
    base, _, _ = create_and_prepare_model(model_args)
    unpacked_4bit(base)
    base_loss = base(**batch).loss.item()
    reloaded = unpacked_4bit(PeftModel.from_pretrained(base, adapter_dir))
    state = reloaded.state_dict()
    lora = {k: v for k, v in trained.items() if "lora_" in k}
    diff = max((state[k].float() - v.float()).abs().max().item() for k, v in lora.items())
    return dict(adapter_tensors=len(lora), max_adapter_diff=diff, base_loss=base_loss,
                reloaded_loss=reloaded(**batch).loss.item(), files=sorted(os.listdir(adapter_dir)))


def main(model_args: ModelArguments, data_args: DataArguments, training_args: SFTConfig):
    enable_cpu_fsdp(say=not torch.cuda.is_available())
    set_seed(training_args.seed)
    from datasets import load_dataset
    model, peft_config, tokenizer = create_and_prepare_model(model_args)
    weights_on = next(model.parameters()).device.type  # "meta" on ranks > 0 under FSDP_CPU_RAM_EFFICIENT_LOADING=true
    dataset = load_dataset("json", data_files=data_args.dataset_path, split="train")
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config)
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    # PEFT's policy (LoRA layers in their own units) is an FSDP1 callable: accelerate's FSDP2 path reads only the
    # file's policy, and would wrap no decoder layer given this one
    if plugin is not None and plugin.fsdp_version == 1:
        from peft.utils.other import fsdp_auto_wrap_policy
        plugin.auto_wrap_policy = fsdp_auto_wrap_policy(trainer.model)
    trainer.train()
    facts = confirm_fsdp2(trainer.model_wrapped, "SFTTrainer")
    loading = dict(FSDP_CPU_RAM_EFFICIENT_LOADING=os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING"),
                   weights_on=gather_objects(weights_on))
    # as PEFT's example: a whole adapter for the final save
    trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    adapter_dir = os.path.join(training_args.output_dir, "adapter")
    trainer.save_model(adapter_dir)
    trained = full_state_dict(trainer.model_wrapped)
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        batch = tokenizer(dataset[:4]["text"], return_tensors="pt", padding=True)
        batch = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
        result = HFRunResult("qlora" if model_args.use_4bit_quantization else "sft", trainer.accelerator.num_processes,
                             True, len(facts["units"]), facts["param_types"][0], facts["mixed_precision_policy"],
                             trainer_losses(trainer), adapter_dir, "PeftModel.from_pretrained",
                             reload_check(model_args, adapter_dir, trained, batch), units=facts["units"],
                             per_rank=facts["per_rank"], activation_checkpointing=facts["activation_checkpointing"],
                             distributed_type=str(trainer.accelerator.distributed_type), loading=loading)
        if model_args.use_4bit_quantization:
            packed = [m.weight for m in trainer.model.modules() if type(m).__name__ == "Linear4bit"]
            result.notes.append(f"{len(packed)} Linear4bit layers, their 4-bit weights packed in "
                                f"{packed[0].dtype} (bnb_4bit_quant_storage)")
        if data_args.result_json:
            with open(data_args.result_json, "w") as f: json.dump(asdict(result), f, indent=1)
        print(json.dumps(dict(workflow=result.workflow, fsdp_units=result.fsdp_units, losses=result.losses,
                              load_check=result.load_check)))
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()  # a clean end: no warning, no wait at exit


if __name__ == "__main__":
    defaults = dict(report_to="none", save_strategy="no", logging_steps="1", disable_tqdm="True",
                    dataset_text_field="text")
    if not torch.cuda.is_available(): defaults["use_cpu"] = "True"
    # quiet, local defaults
    argv = sys.argv[1:] + [a for k, v in defaults.items() if f"--{k}" not in sys.argv for a in (f"--{k}", v)]
    parser = HfArgumentParser((ModelArguments, DataArguments, SFTConfig))
    main(*parser.parse_args_into_dataclasses(args=argv))
