//! GPU figure for the bundle: throughput of pack (`cat` of 64 gradient tensors) + NCCL
//! all-reduce (world size 1) + unpack (`narrow`) of a 256 MiB bucket, against a
//! device-to-device copy of the same bytes, as a ratio. Prints "no GPU" and exits 0 without one.
//! It takes no flags (`--help` says so).

use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};
use burn_ddp_nccl::{NcclComm, ReduceOp, check_libraries, unique_id};
use clap::Parser;

const PARTS: usize = 64;
const BYTES: usize = 256 << 20;

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn time(device: &Device, mut f: impl FnMut()) -> Duration {
    let runs = (0..7)
        .map(|_| {
            let t = Instant::now();
            f();
            let _ = device.sync();
            t.elapsed()
        })
        .collect();
    median(runs)
}

/// Throughput of pack + NCCL all-reduce + unpack of a 256 MiB bucket against a device copy.
#[derive(Debug, Parser)]
#[command(name = "bucket_bench")]
struct Cli {}

fn main() {
    Cli::parse();
    if let Err(e) = check_libraries() {
        println!("no GPU: {e}");
        return;
    }
    let device = Device::cuda(0);
    let comm =
        match unique_id(0).and_then(|id| NcclComm::new(0, 1, 0, &id, Duration::from_secs(60))) {
            Ok(c) => c,
            Err(e) => {
                println!("NCCL unavailable: {e}");
                std::process::exit(1);
            }
        };
    let n = BYTES / 4 / PARTS;
    let grads: Vec<Tensor<1>> = (0..PARTS).map(|_| Tensor::ones([n], &device)).collect();
    let whole: Tensor<1> = Tensor::ones([n * PARTS], &device);
    let _ = device.sync();

    let copy = time(&device, || {
        let _copy = whole.clone().add_scalar(0.0);
    });
    let pipeline = time(&device, || {
        let packed = Tensor::cat(grads.clone(), 0);
        let reduced = comm.all_reduce(packed, ReduceOp::Avg).expect("all_reduce");
        let _parts: Vec<Tensor<1>> = (0..PARTS)
            .map(|i| reduced.clone().narrow(0, i * n, n).add_scalar(0.0))
            .collect();
    });
    let gbps = |d: Duration| BYTES as f64 / d.as_secs_f64() / 1e9;
    println!(
        "256 MiB bucket: pack+all_reduce+unpack {:.2} ms ({:.1} GB/s), device copy {:.2} ms ({:.1} GB/s), ratio {:.2}",
        pipeline.as_secs_f64() * 1e3,
        gbps(pipeline),
        copy.as_secs_f64() * 1e3,
        gbps(copy),
        pipeline.as_secs_f64() / copy.as_secs_f64()
    );
}
