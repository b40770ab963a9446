"""The benchmark as a table and, optionally, a plot."""

from __future__ import annotations

import re
from pathlib import Path

from specrt.errors import SpecrtError

WIDTH = 36


def table(report: dict) -> str:
    labels = list(report["results"])
    names = list(dict.fromkeys(n for label in labels for n in report["results"][label]))
    header = f"{'contender':<{WIDTH}}" + "".join(f"{label:>26}" for label in labels)
    header += f"{'alpha':>8}{'predicted':>11}{'with v_K':>10}{'overhead':>10}"
    lines = [header, f"{'':<{WIDTH}}" + "".join(f"{'tokens/s   x target':>26}" for _ in labels)]
    for name in names:
        row = f"{name:<{WIDTH}}"
        for label in labels:
            entry = report["results"][label].get(name)
            if entry is None:
                row += f"{'-':>26}"
                continue
            row += f"{entry['tokens_per_second']:>17.1f}{entry['speedup']:>8.2f}x"
        first = report["results"][labels[0]].get(name, {})
        row += f"{first['alpha']:>8.2f}" if "alpha" in first else f"{'':>8}"
        for key, width in (("predicted_speedup", 11), ("predicted_speedup_measured_verify", 10)):
            predicted = first.get(key)
            row += f"{predicted:>{width - 1}.2f}x" if predicted else f"{'':>{width}}"
        overhead = first.get("overhead_fraction")
        row += f"{overhead:>9.1%}" if overhead is not None else ""
        lines.append(row)
    costs = report["costs"]
    lines.append(
        f"c = draft/target step cost = {costs['cost_ratio']:.3f}; {report['prompts']} prompts, "
        f"{report['max_new_tokens']} new tokens, {report['threads']} threads, engine "
        f"{report.get('engine', 'auto')}; medians over prompts; alpha, predicted and overhead "
        "for the first column; predicted = (1 - alpha^(K+1)) / ((1 - alpha)(1 + K c)), 'with v_K'"
        " puts the measured cost of verifying K+1 tokens (v_K target steps) in place of the 1; "
        "alpha for the draft model alone (a hybrid's K is its model's: its matches run to 24); "
        "overhead = the share of the time spent outside onnxruntime"
    )
    verify = costs.get("verify_cost_ratio", {})
    if verify:
        lines.append("v_K: " + ", ".join(f"K={k} {v:.2f}" for k, v in verify.items()))
    for what, why in report["skipped"].items():
        lines.append(f"skipped {what}: {why}")
    return "\n".join(lines)


def check_plot_path(path: Path) -> None:
    """Refuse a plot matplotlib could not write, before the benchmark runs."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError as exc:
        raise SpecrtError("--plot needs matplotlib: pip install 'specrt[bench]'") from exc
    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(path).suffix.removeprefix(".").lower()
    if suffix and suffix not in formats:
        raise SpecrtError(
            f"--plot {path}: matplotlib writes no .{suffix} files; end the name in one of "
            + ", ".join(f".{name}" for name in sorted(formats))
        )


def plot(report: dict, path: Path) -> None:
    check_plot_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, results in report["results"].items():
        fixed = {
            int(m.group(1)): entry
            for name, entry in results.items()
            if (m := re.fullmatch(r"specrt K=(\d+)", name))
        }
        ks = sorted(fixed)
        left.plot(ks, [fixed[k]["speedup"] for k in ks], "o-", label=f"measured ({label})")
        left.plot(
            ks, [fixed[k]["predicted_speedup"] for k in ks], "x--", label=f"predicted ({label})"
        )
        left.plot(
            ks,
            [fixed[k]["predicted_speedup_measured_verify"] for k in ks],
            "+:",
            label=f"predicted, measured v_K ({label})",
        )
        best = max(ks, key=lambda k: fixed[k]["speedup"])
        rates = fixed[best]["accepted_per_position_rate"]
        right.bar(
            [i + 1 + (0.2 if label != "greedy" else -0.2) for i in range(len(rates))],
            rates,
            width=0.4,
            label=f"K={best} ({label})",
        )
        left.set_xticks(ks)
    right.set_xticks(range(1, max(ks) + 1))
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xlabel="draft tokens K", ylabel="speedup vs target only", title="Speedup")
    right.set(xlabel="draft position", ylabel="accepted per round", title="Acceptance by position")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
