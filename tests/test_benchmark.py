"""The benchmark tools: benchmark/sweep.py in local mode (runs in parallel, keeps going past a failing run and
reports it, skips finished runs, resumes unfinished ones) and as a Slurm job array on a real single-node cluster,
and benchmark/report.py on synthetic evaluation files."""
import csv
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from benchmark import report
from tests.conftest import REPO, cli_env, flags_with

FLAGS = ["--", "--total-timesteps", "300", "--learning-starts", "100", "--batch-size", "32", "--eval-episodes", "1",
         "--no-cuda", "--checkpoint-freq", "0"]


def sweep(cwd, envs, *options, flags=FLAGS, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "benchmark" / "sweep.py"), "td3_continuous.py", "--envs", *envs,
                           "--seeds", "1", "2", *(options or ["--workers", "2"]), *flags], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_sweep_reports_failures_and_skips_finished_runs(tmp_path):
    first = sweep(tmp_path, ["tests.toy_envs:Counter-v0", "NoSuchEnv-v0"])
    assert first.returncode == 1
    assert all(f"done   tests.toy_envs:Counter-v0 seed {s}" in first.stdout for s in (1, 2))
    assert "2 of 4 runs failed: NoSuchEnv-v0 seed 1, NoSuchEnv-v0 seed 2" in first.stderr
    assert "cannot make --env-id" in (tmp_path / "benchmark/logs/td3_continuous__NoSuchEnv-v0__1.log").read_text()
    assert len(list((tmp_path / "runs").glob("*/evaluations.csv"))) == 2
    again = sweep(tmp_path, ["tests.toy_envs:Counter-v0"])
    assert again.returncode == 0
    assert "0 runs to do (0 resumed), 2 already finished" in again.stdout


def test_sweep_resumes_an_unfinished_run(tmp_path):
    """A run of 300 steps killed after its checkpoint at 150 (made here as a run of 150 steps whose args.json then
    says 300, which is what such a run leaves) is resumed from its checkpoint.pt, not started again."""
    flags = flags_with(FLAGS, total_timesteps=150, checkpoint_freq=150)
    assert sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--workers", "2", flags=flags).returncode == 0
    run = next((tmp_path / "runs").glob("*__1__*"))
    args = json.loads((run / "args.json").read_text())
    (run / "args.json").write_text(json.dumps({**args, "total_timesteps": 300}))
    again = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--workers", "2", flags=FLAGS)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 runs to do (1 resumed), 1 already finished" in again.stdout, again.stdout
    log = (tmp_path / "benchmark/logs/td3_continuous__tests.toy_envs:Counter-v0__1.log").read_text()
    assert f"resumed {run} at global_step 150" in log
    assert (run / "evaluations.csv").read_text().splitlines()[-1].startswith("300,")


def slurm_available():
    return shutil.which("sbatch") is not None and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0


def test_sweep_on_slurm(tmp_path):
    """The same runs as a job array on the real single-node cluster that .ci/run starts: sbatch --wait returns
    when the array is done, and every run's results are there."""
    if not slurm_available():
        if os.environ.get("CI"):
            pytest.fail("no Slurm cluster answers; .ci/run starts one with .ci/slurm-up")
        pytest.skip("no Slurm cluster here (bash .ci/slurm-up starts a single-node one)")
    result = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--slurm", "--time", "10", "--cpus-per-task", "1",
                   "--mem", "1G", "--wait", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 2 runs finished" in result.stdout
    assert "#SBATCH --array=0-1" in (tmp_path / "benchmark/logs/td3_continuous.sbatch").read_text()
    for seed in (1, 2):
        (run,) = (tmp_path / "runs").glob(f"tests.toy_envs-Counter-v0__td3_continuous__{seed}__*")
        assert int(list(csv.DictReader(open(run / "evaluations.csv")))[-1]["global_step"]) == 300
    assert len(list((tmp_path / "benchmark/logs").glob("slurm-*_*.out"))) == 2
    again = sweep(tmp_path, ["tests.toy_envs:Counter-v0"], "--slurm")
    assert again.returncode == 0
    assert "0 runs to submit, 2 already finished" in again.stdout


def write_run(runs, algorithm, env_id, seed, rows):
    run = runs / f"{env_id}__{algorithm}__{seed}__0"
    run.mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"exp_name": algorithm, "env_id": env_id, "seed": seed}))
    with open(run / "evaluations.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["global_step", "wall_time_s", "mean_return", "std_return", "returns"])
        out.writerows([step, 0, value, 0, value] for step, value in rows)


def test_report_numbers_and_plot(tmp_path):
    """Three seeds with known returns: at 200 steps they score 10, 20 and 60 (the last evaluation at or before
    200), so the mean is 30 and the 95% interval 30 +- 4.303 * std(ddof=1) / sqrt(3); a fourth seed that stopped at
    100 steps, or one with no evaluation before 200, is not counted at 200. The IQM of 1..8 is the mean of 3..6."""
    runs = tmp_path / "runs"
    write_run(runs, "td3_continuous", "Hopper-v4", 1, [(100, 0), (200, 10), (300, 99)])
    write_run(runs, "td3_continuous", "Hopper-v4", 2, [(100, 5), (150, 20), (300, 99)])
    write_run(runs, "td3_continuous", "Hopper-v4", 3, [(100, 1), (200, 60), (300, 99)])
    write_run(runs, "td3_continuous", "Hopper-v4", 4, [(100, 7)])
    write_run(runs, "td3_continuous", "Hopper-v4", 5, [(250, 1000)])  # no evaluation at or before 200: not counted
    reference = [{"algorithm": "td3_continuous", "env_id": "Hopper-v4", "step": "200", "mean": "3135", "std": "360",
                  "measure": "training return", "source": "CleanRL"}]
    text = report.table(report.read_runs(runs), [200], reference=reference)
    half = 4.303 * np.std([10, 20, 60], ddof=1) / math.sqrt(3)
    assert f"| td3_continuous | Hopper-v4 | 30.0 | [{30 - half:.1f}, {30 + half:.1f}] | 3 | 3135 +- 360" in text
    assert report.iqm([8, 1, 7, 2, 6, 3, 5, 4]) == 4.5
    assert report.summarise([5.0]) == (5.0, None, 1)
    pytest.importorskip("matplotlib")
    report.main(["--runs", str(runs), "--steps", "200", "--out", str(tmp_path / "out")])
    png = (tmp_path / "out" / "Hopper-v4.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert len(png) > 5000
    assert "| td3_continuous | Hopper-v4 | 30.0 |" in (tmp_path / "out" / "report.md").read_text()


def test_reference_file_is_complete():
    rows = report.read_reference()
    assert {r["algorithm"] for r in rows} == {"td3_continuous", "td7_continuous", "sac_continuous", "sac_discrete",
                                               "erl_td3"}
    assert all(r["source"] and float(r["mean"]) == float(r["mean"]) for r in rows)
