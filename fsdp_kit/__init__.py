"""Learn and measure PyTorch FSDP2 as people use it: transformers, accelerate, peft and bitsandbytes, on CPU or GPU.

Modules:

- `fsdp_kit.cli`: The `fsdp-kit` command line: the parser made from `commands.COMMANDS`, errors, exit codes.
- `fsdp_kit.docs`: `fsdp-kit docs --out DIR`: the notebooks as a browsable site.
- `fsdp_kit.examples.doctor_twin`: The script `fsdp-kit doctor` runs on the twin of a model, through its entry point.
- `fsdp_kit.examples.sft_lora`: LoRA or QLoRA supervised fine-tuning under FSDP2, after PEFT's examples/sft/train.py.
- `fsdp_kit.tour`: `fsdp-kit tour`: run what the kit can show on this machine, on its defaults, and write a report."""

__version__ = "0.1.0"
