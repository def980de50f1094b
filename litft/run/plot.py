"""out_dir/logs/loss.png: the run's training and validation loss and its learning rate, drawn from the CSV log; under RL the
mean reward of the rollouts and of the held-out prompts instead of the losses, whose values say little there."""

import csv
import os
from pathlib import Path
from typing import Dict, List, Tuple


def series(csv_path: Path, keys: Tuple[str, ...]) -> Dict[str, Tuple[List[float], List[float]]]:
    """(steps, values) of each key, from the rows of metrics.csv that have it (a resumed run's rows included)."""
    found: Dict[str, Tuple[List[float], List[float]]] = {key: ([], []) for key in keys}
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            for key in keys:
                if row.get(key) not in (None, "") and row.get("step") not in (None, ""):
                    found[key][0].append(float(row["step"]))
                    found[key][1].append(float(row[key]))
    return found


def plot_losses(csv_path: Path, png_path: Path) -> bool:
    """Draw the plot (no display needed: Agg renders to a file); False when the log has no loss yet."""
    if not csv_path.is_file():
        return False
    data = series(csv_path, ("loss", "val_loss", "lr", "reward_mean", "val_reward"))
    rl = bool(data["reward_mean"][0] or data["val_reward"][0])
    train, held_out = ("reward_mean", "val_reward") if rl else ("loss", "val_loss")
    if not data[train][0] and not data[held_out][0]:
        return False
    # Imported here: only rank 0 draws, and matplotlib takes about a second of a process's start.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    loss_axis = figure.add_subplot()
    lines = loss_axis.plot(*data[train], color="tab:blue", linewidth=1.2, label="rollouts' mean reward" if rl else "train loss")
    if data[held_out][0]:
        lines += loss_axis.plot(*data[held_out], color="tab:orange", marker="o", markersize=4,
                                label="held-out reward (greedy)" if rl else "validation loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("reward" if rl else "loss")
    loss_axis.grid(alpha=0.3)
    if data["lr"][0]:
        lr_axis = loss_axis.twinx()
        lines += lr_axis.plot(*data["lr"], color="tab:gray", linestyle="--", linewidth=1, label="learning rate")
        lr_axis.set_ylabel("learning rate")
        lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    loss_axis.legend(lines, [line.get_label() for line in lines], loc="upper right")
    figure.tight_layout()
    # Written aside and renamed, so that a viewer never reads half a file.
    partial = png_path.with_name(f".{png_path.name}.{os.getpid()}.png")
    figure.savefig(partial)
    os.replace(partial, png_path)
    return True
