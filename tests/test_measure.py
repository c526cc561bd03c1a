"""The collective counter against torch's CommDebugMode, on a model with a module called twice in one step."""
import pytest
from fsdp_kit.launch import launch

pytestmark = pytest.mark.timeout(180)


def _count_both():
    "Every rank: count one FSDP2 step's collectives with comm_counter and with CommDebugMode."
    # on a model without and with a module called twice
    import torch, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from fsdp_kit.measure import comm_counter, quiet_hook_warnings

    class Net(nn.Module):
        def __init__(self, twice:bool):
            super().__init__()
            self.a, self.b, self.act, self.twice = nn.Linear(16, 16), nn.Linear(16, 16), nn.GELU(), twice
        def forward(self, x):  # the GELU module runs once, or twice (as a shared function-module does, e.g. transformers' hub kernels)
            x = self.act(self.a(x)) if self.twice else self.a(x)
            return self.act(self.b(x))

    def counts(twice:bool, mode):
        torch.manual_seed(0)
        model = Net(twice)
        for unit in (model.a, model.b, model): fully_shard(unit)
        x = torch.randn(4, 16)
        try:
            with quiet_hook_warnings(), mode: model(x).sum().backward()
        except Exception as e: return f"{type(e).__name__}: {e}"
        return {op.__name__: n for op, n in mode.get_comm_counts().items()}, dict(getattr(mode, "bytes", {}))

    return dict(kit_once=counts(False, comm_counter()), kit_twice=counts(True, comm_counter()),
                torch_once=counts(False, CommDebugMode()), torch_twice=counts(True, CommDebugMode()))


def test_comm_counter_counts_what_comm_debug_mode_counts_and_survives_a_module_called_twice():
    r = launch(_count_both, nprocs=2, timeout=60)
    counts, nbytes = r["kit_once"]
    # c10d ops on gloo: a and b gathered in forward and again in backward; the root holds none
    assert counts == r["torch_once"][0] == {"_allgather_base_": 4, "_reduce_scatter_base_": 2}, r
    # each gathered / reduced buffer is one whole Linear in fp32
    assert nbytes == {"all_gather": 4 * (16 * 16 + 16) * 4, "reduce_scatter": 2 * (16 * 16 + 16) * 4}
    assert r["kit_twice"] == r["kit_once"]  # the same collectives with the module called twice
    # torch 2.13.0's module tracker pops its stack once too often, which is why the kit counts on its own; 2.14.1 counts such a step
    # (measured on both; 04a_measure says so). A release that behaves otherwise fails here and says so.
    import re, torch
    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 14):
        assert isinstance(r["torch_twice"], str) and r["torch_twice"].startswith("IndexError: "), r["torch_twice"]
    else: assert r["torch_twice"][0] == r["kit_twice"][0], r["torch_twice"]
