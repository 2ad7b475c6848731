#!/usr/bin/env bash
# burn-ddp one-command GPU check (made by `cargo xtask gpu-bundle`). Needs a Linux x86-64 machine
# with an NVIDIA driver, CUDA 13 and NCCL (the `nvidia-nccl-cu13` wheel or BURN_DDP_NCCL_DIR);
# no cargo, no network. Prints a summary table; on a machine without a GPU it says so and exits 0.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
results=()
record() { results+=("$(printf '%-58s %s' "$1" "$2")"); }
summary() {
    echo
    echo "=== burn-ddp GPU check: summary ==="
    printf '%s\n' "${results[@]}"
}

# Unpack the binaries.
mkdir -p "$work/bin"
for f in "$here"/bin/*; do
    case "$f" in
        *.xz) xz -dc "$f" > "$work/bin/$(basename "${f%.xz}")" ;;
        *) cp "$f" "$work/bin/" ;;
    esac
done
chmod +x "$work"/bin/*

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "$gpus" -eq 0 ]; then
    echo "no GPU: nvidia-smi lists none (or is missing); nothing to check on this machine"
    record "GPU" "none: every check skipped"
    # The binaries still start and fail cleanly without CUDA (no loader panic):
    if "$work/bin/quickstart" --device cuda --epochs 1 >"$work/q.log" 2>&1; then
        record "quickstart --device cuda without a GPU" "UNEXPECTED success"
    elif grep -q "not found" "$work/q.log"; then
        record "quickstart --device cuda without a GPU" "clean error: $(grep -m1 -o 'lib[a-z]* not found' "$work/q.log")"
    else
        record "quickstart --device cuda without a GPU" "FAILED: $(tail -n1 "$work/q.log")"
    fi
    summary
    exit 0
fi
echo "GPUs: $gpus"
record "GPUs visible" "$gpus"

# NCCL: the wheel ships libnccl.so.2; the loader wants libnccl.so.
nccl_dir="${BURN_DDP_NCCL_DIR:-}"
if [ -z "$nccl_dir" ]; then
    nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
fi
if [ -n "$nccl_dir" ] && [ -f "$nccl_dir/libnccl.so.2" ]; then
    mkdir -p "$work/lib"
    ln -sf "$nccl_dir/libnccl.so.2" "$work/lib/libnccl.so"
    export LD_LIBRARY_PATH="$work/lib:$nccl_dir:${LD_LIBRARY_PATH:-}"
    record "NCCL library" "$nccl_dir/libnccl.so.2"
else
    record "NCCL library" "not found (set BURN_DDP_NCCL_DIR or pip install nvidia-nccl-cu13)"
fi

# 1. NCCL world size 1: all-gather out of place into a fresh buffer (started on one thread,
# finished on another), all-reduce and broadcast in place; f32/f16/bf16, odd lengths.
check1="NCCL world 1 gather/reduce/broadcast (f32/f16/bf16, n=1,7,1000003)"
if "$work/bin/nccl-tests" --nocapture --test-threads=1 >"$work/t.log" 2>&1; then
    if grep -q SKIPPED "$work/t.log"; then
        record "$check1" "SKIPPED: $(grep -m1 SKIPPED "$work/t.log")"
    else
        record "$check1" "ok ($(grep -c 'NCCL world 1 .*: ok' "$work/t.log") cases)"
    fi
else
    record "$check1" "FAILED (see below)"
    tail -n 30 "$work/t.log"
fi

# 2. The quickstart through DdpLearner on the GPU, world 1; and burn's own Learner.
step_ms() { grep -o '[0-9.]* ms per step' "$1" | head -n1 | cut -d' ' -f1; }
RANK=0 WORLD_SIZE=1 "$work/bin/quickstart" --device cuda --epochs 3 --quiet >"$work/q1.log" 2>&1
q1=$?
"$work/bin/quickstart" --device cuda --epochs 3 --quiet --plain >"$work/qp.log" 2>&1
qp=$?
if [ $q1 -eq 0 ]; then
    record "quickstart, DdpLearner, world 1, GPU" "ok: $(grep -o 'validation accuracy [0-9.]*%' "$work/q1.log")"
else
    record "quickstart, DdpLearner, world 1, GPU" "FAILED: $(tail -n1 "$work/q1.log")"
fi
if [ $q1 -eq 0 ] && [ $qp -eq 0 ]; then
    a=$(step_ms "$work/q1.log"); b=$(step_ms "$work/qp.log")
    record "step time DdpLearner / burn Learner (world 1, GPU)" "$a ms / $b ms = $(python3 -c "print(f'{$a/$b:.3f}')" 2>/dev/null)"
fi

# 2b. Checkpoint and resume on the GPU: 2 epochs with a checkpoint, resumed to 4, against 4
# straight; the final parameters must be bit-identical.
digest() { grep -o 'parameters digest [0-9a-f]*' "$1" | cut -d' ' -f3; }
rm -rf "$work/ckpt"
RANK=0 WORLD_SIZE=1 "$work/bin/quickstart" --device cuda --epochs 2 --quiet --checkpoint-dir "$work/ckpt" >"$work/r1.log" 2>&1 \
    && RANK=0 WORLD_SIZE=1 "$work/bin/quickstart" --device cuda --epochs 4 --quiet --checkpoint-dir "$work/ckpt" >"$work/r2.log" 2>&1 \
    && RANK=0 WORLD_SIZE=1 "$work/bin/quickstart" --device cuda --epochs 4 --quiet >"$work/r3.log" 2>&1
if [ $? -ne 0 ]; then
    record "resume from a checkpoint (GPU, world 1)" "FAILED: $(tail -qn1 "$work"/r[123].log | head -n1)"
elif [ "$(digest "$work/r2.log")" = "$(digest "$work/r3.log")" ]; then
    record "resume from a checkpoint (GPU, world 1)" "bit-identical to a straight run ($(digest "$work/r3.log"))"
else
    record "resume from a checkpoint (GPU, world 1)" "DIFFERS: $(digest "$work/r2.log") vs $(digest "$work/r3.log")"
fi

# 3. Pack + NCCL all-reduce + unpack of 256 MiB against a device copy: one blocking bucket, and
# 8 buckets in flight as burn-ddp's group runs them (started here, finished on another thread).
if "$work/bin/bucket-bench" >"$work/b.log" 2>&1; then
    record "256 MiB, one blocking bucket vs device copy" "$(tail -n2 "$work/b.log" | head -n1)"
    record "256 MiB, 8 buckets in flight vs device copy" "$(tail -n1 "$work/b.log")"
else
    record "256 MiB bucket vs device copy" "FAILED: $(tail -n1 "$work/b.log")"
fi

# 4. World size 2 on the one GPU: two processes that NCCL should see as two hosts.
port=$((20000 + RANDOM % 20000))
for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    NCCL_HOSTID="burn-ddp-host-$r" NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 BURN_DDP_TIMEOUT=120 \
        "$work/bin/quickstart" --device cuda --epochs 2 --quiet --save-model "$work/w2-$r.safetensors" \
        >"$work/w2-$r.log" 2>&1 &
done
wait
if grep -q "validation accuracy" "$work/w2-0.log"; then
    record "world 2 on one GPU (NCCL_HOSTID per rank)" "NCCL accepted it: $(grep -o 'validation accuracy [0-9.]*%' "$work/w2-0.log")"
    if [ "$(digest "$work/w2-0.log")" = "$(digest "$work/w2-1.log")" ]; then
        record "world 2: parameters of rank 0 and rank 1" "identical ($(digest "$work/w2-0.log"))"
    else
        record "world 2: parameters of rank 0 and rank 1" "DIFFER: $(digest "$work/w2-0.log") vs $(digest "$work/w2-1.log")"
    fi
else
    record "world 2 on one GPU (NCCL_HOSTID per rank)" "not accepted: $(grep -h -m1 -i 'error\|nccl' "$work"/w2-*.log | head -n1)"
fi

# 5. Equivalence where two GPUs exist: world 2 with batch 16 per rank against world 1 with batch
# 32, the parameters compared numerically (relative error: max |a - b| / max |b|, at most 1e-5).
if [ "$gpus" -ge 2 ]; then
    port=$((20000 + RANDOM % 20000))
    for r in 0 1; do
        RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        BURN_DDP_TIMEOUT=120 "$work/bin/quickstart" --device cuda --epochs 2 --batch-size 16 --quiet \
            --params-out "$work/e2-$r.f32" >"$work/e2-$r.log" 2>&1 &
    done
    wait
    RANK=0 WORLD_SIZE=1 "$work/bin/quickstart" --device cuda --epochs 2 --batch-size 32 --quiet \
        --params-out "$work/e1.f32" >"$work/e1.log" 2>&1
    rel=$(python3 - "$work/e2-0.f32" "$work/e1.f32" <<'PY' 2>&1
import sys
from array import array
a, b = array("f"), array("f")
a.frombytes(open(sys.argv[1], "rb").read())
b.frombytes(open(sys.argv[2], "rb").read())
assert len(a) == len(b) > 0, f"{len(a)} vs {len(b)} parameters"
print(f"{max(abs(x - y) for x, y in zip(a, b)) / max(abs(y) for y in b):.3g}")
PY
)
    if python3 -c "import sys; sys.exit(0 if float('$rel') <= 1e-5 else 1)" 2>/dev/null; then
        record "world 2 x batch 16 vs world 1 x batch 32 (2 GPUs)" "equal: relative error $rel"
    else
        record "world 2 x batch 16 vs world 1 x batch 32 (2 GPUs)" "DIFFERS: $rel $(tail -qn1 "$work"/e2-0.log "$work"/e1.log | head -n1)"
    fi
else
    record "world 2 x batch 16 vs world 1 x batch 32" "needs 2 GPUs (this machine has $gpus)"
fi

summary
