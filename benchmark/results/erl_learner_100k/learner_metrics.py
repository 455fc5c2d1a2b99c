"""The table of README.md: for each run under evaluations/, the champion's and learner 0's evaluation at the last
generation end at or before 100k steps (evaluations.csv), and from its TensorBoard file the learner's saturation
(charts/learner_saturation), Q1 at the buffer's actions (losses/qf1_values) and the best return of any episode yet
(charts/best_return) at the last generation end at or before 11k, 33k and 99k steps, and Q1's largest value.

    python benchmark/results/erl_learner_100k/learner_metrics.py
"""

import csv
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

STEPS = (11_000, 33_000, 99_000)


def at(points, step):
    """The last value logged at or before `step` (nan if none)."""
    values = [value for s, value in points if s <= step]
    return values[-1] if values else float("nan")


def row(run):
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]

    def points(tag):  # (step, value), the last write of each step (a resumed run rewrites its checkpoint's step)
        return sorted({e.step: e.value for e in events.Scalars(tag)}.items()) if tag in tags else []

    saturation, q, best = (points(t) for t in ("charts/learner_saturation", "losses/qf1_values", "charts/best_return"))
    evaluation = [r for r in csv.DictReader(open(run / "evaluations.csv")) if int(r["global_step"]) <= 100_000][-1]
    env, name, seed = run.name.split("__")[:3]
    return [
        env,
        "ERL's learner" if name.endswith("erl_learner") else "defaults",
        seed,
        evaluation["global_step"],
        f"{float(evaluation['mean_return']):.0f}",
        f"{float(evaluation['learner_mean_return']):.0f}",
        " / ".join(f"{100 * at(saturation, s):.0f}%" for s in STEPS),
        " / ".join(f"{at(q, s):.0f}" for s in STEPS),
        f"{max(v for _, v in q):.0f}",
        " / ".join(str(round(at(best, s))) for s in STEPS),  # (round: no "-0")
    ]


if __name__ == "__main__":
    header = ["env", "settings", "seed", "step", "champion", "learner", "saturation", "Q1", "Q1 max", "best return"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    runs = Path(__file__).parent.glob("evaluations/*/")
    for run in sorted(runs, key=lambda r: [r.name.split("__")[i] for i in (0, 2, 1)]):  # env, seed, settings
        print("| " + " | ".join(row(run)) + " |")
