"""`python -m fsdp_kit ...` is the `fsdp-kit` command; torchrun starts workers as
`python -m fsdp_kit worker RUN_DIR`."""
from fsdp_kit.cli import main

if __name__ == "__main__":
    main()
