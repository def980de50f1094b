"""The parts of a watched run that need no training: a missing extra is one line, and the loss plot is drawn from the CSV log."""

import csv
import sys

import pytest

from litft.errors import LitftError
from litft.run.plot import plot_losses
from litft.run.trackers import MLflowTracker, WandbTracker


@pytest.mark.parametrize("tracker, module, extra", [(WandbTracker, "wandb", "wandb"), (MLflowTracker, "mlflow", "mlflow")])
def test_a_missing_extra_says_what_to_install(tmp_path, monkeypatch, tracker, module, extra):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")] or [module]:
        monkeypatch.setitem(sys.modules, name, None)  # what an absent package (and its submodules) looks like to import
    with pytest.raises(LitftError, match=rf"--logger_name {extra} needs the {module} package: pip install 'litft\[{extra}\]'$"):
        tracker(tmp_path)


def test_loss_plot_is_drawn_once_there_is_a_loss_and_redrawn(tmp_path):
    from matplotlib.image import imread

    log, png = tmp_path / "metrics.csv", tmp_path / "loss.png"
    rows = [{"step": 0, "val_loss": 5.0}, *({"step": s, "loss": 5.0 - s / 3, "lr": 1e-3 * s} for s in range(1, 7)), {"step": 6, "val_loss": 3.2}]
    with open(log, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "val_loss"])
        writer.writeheader()
        writer.writerow({"step": 0, "lr": 1e-3})
    assert not plot_losses(log, png) and not png.exists()  # nothing to draw yet
    with open(log, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=["step", "loss", "lr", "val_loss"]).writerows(rows[:4])
    assert plot_losses(log, png)
    first = imread(png)
    with open(log, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=["step", "loss", "lr", "val_loss"]).writerows(rows[4:])
    assert plot_losses(log, png)
    second = imread(png)
    assert first.shape == second.shape == (450, 800, 4) and (first != second).any()
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".png"] == ["loss.png"]  # no partial file left behind


def test_an_rl_runs_plot_shows_its_rewards_not_its_losses(tmp_path, monkeypatch):
    """Under GRPO the loss is near 0 by construction: the plot draws the rollouts' mean reward and the held-out reward."""
    import matplotlib.axes

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **k: drawn.append(k.get("label")) or real(self, *a, **k))
    log, png = tmp_path / "metrics.csv", tmp_path / "loss.png"
    fields = ["step", "loss", "lr", "reward_mean", "val_reward"]
    with open(log, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows([{"step": 0, "val_reward": 0.1}, *({"step": s, "loss": 0.0, "lr": 1e-3, "reward_mean": s / 10} for s in range(1, 5)),
                          {"step": 4, "val_reward": 0.4}])
    assert plot_losses(log, png)
    assert drawn == ["rollouts' mean reward", "held-out reward (greedy)", "learning rate"]
