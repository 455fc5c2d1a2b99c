"""Tables and learning curves from the runs' evaluations.csv, beside the published reference numbers.

    python benchmark/report.py                                   # runs/ -> benchmark/results/report.md + PNGs
    python benchmark/report.py --runs runs --steps 300000 1000000 --iqm --out benchmark/results

For each algorithm (the run's exp_name) and env, and each step S of --steps, a run's score is the mean return
of its last evaluation at or before S, counted only if the run reached S. Over seeds the table gives the mean
and a 95% confidence interval (Student's t; with --iqm, the interquartile mean instead of the mean), and the
reference numbers of benchmark/reference.csv for that algorithm, env and step. The curves (one PNG per env, one
line per algorithm: the mean over seeds with its 95% band, each run interpolated on a common grid over the steps
that all its runs cover) need matplotlib, the optional `plot` extra.
"""
import argparse
import csv
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).resolve().parent / "reference.csv"
# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); above that, the normal's 1.96.
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def read_runs(runs_dir):
    """{(algorithm, env_id): [(seed, steps array, mean returns array)]} from runs_dir/*/{args.json,evaluations.csv}."""
    runs = defaultdict(list)
    for path in sorted(Path(runs_dir).glob("*/evaluations.csv")):
        try:
            args = json.loads((path.parent / "args.json").read_text())
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        except (OSError, ValueError):
            continue
        if rows:
            steps = np.array([int(r["global_step"]) for r in rows])
            returns = np.array([float(r["mean_return"]) for r in rows])
            runs[(args["exp_name"], args["env_id"])].append((args["seed"], steps, returns))
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
    return float(np.mean(values[cut: len(values) - cut]))


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


def table(runs, steps, use_iqm=False, reference=None):
    """The markdown report: one table per step, a row per algorithm and env."""
    reference = read_reference() if reference is None else reference
    lines = []
    for step in steps:
        lines += [f"## At {step:,} env steps", "",
                  f"| algorithm | env | {'IQM' if use_iqm else 'mean'} return | 95% CI | seeds | reference |",
                  "|---|---|---|---|---|---|"]
        for (algorithm, env_id), group in sorted(runs.items()):
            scores = [s for s in (score_at(st, r, step) for _, st, r in group) if s is not None]
            refs = [f"{r['mean']}" + (f" +- {r['std']}" if r["std"] else "") + f" ({r['measure']}; {r['source']})"
                    for r in reference if r["algorithm"] == algorithm and r["env_id"] == env_id
                    and int(r["step"]) == step]
            if not scores:
                lines.append(f"| {algorithm} | {env_id} | - | - | 0 of {len(group)} reached | {'<br>'.join(refs)} |")
                continue
            centre, half, n = summarise(scores, use_iqm)
            interval = f"[{centre - half:.1f}, {centre + half:.1f}]" if half is not None else "-"
            lines.append(f"| {algorithm} | {env_id} | {centre:.1f} | {interval} | {n} | {'<br>'.join(refs)} |")
        lines.append("")
    return "\n".join(lines)


def curves(runs, out_dir, points=100):
    """One PNG per env: per algorithm, the mean over seeds and its 95% band on a common grid of steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for env_id in sorted({env for _, env in runs}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for (algorithm, env), group in sorted(runs.items()):
            if env != env_id:
                continue
            grid = np.linspace(max(st[0] for _, st, _ in group), min(st[-1] for _, st, _ in group), points)
            values = np.array([np.interp(grid, st, r) for _, st, r in group])
            mean = values.mean(0)
            ax.plot(grid, mean, label=f"{algorithm} ({len(group)} seeds)")
            if len(group) > 1:
                half = np.array([summarise(column)[1] for column in values.T])
                ax.fill_between(grid, mean - half, mean + half, alpha=0.2)
        ax.set(title=env_id, xlabel="env steps", ylabel="evaluation return")
        ax.legend()
        fig.tight_layout()
        path = Path(out_dir) / f"{env_id.replace('/', '-').replace(':', '-')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="runs", help="the folder of run directories")
    parser.add_argument("--steps", nargs="+", type=int, default=[300_000, 1_000_000])
    parser.add_argument("--iqm", action="store_true", help="interquartile mean over seeds instead of the mean")
    parser.add_argument("--out", default="benchmark/results", help="folder for report.md and the PNGs")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    runs = read_runs(args.runs)
    if not runs:
        raise SystemExit(f"error: no runs with an evaluations.csv in {args.runs}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = Path(args.out) / "report.md"
    report.write_text(f"# Returns from {args.runs}\n\n" + table(runs, args.steps, args.iqm))
    print(f"wrote {report}")
    if not args.no_plots:
        try:
            for path in curves(runs, args.out):
                print(f"wrote {path}")
        except ImportError:
            raise SystemExit("error: the learning curves need matplotlib: pip install \".[plot]\" (or use --no-plots)")


if __name__ == "__main__":
    main()
