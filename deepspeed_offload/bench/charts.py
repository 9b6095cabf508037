"""The charts, drawn from a run's summary (the JSON the driver writes, or a committed one): time and
memory per mode (a mode without figures says why in its row), the budget sweeps (iteration time
against iteration peak) and the memory timeline of one iteration. Needs matplotlib (imported on
first use)."""

from .modes import lookup
from .report import baseline_of, settings_of
from .results import unmeasured


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
    the step's and what stays between steps. A mode without figures keeps its row, which says why
    (out of memory, with the peak before it where known; timed out; failed)."""
    plt = _pyplot()
    settings = settings_of(summary)
    rows = {m: r for m, r in summary["results"].items() if m != "bandwidth" and ("iter_s" in r or unmeasured(r))}
    res = {m: r for m, r in rows.items() if "iter_s" in r}
    names = list(rows)[::-1]  # first mode at the top
    ys = list(range(len(names)))
    measured = [(y, m) for y, m in zip(ys, names) if m in res]
    my, mn = [y for y, _ in measured], [m for _, m in measured]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 2.2), sharey=True)
    a1.barh(my, [res[m]["iter_s"] for m in mn], color="tab:blue", xerr=_spread_err(res, mn, "iter_s"),
            error_kw={"elinewidth": 1, "capsize": 2})
    floor = summary.get("floor_s")
    marks = []
    for y, m in measured:
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
    a1.set_ylim(-0.6, len(names) - 0.4)  # rows without a bar too
    iter_peak = all("peak_iter_GiB" in res[m] for m in mn)
    h = 0.27 if iter_peak else 0.4
    if iter_peak:
        a2.barh([y + h for y in my], [res[m]["peak_iter_GiB"] for m in mn], height=h, label="iteration peak")
        a2.barh(my, [res[m]["peak_step_GiB"] for m in mn], height=h, label="peak in step")
        a2.barh([y - h for y in my], [res[m]["between_GiB"] for m in mn], height=h, label="between steps")
    else:
        a2.barh([y + 0.2 for y in my], [res[m]["peak_step_GiB"] for m in mn], height=h, label="peak in step")
        a2.barh([y - 0.2 for y in my], [res[m]["between_GiB"] for m in mn], height=h, label="between steps")
    for y, m in zip(ys, names):
        if m not in res:
            _why(a1, y, unmeasured(rows[m]).split(" (")[0].split(":")[0])
            peak = rows[m].get("peak_before_GiB")
            if rows[m].get("oom"):
                _why(a2, y, "out of memory" + (f", peak {peak:.1f} GiB before" if peak is not None else ""))
    a2.set_xlabel("GPU memory allocated, GiB")
    a2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    fig.suptitle(f"{summary.get('device', '')}, {summary['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _why(ax, y, text):
    """A row's reason for having no bar, written where its bar would start."""
    if text:
        ax.annotate(text, (0, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8,
                    color="tab:red", annotation_clip=False)


def _peak(r):
    return r.get("peak_iter_GiB", r["peak_step_GiB"])


# The budget families drawn as lines, and the modes drawn beside them as single points.
FAMILY_LABELS = {"compile_offload": "deepspeed-offload compile mode, by memory_budget_gb",
                 "default": "deepspeed-offload at its defaults, by memory_budget_gb",
                 "stream": "deepspeed-offload stream mode, overlap off, by memory_budget_gb",
                 "stream_overlap": "deepspeed-offload stream mode, overlap on, by memory_budget_gb"}
REFERENCES = {"compile_offload": (("dc_offload_opt_states", "s"), ("dc_offload_opt_states_full", "D"),
                                  ("compiled", "*")),
              "stream": (("resident", "P"), ("offload_states", "X"), ("zero_offload", "v"))}
REFERENCE_LABELS = {"compiled": "compiled (DeepCompile, no offload)", "resident": "resident (ZeRO-3, no offload)"}


def plot_sweep(summary, path):
    """Iteration time against iteration peak: each budget family measured (our compile mode, stream
    mode with overlap off and on) as a line of its budgets in order, labelled; DeepCompile's own
    offload_opt_states and compiled ZeRO-3 beside the compile line, resident ZeRO-3, offload_states
    and ZeRO-Offload beside the stream lines, as points on the same axes; the modes that ran out of
    memory named in a note. Returns False (and draws nothing) without a measured point of a family."""
    settings = settings_of(summary)
    res = {m: r for m, r in summary["results"].items() if "iter_s" in r}
    modes = {m: lookup(m, settings) for m in res}
    lines = {}
    for m in res:
        if modes[m] and modes[m].family:
            lines.setdefault(modes[m].family, []).append(m)
    if not lines:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    labels = {}  # budgets that land on (nearly) one point, all fitting or none, share one label
    for family, members in lines.items():
        order = sorted(members, key=lambda m: (modes[m].budget_gb is None, modes[m].budget_gb or 0))
        ax.errorbar([_peak(res[m]) for m in order], [res[m]["iter_s"] for m in order],
                    yerr=_spread_err(res, order, "iter_s"), marker="o", capsize=3, label=FAMILY_LABELS[family])
        for m in order:
            near = (round(_peak(res[m]), 1), round(res[m]["iter_s"], 2))
            xy, names = labels.setdefault(near, ((_peak(res[m]), res[m]["iter_s"]), []))
            names.append(modes[m].budget_label)
    for xy, names in labels.values():
        ax.annotate(", ".join(names), xy, textcoords="offset points", xytext=(6, 4), fontsize=8)
    groups = {"compile_offload" if f == "compile_offload" else "stream" for f in lines}
    for m, marker in (ref for g in sorted(groups) for ref in REFERENCES[g]):
        if m in res:
            ax.errorbar([_peak(res[m])], [res[m]["iter_s"]], yerr=_spread_err(res, [m], "iter_s"), marker=marker,
                        linestyle="none", capsize=3, markersize=9 if marker == "*" else 7,
                        label=REFERENCE_LABELS.get(m, m))
    oom = [m for m, r in summary["results"].items() if r.get("oom")]
    if oom:
        ax.text(0.99, 0.01, "out of memory: " + ", ".join(oom), transform=ax.transAxes, ha="right", va="bottom",
                fontsize=8, color="tab:red")
    what = "compile-mode" if groups == {"compile_offload"} else "resident-budget"
    _finish(plt, fig, ax, "iteration peak GPU memory, GiB", "iteration time, s (median, min-max)",
            f"{what} sweep, {summary.get('device', '')} {summary['date']}", path)
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
