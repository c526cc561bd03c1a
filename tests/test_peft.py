"""The PEFT guide's caveats (fsdp_kit.peft_guide): refusals, the seed commands' parsing and a failure's summary.
Every caveat's run (the lost freeze on 2 ranks among them) is asserted by nbs/05b_peft.ipynb; these are the helpers' own checks."""
import pytest

pytestmark = pytest.mark.timeout(180)


def test_bad_settings_are_refused_naming_the_field():
    from fsdp_kit.errors import KitError
    from fsdp_kit.peft_guide import PeftSpec, method_config
    for kw, start in ((dict(steps=0), "steps=0 is not allowed: a whole number >= 1"),
                      (dict(lr=-1.0), "lr=-1.0 is not allowed: a finite number > 0"),
                      (dict(best_max_steps=3), "best_max_steps=3 is not allowed: a whole number >= 4"),
                      (dict(seed=-1), "seed=-1 is not allowed: a whole number in 0 .. 4294967295")):
        with pytest.raises(KitError) as e: PeftSpec(**kw).check()
        assert str(e.value).startswith(start)
    assert PeftSpec(steps=3, lr=1e-2).check() == PeftSpec(steps=3, lr=1e-2)  # the guide's own
    with pytest.raises(TypeError): PeftSpec(mesh=None)  # no mesh, FSDP or LoRA section: each method carries its own
    with pytest.raises(KitError) as e: method_config("qlora")  # refused before peft is imported (this process must stay forkable)
    assert str(e.value) == ("method='qlora' is not allowed: one of lora, dora, modules_to_save, prompt_tuning, prefix_tuning, "
                            "adaption_prompt")


def test_the_seed_commands_are_whole_and_parsed():
    from fsdp_kit.peft_guide import SEED_COMMANDS, SEED_DIFF, command_flags
    lora, qlora = (dict(command_flags(SEED_COMMANDS[k])) for k in ("lora", "qlora"))
    assert len(command_flags(SEED_COMMANDS["lora"])) == 38 and len(command_flags(SEED_COMMANDS["qlora"])) == 41
    assert (lora["model_name_or_path"] == "meta-llama/Llama-2-70b-hf" and lora["push_to_hub"] is None
            and lora["use_4bit_quantization"] == "False")
    assert (qlora["per_device_train_batch_size"], qlora["gradient_accumulation_steps"], qlora["use_reentrant"]) == ("2", "2", "True")
    assert qlora["bnb_4bit_quant_storage_dtype"] == "bfloat16" and set(qlora) - set(lora) == {"use_nested_quant", "bnb_4bit_compute_dtype",
                                                                                           "bnb_4bit_quant_storage_dtype"}
    assert SEED_COMMANDS["qlora"].startswith('accelerate launch --config_file "configs/fsdp_config_qlora.yaml" train.py \\\n--seed 100')
    assert [l for l in SEED_DIFF.splitlines() if l.startswith("+")] == ["+   bnb_4bit_quant_storage=quant_storage_dtype,",
                                                                       "+   dtype=quant_storage_dtype or torch.float32,"]


def test_trainer_failure_names_the_error_and_the_trainer_method():
    from fsdp_kit.peft_guide import trainer_failure
    try: raise RuntimeError("first line\nsecond line")
    except RuntimeError as e: out = trainer_failure(e)
    assert out == dict(error="RuntimeError: first line", failed_in=None)  # raised outside transformers' trainer.py
