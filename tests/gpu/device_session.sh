#!/usr/bin/env bash
# THE one prepared script for a lent GPU (issues 40 and 41): the GPU checks, the benchmark, the profile,
# each under its own timeout, everything written flat into $OUT (7 files), then a summary.
#
#   bash tests/gpu/fetch_wheels.sh          # here, with PyPI reachable: the wheels the GPU machine lacks
#   bash tests/gpu/device_session.sh        # there (the device tool: carry .whl; about 9 minutes)
#
# The parts, in order (PARTS picks some: PARTS="profile bench"; their timeouts in seconds):
#   checks   bash tests/gpu/run.sh: the GPU checks, report gpu_report.md              (CHECKS_S, 200)
#   bench    benchmarks/vs_trl.py gpu: rlite vs TRL 1.16 in bf16 and with fp32 masters,
#            bench_report.md and bench_results.json; its --budget-s is BENCH_S - 80    (BENCH_S, 240)
#   profile  benchmarks/profile_gpu.py: one GRPO step (128 new tokens a completion) profiled
#            for fsdp2, megatron dense and megatron MoE on one GPU, profile_gpu.md and
#            profile_gpu.json; its --budget-s is PROFILE_S - 30                          (PROFILE_S, 120)
# 560 s in all, under the device's 600 s a call: call it with timeout_s=600. The checks come first (they
# say what broke, if anything did), the benchmark second (the issues' numbers).
# Files in $OUT (default ./device-out): session.log (every part's output), gpu_report.md,
# profile_gpu.md, profile_gpu.json, bench_report.md, bench_results.json, summary.md. Without a CUDA GPU
# every part is skipped, summary.md says so, and the script exits 0. Exit status: the number of parts
# that failed or timed out. PYTHON picks the interpreter (python3).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
out=${OUT:-$repo/device-out}
parts=${PARTS:-checks bench profile}
checks_s=${CHECKS_S:-200}
profile_s=${PROFILE_S:-120}
bench_s=${BENCH_S:-240}
mkdir -p "$out"
log=$out/session.log
summary=$out/summary.md
: > "$log"
started=$(date +%s)
declare -a lines=()
failed=0

say() { echo "[device_session $(date +%H:%M:%S)] $*" | tee -a "$log"; }

# run_part NAME TIMEOUT COMMAND...: the command's output goes to the terminal and session.log
run_part() {
    local name=$1 limit=$2 t0 status took
    shift 2
    say "$name: $* (timeout ${limit} s)"
    t0=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
    took=$(( $(date +%s) - t0 ))
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        lines+=("- $name: TIMED OUT after ${took} s (limit ${limit} s); partial output in session.log")
        failed=$((failed + 1))
    elif [ "$status" -ne 0 ]; then
        lines+=("- $name: FAILED (exit $status) in ${took} s; see session.log")
        failed=$((failed + 1))
    else
        lines+=("- $name: done in ${took} s")
    fi
    say "$name: exit $status after ${took} s"
}

write_summary() {
    {
        echo "# rlite device session, $(date -u +%Y-%m-%dT%H:%MZ)"
        echo
        echo "Commit $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?'); $gpu; total $(( $(date +%s) - started )) s."
        echo
        printf '%s\n' "${lines[@]}"
        for part in gpu_report.md bench_report.md profile_gpu.md; do
            [ -f "$out/$part" ] || continue
            echo
            echo "## $part"
            echo
            # the profile is long: its per-run headlines and phase tables are what a reader needs first
            if [ "$part" = profile_gpu.md ]; then awk '/^## /{p=1} /^Host gaps/{print; p=0; next} p' "$out/$part"
            else cat "$out/$part"; fi
        done
    } > "$summary"
    cat "$summary"
}

gpu=$("$python" -c "import torch; print(torch.cuda.get_device_name() + ', torch ' + torch.__version__ if torch.cuda.is_available() else '')" 2>/dev/null)
if [ -z "$gpu" ]; then
    gpu="no CUDA GPU visible to $python"
    lines+=("- every part skipped: $gpu (the checks, the profile and the benchmark need one)")
    say "skipped: $gpu"
    write_summary
    exit 0
fi
say "GPU: $gpu"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv >> "$log" 2>&1

# the carried wheels and this checkout's rlite, as tests/gpu/run.sh lays them out, for the profile and the benchmark
work=$(mktemp -d "${TMPDIR:-/tmp}/rlite-device-session.XXXXXX")
site=$work/site
mkdir -p "$site"
shopt -s nullglob
wheels=("$repo"/.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" >> "$log" 2>&1 \
        || say "installing the carried wheels failed (see session.log)"
fi
cp -r "$repo/trainer" "$site/rlite"
cp -r "$repo/plugins" "$site/rlite/plugins"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

cd "$repo"
for part in $parts; do
    case $part in
        checks) run_part checks "$checks_s" bash tests/gpu/run.sh "$out/gpu_report.md" ;;
        profile) run_part profile "$profile_s" "$python" benchmarks/profile_gpu.py \
                     --runs fsdp2:dense,megatron:dense,megatron:moe --new-tokens 128 --budget-s $(( profile_s - 30 )) \
                     --out "$out" ;;
        bench)
            # its processes may run 60 s past the budget; the model is built before it starts
            run_part bench "$bench_s" "$python" benchmarks/vs_trl.py gpu --budget-s $(( bench_s - 80 )) --out-dir "$work/bench"
            [ -f "$work/bench/gpu/report_gpu.md" ] && cp "$work/bench/gpu/report_gpu.md" "$out/bench_report.md"
            [ -f "$work/bench/gpu/results_gpu.json" ] && cp "$work/bench/gpu/results_gpu.json" "$out/bench_results.json"
            ;;
        *) lines+=("- $part: unknown part (PARTS takes checks, profile, bench)"); failed=$((failed + 1)) ;;
    esac
done
rm -rf "$work"
write_summary
exit "$failed"
