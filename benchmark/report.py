"""Tables and learning curves from the runs' evaluations.csv, beside the published reference numbers.

    python benchmark/report.py sweeps/td3_continuous sweeps/sac_continuous --steps 100000 --out benchmark/results
    python benchmark/report.py runs --steps 300000 1000000 --iqm --seed-lines

It reads the directories it is given: each a sweep's directory (holding runs/) or a folder of run directories. For
each algorithm (the run's exp_name) and env, and each step S of --steps (by default the last step that every run
reached), a run's score is the mean return of its last evaluation at or before S, counted only if the run reached S;
with several runs of one seed, the one that went furthest counts. Over seeds the table gives the mean and a 95%
confidence interval (Student's t; with --iqm, the interquartile mean instead of the mean), how many seeds reached S,
and the reference numbers of benchmark/reference.csv for that algorithm, env and step. A last table gives each
seed's last and best evaluation. The curves (one PNG per env, one colour per algorithm: the mean over the seeds that
reached each evaluation step, shaded between the lowest and highest seed, the reference numbers as markers at their
step, and the published learning curves of benchmark/reference_curves.csv as grey bands of mean +- sd, which the
tables quote at their steps too) need matplotlib, the optional `plot` extra; without it the tables are written and
the plots skipped.
"""

import argparse
import csv
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).resolve().parent / "reference.csv"
# Published learning curves (the same columns, a row per evaluation step), drawn as a band of mean +- sd; their env
# ids may carry another version than the runs' (the TD3 paper's are -v1), so they match a run's env by its name.
REFERENCE_CURVES = Path(__file__).resolve().parent / "reference_curves.csv"
# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); above that, the normal's 1.96.
T95 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


class Runs(defaultdict):
    """{(algorithm, env_id): [(seed, steps array, mean returns array)]}, and `left_out`: the runs that could not be
    read, each as (run directory, reason)."""

    def __init__(self):
        super().__init__(list)
        self.left_out = []


def read_run(run):
    """(args, steps, returns) of one run directory, its rows sorted by step and each step once; raises ValueError
    naming what cannot be read. Warns on stderr about rows it sorted or dropped."""
    try:
        args = json.loads((run / "args.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read args.json ({getattr(e, 'strerror', None) or e})") from None
    missing = [name for name in ("exp_name", "env_id", "seed") if name not in args]
    if missing:
        raise ValueError(f"args.json has no {', '.join(missing)}")
    with open(run / "evaluations.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    by_step = {}
    for number, row in enumerate(rows, start=2):  # line 1 is the header
        try:
            step, value = int(row["global_step"]), float(row["mean_return"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"evaluations.csv line {number} is short or not a number: {list(row.values())}") from None
        if not math.isfinite(value):
            raise ValueError(f"evaluations.csv line {number} has the return {value}")
        by_step[step] = value  # a step written twice (by two processes, or a resume): the last row counts
    steps = sorted(by_step)
    if len(steps) < len(rows):
        warn(f"{run}: {len(rows) - len(steps)} duplicated evaluation rows dropped (the last of each step kept)")
    if [int(row["global_step"]) for row in rows] != sorted(int(row["global_step"]) for row in rows):
        warn(f"{run}: evaluation rows out of order, sorted by step")
    return args, np.array(steps, dtype=np.int64), np.array([by_step[step] for step in steps])


def warn(message):
    print(f"warning: {message}", file=sys.stderr)


def read_runs(*directories):
    """The runs (a Runs), one entry per seed (the run that went furthest), from each directory's runs/*/ (a sweep)
    or */ (a folder of runs) args.json and evaluations.csv. A run that cannot be read is named in one warning line
    and left out."""
    best, runs = {}, Runs()
    for directory in directories:
        folder = Path(directory) / "runs" if (Path(directory) / "runs").is_dir() else Path(directory)
        for path in sorted(folder.glob("*/evaluations.csv")):
            try:
                args, steps, returns = read_run(path.parent)
            except (OSError, ValueError) as e:
                warn(f"left out {path.parent}: {e}")
                runs.left_out.append((path.parent, str(e)))
                continue
            key = (args["exp_name"], args["env_id"], args["seed"])
            if len(steps) and (key not in best or steps[-1] > best[key][1][-1]):
                best[key] = (args["seed"], steps, returns)
    for (algorithm, env_id, _), run in sorted(best.items(), key=lambda item: str(item[0])):
        runs[(algorithm, env_id)].append(run)
    return runs


def score_at(steps, returns, step):
    """The return of the last evaluation at or before `step`; None when the run did not reach `step`, or has no
    evaluation at or before it."""
    i = np.searchsorted(steps, step, side="right") - 1
    return float(returns[i]) if steps[-1] >= step and i >= 0 else None


def iqm(values):
    """Interquartile mean: the mean of the values left after dropping the lowest and highest quarter."""
    values = np.sort(values)
    cut = int(len(values) * 0.25)
    return float(np.mean(values[cut : len(values) - cut]))


def summarise(values, use_iqm=False):
    """(centre, half-width of the 95% interval of the mean, n); the half-width is None for fewer than 2 seeds."""
    values = np.asarray(values, dtype=float)
    n = len(values)
    centre = iqm(values) if use_iqm else float(values.mean())
    if n < 2:
        return centre, None, n
    t = T95[n - 2] if n - 1 <= len(T95) else 1.96
    return centre, t * float(values.std(ddof=1)) / math.sqrt(n), n


def read_reference(path=REFERENCE):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def same_task(env_id, other):
    """Two env ids of one task, whatever their versions: HalfCheetah-v4 and HalfCheetah-v1."""
    return env_id.rsplit("-v", 1)[0] == other.rsplit("-v", 1)[0]


def published_curves(curve_rows, algorithm, env_id):
    """The published curves of `algorithm` on `env_id`'s task: {(source, env_id, seeds): (steps, means, sds)}."""
    found = defaultdict(list)
    for r in curve_rows:
        if r["algorithm"] == algorithm and same_task(r["env_id"], env_id):
            found[r["source"], r["env_id"], r["seeds"]].append((int(r["step"]), float(r["mean"]), float(r["std"])))
    return {key: tuple(np.array(column) for column in zip(*sorted(rows))) for key, rows in found.items()}


def table(runs, steps, use_iqm=False, reference=None, curve_rows=None):
    """The markdown report: one table per step, a row per algorithm and env; the reference column holds the
    reference numbers at that step and the published curves' values there (with their env id)."""
    reference = read_reference() if reference is None else reference
    curve_rows = read_reference(REFERENCE_CURVES) if curve_rows is None else curve_rows
    lines = []
    for step in steps:
        lines += [
            f"## At {step:,} env steps",
            "",
            f"| algorithm | env | {'IQM' if use_iqm else 'mean'} return | 95% CI | seeds | reference |",
            "|---|---|---|---|---|---|",
        ]
        for (algorithm, env_id), group in sorted(runs.items()):
            scores = [s for s in (score_at(st, r, step) for _, st, r in group) if s is not None]
            refs = [
                f"{r['mean']}" + (f" +- {r['std']}" if r["std"] else "") + f" ({r['measure']}; {r['source']})"
                for r in reference
                if r["algorithm"] == algorithm and r["env_id"] == env_id and int(r["step"]) == step
            ]
            for (source, curve_env, n), (at, mean, sd) in published_curves(curve_rows, algorithm, env_id).items():
                if step in at:
                    refs.append(f"{mean[at == step][0]} +- {sd[at == step][0]} ({curve_env}, {n} seeds; {source})")
            seeds = f"{len(scores)}" if len(scores) == len(group) else f"{len(scores)} of {len(group)} reached"
            if not scores:
                lines.append(f"| {algorithm} | {env_id} | - | - | {seeds} | {'<br>'.join(refs)} |")
                continue
            centre, half, n = summarise(scores, use_iqm)
            interval = f"[{centre - half:.1f}, {centre + half:.1f}]" if half is not None else "-"
            lines.append(f"| {algorithm} | {env_id} | {centre:.1f} | {interval} | {seeds} | {'<br>'.join(refs)} |")
        lines.append("")
    return "\n".join(lines)


def seed_table(runs):
    """The markdown table of each run (the one per seed that went furthest): its last and its best evaluation."""
    lines = [
        "## Each seed: its last and its best evaluation",
        "",
        "| algorithm | env | seed | last evaluation | best evaluation |",
        "|---|---|---|---|---|",
    ]
    for (algorithm, env_id), group in sorted(runs.items()):
        for seed, steps, returns in group:
            b = int(np.argmax(returns))
            lines.append(
                f"| {algorithm} | {env_id} | {seed} | {returns[-1]:.1f} at {steps[-1]:,} "
                f"| {returns[b]:.1f} at {steps[b]:,} |"
            )
    return "\n".join(lines + [""])


def curve(group):
    """On the union of the seeds' evaluation steps: the number of seeds that reached each step, their mean, lowest
    and highest return there (each seed interpolated between its own evaluations, never beyond its last)."""
    grid = np.unique(np.concatenate([steps for _, steps, _ in group]))
    values = np.array(
        [np.where((grid >= st[0]) & (grid <= st[-1]), np.interp(grid, st, r), np.nan) for _, st, r in group]
    )
    count = (~np.isnan(values)).sum(0)
    grid, values, count = grid[count > 0], values[:, count > 0], count[count > 0]
    return grid, count, np.nanmean(values, 0), np.nanmin(values, 0), np.nanmax(values, 0), values


def plot_env(ax, runs, env_id, reference, seed_lines=False, curve_rows=()):
    """Draw one env's curves on `ax`: per algorithm its mean, shaded between its lowest and highest seed in the
    line's own colour, optionally each seed as a thin line, its reference numbers as star markers at their step, and
    its published curves (`curve_rows`, rows of reference_curves.csv) as a grey dashed mean in a grey band of +- one
    sd, each with a legend entry of its own. References beyond the last evaluation drawn are left out (a 1M-step
    reference would squash 100k-step curves)."""
    groups = {algorithm: group for (algorithm, env), group in sorted(runs.items()) if env == env_id}
    last = max(steps[-1] for group in groups.values() for _, steps, _ in group)
    for algorithm, group in groups.items():
        grid, count, mean, low, high, values = curve(group)
        seeds = f"{count.min()}-{count.max()}" if count.min() != count.max() else str(count.max())
        seeds += " seed" if seeds == "1" else " seeds"
        (line,) = ax.plot(grid, mean, marker="o" if len(grid) == 1 else None, label=f"{algorithm} ({seeds})")
        ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        for row in values if seed_lines else []:
            ax.plot(grid, row, color=line.get_color(), linewidth=0.5, alpha=0.6)
        published = [
            r
            for r in reference
            if r["algorithm"] == algorithm and r["env_id"] == env_id and int(r["step"]) <= 1.05 * last
        ]
        for i, r in enumerate(published):
            ax.errorbar(
                int(r["step"]),
                float(r["mean"]),
                yerr=float(r["std"] or 0),
                color=line.get_color(),
                marker="*",
                markersize=10,
                capsize=3,
                linestyle="none",
                label=f"{algorithm}, published (mean, sd)" if i == 0 else None,
            )
        for (source, curve_env, n), (at, mean, sd) in published_curves(curve_rows, algorithm, env_id).items():
            shown = at <= 1.05 * last
            label = f"{source}: {curve_env}, {n} seeds (mean +- sd)"
            ax.plot(at[shown], mean[shown], color="0.35", linestyle="--", linewidth=1.2, label=label)
            ax.fill_between(at[shown], (mean - sd)[shown], (mean + sd)[shown], color="0.5", alpha=0.18, linewidth=0)
    ax.set(xlabel="env steps", ylabel="evaluation return")
    ax.set_title(f"{env_id}: mean over seeds, shaded from lowest to highest", fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)  # beside: no curve hidden


def curves(runs, out_dir, reference=None, seed_lines=False, curve_rows=None):
    """One PNG per env (see plot_env); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = read_reference() if reference is None else reference
    curve_rows = read_reference(REFERENCE_CURVES) if curve_rows is None else curve_rows
    written = []
    for env_id in sorted({env for _, env in runs}):
        fig, ax = plt.subplots(figsize=(10, 4.5))
        plot_env(ax, runs, env_id, reference, seed_lines, curve_rows)
        path = Path(out_dir) / f"{env_id.replace('/', '-').replace(':', '-')}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")  # the axes and the legend beside them
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("directories", nargs="+", help="sweep directories (holding runs/) or folders of runs")
    parser.add_argument(
        "--steps", nargs="+", type=int, help="the steps of the tables (default: the last step every run reached)"
    )
    parser.add_argument("--iqm", action="store_true", help="interquartile mean over seeds instead of the mean")
    parser.add_argument(
        "--out",
        default="report",
        help="folder for report.md and the PNGs (benchmark/results/... to add them to the project's results)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write the tables only")
    parser.add_argument("--seed-lines", action="store_true", help="draw each seed's curve as a thin line too")
    args = parser.parse_args(argv)
    runs = read_runs(*args.directories)
    if not runs:
        raise SystemExit(f"error: no runs with an evaluations.csv in {', '.join(args.directories)}")
    steps = args.steps or [min(st[-1] for group in runs.values() for _, st, _ in group)]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = Path(args.out) / "report.md"
    left_out = (
        f"\n{len(runs.left_out)} runs could not be read and are left out (see the warnings).\n"
        if (getattr(runs, "left_out", None))
        else ""
    )
    report.write_text(
        f"# Returns from {', '.join(args.directories)}\n\n"
        + table(runs, steps, args.iqm)
        + left_out
        + "\n"
        + seed_table(runs)
    )
    print(f"wrote {report}")
    if args.no_plots:
        return
    try:
        paths = curves(runs, args.out, seed_lines=args.seed_lines)
    except ImportError:
        print('plots skipped: the learning curves need matplotlib (pip install ".[plot]")')
        return
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
