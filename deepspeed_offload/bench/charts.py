"""The charts, drawn from a run's summary (the JSON the driver writes, or a committed one): time and
memory per mode, the budget sweep (iteration time against iteration peak) and the memory timeline
of one iteration. Needs matplotlib (imported on first use)."""

from .modes import lookup
from .report import baseline_of, settings_of


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _spread_err(res, names, key):
    """Error bars (below, above the median) where the run kept the spread, else None."""
    if not all(key + "_min" in res[m] for m in names):
        return None
    return [[res[m][key] - res[m][key + "_min"] for m in names], [res[m][key + "_max"] - res[m][key] for m in names]]


def plot(summary, path):
    """Two panels, one row per mode (horizontal bars: a dozen mode names stay readable). Iteration
    time with its min-max where measured; the copy floor is marked on each offloading mode's bar as
    its baseline's time plus the floor, since the compiled modes start from DeepCompile's faster
    iteration, not from eager ZeRO-3's. Memory: the iteration peak (where recorded; else the step's),
    the step's and what stays between steps."""
    plt = _pyplot()
    settings = settings_of(summary)
    res = {m: r for m, r in summary["results"].items() if "iter_s" in r}
    names = list(res)[::-1]  # first mode at the top
    ys = list(range(len(names)))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 2.2), sharey=True)
    a1.barh(ys, [res[m]["iter_s"] for m in names], color="tab:blue", xerr=_spread_err(res, names, "iter_s"),
            error_kw={"elinewidth": 1, "capsize": 2})
    floor = summary.get("floor_s")
    marks = []
    for y, m in zip(ys, names):
        mode, base = lookup(m, settings), baseline_of(m, settings)
        if floor and mode and mode.against_floor and base in res:
            marks.append((y, res[base]["iter_s"] + floor))
    if marks:
        a1.scatter([x for _, x in marks], [y for y, _ in marks], marker="|", s=300, color="tab:red", zorder=3,
                   label=f"baseline + copy floor ({floor:.3f} s)")
        a1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    a1.set_xlabel("iteration time, s (median, min-max)")
    a1.set_yticks(ys)
    a1.set_yticklabels(names)
    iter_peak = all("peak_iter_GiB" in res[m] for m in names)
    h = 0.27 if iter_peak else 0.4
    if iter_peak:
        a2.barh([y + h for y in ys], [res[m]["peak_iter_GiB"] for m in names], height=h, label="iteration peak")
        a2.barh(ys, [res[m]["peak_step_GiB"] for m in names], height=h, label="peak in step")
        a2.barh([y - h for y in ys], [res[m]["between_GiB"] for m in names], height=h, label="between steps")
    else:
        a2.barh([y + 0.2 for y in ys], [res[m]["peak_step_GiB"] for m in names], height=h, label="peak in step")
        a2.barh([y - 0.2 for y in ys], [res[m]["between_GiB"] for m in names], height=h, label="between steps")
    a2.set_xlabel("GPU memory allocated, GiB")
    a2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    fig.suptitle(f"{summary.get('device', '')}, {summary['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _peak(r):
    return r.get("peak_iter_GiB", r["peak_step_GiB"])


def plot_sweep(summary, path):
    """Iteration time against iteration peak: our compile mode at each budget (a line, in budget
    order, labelled), DeepCompile's own offload_opt_states and compiled ZeRO-3 without offload as
    points on the same axes. Returns False (and draws nothing) without a measured sweep point."""
    settings = settings_of(summary)
    res = {m: r for m, r in summary["results"].items() if "iter_s" in r}
    modes = {m: lookup(m, settings) for m in res}
    sweep = [m for m in res if modes[m] and modes[m].family == "compile_offload"]
    if not sweep:
        return False
    order = sorted(sweep, key=lambda m: (modes[m].budget_gb is None, modes[m].budget_gb or 0))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.errorbar([_peak(res[m]) for m in order], [res[m]["iter_s"] for m in order],
                yerr=_spread_err(res, order, "iter_s"), marker="o", capsize=3,
                label="deepspeed-offload compile mode, by memory_budget_gb")
    labels = {}  # budgets that land on (nearly) one point, all fitting or none, share one label
    for m in order:
        near = (round(_peak(res[m]), 1), round(res[m]["iter_s"], 2))
        xy, names = labels.setdefault(near, ((_peak(res[m]), res[m]["iter_s"]), []))
        names.append(modes[m].budget_label)
    for xy, names in labels.values():
        ax.annotate(", ".join(names), xy, textcoords="offset points", xytext=(6, 4), fontsize=8)
    for m, marker in (("dc_offload_opt_states", "s"), ("dc_offload_opt_states_full", "D"), ("compiled", "*")):
        if m in res:
            ax.errorbar([_peak(res[m])], [res[m]["iter_s"]], yerr=_spread_err(res, [m], "iter_s"), marker=marker,
                        linestyle="none", capsize=3, markersize=9 if marker == "*" else 7,
                        label=m if m != "compiled" else "compiled (DeepCompile, no offload)")
    _finish(plt, fig, ax, "iteration peak GPU memory, GiB", "iteration time, s (median, min-max)",
            f"compile-mode budget sweep, {summary.get('device', '')} {summary['date']}", path)
    return True


def plot_timeline(summary, path):
    """Allocated GiB over one iteration for every traced mode on one chart, with each mode's
    backward, step and end marked in its colour. Returns False without a traced mode."""
    traced_modes = [m for m, r in summary["results"].items() if (r or {}).get("timeline")]
    if not traced_modes:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    styles = {"backward": ":", "step": "--", "end": "-."}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, m in enumerate(traced_modes):
        color = colors[k % len(colors)]
        tl = summary["results"][m]["timeline"]
        ax.step(tl["t_s"], tl["allocated_GiB"], where="post", color=color, label=f"{m} (peak {tl['peak_GiB']:.1f} GiB)")
        for key, ls in styles.items():
            if key in tl["marks_s"]:
                ax.axvline(tl["marks_s"][key], color=color, linestyle=ls, alpha=0.6, linewidth=1)
    for key, ls in styles.items():
        ax.plot([], [], color="gray", linestyle=ls, label=f"{key} starts" if key != "end" else "step ends")
    _finish(plt, fig, ax, "time since the start of forward, s", "GPU memory allocated, GiB",
            f"one iteration, {summary.get('device', '')} {summary['date']}", path)
    return True


def _finish(plt, fig, ax, xlabel, ylabel, title, path):
    """Labels, grid, legend and title of a one-panel chart; written to ``path``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
