"""Writes a validation Report: report.json, report.md, plots/*.png, examples/*.jsonl."""

from __future__ import annotations

import json
import os

from rm_jax.label.validate import CELLS, ROUTES, Report


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(r: Report) -> str:
    out = [f"# Label validation: {os.path.basename(r.labels)}", ""]
    out.append(f"{r.n_rows} labelled rows" + (f", {len(r.unreadable)} unreadable (listed in report.json)"
                                               if r.unreadable else "") + ".")
    out += ["", "## Flags", ""]
    if r.flags:
        out += [f"- **{f.name}**: {f.detail}" for f in r.flags]
    else:
        out.append("None raised.")
    out += ["", "## Text-only fail rate by similarity to the reply that went out", "",
            "| similarity | rows | teacher fail rate |", "|---|---|---|"]
    for b in r.bins:
        out.append(f"| {b.name} | {b.n} | {_pct(b.fail_rate)}{'' if b.judged or not b.n else ' (too few to judge)'} |")
    out += ["", f"Text-only rows with a reference_reply: {r.text_only_with_reference} "
                f"(without: {r.text_only_without_reference}); their fail rate {_pct(r.text_only_fail_rate)}. "
                "Sound labels fail far less often near the reply that went out (plots/similarity_fail_rate.png).",
            "", "## Routes", "", "| route | rows | fail rate |", "|---|---|---|"]
    for route in ROUTES:
        v = r.routes[route]
        out.append(f"| {route} | {v['n']} | {_pct(v['fail_rate'])} |")
    c = r.route_comparison
    out += ["", f"Ratio of the higher to the lower fail rate: {c['ratio'] if c['ratio'] is not None else '-'}"
                f" (z = {c['z'] if c['z'] is not None else '-'}).", "", "## Issues by route", ""]
    for route in ROUTES:
        items = ", ".join(f"{k} {n}" for k, n in r.issues_by_route[route].items()) or "none"
        out.append(f"- {route}: {items}")
    out.append(f"- tool-call issue types on text-only answers: {len(r.tool_issue_rows)}"
               + (f" (e.g. {', '.join(r.tool_issue_rows[:5])})" if r.tool_issue_rows else ""))
    if r.migration is not None:
        m = r.migration
        out += ["", f"## Migration from {os.path.basename(r.previous)}", "",
                f"{m['compared']} rows in both: unchanged {m['unchanged']}, pass->fail {m['pass_to_fail']}, "
                f"fail->pass {m['fail_to_pass']} (only in previous: {m['only_in_previous']}, only in these "
                f"labels: {m['only_in_labels']}).", "", "| previous \\ now | pass | fail |", "|---|---|---|",
                f"| pass | {m['matrix']['pass->pass']} | {m['matrix']['pass->fail']} |",
                f"| fail | {m['matrix']['fail->pass']} | {m['matrix']['fail->fail']} |", ""]
        for cell in CELLS:
            ex = m["examples"].get(cell)
            if ex:
                out.append(f"- {cell} `{ex['id']}` ({ex['route']}): was \"{ex['previous_reason']}\", now "
                           f"\"{ex['reason']}\". Response: {ex['response']!r}")
    out += ["", "## Examples per similarity bin", "", "All of them in examples/similarity_*.jsonl; two per bin here.", ""]
    for name, rows in r.examples.items():
        for ex in rows[:2]:
            out.append(f"- {name} `{ex['id']}` sim {ex['similarity']} **{ex['l3']}** ({', '.join(ex['issues']) or '-'}): "
                       f"{ex['reason']!r}. Response {ex['response']!r}; went out {ex['reference_reply']!r}")
    return "\n".join(out) + "\n"


def plots(r: Report, plot_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [b.name for b in r.bins]
    rates = [100 * (b.fail_rate or 0.0) for b in r.bins]
    bars = ax.bar(names, rates, color=["C0" if b.judged else "lightgray" for b in r.bins])
    for bar, b in zip(bars, r.bins):
        ax.annotate(f"n={b.n}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    if r.text_only_fail_rate is not None:
        ax.axhline(100 * r.text_only_fail_rate, color="C3", ls="--", lw=1, label="text-only overall")
        ax.legend(fontsize=8)
    ax.set_xlabel("character similarity to the reply that went out")
    ax.set_ylabel("teacher fail rate (%)")
    ax.set_title("Text-only answers")
    fig.tight_layout()
    written.append(os.path.join(plot_dir, "similarity_fail_rate.png"))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    a1.bar(list(ROUTES), [100 * (r.routes[x]["fail_rate"] or 0.0) for x in ROUTES], color=["C1", "C0"])
    a1.set_ylabel("teacher fail rate (%)")
    a1.set_title("Fail rate by route")
    issues = sorted({k for x in ROUTES for k in r.issues_by_route[x]})
    width = 0.4
    for j, route in enumerate(ROUTES):
        a2.bar([i + (j - 0.5) * width for i in range(len(issues))],
               [r.issues_by_route[route].get(k, 0) for k in issues], width, label=route)
    a2.set_xticks(range(len(issues)))
    a2.set_xticklabels(issues, rotation=60, ha="right", fontsize=7)
    a2.set_title("Issues by route")
    a2.legend(fontsize=8)
    fig.tight_layout()
    written.append(os.path.join(plot_dir, "routes_and_issues.png"))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    if r.migration is not None:
        m = r.migration["matrix"]
        grid = [[m["pass->pass"], m["pass->fail"]], [m["fail->pass"], m["fail->fail"]]]
        fig, ax = plt.subplots(figsize=(3.6, 3.2))
        ax.imshow(grid, cmap="Blues")
        for i in range(2):
            for j in range(2):
                ax.text(j, i, str(grid[i][j]), ha="center", va="center")
        ax.set_xticks([0, 1], ["pass", "fail"])
        ax.set_yticks([0, 1], ["pass", "fail"])
        ax.set_xlabel("now")
        ax.set_ylabel("previous")
        ax.set_title("Label migration")
        fig.tight_layout()
        written.append(os.path.join(plot_dir, "migration.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def write_report(r: Report, out_dir: str) -> dict:
    os.makedirs(os.path.join(out_dir, "examples"), exist_ok=True)
    for name, rows in r.examples.items():
        with open(os.path.join(out_dir, "examples", f"similarity_{name}.jsonl"), "w", encoding="utf-8") as f:
            for ex in rows:
                f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    written = plots(r, os.path.join(out_dir, "plots"))
    obj = r.to_json()
    obj["plots"] = [os.path.relpath(p, out_dir) for p in written]
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(markdown(r))
    return obj
