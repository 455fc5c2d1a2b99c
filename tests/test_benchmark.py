"""benchmark/sweep.py in local mode: runs in parallel, keeps going past a failing run and reports it, and
skips runs that already finished."""
import subprocess
import sys

from tests.conftest import REPO, cli_env

FLAGS = ["--", "--total-timesteps", "300", "--learning-starts", "100", "--batch-size", "32", "--eval-episodes", "1",
         "--no-cuda", "--checkpoint-freq", "0"]


def sweep(cwd, envs):
    return subprocess.run([sys.executable, str(REPO / "benchmark" / "sweep.py"), "td3_continuous.py", "--envs", *envs,
                           "--seeds", "1", "2", "--workers", "2", *FLAGS], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=300)


def test_sweep_reports_failures_and_skips_finished_runs(tmp_path):
    first = sweep(tmp_path, ["tests.toy_envs:Counter-v0", "NoSuchEnv-v0"])
    assert first.returncode == 1
    assert all(f"done   tests.toy_envs:Counter-v0 seed {s}" in first.stdout for s in (1, 2))
    assert "2 of 4 runs failed: NoSuchEnv-v0 seed 1, NoSuchEnv-v0 seed 2" in first.stderr
    assert "cannot make --env-id" in (tmp_path / "benchmark/logs/td3_continuous__NoSuchEnv-v0__1.log").read_text()
    assert len(list((tmp_path / "runs").glob("*/evaluations.csv"))) == 2
    again = sweep(tmp_path, ["tests.toy_envs:Counter-v0"])
    assert again.returncode == 0 and "0 runs to do, 2 already finished" in again.stdout
