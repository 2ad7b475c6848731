"""PyTorch gloo's all-reduce, timed as burn-ddp's bench_collectives times its own (run by
`cargo xtask bench-collectives --gloo PYTHON` under torchrun): f32 sum, back-to-back operations,
the median per rank, the slowest rank's median; rank 0 writes `bytes median_us busbw_gbps`."""
import argparse
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--sizes", required=True, help="comma-separated sizes in bytes")
parser.add_argument("--report", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
lines = []
for size in [int(s) for s in args.sizes.split(",")]:
    elems = max(size // 4, 1)
    iters = min(max((2 << 30) // max(size, 1), 5), 200)
    t = torch.zeros(elems, dtype=torch.float32)
    for _ in range(max(iters // 4, 2)):
        dist.all_reduce(t)
    times = []
    for _ in range(iters):
        s = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - s)
    times.sort()
    mine = torch.tensor([times[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    med = mine.item()
    busbw = elems * 4 / med / 1e9 * 2 * (n - 1) / n
    lines.append(f"{elems * 4} {med * 1e6:.3f} {busbw:.6f}\n")
if rank == 0:
    with open(args.report, "w") as f:
        f.writelines(lines)
dist.destroy_process_group()
