"The lessons' figures draw exactly the numbers they are given: bar heights, widths and positions read back from the drawn artists."
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

MiB = 2**20


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def bars(ax) -> list:
    "(x, y, width, height) of every bar drawn in `ax`, in drawing order."
    return [(round(p.get_x(), 6), round(p.get_y(), 6), round(p.get_width(), 6), round(p.get_height(), 6))
            for c in ax.containers for p in c if isinstance(p, Rectangle)]


def test_ddp_fsdp_draws_each_category_and_the_bytes_sent():
    from fsdp_kit.train import plot_ddp_fsdp
    ddp = dict(unsharded_params=4 * MiB, unsharded_grads=4 * MiB, optimizer_state=8 * MiB, activations=23 * MiB, temporaries=4 * MiB)
    fsdp = dict(sharded_params=2 * MiB, all_gather_buffers=0.5 * MiB, optimizer_state=4 * MiB, activations=23 * MiB, temporaries=4 * MiB)
    held = {"DDP": ddp | {"total": sum(ddp.values())}, "FSDP2": fsdp | {"total": sum(fsdp.values())}}
    sent = {"DDP": {"all_reduce": 3.82 * MiB}, "FSDP2": {"all_gather": 3.57 * MiB, "reduce_scatter": 1.91 * MiB}}
    fig = plot_ddp_fsdp(held, sent)
    left, right = fig.axes
    stacks = {}
    for x, y, w, h in bars(left): stacks.setdefault(round(x + w / 2), []).append((y, h))
    assert sorted(h for _, h in stacks[0] if h) == sorted(v / MiB for v in ddp.values())  # every DDP category, as tall as its bytes
    assert sorted(h for _, h in stacks[1] if h) == sorted(v / MiB for v in fsdp.values())
    assert [round(sum(h for _, h in stacks[i]), 6) for i in (0, 1)] == [43.0, 33.5]
    right_bars = [(round(x + w / 2), h) for x, _, w, h in bars(right) if h]
    assert right_bars == [(1, 3.57), (1, 1.91), (0, 3.82)]  # all-gather and reduce-scatter stacked for FSDP2, the all-reduce for DDP
    assert "DDP 43.00 / FSDP2 33.50" in left.get_title() and "DDP 3.82 / FSDP2 5.48 (1.43x)" in right.get_title()


def test_cp_layout_draws_each_rank_at_its_positions_and_its_work():
    import torch
    from fsdp_kit.cp import shard_sequence, plot_cp_layout, causal_pairs
    tokens = torch.arange(8)[None]
    layouts = {"head-tail, cp=2": [shard_sequence(tokens, 2, r)[0].tolist() for r in range(2)],
               "contiguous, cp=2": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    assert layouts["head-tail, cp=2"] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    fig = plot_cp_layout(layouts)
    seq, work = fig.axes
    cells = [(round(x + w / 2), round(y + h / 2)) for x, y, w, h in bars(seq)]  # (position, row)
    assert cells == [(p, 0) for p in (0, 1, 6, 7, 2, 3, 4, 5)] + [(p, 1) for p in range(8)]  # rank 0's tokens, then rank 1's, row by row
    colors = [matplotlib.colors.to_hex(p.get_facecolor()) for c in seq.containers for p in c]
    assert colors == ["#1f77b4"] * 4 + ["#ff7f0e"] * 4 + ["#1f77b4"] * 4 + ["#ff7f0e"] * 4  # C0 for rank 0, C1 for rank 1
    assert [w for _, _, w, _ in bars(work)] == [18, 18, 10, 26]  # query-key pairs: 1+2+7+8 and 3+4+5+6, then 1+2+3+4 against 5+6+7+8
    assert [causal_pairs(p) for p in layouts["contiguous, cp=2"]] == [10, 26]
    texts = [t.get_text().strip() for t in work.texts]
    assert texts == ["18 / 18", "10 / 26"]


def unit_rows(tail_reshard=False) -> list:
    "`unit_table` rows of the tiny Llama as accelerate and the kit shard it: innermost first, the tail one group of two modules."
    return [dict(module="lm_head", cls="Linear", parameters=16384, reshard_after_forward=tail_reshard, group=0),
            dict(module="model.norm", cls="LlamaRMSNorm", parameters=64, reshard_after_forward=tail_reshard, group=0),
            dict(module="model.layers.1", cls="LlamaDecoderLayer", parameters=46208, reshard_after_forward=True, group=1),
            dict(module="model.layers.0", cls="LlamaDecoderLayer", parameters=46208, reshard_after_forward=True, group=2),
            dict(module="model.embed_tokens", cls="Embedding", parameters=16384, reshard_after_forward=True, group=3),
            dict(module="", cls="LlamaForCausalLM", parameters=0, reshard_after_forward=None, group=None)]


def test_unit_layouts_draw_each_unit_in_model_order():
    from fsdp_kit.hf_run import plot_unit_layouts
    fig = plot_unit_layouts({"Trainer": unit_rows(), "kit": unit_rows(), "native": unit_rows(tail_reshard=True)})
    (ax,) = fig.axes
    heights = [(round(x + w / 2), y, h) for x, y, w, h in bars(ax)]
    column = [(0, 0, 16384), (0, 16384, 46208), (0, 62592, 46208), (0, 108800, 16448)]  # embeddings, layer 0, layer 1, tail
    assert heights == column + [(1, y, h) for _, y, h in column] + [(2, y, h) for _, y, h in column]
    hatched = [bool(p.get_hatch()) for c in ax.containers for p in c]
    assert hatched == [False, False, False, True] * 2 + [False] * 4  # the tail kept after forward, except where it reshards
    assert "16,384 + 46,208 + 46,208 + 16,448" in ax.get_title() and "the same in all" not in ax.get_title()  # one run reshards its tail


def test_merge_layouts_draw_the_bytes_held_and_what_the_merge_left():
    from fsdp_kit.lora import plot_merge_layouts
    layouts = [dict(layout="fully_shard", bytes_held=8192, full_bytes=16384, merge="no error", vs_one_process_merge=0.0, vs_unmerged=0.181),
               dict(layout="fully_shard, kept", bytes_held=16384, full_bytes=16384, merge="no error", vs_one_process_merge=0.181,
                    vs_unmerged=0.0),
               dict(layout="FSDP1", bytes_held=0, full_bytes=16384, merge="RuntimeError: The tensor has a non-zero number of elements"),
               dict(layout="FSDP1, orig params", bytes_held=111104, full_bytes=16384, merge="RuntimeError: inconsistent tensor size")]
    held, left = plot_merge_layouts(layouts).axes
    whole, storage = held.containers
    assert [p.get_width() for p in storage] == [8, 16, 0, 108.5] and [p.get_width() for p in whole] == [16] * 4  # KiB
    widths = [[round(p.get_width(), 6) for p in c] for c in left.containers]
    assert widths == [[0.0, 0.181], [0.181, 0.0]]  # only the two layouts whose merge ran: vs one process's merge, vs the unmerged weights
    assert [t.get_text().strip() for t in left.texts] == ["0 / 0.181", "0.181 / 0", "RuntimeError at the merge",
                                                          "RuntimeError at the merge"]


def test_collectives_draw_each_call_at_its_time_on_one_clock():
    from fsdp_kit.measure import plot_collectives
    def step(clock, shift):
        events = [dict(kind="all_gather", bytes=65536, start_s=0.001 + shift, phase="forward"),
                  dict(kind="all_gather", bytes=184832, start_s=0.004 + shift, phase="forward"),
                  dict(kind="reduce_scatter", bytes=184832, start_s=0.030 + shift, phase="backward")]
        return dict(clock_s=clock, phases=dict(forward=0.0, backward=0.02, optimizer=0.05, end=0.06), events=events)
    fig = plot_collectives([step(100.0, 0.0), step(100.002, 0.001)])  # rank 1 started its step 2 ms later
    for ax, offset_ms in zip(fig.axes, (0, 3)):
        drawn = [(round(x, 6), round(h, 6)) for x, _, _, h in bars(ax)]
        assert drawn == [(round(1 + offset_ms, 6), round(65536 / MiB, 6)), (round(4 + offset_ms, 6), round(184832 / MiB, 6)),
                         (round(30 + offset_ms, 6), round(184832 / MiB, 6))]
    assert "2 all-gathers (0.24 MiB), 1 reduce-scatter (0.18 MiB)" in fig.axes[0].get_title()
