"""A one-page PNG of a run: loss, throughput, layout and communication share per step,
with failures (red) and recoveries (green) marked where they happened.

Draws with matplotlib's object API on the Agg canvas, never through pyplot,
so it needs no display and leaves the process's backend alone.
"""

from __future__ import annotations

from pathlib import Path

FAILURE_COLOR = "tab:red"
RECOVERY_COLOR = "tab:green"
# Re-plans no failure caused: drawn as resizes.
PLANNED = ("grow", "drain")


def _failures(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("kind") == "failure"]


def _recoveries(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("kind") == "recovery"]


def _failed_state(events: list[dict]) -> dict | None:
    return next((e for e in reversed(events) if e.get("kind") == "state" and e.get("to") == "FAILED"), None)


def _title(history: list[dict], events: list[dict], title: str | None) -> str:
    parts = [title] if title else []
    failures, recoveries = _failures(events), _recoveries(events)
    parts.append(f"{len(history)} step(s), {len(failures)} failure(s), {len(recoveries)} recovery(ies)")
    failed = _failed_state(events)
    if failed is not None:
        parts.append("run FAILED" + (f": {str(failed['error'])[:100]}" if failed.get("error") else ""))
    return "\n".join(parts)


def _mark_events(ax, events: list[dict]) -> None:
    """Failures at the step that did not complete; recoveries at the step training resumed from."""
    for e in _failures(events):
        if e.get("step") is not None:
            ax.axvline(e["step"], color=FAILURE_COLOR, linestyle="--", linewidth=1.2, alpha=0.8)
    for e in _recoveries(events):
        if e.get("restored_step") is not None:
            # A resize (a grow, a drain's move) is a planned change, not a failure's aftermath.
            style = ":" if e.get("reason") in PLANNED else "-"
            ax.axvline(e["restored_step"], color=RECOVERY_COLOR, linestyle=style, linewidth=1.2, alpha=0.8)


def _ratio(num, den) -> float:
    return num / den if num is not None and den else float("nan")


def _pace_grid(figures: list[dict] | None):
    """(ranks x steps array of each rank's compute over the step's median rank, rank count, first
    and last step), or None where there are no per-rank figures (balance.mode off, no report_dir).
    ``figures``: the run's per-rank figures in step order (``rank_file.read_rank_figures``)."""
    import numpy as np

    rows = [f.get("rank_compute_s") or {} for f in figures or []]
    ranks = 1 + max((int(k) for row in rows for k in row), default=-1)
    if ranks <= 0:
        return None
    grid = np.full((ranks, len(rows)), np.nan)
    for j, row in enumerate(rows):
        if row:
            mid = float(np.median(list(row.values())))
            for k, v in row.items():
                grid[int(k), j] = v / mid if mid > 0 else np.nan
    return grid, ranks, figures[0]["step"], figures[-1]["step"]


def _memory_lines(figures: list[dict] | None) -> dict[int, tuple[list[int], list[float]]]:
    """Each rank's (steps, peak resident GiB in that step) from the per-rank figures."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for f in figures or []:
        for k, v in (f.get("rank_peak_rss_bytes") or {}).items():
            steps, gib = out.setdefault(int(k), ([], []))
            steps.append(f["step"])
            gib.append(v / (1 << 30))
    return out


def _goodput_bar(ax, goodput: dict) -> None:
    """One bar of the run's wall time, split by where it went (``controller.run.goodput``)."""
    wall = goodput.get("wall_s") or 0.0
    left = 0.0
    parts = [(b, s) for b, s in goodput["seconds"].items() if s > 0]
    colors = {b: ("tab:green" if b == "training" else c) for b, c in zip(
        (b for b, _ in parts), ("tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                                "tab:gray", "tab:olive", "tab:cyan", "gold", "navy", "salmon", "black"))}
    for bucket, seconds in parts:
        ax.barh(0, seconds, left=left, color=colors[bucket], edgecolor="white",
                label=f"{bucket} {seconds:.1f} s ({seconds / wall:.1%})" if wall else bucket)
        left += seconds
    ax.set_xlim(0, max(wall, left) or 1.0)
    ax.set_yticks([])
    ax.set_xlabel("wall time (s)")
    share = goodput.get("goodput")
    ax.set_title(f"goodput {share:.1%}: training that counts, over the run's wall time" if share is not None
                 else "goodput", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=7, frameon=False)


def report_figure(history: list[dict], events: list[dict], title: str | None = None,
                  ranks: list[dict] | None = None, goodput: dict | None = None):
    """The report as a matplotlib ``Figure`` (not yet saved); see ``write_report``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    if not history:
        fig = Figure(figsize=(8, 4), dpi=100)
        FigureCanvasAgg(fig)
        fig.suptitle(_title(history, events, title), fontsize=11)
        lines = ["no steps completed"]
        for e in _failures(events)[:10]:
            where = f" (rank {e['rank']})" if e.get("rank") is not None else ""
            lines.append(f"{e.get('failure')} of worker {e.get('worker')}{where} at step {e.get('step')}")
        if len(_failures(events)) > 10:
            lines.append(f"... and {len(_failures(events)) - 10} more failure(s)")
        fig.text(0.5, 0.5, "\n".join(lines), ha="center", va="center", fontsize=12,
                 color=FAILURE_COLOR if _failures(events) else "black")
        return fig

    steps = [r["step"] for r in history]
    pace = _pace_grid(ranks)
    memory = _memory_lines(ranks)
    heights = [3, 3, 3, 3] + ([1.6] if pace is not None else []) + ([2.2] if memory else [])
    tall = 12 + 2 * (len(heights) - 4)
    if goodput and goodput.get("seconds"):
        # The wall time's bar below the per-step panels, on an axis of its own (seconds, not steps).
        fig = Figure(figsize=(10, tall + 2.4), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        top, bottom = fig.subfigures(2, 1, height_ratios=[tall, 2.4])
        axes = top.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
        _goodput_bar(bottom.subplots(), goodput)
    else:
        fig = Figure(figsize=(10, tall), dpi=100)
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    fig.suptitle(_title(history, events, title), fontsize=11)

    ax = axes[0]
    ax.plot(steps, [r.get("loss", float("nan")) for r in history], color="tab:blue", linewidth=1.2, label="train")
    evals = [(r["step"], r["eval_loss"]) for r in history if r.get("eval_loss") is not None]
    if evals:
        ax.plot(*zip(*evals), color="tab:green", marker="o", markersize=3, linewidth=1.2, label="validation")
    ax.set_ylabel("loss")
    lrs = [r.get("lr") for r in history]
    if any(v is not None for v in lrs):
        # The rate on its own axis, faint: the schedule beside the curve it shapes.
        lr_ax = ax.twinx()
        lr_ax.plot(steps, [float("nan") if v is None else v for v in lrs], color="tab:gray", linewidth=0.9,
                   linestyle=":", label="learning rate")
        lr_ax.set_ylabel("learning rate", color="tab:gray", fontsize=8)
        lr_ax.tick_params(axis="y", labelsize=7, colors="tab:gray")
        lr_ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[1]
    ax.plot(steps, [r.get("tokens_per_s", float("nan")) for r in history], color="tab:purple", linewidth=1.2)
    ax.set_ylabel("tokens/s")

    ax = axes[2]
    # Layout changes only at recoveries and resizes, so steps, not slopes.
    ax.step(steps, [r.get("world_size") for r in history], where="post", label="world size", color="black")
    ax.step(steps, [r.get("dp") for r in history], where="post", label="dp", color="tab:orange", linestyle="--")
    ax.step(steps, [r.get("pp") for r in history], where="post", label="pp", color="tab:cyan", linestyle="-.")
    ax.set_ylabel("ranks")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[3]
    # Exposed communication: the part of the step spent waiting for it (overlap hides the rest).
    ax.plot(steps, [100 * _ratio(r.get("exposed_comm_s", r.get("comm_time_s")), r.get("step_time_s"))
                    for r in history], color="tab:brown", linewidth=1.2)
    ax.set_ylabel("exposed comm / step (%)")
    ax.set_ylim(bottom=0)
    if pace is not None:
        ax = axes[4]
        grid, nranks, first, last = pace
        # One row per rank: its compute over the step's median rank (red: slower, green: faster).
        im = ax.imshow(grid, aspect="auto", cmap="RdYlGn_r", vmin=0.5, vmax=2.0, interpolation="nearest",
                       extent=(first - 0.5, last + 0.5, nranks - 0.5, -0.5))
        ax.set_ylabel("rank pace")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01, label="compute / median")
    if memory:
        ax = axes[-1]
        # Each rank's peak resident memory in each step (VmHWM, reset every step).
        for r, (at, gib) in sorted(memory.items()):
            ax.plot(at, gib, linewidth=1.0, label=f"rank {r}")
        ax.set_ylabel("peak memory (GiB)")
        ax.set_ylim(bottom=0)
        if len(memory) <= 8:
            ax.legend(loc="lower right", fontsize=7, ncol=min(4, len(memory)))
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))

    for ax in axes:
        _mark_events(ax, events)
        ax.grid(True, alpha=0.3)
    handles = []
    if _failures(events):
        handles.append(Line2D([], [], color=FAILURE_COLOR, linestyle="--", label="failure"))
    if any(e.get("reason") not in PLANNED for e in _recoveries(events)):
        handles.append(Line2D([], [], color=RECOVERY_COLOR, linestyle="-", label="recovery (resumed from)"))
    if any(e.get("reason") in PLANNED for e in _recoveries(events)):
        handles.append(Line2D([], [], color=RECOVERY_COLOR, linestyle=":", label="resize"))
    if handles:
        axes[0].legend(handles=handles, loc="upper right", fontsize=8)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    return fig


def write_report(history: list[dict], events: list[dict], path, title: str | None = None,
                 ranks: list[dict] | None = None, goodput: dict | None = None) -> Path:
    """Draw the run's report to a PNG at ``path`` and return the path.

    ``history`` and ``events`` are a ``Result``'s (or the controller's) lists; ``ranks`` the
    per-rank figures (``rank_file.read_rank_figures``), drawn as a pace strip; ``goodput`` the
    run's (``Result.goodput``), drawn as a bar of its wall time by bucket;
    an empty history gives a page that says no step completed, listing the
    failures if there were any. Needs matplotlib.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report_figure(history, events, title, ranks, goodput).savefig(path, format="png")
    return path
