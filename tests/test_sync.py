"""The notebooks are the source: exporting and cleaning a checkout must change nothing."""
import filecmp, shutil, subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _copy(tmp_path):
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("nbs", "fsdp_kit"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    return tmp_path


def _changed(a: Path, b: Path, pattern: str) -> list:
    return [str(p.relative_to(a)) for p in sorted(a.rglob(pattern))
            if "__pycache__" not in p.parts and not filecmp.cmp(p, b / p.relative_to(a), shallow=False)]


def test_nbdev_export_changes_nothing(tmp_path):
    work = _copy(tmp_path)
    subprocess.run(["nbdev-export"], cwd=work, check=True, timeout=120)
    assert _changed(work / "fsdp_kit", ROOT / "fsdp_kit", "*.py") == []
    assert sorted(p.name for p in (work / "fsdp_kit").glob("*.py")) == sorted(p.name for p in (ROOT / "fsdp_kit").glob("*.py"))


def test_nbdev_clean_changes_nothing(tmp_path):
    work = _copy(tmp_path)
    subprocess.run(["nbdev-clean"], cwd=work, check=True, timeout=120)
    assert _changed(work / "nbs", ROOT / "nbs", "*.ipynb") == []


def test_every_notebook_is_executed_with_outputs():
    "The docs show stored outputs: a notebook committed without running would show nothing (a page of prose has no code to run)."
    import json
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = [c for c in cells if c["cell_type"] == "code" and c["source"]]
        assert not code or any(c.get("outputs") for c in code), f"{nb.name} has no stored outputs: run it, then nbdev-clean"
