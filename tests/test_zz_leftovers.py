"""Runs last (pytest takes files in name order): every launch of the suite removed its run folder and torchrun's log folders."""
import tempfile
from tests.conftest import SESSION_TMP


def test_no_launch_folder_is_left_in_the_temp_dir():
    assert tempfile.gettempdir() == str(SESSION_TMP)
    left = sorted(p.name for pattern in ("fsdp_kit_run_*", "torchelastic_*") for p in SESSION_TMP.glob(pattern))
    assert left == [], f"left behind in {SESSION_TMP}: {left}"
