"""Report charts: one labelled PNG per measure, over the runs' statistics."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kimi_pipe.reporting.formatting import pct
from kimi_pipe.reporting.stats import RunStats

# --------------------------------------------------------------------------- charts


def write_charts(stats: list[RunStats], out_dir: Path, ignored: Iterable[str] = ()) -> list[Path]:
    """One PNG per measure; each has a title, axis units and labelled bars. Providers the
    recommendation ignores are marked in every chart's axis labels."""
    import matplotlib  # optional dep

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt  # optional dep

    skip = set(ignored)
    names = [s.provider + ("\n(ignored)" if s.provider in skip else "") for s in stats]
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    def grouped(ax: Any, series: dict[str, list[float | None]], fmt: str) -> None:
        """Labelled bars per provider, one bar per series (a legend when there are several)."""
        width = 0.8 / max(len(series), 1)
        for j, (label, values) in enumerate(series.items()):
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(names))]
            heights = [v if v is not None else 0.0 for v in values]
            rects = ax.bar(xs, heights, width, label=label, color=None if label else "tab:blue")
            texts = ["n/a" if v is None else fmt.format(v) for v in values]
            ax.bar_label(rects, texts, padding=2, fontsize=8 if len(series) == 1 else 7)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.margins(y=0.15)

    width = max(6.0, 1.2 * len(stats) + 3)

    @contextmanager
    def chart(
        name: str, title: str, ylabel: str, xlabel: str = "provider", ylim: float | None = None
    ) -> Iterator[Any]:
        fig, ax = plt.subplots(figsize=(width, 4), layout="constrained")
        yield ax
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(xlabel)
        if ylim is not None:
            ax.set_ylim(0, ylim)
        save(fig, name)

    with chart(
        "ok_rate.png",
        "Reconstruction ok rate (ids agree with billed token count)",
        "% of answered requests",
        ylim=110,
    ) as ax:
        grouped(ax, {"": [pct(s.ok_rate) for s in stats]}, "{:.1f}%")

    with chart(
        "billing_drift.png",
        "Billing drift per sample: (reconstructed - reported) / reported tokens",
        "drift, % of reported output tokens",
        xlabel="provider (one dot per answered sample)",
    ) as ax:
        data = [s.drift_pct for s in stats]
        ax.boxplot(data, showfliers=False)
        for i, values in enumerate(data, start=1):
            if not values:
                ax.text(i, 0.0, "no answers", ha="center", va="bottom", fontsize=8)
            jitter = [i + 0.15 * math.sin(7.0 * k) for k in range(len(values))]  # deterministic
            ax.scatter(jitter, values, s=10, alpha=0.6, color="tab:red")
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=20, ha="right")

    codes = sorted({c for s in stats for c in s.issues})
    with chart("issues.png", "Reconstruction issue codes", "answered requests with the code") as ax:
        if codes:
            bottom = [0.0] * len(stats)
            for code in codes:
                values = [float(s.issues.get(code, 0)) for s in stats]
                ax.bar(names, values, bottom=bottom, label=code)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            ax.legend(fontsize=8, title="issue code")
        else:
            ax.bar(names, [0.0] * len(stats))
            ax.text(0.5, 0.5, "no issue codes in any run", ha="center", transform=ax.transAxes)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")

    with chart(
        "tool_calls.png",
        "Tool-call validity (arguments are JSON matching the declared schema)",
        "% of returned tool calls (n/a: none)",
        ylim=110,
    ) as ax:
        grouped(ax, {"": [pct(s.tool_valid_rate) for s in stats]}, "{:.1f}%")

    with chart(
        "cost.png",
        "Cost per million output tokens (total run cost / reported output tokens)",
        "USD per 1M output tokens",
    ) as ax:
        grouped(ax, {"": [s.usd_per_mtok for s in stats]}, "${:.3g}")

    with chart("latency.png", "Request latency (the attempt that answered)", "seconds") as ax:
        grouped(
            ax,
            {"p50": [s.p50_latency for s in stats], "p95": [s.p95_latency for s in stats]},
            "{:.2f}",
        )

    with chart(
        "throughput.png", "Output speed (median per request)", "output tokens per second"
    ) as ax:
        grouped(ax, {"": [s.median_tokens_per_s for s in stats]}, "{:.1f}")

    with chart(
        "errors.png",
        "Errors (request failed for good) and retries (needed >1 attempt)",
        "% of requests",
    ) as ax:
        grouped(
            ax,
            {
                "error rate": [pct(s.error_rate) for s in stats],
                "retry rate": [pct(s.retry_rate) for s in stats],
            },
            "{:.1f}%",
        )
    return paths
