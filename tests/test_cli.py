"""The command line: env, and the tour (the kit's main job on its defaults)."""
import json
import pytest

pytestmark = pytest.mark.timeout(480)


def test_env_json(cli):
    out = cli("env", "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    env = json.loads(out.stdout)
    assert env["backend"] in ("gloo", "nccl") and env["versions"]["transformers"]


def test_tour_writes_figures_and_json(cli, tmp_path):
    out = cli("tour", "--out", tmp_path / "tour", timeout=420)
    assert out.returncode == 0, out.stderr
    files = {p.name for p in (tmp_path / "tour").iterdir()}
    assert {"report.json", "summary.md", "train.png", "mesh.png", "train.json"} <= files
    report = json.loads((tmp_path / "tour" / "report.json").read_text())
    assert report["mesh"]["data"]["grid"] == [[0, 1], [2, 3]]
    train = report["train"]["data"]
    assert train["losses"][-1] < train["losses"][0] and train["max_param_diff"] <= 1e-4
    assert (tmp_path / "tour" / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    qlora = report["qlora"]["data"]
    assert "qlora.png" in files and qlora["losses"][-1] < qlora["losses"][0] and qlora["sharded_vs_unsharded_loss_diff"] < 1e-4
    assert all(q < b for q, b in zip(qlora["peak_bytes"]["qlora"], qlora["peak_bytes"]["bf16_lora"]))
    cp = report["cp_eval"]["data"]
    assert cp["cp_size"] == 2 and abs(cp["eval_loss"] - cp["eval_loss_reference"]) < 1e-5 and cp["predictions_match_reference"]
    assert report["checkpoint"]["data"]["bit_identical"] is True


def test_no_subcommand_is_a_usage_error(cli):
    out = cli(timeout=60)
    assert out.returncode == 2 and "usage: fsdp-kit" in out.stderr
