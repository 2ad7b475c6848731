#!/usr/bin/env bash
# burn-ddp's one-command GPU check (made by `cargo xtask gpu-bundle`). Needs a Linux x86-64
# machine with an NVIDIA driver, CUDA 13 (NVRTC and its headers) and NCCL (the `nvidia-nccl-cu13`
# wheel or BURN_DDP_NCCL_DIR); no cargo, no network.
#
# Every step runs under `timeout` (STEP_LIMIT seconds, 150 by default; the whole check takes
# under 8 minutes on one H100). Each check compares against a result computed independently (the
# host's reduction, one process with the whole batch), never one rank against another. Prints a
# summary table; exits non-zero if any check failed. Without a GPU it says so and exits 0.
#
# On one GPU the multi-rank checks run two ranks on it: NCCL refuses two ranks of one
# communicator on one GPU ("Duplicate GPU detected") unless they look like two hosts, which a
# different NCCL_HOSTID per process gives (NCCL hashes the host from it); the two "hosts" then
# talk through NCCL's socket transport on loopback (NCCL_NET=Socket, NCCL_SOCKET_IFNAME=lo).
# With several GPUs, one rank per GPU instead.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
STEP_LIMIT="${STEP_LIMIT:-150}"
failures=0
results=()
record() { results+=("$(printf '%-62s %-8s %s' "$1" "$2" "$3")"); }
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
    echo "failed: $failures"
    [ "$failures" -eq 0 ]
    exit $?
}
# The last line of a log, for a table cell.
last() { tail -n 1 "$1" 2>/dev/null | cut -c1-200; }

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
    echo "no GPU: nvidia-smi lists none (or is missing); nothing to check on this machine"
    skip "GPU" "none: every GPU check skipped"
    # The binaries still start, and fail cleanly without CUDA (no loader panic):
    timeout -k 5 "$STEP_LIMIT" "$work/bin/quickstart" --device cuda --epochs 1 >"$work/q.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        fail "quickstart --device cuda without a GPU" "succeeded without a GPU"
    elif grep -q "panicked" "$work/q.log"; then
        fail "quickstart --device cuda without a GPU" "panicked: $(grep -m1 panicked "$work/q.log")"
    else
        pass "quickstart --device cuda without a GPU" "clean error: $(last "$work/q.log")"
    fi
    finish
fi
pass "GPUs visible" "$gpus: $(nvidia-smi -L | head -n 1)"

# Finds a file named like $1 on the loader's path.
find_lib() {
    local name="$1" d
    if ldconfig -p 2>/dev/null | awk '{print $1}' | grep -qx "$name"; then
        ldconfig -p | awk -v n="$name" '$1 == n {print $NF; exit}'
        return 0
    fi
    for d in $(printf %s "${LD_LIBRARY_PATH:-}" | tr : ' ') /lib /usr/lib /lib64 /usr/lib64 \
        /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        if [ -e "$d/$name" ]; then
            echo "$d/$name"
            return 0
        fi
    done
    return 1
}
preflight_ok=1
if lib=$(find_lib libcuda.so.1); then
    pass "preflight: CUDA driver (libcuda)" "$lib"
else
    fail "preflight: CUDA driver (libcuda)" "libcuda.so.1 not found: install the NVIDIA driver"
    preflight_ok=0
fi
# NCCL: the wheel ships libnccl.so.2; cudarc's loader wants libnccl.so (a link in $work/lib).
nccl_dir="${BURN_DDP_NCCL_DIR:-}"
if [ -z "$nccl_dir" ]; then
    nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
fi
if [ -z "$nccl_dir" ] && lib=$(find_lib libnccl.so.2); then
    nccl_dir=$(dirname "$lib")
fi
if [ -n "$nccl_dir" ] && [ -f "$nccl_dir/libnccl.so.2" ]; then
    mkdir -p "$work/lib"
    ln -sf "$nccl_dir/libnccl.so.2" "$work/lib/libnccl.so"
    export LD_LIBRARY_PATH="$work/lib:$nccl_dir:${LD_LIBRARY_PATH:-}"
    pass "preflight: NCCL (libnccl)" "$nccl_dir/libnccl.so.2"
else
    fail "preflight: NCCL (libnccl)" "libnccl.so.2 not found: pip install nvidia-nccl-cu13, or set BURN_DDP_NCCL_DIR"
    preflight_ok=0
fi
# NVRTC compiles burn's kernels; cudarc loads one of these names.
nvrtc=""
for n in libnvrtc.so libnvrtc.so.13 libnvrtc.so.12; do
    if lib=$(find_lib "$n"); then
        nvrtc="$lib"
        break
    fi
done
if [ -n "$nvrtc" ]; then
    pass "preflight: NVRTC (libnvrtc)" "$nvrtc"
else
    fail "preflight: NVRTC (libnvrtc)" "libnvrtc.so(.13) not found: install the CUDA toolkit's NVRTC (pip install nvidia-cuda-nvrtc) and put it on LD_LIBRARY_PATH"
    preflight_ok=0
fi
# CUDA headers: cubecl-cuda takes CUDA_PATH, else /usr/local/cuda, /opt/cuda, /usr (with
# /usr/bin/nvcc), and panics without one; its kernels include cuda_fp16.h from <root>/include.
if [ -n "${CUDA_PATH+x}" ]; then cuda_root="$CUDA_PATH"
elif [ -e /usr/local/cuda ]; then cuda_root=/usr/local/cuda
elif [ -e /opt/cuda ]; then cuda_root=/opt/cuda
elif [ -e /usr/bin/nvcc ]; then cuda_root=/usr
else cuda_root=""; fi
if [ -n "$cuda_root" ] && [ -f "$cuda_root/include/cuda_fp16.h" ]; then
    pass "preflight: CUDA headers" "$cuda_root/include"
else
    fail "preflight: CUDA headers" "no cuda_fp16.h under ${cuda_root:-CUDA_PATH, /usr/local/cuda, /opt/cuda}/include: install the CUDA toolkit headers or set CUDA_PATH"
    preflight_ok=0
fi
# python3 compares the parameters of the DdpLearner runs.
if command -v python3 >/dev/null 2>&1; then
    pass "preflight: python3" "$(python3 --version 2>&1)"
else
    fail "preflight: python3" "not found: the parameter comparisons need it"
    preflight_ok=0
fi
if [ "$preflight_ok" -eq 0 ]; then
    echo "preflight failed: the checks need the libraries above"
    finish
fi

# --- Ranks ---------------------------------------------------------------------------------
# Runs `$@` as ranks 0 and 1 of a world of 2 (logs $work/$name-$r.log); the status is 0 when
# both exited 0. On one GPU both use it as two NCCL "hosts"; with more, one GPU each.
world2() {
    local name="$1"
    shift
    local port=$((20000 + RANDOM % 20000)) r pids=() rc=0
    for r in 0 1; do
        if [ "$gpus" -ge 2 ]; then
            env RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
                MASTER_PORT=$port BURN_DDP_TIMEOUT=60 \
                timeout -k 5 "$STEP_LIMIT" "$@" >"$work/$name-$r.log" 2>&1 &
        else
            env RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
                MASTER_PORT=$port BURN_DDP_TIMEOUT=60 BURN_DDP_TRANSPORT=tcp \
                NCCL_HOSTID="burn-ddp-check-$r" NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo \
                NCCL_NVLS_ENABLE=0 NCCL_MNNVL_ENABLE=0 \
                timeout -k 5 "$STEP_LIMIT" "$@" >"$work/$name-$r.log" 2>&1 &
        fi
        pids+=($!)
    done
    for p in "${pids[@]}"; do
        wait "$p" || rc=1
    done
    return $rc
}
# One world-1 process (logs $work/$name.log).
world1() {
    local name="$1"
    shift
    env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
        timeout -k 5 "$STEP_LIMIT" "$@" >"$work/$name.log" 2>&1
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
    done < <(grep '^CHECK ' "$log")
}
ranks="two ranks on one GPU"
[ "$gpus" -ge 2 ] && ranks="one rank per GPU"

# 1. World size 1 (out of place, so a wrong pointer shows): gather, the four reductions and
# broadcast of f32/f16/bf16 (f64 where burn has it), started on one thread and finished on another.
check="NCCL world 1: all_gather, all_reduce x 4, broadcast"
if timeout -k 5 "$STEP_LIMIT" "$work/bin/nccl-tests" --nocapture --test-threads=1 >"$work/t.log" 2>&1; then
    if grep -q SKIPPED "$work/t.log"; then
        fail "$check" "skipped on a GPU machine: $(grep -m1 SKIPPED "$work/t.log")"
    else
        pass "$check" "$(grep -c 'NCCL world 1 .*: ok' "$work/t.log") dtype x length cases"
    fi
else
    fail "$check" "$(grep -m1 -E 'panicked|FAILED|error' "$work/t.log" || last "$work/t.log")"
fi

# 2. World 2: every collective against the host's result.
if world2 coll "$work/bin/gpu-check" collectives; then
    table_of "$work/coll-0.log"
else
    table_of "$work/coll-0.log"
    fail "world 2 collectives ($ranks)" "$(last "$work/coll-0.log") / $(last "$work/coll-1.log")"
fi

# 3. SyncBatchNorm at world 2 against BatchNorm on the whole batch.
if world2 bn "$work/bin/gpu-check" syncbn; then
    table_of "$work/bn-0.log"
else
    table_of "$work/bn-0.log"
    fail "SyncBatchNorm world 2 ($ranks)" "$(last "$work/bn-0.log") / $(last "$work/bn-1.log")"
fi

# 4. DdpLearner: world 2 x batch 16 against world 1 x batch 32 (relative error of the final
# parameters: max |a - b| / max |b|), uncompressed (at most 1e-5) and with bf16 gradients (at
# most 1e-2: bf16 keeps 8 bits of mantissa; the CPU tests measure 7e-4).
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
q() { echo "$work/bin/quickstart" --device cuda --epochs 2 --quiet "$@"; }
if world1 e1 $(q --batch-size 32 --params-out "$work/e1.f32"); then
    pass "quickstart, DdpLearner, world 1 x 32" "$(grep -o 'validation accuracy [0-9.]*%' "$work/e1.log")"
    for compression in none bf16; do
        name="DdpLearner world 2 x 16 vs world 1 x 32, compression $compression"
        limit=1e-5
        [ "$compression" = bf16 ] && limit=1e-2
        if world2 "e2$compression" $(q --batch-size 16 --compression "$compression" --params-out "$work/e2$compression.f32"); then
            r=$(rel "$work/e2$compression.f32" "$work/e1.f32")
            if python3 -c "import sys; sys.exit(0 if float('$r') <= $limit else 1)" 2>/dev/null; then
                pass "$name" "relative error $r (limit $limit)"
            else
                fail "$name" "relative error $r (limit $limit)"
            fi
        else
            fail "$name" "$(last "$work/e2$compression-0.log") / $(last "$work/e2$compression-1.log")"
        fi
    done
    # The sharded optimizer (ZeRO-2: reduce-scatter, all-gather of the parameters) with Adam,
    # against the same run unsharded.
    if world2 adam $(q --batch-size 16 --optimizer adam --params-out "$work/adam.f32") &&
        world2 zero $(q --batch-size 16 --optimizer adam --shard gradients --params-out "$work/zero.f32"); then
        r=$(rel "$work/zero.f32" "$work/adam.f32")
        name="DdpLearner world 2, Adam sharded (ZeRO-2) vs unsharded"
        if python3 -c "import sys; sys.exit(0 if float('$r') <= 1e-5 else 1)" 2>/dev/null; then
            pass "$name" "relative error $r (limit 1e-5); $(grep -h 'optimizer state' "$work"/zero-*.log | tr '\n' ' ')"
        else
            fail "$name" "relative error $r (limit 1e-5)"
        fi
    else
        fail "DdpLearner world 2, Adam sharded (ZeRO-2)" "$(last "$work/zero-0.log") / $(last "$work/zero-1.log")"
    fi
else
    fail "quickstart, DdpLearner, world 1 x 32" "$(last "$work/e1.log")"
fi

# 5. A rank dies in the middle of an all-reduce: the other names it within 10 s.
world2 die "$work/bin/gpu-check" die
table_of "$work/die-0.log"
grep -q '^CHECK ' "$work/die-0.log" || fail "a rank killed mid-all-reduce is named" "$(last "$work/die-0.log")"

# 6. The bucket path's bandwidth at world 2 against a device copy of the same bytes.
if world2 bw "$work/bin/gpu-check" bandwidth; then
    table_of "$work/bw-0.log"
else
    fail "bucket all-reduce bandwidth, world 2" "$(last "$work/bw-0.log") / $(last "$work/bw-1.log")"
fi

finish
