"""LoRA merge helpers (fsdp_kit.lora) and the host-memory split the checkpoint lesson measures (fsdp_kit.checkpoint.rss_split).
The merge under each sharding, the unmerge and training on are asserted by nbs/05a_lora.ipynb; these are the refusals and invariants."""
import mmap, os
import pytest

pytestmark = pytest.mark.timeout(120)


def test_merge_probe_refuses_an_unknown_layout():
    from fsdp_kit.errors import KitError
    from fsdp_kit.lora import merge_probe, MERGE_LAYOUTS
    with pytest.raises(KitError) as e: merge_probe("FSDP3", None, None)  # refused before any process group or model is needed
    assert str(e.value).startswith("layout='FSDP3' is not allowed") and all(k in str(e.value) for k in MERGE_LAYOUTS)
    assert list(MERGE_LAYOUTS) == ["fully_shard", "fully_shard, kept", "FSDP1", "FSDP1, orig params"]


BASE_SHARDS = """
import json, torch
from fsdp_kit.lora import add_lora, base_shards, LINEARS
from fsdp_kit.models import build_model, model_config
model = add_lora(build_model(model_config("tiny")), r=4)
shards, params = base_shards(model), dict(model.named_parameters())
with torch.no_grad(): params[next(iter(shards))].add_(1.0)  # as a merge would: the copy must not follow
first = next(iter(shards))
print(json.dumps(dict(n=len(shards), want=model.config.num_hidden_layers * len(LINEARS),
                      names=all(k.endswith("base_layer.weight") for k in shards),
                      copied=all(torch.equal(v, params[k]) for k, v in list(shards.items())[1:]),
                      detached=not torch.equal(shards[first], params[first]))))
"""


def test_base_shards_copies_only_the_adapted_base_weights():
    "In a subprocess: peft imported here would keep this process from forking workers."
    import json, subprocess, sys
    from tests.conftest import ROOT
    out = subprocess.run([sys.executable, "-c", BASE_SHARDS], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["n"] == r["want"] == 14 and r["names"] and r["copied"] and r["detached"]


def test_rss_split_adds_up_and_counts_a_mapped_file_as_mapped(tmp_path):
    from fsdp_kit.checkpoint import rss_split, rss_bytes
    s = rss_split()
    assert abs(s["own"] + s["mapped"] - rss_bytes()) < 8 * 2**20  # RssAnon + RssFile (+ a little shmem) = VmRSS
    path = tmp_path / "weights.bin"
    size = 32 * 2**20
    data = os.urandom(size)
    path.write_bytes(data)
    before = rss_split()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        touched = sum(m[i] for i in range(0, size, mmap.PAGESIZE))  # read one byte of every page: all of them resident
        during = rss_split()
    assert touched == sum(data[i] for i in range(0, size, mmap.PAGESIZE))  # the mapping reads the file's own bytes
    assert during["mapped"] - before["mapped"] >= 0.9 * size  # the file's pages are mapped, not own memory
    assert during["own"] - before["own"] < 0.25 * size
