#!/usr/bin/env bash
# The GPU check: the --cuda, --compile and --cudagraphs paths tested and timed on a machine with a CUDA GPU, in
# phases (from the repository root, with the package installed: pip install ".[test]"):
#
#     bash benchmark/gpu_check.sh all        # tests, speed, compile, determinism in one command, in that order (the speed
#                                            # table's compiled rows fill the cache that the compile tests then use)
#     bash benchmark/gpu_check.sh tests      # tests/test_gpu.py, except its --compile tests
#     bash benchmark/gpu_check.sh speed      # the speed table: 5 scripts x eager, cudagraphs, compile+cudagraphs
#     bash benchmark/gpu_check.sh compile    # tests/test_gpu.py's --compile tests (cold compiles take minutes)
#     bash benchmark/gpu_check.sh determinism  # the price of --torch-deterministic: eager and cudagraphs with it (last)
#     bash benchmark/gpu_check.sh anchors    # benchmark/anchors.py: ours beside CleanRL's, LeanRL's and the TD7
#                                            # authors' code on the GPU, start-up and steady steps/s (not in all)
#     bash benchmark/gpu_check.sh loan       # for a 15-minute GPU loan: TD3, SAC, TD7 at 500 updates, what issue 48
#                                            # asks to see first (table, anchors, determinism's price, the eager
#                                            # profile, the graphs' breakdown), then the tests; compiling left out
#
# Without a CUDA GPU it stops with one line and exit status 1. For a GPU machine without internet access, first run
#     bash benchmark/gpu_check.sh wheels     # with access: the packages as wheels (Python 3.12, x86_64) in .whl/
# and copy .whl/ beside the checkout: every phase installs from it when it is there; and for the anchors phase
#     bash benchmark/gpu_check.sh get-anchors  # with access: the anchors' code (their scripts only) in .anchors/
# `rehearse` runs the same steps
# without CUDA (see below), to check the wheels and the scripts before a GPU is at hand.
#
# Everything goes under $OUT when it is set, else under benchmark/results/gpu_check_DATE/: log.txt (every step's
# output), pytest.txt and pytest-compile.txt (pytest's summary, its durations and exit status), speed.md (the table,
# a row as each run ends), status.txt (each step's exit status). The exit status is non-zero when any step failed;
# no step's failure stops the next one. Times and what to read in the files: docs/fast_path.md, "The GPU check".
#
# tests/test_gpu.py and the table run the same shapes (benchmark/speed.py's workload: batch 256, the default
# networks and buffer), so each update is compiled once, into one inductor cache ($CACHE), for both.
#
# rehearse: in a fresh virtual environment holding only what the device has (torch, numpy, tensorboard, pytest,
# matplotlib, rich and the like, no gymnasium, mujoco or tyro), the wheels of .whl-rehearsal/ (this machine's python
# version) installed as the device installs them; then the test collection, that LeanRL's packages import, the CPU
# half of the tests (tests/test_fast_path.py, tests/test_gpu.py skipping), the table's CPU rows (eager and compile),
# and where .anchors/ is there, the anchors on the CPU at 200 updates (that they run here, not their speed).
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmark/results/gpu_check_$(date +%F)}
CACHE=${CACHE:-/tmp/rl-singlefile-inductor}
export TORCHINDUCTOR_CACHE_DIR=$CACHE TRITON_CACHE_DIR=$CACHE/triton PYTHONUNBUFFERED=1
failed=0

# The packages the device lacks, at the versions this project is tested with, and what they need that it lacks too.
WHEELS="gymnasium==1.4.0 farama-notifications==0.0.6 mujoco==4.0.0 mujoco-core==4.0.0 mujoco-studio==4.0.0
  websockets==17.4 glfw==2.11.0 pyopengl==3.1.10 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
  typing-extensions==4.16.0 tqdm==4.70.1
  tensordict==0.6.2 torchrl==0.6.0 orjson==3.13.0"
# (the last three: LeanRL's, for the anchors. From tensordict 0.7 on, its SAC's acting module, which returns three
# tensors for one out_key, is refused; with 0.15 its TD3's acting copy keeps gradients. Both ran with these, eager
# and compiled, on the CPU with torch 2.13.)
# What the device has and these need; the rehearsal's environment gets them from PyPI (torch: its CPU build).
DEVICE_HAS="numpy tensorboard pytest matplotlib rich cloudpickle absl-py etils fsspec zipp pillow imageio"

step() {  # step NAME COMMAND...: run it, its output into log.txt (and the terminal), its exit status into status.txt
  local name=$1
  shift
  mkdir -p "$OUT"  # here, so that the phases that run no step (wheels, get-anchors) leave no empty folder
  echo "== $name: $* ($(date -u +%T))" | tee -a "$OUT/log.txt"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/log.txt"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/log.txt" >>"$OUT/status.txt"
  [ "$rc" -eq 0 ] || failed=1
  return "$rc"
}

download() {  # download DIR PYTHON_VERSION: the wheels, afresh
  rm -rf "$1"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$2" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$1" $WHEELS
}

install() {  # install DIR: the wheels into /tmp/site, without pip's index or their dependencies
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl
}

gpu_tests() {  # gpu_tests NAME PYTEST_ARGS...: pytest's output and exit status into NAME.txt
  local name=$1
  shift
  "$PYTHON" -m pytest -q -p no:cacheprovider --durations=0 -rfEs "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  cat "$OUT/$name.txt"
  echo "pytest exit status $rc" | tee -a "$OUT/$name.txt"
  return $rc
}

table() {  # table DEVICE MODE...: every script at 1000 updates (SCRIPTS and UPDATES change that)
  local device=$1
  shift
  "$PYTHON" benchmark/speed.py ${SCRIPTS:+--scripts $SCRIPTS} --devices "$device" --modes "$@" \
    --updates "${UPDATES:-1000}" --repeats 1 --out "$OUT/speed.md"
}

loan() {  # the loan phase's steps, the most needed first: a loan that ends midway keeps what came before
  local three="td3_continuous.py sac_continuous.py td7_continuous.py"
  SCRIPTS=$three UPDATES=500 step table table cuda eager cudagraphs
  step anchors "$PYTHON" benchmark/anchors.py --anchors .anchors --devices cuda --updates 500 --repeats 1 \
    --out "$OUT/anchors.md"
  SCRIPTS=$three UPDATES=500 step determinism table cuda eager+deterministic cudagraphs+deterministic
  step profile "$PYTHON" benchmark/profile_update.py --device cuda --scripts td3_continuous.py td7_continuous.py \
    --updates 300 --top 15 --out "$OUT/profile.md"
  step breakdown "$PYTHON" benchmark/profile_update.py --ops --breakdown --device cuda --mode cudagraphs \
    --scripts $three --updates 500 --out "$OUT/breakdown.md"
  step tests gpu_tests pytest tests/test_gpu.py -k "not compile"
}

case $phase in
get-anchors)  # each anchor's files that anchors.py runs, its commit in COMMIT; no git history (.anchors/ travels)
  grep -qx '/.anchors/' .git/info/exclude 2>/dev/null || echo '/.anchors/' >>.git/info/exclude
  rm -rf .anchors && mkdir -p .anchors
  for repo_paths in "vwxyzjn/cleanrl cleanrl cleanrl_utils" "sfujim/TD7" "meta-pytorch/LeanRL leanrl"; do
    set -- $repo_paths
    dir=.anchors/${1#*/}
    git clone -q --depth 1 --filter=blob:none --sparse "${ANCHORS_FROM:-https://github.com}/$1" "$dir" || exit 1
    [ $# -eq 1 ] || git -C "$dir" sparse-checkout set "${@:2}" || exit 1
    git -C "$dir" rev-parse HEAD >"$dir/COMMIT" && rm -rf "$dir/.git"
  done
  du -sh .anchors
  exit 0
  ;;
wheels)
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  download .whl 3.12 && ls -la .whl && du -sh .whl
  exit $?
  ;;
rehearse)
  grep -qx '/.whl-rehearsal/' .git/info/exclude 2>/dev/null || echo '/.whl-rehearsal/' >>.git/info/exclude
  version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  step wheels download .whl-rehearsal "$version"
  venv=/tmp/gpu-check-rehearsal
  step device-like-environment bash -c "rm -rf $venv /tmp/site && $PYTHON -m venv $venv &&
    $venv/bin/python -m pip install -q torch==2.13.0 $DEVICE_HAS"
  PYTHON=$venv/bin/python
  step install install .whl-rehearsal
  export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=
  step collection "$PYTHON" -m pytest tests --collect-only -q -p no:cacheprovider
  step leanrl-imports "$PYTHON" -c "from tensordict.nn import CudaGraphModule; from torchrl.data import ReplayBuffer"
  step tests gpu_tests pytest tests/test_fast_path.py tests/test_gpu.py
  step table table cpu eager compile
  if [ -d .anchors ]; then  # the anchors' route (their scripts run in this environment), not their speed
    step anchors "$PYTHON" benchmark/anchors.py --anchors .anchors --devices cpu --updates 200 --repeats 1 \
      --out "$OUT/anchors.md"
  fi
  ;;
tests | compile | speed | determinism | anchors | loan | all)
  "$PYTHON" -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else "error: no CUDA GPU")' || exit 1
  if [ -d .whl ]; then
    step install install .whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  step machine bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PYTHON -c \
    'import torch, gymnasium, mujoco, tyro; print(torch.__version__, torch.cuda.get_device_name(), gymnasium.__version__,
    mujoco.__version__)'" || exit 1
  if [ "$phase" = tests ] || [ "$phase" = all ]; then step tests gpu_tests pytest tests/test_gpu.py -k "not compile"; fi
  if [ "$phase" = speed ] || [ "$phase" = all ]; then step table table cuda eager cudagraphs compile+cudagraphs; fi
  if [ "$phase" = compile ] || [ "$phase" = all ]; then step compile gpu_tests pytest-compile tests/test_gpu.py -k compile; fi
  if [ "$phase" = determinism ] || [ "$phase" = all ]; then
    step determinism table cuda eager+deterministic cudagraphs+deterministic
  fi
  if [ "$phase" = loan ]; then loan; fi
  if [ "$phase" = anchors ]; then
    step anchors "$PYTHON" benchmark/anchors.py --anchors .anchors --devices cuda --updates 1000 --repeats 1 \
      --out "$OUT/anchors.md"
  fi
  ;;
*)
  echo "usage: bash benchmark/gpu_check.sh wheels|get-anchors|tests|compile|speed|determinism|anchors|loan|all|rehearse" >&2
  exit 2
  ;;
esac
echo "== done: $([ $failed -eq 0 ] && echo 'every step passed' || echo 'FAILED (status.txt)'); everything in $OUT"
exit $failed
