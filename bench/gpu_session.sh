#!/usr/bin/env bash
# One session on a lent GPU machine: versions, the first copier's cold start, GPU tests,
# compute-sanitizer on the scatter kernel, the full benchmark suite, the host-path probe.
#
# Usage (from the repository root, with the machine's own python3; installs nothing):
#   OUT=<dir> bash bench/gpu_session.sh
#   ONLY=hf_async,hf_sync OUT=<dir> bash bench/gpu_session.sh   # these steps (+ build, versions)
#
# Writes $OUT/summary.txt (each step's exit status, time and log tail; the bench's
# tables), $OUT/bench.json (the suite's result, when it wrote one), $OUT/cold_start.json
# (the first copier's cost, cold and warm kernel cache), $OUT/hf_continuous_batching-*.json
# (transformers' continuous batching, unmodified vs routed) and $OUT/results.tgz (every log,
# the JSONs and plots).
# Every step has a time limit and the script keeps going past failures; all of it
# ends within BUDGET_S seconds (default 530, under 9 minutes).
set -u
set -o pipefail
cd "$(dirname "$0")/.."

: "${OUT:?set OUT to the folder whose files come back}"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-530}
ONLY=${ONLY:-}  # comma-separated step names; empty: every step
mkdir -p "$OUT"
work=$(mktemp -d)
logs=$work/logs
mkdir -p "$logs" "$work/bench"
# keep NVLink multicast off (it can take a shared host's GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

start=$(date +%s)
deadline=$((start + BUDGET_S))
names=()
codes=()
secs=()

# step NAME LIMIT_S CMD...: run CMD under `timeout`, output teed to logs/NAME.log.
# The limit shrinks to what is left before the deadline (30 s kept for the summary).
step() {
    local name=$1 limit=$2
    shift 2
    if [[ -n $ONLY && $name != build_ext && $name != versions && ",$ONLY," != *",$name,"* ]]; then
        return  # not asked for (ONLY)
    fi
    local left=$((deadline - $(date +%s) - 30))
    if ((left < limit)); then limit=$left; fi
    local log=$logs/$name.log
    if ((limit < 10)); then
        echo "== $name: skipped, no time left" | tee "$log"
        names+=("$name") codes+=("skip") secs+=(0)
        return
    fi
    echo "== $name (limit ${limit}s): $*" | tee "$log"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    if ((rc == 124 || rc == 137)); then echo "-- $name: TIMED OUT after ${limit}s" | tee -a "$log"; fi
    names+=("$name") codes+=("$rc") secs+=($(($(date +%s) - t0)))
    echo "-- $name: rc=$rc" | tee -a "$log"
}

skip() {  # skip NAME WHY
    if [[ -n $ONLY && ",$ONLY," != *",$1,"* ]]; then return; fi
    echo "== $1: skipped: $2" | tee "$logs/$1.log"
    names+=("$1") codes+=("skip") secs+=(0)
}

versions() {
    nvidia-smi || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version(), platform.platform(terse=True))
for mod in ("numpy", "cupy", "torch", "cuda.bindings", "jax", "transformers", "matplotlib", "tqdm", "pytest"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:14s}", getattr(m, "__version__", "?"))
    except Exception as e:
        print(f"{mod:14s} unavailable: {e!r}")
try:
    import torch
    print("torch.version.cuda", torch.version.cuda, "devices", torch.cuda.device_count())
except Exception as e:
    print("torch cuda: unavailable:", repr(e))
try:
    import cupy
    rt = cupy.cuda.runtime
    p = rt.getDeviceProperties(0)
    print("cupy device 0:", p["name"], f"sm_{p['major']}{p['minor']}",
          "driver", rt.driverGetVersion(), "runtime", rt.runtimeGetVersion())
except Exception as e:
    print("cupy device: unavailable:", repr(e))
from cucopy.backends.cuda import gpu_available
print("cucopy gpu_available:", gpu_available())
import cucopy
cucopy.show_config()
EOF
    (command -v nvcc >/dev/null && nvcc --version | tail -2) || echo "nvcc: not on PATH"
    git rev-parse HEAD 2>/dev/null || echo "git: no commit (not a checkout)"
    echo "source digest $("$PY" bench/digest.py)  (bench/digest.py --find names its commit)"
}

# the compiled staging core, built here from the tree's sources (the machine's Python
# differs from CI's; nothing is installed)
step build_ext 120 "$PY" setup.py build_ext --inplace
"$PY" -c "import cucopy.segment as s; print('staging path:', s.IMPLEMENTATION)" | tee "$logs/staging.log"

export -f versions
export PY
step versions 30 bash -c versions

# the first copier's cost in fresh processes: a cold CuPy kernel cache (an empty
# CUPY_CACHE_DIR), the same cache warm, and cold with the kernels built one at a time
step cold_start 120 "$PY" bench/cold_start.py --json "$work/bench/cold_start.json"

step pytest_gpu 220 "$PY" -m pytest -m gpu -q -p no:cacheprovider -o faulthandler_timeout=60 tests/

sanitizer=$(command -v compute-sanitizer || true)
if [[ ! -f bench/kernel_check.py ]]; then
    skip memcheck "bench/kernel_check.py is absent"
    skip racecheck "bench/kernel_check.py is absent"
elif [[ -z "$sanitizer" ]]; then
    skip memcheck "compute-sanitizer is not on PATH"
    skip racecheck "compute-sanitizer is not on PATH"
else
    # a few hundred random segments per flush mode under each tool (the thousands of the
    # conformance test run without it, in pytest_gpu)
    mem_args=(--segments 300 --fills 300)
    race_args=(--segments 40 --fills 40 --batch 8)
    step memcheck 60 "$sanitizer" --tool memcheck --error-exitcode 99 \
        "$PY" bench/kernel_check.py "${mem_args[@]}"
    step racecheck 60 "$sanitizer" --tool racecheck --error-exitcode 99 \
        "$PY" bench/kernel_check.py "${race_args[@]}"
    # the copier end to end (random programs, stalls, discards) under the memory checker
    # (every seed; racecheck too, since the copier's kernels share memory within a block)
    # (and the graphed segments of 8-32 KiB, whose kernel reads a second round)
    programs=(-m pytest -q -p no:cacheprovider -m gpu tests/test_properties_env.py tests/test_cudacall.py
        -k "(match_the_model and cuda) or past_the_graph_capacity")
    step memcheck_programs 150 "$sanitizer" --tool memcheck --error-exitcode 99 "$PY" "${programs[@]}"
    step racecheck_programs 150 "$sanitizer" --tool racecheck --error-exitcode 99 "$PY" "${programs[@]}"
    # the graph feed's kernel (a captured node reading its mailbox, replays with and
    # without steps, a stalled stream, random programs) under the memory checker
    feed_tests=(-m pytest -q -p no:cacheprovider -m gpu tests/test_feed.py -k "cuda and not many_steps")
    step memcheck_feed 70 "$sanitizer" --tool memcheck --error-exitcode 99 "$PY" "${feed_tests[@]}"
fi

# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
step bench 200 "$PY" -m bench --out "$work/bench/results" ${BENCH_ARGS:-}

# graphed launches on and off (auto graphs small segments since session 12) and the
# graphed kernel's variants (one warp a descriptor, the default, or the whole block);
# each in its own process, alternating (session 12's first run also tried 32 KiB reads)
# (and, session 12, streaming stores into the slots off: nont)
step graph_kernel 170 "$PY" bench/probes/graph_kernel.py --variants off,warp8k,nont \
    --rounds 2 --n 8,32,128,512 --reps 100 --json "$work/bench/graph_kernel.json"

# the host path's pieces (an open question: bench/README.md, probes)
step hot_path 40 "$PY" bench/probes/hot_path.py --n 32
# (--n 32 also times the cold step's floors: empty launches, a graphed step with and
# without the slot's completion tag, and the summary of issue 29's two ratios)
step step_phases 100 "$PY" bench/probes/step_phases.py --n 32
step cold_parts 90 "$PY" bench/probes/cold_parts.py
# which graphed launch (made now or before, tagged or not) blocks behind a held stream
step graph_hold 60 bash -c "\"$PY\" bench/probes/graph_hold.py --hold-s 2 &&
    \"$PY\" bench/probes/graph_hold.py --program 2 --mode mapped --hold-s 2"
# completion tags off (CUCOPY_TAG=0; pytest_gpu runs them on, the default): the GPU tests
# that drive graphed launches behind held streams, with the slots' events instead
step pytest_events 150 env CUCOPY_TAG=0 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    -o faulthandler_timeout=60 tests/test_properties_env.py tests/test_carry.py tests/test_cudacall.py
step step_phases_n 60 bash -c "for n in 8 128; do \"$PY\" bench/probes/step_phases.py --n \$n --steps 1000 --no-floors | grep -E '^N='; done"
# a copy's host cost as a multiple of an empty call (simulated device, both staging paths)
# the driver's own host cost of one launch (and other stream operations), from C
# what staging bytes into the ring's page-locked slots costs, against ordinary memory
step pinned_bytes 40 "$PY" bench/probes/pinned_bytes.py --json "$work/bench/pinned_bytes.json"
step launch_floor 40 "$PY" bench/probes/launch_floor.py --json "$work/bench/launch_floor.json"
# is a slow spell of the lent host a time or a CPU (each CPU in turn, chained copy_ and cucopy)
step host_cpus 40 "$PY" bench/probes/host_cpus.py --json "$work/bench/host_cpus.json"
step host_ratio 60 "$PY" bench/host_ratio.py --steps 1000 --json "$work/bench/host_ratio.json"
# issue 15: the graph feed's mailbox node against per-step parameter updates and
# today's separate inline launch (GPU periods behind a stall, host us per step)
step graph_feed 45 "$PY" bench/probes/graph_feed.py --n 32 --json "$work/bench/graph_feed.json"
for ex in examples/*.py; do
    [[ -f "$ex" ]] || continue
    [[ $(basename "$ex") == hf_continuous_batching.py ]] && continue # bench/hf_ab.py below
    step "example_$(basename "$ex" .py)" 60 env PYTHONPATH=. "$PY" "$ex"
done

# the copy profiler over the decode example and transformers' continuous batching (both
# modes): its counts against what the programs issue, its estimate beside the routed result
step profile_programs 150 "$PY" bench/profile_programs.py --out "$work/bench/profile_programs"

# what each read of NumPy's and torch's internals saves a merged step (public path / read)
step foreign_reads 150 "$PY" bench/probes/foreign_reads.py

# before/after on this host, alternating processes (AB_BASE: a tree of the base commit;
# its extension is built here): a merged step from NumPy and from pinned torch sources
if [[ -n ${AB_BASE:-} ]]; then
    step ab_build 120 bash -c "cd '$AB_BASE' && '$PY' setup.py -q build_ext --inplace"
    step ab_step 200 bash -c "for r in 1 2 3; do for t in '$AB_BASE' .; do for s in numpy torch; do
        '$PY' bench/probes/ab_step.py --tree \$t --steps 2000 --src \$s --label \$t; done; done; done"
    # the same, both trees in one process, blocks of steps interleaved (immune to the
    # host's slow and fast spells, which last longer than a block pair)
    step ab_inproc 200 bash -c "for s in numpy torch; do
        '$PY' bench/probes/ab_inproc.py --base '$AB_BASE' --tree . --src \$s; done"
fi

# the cold step (step_phases' 64 MiB variant, N = 32) of COLD_BASE (a tree without build
# outputs, e.g. git archive) and of this tree, in alternating processes, three times each:
# lent hosts' cold figures differ more than a change does, so compare within one run
if [[ -n ${COLD_BASE:-} && -d ${COLD_BASE:-} ]]; then
    step cold_build 120 bash -c "cd '$COLD_BASE' && '$PY' setup.py -q build_ext --inplace"
    # (tree_nographs: this tree with CUCOPY_NO_GRAPHS=1, no graphed launches' pool made)
    step ab_cold 240 bash -c "for r in 1 2 3; do for t in base tree tree_nographs; do
        d=.; [[ \$t == base ]] && d='$COLD_BASE'
        g=; [[ \$t == tree_nographs ]] && g=1
        (cd \$d && CUCOPY_NO_GRAPHS=\$g '$PY' bench/probes/step_phases.py --n 32 --steps 1000 --no-floors |
            grep -E '^N=32 torch dst, numpy src, each after a drained stream and' |
            sed \"s|^|\$t: |\"); done; done"
fi

# transformers' continuous batching (generate_batch) unmodified and routed through cucopy,
# one process per mode; rc 1 on any token mismatch, the targets are in the log and JSON
# (--watchdog: every thread's stack in the log if a run hangs, before the step's timeout)
if "$PY" -c "import transformers" 2>/dev/null; then
    # --bound: also a variant that uploads nothing (its tokens are not compared), the
    # floor under any upload path's step ratio in the same run; 7 rounds, rotated
    for mode in async sync; do
        step "hf_$mode" 110 env PYTHONPATH=. "$PY" bench/hf_ab.py \
            --mode "$mode" --bound --pairs 7 --watchdog 100 \
            --json "$work/bench/hf_continuous_batching-$mode.json"
    done
    # async with flush_mode="auto" (the route's own is "mapped": graphed launches of
    # its 29 KB steps, where auto carries them), only when ONLY names it
    if [[ ",$ONLY," == *",hf_async_auto,"* ]]; then
        step hf_async_auto 110 env PYTHONPATH=. "$PY" bench/hf_ab.py \
            --mode async --flush-mode auto --bound --pairs 7 --watchdog 100 \
            --json "$work/bench/hf_continuous_batching-async-auto.json"
    fi
    # the routed upload's calls by own time, from the engine's thread (async mode)
    step hf_profile 90 env PYTHONPATH=. "$PY" bench/probes/hf_upload_profile.py \
        --mode async --pairs 2
    # (the dma/mapped flush and one torch thread ran in runs 31-33 and final7:
    # bench/hf_ab.py --flush-mode, --threads)
else
    skip hf_async "transformers is not installed"
    skip hf_sync "transformers is not installed"
fi

# -- summary ---------------------------------------------------------------------------------
{
    echo "gpu_session: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - start)) s in all"
    for i in "${!names[@]}"; do
        printf '%-14s rc=%-5s %4ss\n' "${names[$i]}" "${codes[$i]}" "${secs[$i]}"
    done
    for i in "${!names[@]}"; do
        n=${names[$i]}
        lines=15
        [[ $n == bench ]] && lines=200
        [[ $n == hf_* ]] && lines=40
        [[ $n == hf_profile ]] && lines=60
        echo
        echo "---- $n (last $lines lines) ----"
        tail -n "$lines" "$logs/$n.log"
    done
} >"$work/summary.txt" 2>&1
cp "$work/summary.txt" "$OUT/summary.txt"
json=$(ls "$work"/bench/results/*.json 2>/dev/null | head -n 1)
if [[ -n "$json" ]]; then cp "$json" "$OUT/bench.json"; fi
if [[ -f "$work/bench/cold_start.json" ]]; then cp "$work/bench/cold_start.json" "$OUT/"; fi
for f in "$work"/bench/hf_continuous_batching-*.json; do
    if [[ -f "$f" ]]; then cp "$f" "$OUT/"; fi
done
tar -czf "$OUT/results.tgz" -C "$work" logs bench summary.txt
echo
head -n 12 "$OUT/summary.txt"
echo "wrote summary.txt, results.tgz${json:+, bench.json}, cold_start.json and hf_continuous_batching-*.json (if they ran) under \$OUT"
