"""plan's old spellings of FSDP settings read as the new ones (the other commands: tests/test_flags.py)."""
import json
from tests.badinput import Case, run_case


def test_an_old_spelling_gives_the_same_spec(tmp_path):
    "--reshard, --offload and --policy read as --reshard-after-forward, --cpu-offload and --auto-wrap-policy."
    plans = []
    for flags in (["--reshard", "false", "--offload"], ["--reshard-after-forward", "false", "--cpu-offload", "true"]):
        out = tmp_path / f"plan{len(plans)}.json"
        argv = ["plan", "--model", "llama-3-8b", "--gpus", "4", *flags, "--json", out]
        code, _, err = run_case(Case("plan-spelling", argv, 0, ""), tmp_path)
        assert code == 0, err
        plans.append(json.loads(out.read_text()))
    assert plans[0] == plans[1] and plans[0]["settings"]["reshard"] is False and plans[0]["settings"]["offload"] is True
    layouts = [run_case(Case("plan-layout", ["plan", "--model", "llama-3-8b", *flags], 0, ""), tmp_path)[1]
               for flags in (["--edges-in-root"], ["--layout", "layers"])]
    assert layouts[0] == layouts[1] and "embeddings and head in the root" in layouts[0]
