"""Meshes: sizes resolved like accelerate's ParallelismConfig, layouts measured by collectives, bad sizes refused."""
import json
import pytest
from fsdp_kit.errors import KitError
from fsdp_kit.launch import launch
from fsdp_kit.mesh import MeshSpec, mesh_worker

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("spec, world, resolved", [
    (MeshSpec(), 4, MeshSpec(1, 4, 1)),
    (MeshSpec(dp_replicate=2), 4, MeshSpec(2, 2, 1)),
    (MeshSpec(dp_replicate=-1, dp_shard=2), 8, MeshSpec(4, 2, 1)),
    (MeshSpec(dp_shard=2, cp=2), 4, MeshSpec(1, 2, 2)),
    (MeshSpec(dp_replicate=2, dp_shard=1, cp=2), 4, MeshSpec(2, 1, 2)),
])
def test_resolve_fills_minus_one(spec, world, resolved):
    assert spec.resolve(world) == resolved


@pytest.mark.parametrize("spec, world, message", [
    (MeshSpec(dp_replicate=3, dp_shard=2), 4, "dp_replicate=3, dp_shard=2, cp=1 multiply to 6, but the world size is 4"),
    (MeshSpec(dp_replicate=3), 4, "cannot fill world size 4: 3 does not divide it"),
    (MeshSpec(dp_replicate=-1, dp_shard=-1), 4, "only one mesh size may be -1"),
    (MeshSpec(dp_shard=0), 4, "dp_shard=0 is not allowed"),
    (MeshSpec(cp=-2), 4, "cp=-2 is not allowed"),
])
def test_resolve_refuses_sizes_naming_them(spec, world, message):
    with pytest.raises(KitError, match=message):
        spec.resolve(world)


def test_layouts_on_4_processes_in_one_launch():
    "HSDP 2x2 and dp_shard x cp 2x2, measured by all_gather_object over each axis group."
    def both():
        return mesh_worker(MeshSpec(dp_replicate=2, dp_shard=2)), mesh_worker(MeshSpec(dp_shard=2, cp=2))
    hsdp, cp = launch(both, nprocs=4)
    assert hsdp.axis_names == ["dp_replicate", "dp_shard"] and hsdp.grid == [[0, 1], [2, 3]]
    assert hsdp.groups == {"dp_replicate": [[0, 2], [1, 3]], "dp_shard": [[0, 1], [2, 3]]}
    assert cp.axis_names == ["dp_shard", "cp"]
    assert cp.groups == {"dp_shard": [[0, 2], [1, 3]], "cp": [[0, 1], [2, 3]], "dp_shard_cp": [[0, 1, 2, 3]]}


def test_cli_mesh_hsdp_json(cli):
    out = cli("mesh", "--nproc", 4, "--dp-replicate", 2, "--dp-shard", 2, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["grid"] == [[0, 1], [2, 3]] and data["axis_names"] == ["dp_replicate", "dp_shard"]
    assert data["groups"]["dp_shard"] == [[0, 1], [2, 3]] and data["world_size"] == 4
    # the flattened dp_shard_cp group of a CP layout: test_layouts_on_4_processes_in_one_launch, the same worker forked


def test_cli_mesh_refuses_bad_sizes_without_traceback(tmp_path):
    from tests.badinput import run_case, Case
    code, out, err = run_case(Case("mesh-3x2", ["mesh", "--nproc", "4", "--dp-replicate", "3", "--dp-shard", "2"], 2, ""), tmp_path)
    assert code == 2 and "--dp-replicate=3, --dp-shard=2" in err and "world size is 4" in err
    assert "Traceback" not in err and out == ""
