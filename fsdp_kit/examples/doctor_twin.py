"""The script `fsdp-kit doctor` runs on the twin of a model, through its entry point.

It runs through the entry point the user's FSDP file belongs to, `accelerate launch` for a YAML file and `torchrun` for
a transformers fsdp_config JSON:

    accelerate launch --config_file USER.yaml --num_processes 2 -m fsdp_kit.examples.doctor_twin RUN_FOLDER
    torchrun --standalone --nproc-per-node 2 -m fsdp_kit.examples.doctor_twin RUN_FOLDER

RUN_FOLDER holds spec.json (a `fsdp_kit.doctor.DoctorSpec`) and twin/ (the twin saved with save_pretrained). Each rank
loads the twin as a user's script does, adds LoRA or 4-bit weights as asked, trains a few steps with an unmodified
`Trainer`, saves and loads back; rank 0 writes what it saw to RUN_FOLDER/seen.json. On a machine without CUDA,
`fsdp_kit.hf.enable_cpu_fsdp()` lets accelerate take its FSDP branch on CPU; everything after it is accelerate's,
transformers', PEFT's and bitsandbytes' own code.
"""
from fsdp_kit.doctor import main

if __name__ == "__main__":
    main()
