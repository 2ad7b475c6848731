#!/usr/bin/env bash
# burn-ddp's one-command GPU check (made by `cargo xtask gpu-bundle`). Needs a Linux x86-64
# machine with an NVIDIA driver, CUDA 13 (NVRTC and its headers) and NCCL, as system packages or
# as Python wheels (`nvidia-nccl-cu13`, `nvidia-cuda-nvrtc`: found through `python3`), or
# BURN_DDP_NCCL_DIR; no cargo, no network.
#
# Each check compares against a result computed independently (the host's reduction, one
# process with the whole batch), never one rank against another. Each row of the table is
# printed as soon as it is known; the table is printed again at the end; exits non-zero if any
# check failed.
#
# Settings (environment):
#   BURN_DDP_GPU_CHECK_BUDGET=480  seconds the whole check may take (8 minutes): every step runs
#                                  under `timeout` with its own limit or what is left, whichever
#                                  is less; a step with no time left is a failed row.
#   BURN_DDP_GPU_CHECK_ALLOW_NO_GPU=1  no GPU is expected (CI): say so, check that the binaries
#                                  fail cleanly without CUDA, exit 0. Without it, no GPU fails.
#   OUT                            the logs go there (else to a new directory under /tmp, kept):
#                                  summary.txt (the rows) and gpu-check.log (every process's
#                                  output, each line prefixed with its step, as it comes).
#
# On one GPU the multi-rank checks run two ranks on it: NCCL refuses two ranks of one
# communicator on one GPU ("Duplicate GPU detected") unless they look like two hosts, which a
# different NCCL_HOSTID per process gives (NCCL hashes the host from it); the two "hosts" then
# talk through NCCL's socket transport on loopback (NCCL_NET=Socket, NCCL_SOCKET_IFNAME=lo).
# With several GPUs, one rank per GPU instead.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
budget="${BURN_DDP_GPU_CHECK_BUDGET:-480}"
deadline=$((SECONDS + budget))
work="$(mktemp -d)"
logs="${OUT:-}"
[ -n "$logs" ] || logs="$(mktemp -d "${TMPDIR:-/tmp}/burn-ddp-gpu-check.XXXXXX")"
mkdir -p "$logs"
all="$logs/gpu-check.log"
summary="$logs/summary.txt"
: >"$all"
: >"$summary"
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
echo "burn-ddp GPU check: logs in $logs (summary.txt, gpu-check.log); budget ${budget}s"
failures=0
results=()
# A row: printed now, kept for the final table and in summary.txt.
record() {
    local row
    row="$(printf '%-62s %-8s %s' "$1" "$2" "$3")"
    results+=("$row")
    printf '%s\n' "$row"
    printf '%s\n' "$row" >>"$summary"
}
pass() { record "$1" ok "${2:-}"; }
skip() { record "$1" skipped "${2:-}"; }
fail() {
    failures=$((failures + 1))
    record "$1" FAILED "${2:-}"
}
finish() {
    echo
    echo "=== burn-ddp GPU check: summary ==="
    printf '%-62s %-8s %s\n' check result detail
    printf '%s\n' "${results[@]}"
    echo "failed: $failures (logs: $logs)"
    echo "failed: $failures" >>"$summary"
    [ "$failures" -eq 0 ]
    exit $?
}
# The last line of a log, for a table cell.
last() { tail -n 1 "$1" 2>/dev/null | cut -c1-200; }
# What a failed process said: its first panic (with the message on the next line) or error,
# else its last line.
gist() {
    local said
    said=$(grep -m1 -A1 -E 'panicked at|^Error|^error' "$1" 2>/dev/null | tr '\n' ' ')
    [ -n "$said" ] && printf '%s\n' "$said" | cut -c1-240 || last "$1"
}
# Runs "$@" as the process `$1`: its output goes to $work/$1.log and, each line prefixed with
# "[$1] ", to gpu-check.log as it comes; its exit status to $work/$1.rc.
logged() {
    local name="$1"
    shift
    { "$@" 2>&1; echo $? >"$work/$name.rc"; } | tee "$work/$name.log" | sed -u "s/^/[$name] /" >>"$all"
}
# The exit status `logged` kept for the process `$1` (124: timed out).
rc_of() { cat "$work/$1.rc" 2>/dev/null || echo 1; }
# Seconds a step may run: its own limit $1, or what is left of the budget if less.
limit=0
step_limit() {
    local left=$((deadline - SECONDS))
    limit=$(($1 < left ? $1 : left))
    [ "$limit" -ge 5 ]
}
# Why a step did not finish, from its exit status $1.
why() {
    case "$1" in
        124 | 137) echo "timed out after ${limit}s" ;;
        *) echo "exit $1" ;;
    esac
}

# Unpack the binaries.
mkdir -p "$work/bin"
for f in "$here"/bin/*; do
    case "$f" in
        *.xz) xz -dc "$f" >"$work/bin/$(basename "${f%.xz}")" ;;
        *) cp "$f" "$work/bin/" ;;
    esac
done
chmod +x "$work"/bin/*

# --- Preflight: a GPU, then every library the checks load, named when missing. --------------
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "$gpus" -eq 0 ]; then
    if [ "${BURN_DDP_GPU_CHECK_ALLOW_NO_GPU:-0}" != 1 ]; then
        echo "no GPU: nvidia-smi lists none (or is missing)"
        fail "GPUs visible" "none: nvidia-smi is missing or lists no GPU (BURN_DDP_GPU_CHECK_ALLOW_NO_GPU=1 where none is expected)"
        finish
    fi
    echo "no GPU: nvidia-smi lists none (or is missing); BURN_DDP_GPU_CHECK_ALLOW_NO_GPU=1, so only the no-GPU behaviour is checked"
    skip "GPU" "none (BURN_DDP_GPU_CHECK_ALLOW_NO_GPU=1): every GPU check skipped"
    # The binaries still start, and fail cleanly without CUDA (no loader panic):
    step_limit 60
    logged q timeout -k 5 "$limit" "$work/bin/quickstart" --device cuda --epochs 1
    rc=$(rc_of q)
    if [ "$rc" -eq 0 ]; then
        fail "quickstart --device cuda without a GPU" "succeeded without a GPU"
    elif grep -q "panicked" "$work/q.log"; then
        fail "quickstart --device cuda without a GPU" "panicked: $(grep -m1 panicked "$work/q.log")"
    else
        pass "quickstart --device cuda without a GPU" "clean error: $(last "$work/q.log")"
    fi
    finish
fi
pass "GPUs visible" "$gpus: $(nvidia-smi -L | head -n 1)"

# Python wheels' library folders (nvidia-nccl-cu13: nvidia/nccl/lib; CUDA 13 wheels such as
# nvidia-cuda-nvrtc: nvidia/cu13/lib; CUDA 12 ones: nvidia/cuda_nvrtc/lib), from python3.
wheel_dirs=""
if command -v python3 >/dev/null 2>&1; then
    wheel_dirs=$(python3 -c '
import os, nvidia
for p in nvidia.__path__:
    for sub in ("nccl/lib", "cu13/lib", "cuda_nvrtc/lib"):
        print(os.path.join(p, sub))
' 2>/dev/null || true)
fi
system_dirs="/lib /usr/lib /lib64 /usr/lib64 /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib"
looked_in() { printf '%s' "${BURN_DDP_NCCL_DIR:-} ${LD_LIBRARY_PATH:-} $system_dirs $wheel_dirs" | tr ':\n' '  ' | tr -s ' '; }
# Finds a file named $1: the loader's cache, BURN_DDP_NCCL_DIR, LD_LIBRARY_PATH, the system and
# CUDA folders, the wheels' folders.
find_lib() {
    local name="$1" d
    if ldconfig -p 2>/dev/null | awk '{print $1}' | grep -qx "$name"; then
        ldconfig -p | awk -v n="$name" '$1 == n {print $NF; exit}'
        return 0
    fi
    for d in ${BURN_DDP_NCCL_DIR:-} $(printf %s "${LD_LIBRARY_PATH:-}" | tr : ' ') $system_dirs $wheel_dirs; do
        if [ -e "$d/$name" ]; then
            echo "$d/$name"
            return 0
        fi
    done
    return 1
}
# Folders put first on LD_LIBRARY_PATH before any binary starts: cudarc loads every library by
# its bare name, so a library the loader's cache does not list must be on that path.
lib_path="$work/lib"
mkdir -p "$work/lib"
use_dir() {
    case ":$lib_path:" in *":$1:"*) ;; *) lib_path="$lib_path:$1" ;; esac
}
# Whether the loader now finds $1 by its bare name (what cudarc does).
loads() {
    LD_LIBRARY_PATH="$lib_path:${LD_LIBRARY_PATH:-}" python3 -c '
import ctypes, sys
ctypes.CDLL(sys.argv[1])' "$1" 2>&1 | tail -n 1
    return "${PIPESTATUS[0]}"
}
preflight_ok=1
# python3 finds the wheels, checks that each library loads, and compares parameters.
if command -v python3 >/dev/null 2>&1; then
    pass "preflight: python3" "$(python3 --version 2>&1)"
else
    fail "preflight: python3" "not found: the library checks and parameter comparisons need it"
    finish
fi
# $1 row, $2 the name cudarc loads, $3 the file to look for, $4 the fix when missing.
library() {
    local row="$1" name="$2" file="$3" fix="$4" lib err
    if ! lib=$(find_lib "$file"); then
        fail "$row" "$file not found in: $(looked_in); $fix"
        preflight_ok=0
        return 1
    fi
    use_dir "$(dirname "$lib")"
    [ "$name" = libnccl.so ] && ln -sf "$lib" "$work/lib/libnccl.so"
    if err=$(loads "$name"); then
        pass "$row" "$lib"
    else
        fail "$row" "found $lib, but loading $name fails: $err"
        preflight_ok=0
        return 1
    fi
}
library "preflight: CUDA driver (libcuda)" libcuda.so.1 libcuda.so.1 "install the NVIDIA driver"
# NCCL: the wheel ships libnccl.so.2; cudarc's loader wants libnccl.so (a link in $work/lib).
library "preflight: NCCL (libnccl)" libnccl.so libnccl.so.2 \
    "pip install nvidia-nccl-cu13, or set BURN_DDP_NCCL_DIR"
# NVRTC compiles burn's kernels (cudarc loads libnvrtc.so or libnvrtc.so.13); it loads
# libnvrtc-builtins from its own folder.
nvrtc_file=libnvrtc.so.13
find_lib libnvrtc.so.13 >/dev/null || ! find_lib libnvrtc.so >/dev/null || nvrtc_file=libnvrtc.so
if library "preflight: NVRTC (libnvrtc)" "$nvrtc_file" "$nvrtc_file" \
    "install CUDA 13's NVRTC (the toolkit, or pip install nvidia-cuda-nvrtc)"; then
    nvrtc_dir="$(dirname "$(find_lib "$nvrtc_file")")"
    if ! ls "$nvrtc_dir"/libnvrtc-builtins.so* >/dev/null 2>&1; then
        fail "preflight: NVRTC builtins" "no libnvrtc-builtins.so* beside $nvrtc_dir/$nvrtc_file"
        preflight_ok=0
    fi
fi
# CUDA headers: cubecl-cuda takes CUDA_PATH, else /usr/local/cuda, /opt/cuda, /usr (with
# /usr/bin/nvcc), and panics without one; its kernels include cuda_fp16.h from <root>/include.
# A CUDA 13 wheel's root (nvidia/cu13) holds them too.
if [ -n "${CUDA_PATH+x}" ]; then cuda_root="$CUDA_PATH"
elif [ -e /usr/local/cuda ]; then cuda_root=/usr/local/cuda
elif [ -e /opt/cuda ]; then cuda_root=/opt/cuda
elif [ -e /usr/bin/nvcc ]; then cuda_root=/usr
else
    cuda_root=""
    for d in $wheel_dirs; do
        [ -f "$(dirname "$d")/include/cuda_fp16.h" ] && cuda_root="$(dirname "$d")" && break
    done
    [ -n "$cuda_root" ] && export CUDA_PATH="$cuda_root"
fi
if [ -n "$cuda_root" ] && [ -f "$cuda_root/include/cuda_fp16.h" ]; then
    pass "preflight: CUDA headers" "$cuda_root/include"
else
    fail "preflight: CUDA headers" "no cuda_fp16.h under ${cuda_root:-CUDA_PATH, /usr/local/cuda, /opt/cuda, the wheels}/include: install the CUDA toolkit headers or set CUDA_PATH"
    preflight_ok=0
fi
if [ "$preflight_ok" -eq 0 ]; then
    echo "preflight failed: the checks need the libraries above"
    finish
fi
export LD_LIBRARY_PATH="$lib_path:${LD_LIBRARY_PATH:-}"
# Every NCCL output starts as NaN (burn-ddp-nccl's POISON_VAR): a result that matches proves NCCL
# wrote it, not freed memory that still held the input.
export BURN_DDP_NCCL_POISON=1
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# --- Ranks ---------------------------------------------------------------------------------
# Runs `$@` (after its limit $2) as ranks 0 and 1 of a world of 2 (processes $1-0 and $1-1);
# the status is 0 when both exited 0, else the first non-zero one. On one GPU both use it as
# two NCCL "hosts"; with more, one GPU each. Returns 1 without running when no time is left.
world2() {
    local name="$1" own="$2"
    shift 2
    step_limit "$own" || return 1
    local port=$((20000 + RANDOM % 20000)) r pids=() rc=0 gpu_env
    for r in 0 1; do
        if [ "$gpus" -ge 2 ]; then
            gpu_env="LOCAL_RANK=$r LOCAL_WORLD_SIZE=2"
        else
            gpu_env="LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 BURN_DDP_TRANSPORT=tcp NCCL_HOSTID=burn-ddp-check-$r NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_NVLS_ENABLE=0 NCCL_MNNVL_ENABLE=0"
        fi
        # shellcheck disable=SC2086
        logged "$name-$r" env RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            BURN_DDP_TIMEOUT=60 $gpu_env timeout -k 5 "$limit" "$@" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do
        wait "$p"
    done
    for r in 0 1; do
        [ "$rc" -eq 0 ] && rc=$(rc_of "$name-$r")
    done
    return "$rc"
}
# One world-1 process $1 with limit $2. Returns 1 without running when no time is left.
world1() {
    local name="$1" own="$2"
    shift 2
    step_limit "$own" || return 1
    logged "$name" env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
        timeout -k 5 "$limit" "$@"
    return "$(rc_of "$name")"
}
# A failed row for a step that did not end well: no time left, timed out, or its last lines.
failed_step() {
    local row="$1" name="$2" rc="$3"
    shift 3
    if [ "$limit" -lt 5 ]; then
        fail "$row" "not run: the ${budget}s budget is spent"
    else
        local tails="" l
        for l in "$@"; do
            l="$(gist "$work/$l.log")"
            [ -n "$l" ] && tails="$tails / $l"
        done
        fail "$row" "$(why "$rc")${tails}"
    fi
}
# The CHECK lines of a gpu-check log, one table row each.
table_of() {
    local log="$1" line name rest
    while IFS= read -r line; do
        name="${line#CHECK }"
        rest="${name#*: }"
        name="${name%%: *}"
        case "$rest" in
            ok*) pass "$name" "${rest#ok }" ;;
            skipped*) skip "$name" "${rest#skipped }" ;;
            *) fail "$name" "${rest#FAILED }" ;;
        esac
    done < <(grep '^CHECK ' "$log" 2>/dev/null)
}
ranks="two ranks on one GPU"
[ "$gpus" -ge 2 ] && ranks="one rank per GPU"
check="$work/bin/gpu-check"
# Runs `gpu-check $4` as step $2 at world $1 (1 or 2) with limit $3, adds the CHECK rows of its
# log (rank 0's) to the table, and records row $5 as failed when it did not exit 0; returns its
# exit status.
checked() {
    local world="$1" name="$2" own="$3" sub="$4" row="$5" rc logs
    "world$world" "$name" "$own" "$check" "$sub"
    rc=$?
    logs="$name"
    [ "$world" -eq 2 ] && logs="$name-0 $name-1"
    table_of "$work/${logs%% *}.log"
    # shellcheck disable=SC2086
    [ "$rc" -eq 0 ] || failed_step "$row" "$name" "$rc" $logs
    return "$rc"
}

# 1. World size 1 (out of place, so a wrong pointer shows): gather, the four reductions and
# broadcast of f32/f16/bf16 (f64 where burn has it), started on one thread and finished on another.
row="NCCL world 1: all_gather, all_reduce x 4, broadcast"
if world1 t 60 "$work/bin/nccl-tests" --nocapture --test-threads=1; then
    if grep -q SKIPPED "$work/t.log"; then
        fail "$row" "skipped on a GPU machine: $(grep -m1 SKIPPED "$work/t.log")"
    else
        pass "$row" "$(grep -c 'NCCL world 1 .*: ok' "$work/t.log") dtype x length cases"
    fi
else
    rc=$?
    if [ "$limit" -ge 5 ] && grep -qm1 -E 'panicked|FAILED' "$work/t.log"; then
        fail "$row" "$(why "$rc"): $(grep -m1 -E 'panicked|FAILED' "$work/t.log")"
    else
        failed_step "$row" t "$rc" t
    fi
fi

# 2. Every collective through the process group against the host's result, outputs poisoned
# (NaN) first: at world 1 (where the right result equals the input) and at world 2.
checked 1 coll1 60 collectives "world 1 collectives"
checked 2 coll 90 collectives "world 2 collectives ($ranks)"

# 3. A rank dies in the middle of an all-reduce: the other records it as the culprit within 10 s.
world2 die 40 "$check" die
rc=$?
table_of "$work/die-0.log"
grep -q '^CHECK ' "$work/die-0.log" 2>/dev/null ||
    failed_step "a rank killed mid-all-reduce is recorded as the culprit" die "$rc" die-0 die-1

# 4. The bucket path's bandwidth at world 2 against a device copy of the same bytes; the
# buckets' results are checked.
checked 2 bw 60 bandwidth "bucket all-reduce bandwidth, world 2"

# 5. SyncBatchNorm at world 2 against BatchNorm on the whole batch.
checked 2 bn 60 syncbn "SyncBatchNorm world 2 ($ranks)"

# 5b. Fully sharded layers (each strategy) at world 2: one SGD step on each rank's half of a
# batch against the unwrapped layers' step on the whole batch.
checked 2 fsdp 60 fsdp "fsdp world 2 ($ranks)"

# 6. The f32 matmul's error against the host's exact product, measured in one process: burn
# 0.22's CUDA matmul rounds f32 inputs to TF32 on tensor cores (no switch turns that off), so
# the limits of the comparisons below that run different batch shapes are set from it.
tf32=0
if checked 1 mm 30 precision "f32 matmul precision"; then
    tf32=$(grep -o 'relative error [0-9.e+-]*' "$work/mm.log" | head -n 1 | awk '{print $3}')
fi

# 7. DdpLearner: world 2 x batch 16 against world 1 x batch 32 (relative error of the final
# parameters: max |a - b| / max |b|), uncompressed (at most 1e-5, or 4 x the matmul error
# measured above if that is larger: the two runs multiply 16 and 32 rows) and with bf16
# gradients (at most 1e-2: bf16 keeps 8 bits of mantissa; the CPU tests measure 7e-4).
rel() {
    python3 - "$1" "$2" <<'PY' 2>&1
import sys
from array import array
a, b = array("f"), array("f")
a.frombytes(open(sys.argv[1], "rb").read())
b.frombytes(open(sys.argv[2], "rb").read())
assert len(a) == len(b) > 0, f"{len(a)} vs {len(b)} parameters"
print(f"{max(abs(x - y) for x, y in zip(a, b)) / max(abs(y) for y in b):.3g}")
PY
}
within() { python3 -c "import sys; sys.exit(0 if float('$1') <= float('$2') else 1)" 2>/dev/null; }
q() { echo "$work/bin/quickstart" --device cuda --epochs 2 --quiet "$@"; }
if world1 e1 60 $(q --batch-size 32 --params-out "$work/e1.f32"); then
    pass "quickstart, DdpLearner, world 1 x 32" "$(grep -o 'validation accuracy [0-9.]*%' "$work/e1.log")"
    plain_limit=$(python3 -c "print(f'{max(1e-5, 4 * float(\"${tf32:-0}\")):.3g}')" 2>/dev/null || echo 1e-5)
    for compression in none bf16; do
        row="DdpLearner world 2 x 16 vs world 1 x 32, compression $compression"
        limit_of="$plain_limit (1e-5, or 4 x the f32 matmul error)"
        [ "$compression" = bf16 ] && limit_of=1e-2
        if world2 "e2$compression" 60 $(q --batch-size 16 --compression "$compression" --params-out "$work/e2$compression.f32"); then
            r=$(rel "$work/e2$compression.f32" "$work/e1.f32")
            if within "$r" "${limit_of%% *}"; then
                pass "$row" "relative error $r (limit $limit_of)"
            else
                fail "$row" "relative error $r (limit $limit_of)"
            fi
        else
            failed_step "$row" "e2$compression" $? "e2$compression-0" "e2$compression-1"
        fi
    done
    # The sharded optimizer (ZeRO-2: reduce-scatter, all-gather of the parameters) with Adam,
    # against the same run unsharded: the same batch shapes, so the same kernels (1e-5).
    row="DdpLearner world 2, Adam sharded (ZeRO-2) vs unsharded"
    if ! world2 adam 60 $(q --batch-size 16 --optimizer adam --params-out "$work/adam.f32"); then
        failed_step "$row" adam $? adam-0 adam-1
    elif ! world2 zero 60 $(q --batch-size 16 --optimizer adam --shard gradients --params-out "$work/zero.f32"); then
        failed_step "$row" zero $? zero-0 zero-1
    else
        r=$(rel "$work/zero.f32" "$work/adam.f32")
        if within "$r" 1e-5; then
            pass "$row" "relative error $r (limit 1e-5); $(grep -h 'optimizer state' "$work"/zero-*.log | tr '\n' ' ')"
        else
            fail "$row" "relative error $r (limit 1e-5)"
        fi
    fi
else
    failed_step "quickstart, DdpLearner, world 1 x 32" e1 $? e1
fi

finish
