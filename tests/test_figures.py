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
