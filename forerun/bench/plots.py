"""PNG pictures of a bench: speedup by task kind, acceptance by draft position, and a sweep over K.

Drawn on matplotlib's Agg canvas directly (no pyplot), so no global backend is switched.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from forerun.bench.contenders import PLAIN
from forerun.bench.summary import OVERALL, Row

SPEEDUP_PNG, POSITIONS_PNG, SWEEP_PNG = "speedup_by_task.png", "acceptance_by_position.png", "sweep_k.png"
PLOTS = (SPEEDUP_PNG, POSITIONS_PNG, SWEEP_PNG)  # every file draw_all may write


def draw_all(out: Path, table: dict[str, list[Row]]) -> dict[str, str]:
    """Draw what the data allows; returns {file name: caption} for those drawn."""
    drawn = {}
    overall = table.get(OVERALL, [])
    if speedup_by_task(out / SPEEDUP_PNG, table):
        drawn[SPEEDUP_PNG] = "speedup over plain decoding by task kind and method"
    if acceptance_by_position(out / POSITIONS_PNG, overall):
        drawn[POSITIONS_PNG] = "acceptance by draft position"
    if sweep(out / SWEEP_PNG, overall):
        drawn[SWEEP_PNG] = "tokens/s and mean accepted length against K"
    return drawn


def speedup_by_task(path: Path, table: dict[str, list[Row]]) -> bool:
    """Grouped bars: one group per task kind (and overall), one bar per method at its best K."""
    shown = _best_k(table.get(OVERALL, []))
    if not shown:
        return False
    tasks = list(table)
    fig, ax = _figure(max(7.0, 1.2 * len(tasks) + 4), 4.5)
    width = 0.8 / len(shown)
    for i, label in enumerate(shown):
        values = [next((r.speedup or 0.0 for r in table[t] if r.label == label), 0.0) for t in tasks]
        ax.bar([x + i * width - 0.4 + width / 2 for x in range(len(tasks))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(tasks)), tasks, rotation=20)
    ax.set_ylabel("speedup over plain (median)")
    ax.set_title("Speedup by task kind")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)
    return True


def acceptance_by_position(path: Path, rows: list[Row]) -> bool:
    """Share of drafts whose i-th token was kept, one line per method at its largest K."""
    largest: dict[str, Row] = {}
    for r in rows:
        if r.per_position and (r.method not in largest or r.k > largest[r.method].k):
            largest[r.method] = r
    if not largest:
        return False
    fig, ax = _figure(6.0, 4.0)
    for r in largest.values():
        ax.plot(range(1, len(r.per_position) + 1), r.per_position, marker="o", label=r.label)
    ax.set_xticks(range(1, max(len(r.per_position) for r in largest.values()) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafts kept at this position")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    ax.legend(fontsize="small")
    _save(fig, path)
    return True


def sweep(path: Path, rows: list[Row]) -> bool:
    """Tokens/s (left) and mean accepted length, measured and predicted (right), against K."""
    methods: dict[str, list[Row]] = {}
    for r in rows:
        if r.k > 0:
            methods.setdefault(r.method, []).append(r)
    ks_all = sorted({r.k for group in methods.values() for r in group})
    if len(ks_all) < 2:
        return False
    fig = Figure(figsize=(11.0, 4.0))
    FigureCanvasAgg(fig)
    speed, length = fig.subplots(1, 2)
    for method, group in methods.items():
        group.sort(key=lambda r: r.k)
        ks = [r.k for r in group]
        (line,) = speed.plot(ks, [r.tokens_per_s for r in group], marker="o", label=method)
        if group[0].mean_accepted_length is not None:
            length.plot(ks, [r.mean_accepted_length for r in group], marker="o", color=line.get_color(), label=method)
            length.plot(ks, [r.predicted_length for r in group], linestyle="--", color=line.get_color())
    for r in rows:
        if r.k == 0:
            speed.axhline(r.tokens_per_s, linestyle=":", color="gray" if r.method == PLAIN else "silver")
            speed.annotate(r.method, (speed.get_xlim()[0], r.tokens_per_s), fontsize="small", va="bottom")
    for ax in (speed, length):
        ax.set_xticks(ks_all)
        ax.set_xlabel("K (draft tokens per step)")
        if ax.get_legend_handles_labels()[0]:  # a sweep of methods without drafts has no lengths to label
            ax.legend(fontsize="small", loc="best")
    speed.set_ylabel("tokens/s")
    speed.set_title("Tokens/s against K")
    length.set_ylabel("mean accepted length")
    length.set_title("Mean accepted length against K (dashed: predicted from α, K)", fontsize="medium")
    _save(fig, path)
    return True


def _best_k(rows: list[Row]) -> list[str]:
    """Labels of each non-plain method at the K with the best overall speedup."""
    best: dict[str, Row] = {}
    for r in rows:
        if r.method == PLAIN or r.speedup is None:
            continue
        if r.method not in best or r.speedup > (best[r.method].speedup or 0.0):
            best[r.method] = r
    return [r.label for r in best.values()]


def _figure(width: float, height: float):
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
