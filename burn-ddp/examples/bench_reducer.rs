//! Cost of the reducer's checks: training steps (forward, backward, bucketed gradient
//! reduction) of an MLP (the quickstart's by default) on two ranks (threads over loopback), with
//! both checks, without the desync check (per-bucket fingerprint) and without the non-finite
//! check, in alternating blocks so that all three see the same machine.
//!
//! ```text
//! cargo run --release -p burn-ddp --example bench_reducer [-- STEPS_PER_BLOCK [BLOCKS] [--hidden N]]
//! ```
//!
//! Both ranks are threads of this one process, connected through a store it serves itself on
//! an ephemeral port, so it needs no launcher (and ignores one's variables).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_ddp::ProcessGroup;
use burn_ddp::store::StoreServer;
use burn_ddp::train::{BucketConfig, GradientReducer, NonFinite, broadcast_module};
use clap::Parser;
use clap::builder::RangedU64ValueParser;

/// The quickstart's model: 16 features, 64 hidden (or `--hidden`), 4 classes.
#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
    act: Relu,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Mean and standard error of the mean.
fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, (var / n).sqrt())
}

/// Per-step times of each block: with both checks, without the desync check, without the
/// non-finite check.
type Timings = [Vec<f64>; 3];

fn rank(group: ProcessGroup, args: &Args) -> Result<Timings, burn_ddp::DdpError> {
    let (steps, blocks) = (args.steps, args.blocks);
    let group = Arc::new(group);
    let device = Device::flex().autodiff();
    let model = Mlp {
        hidden: LinearConfig::new(16, args.hidden).init(&device),
        out: LinearConfig::new(args.hidden, 4).init(&device),
        act: Relu::new(),
    };
    let model = broadcast_module(model, &group)?;
    let reducer = || GradientReducer::new(&model, group.clone(), BucketConfig::default());
    let variants = [
        reducer()?,
        reducer()?.desync_check(false),
        reducer()?.non_finite(NonFinite::Propagate),
    ];
    let x: Vec<f32> = (0..32 * 16).map(|i| ((i * 7) % 13) as f32 / 13.0).collect();
    let y: Vec<i64> = (0..32).map(|i| i % 4).collect();
    let x = Tensor::<2>::from_data(TensorData::new(x, [32, 16]), &device);
    let y = Tensor::<1, Int>::from_data(TensorData::new(y, [32]), &device);
    let loss = CrossEntropyLossConfig::new().init(&device);
    let mut times: Timings = Default::default();
    for block in 0..blocks {
        for (reducer, times) in variants.iter().zip(&mut times) {
            group.barrier().wait()?;
            let start = Instant::now();
            for s in 0..steps {
                let h = model.act.forward(model.hidden.forward(x.clone()));
                let l = loss.forward(model.out.forward(h), y.clone());
                let grads = GradientsParams::from_grads(l.backward(), &model);
                reducer.reduce_at(&model, grads, block + 1, s)?;
            }
            times.push(start.elapsed().as_secs_f64() * 1e6 / steps as f64);
        }
    }
    Ok(times)
}

/// Cost of the reducer's checks per training step, on two ranks (threads).
#[derive(Debug, Parser)]
#[command(name = "bench_reducer")]
struct Args {
    /// Training steps per timed block
    #[arg(value_name = "STEPS_PER_BLOCK", default_value_t = 500,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    steps: usize,
    /// Rounds of blocks (with both checks, without the desync check, without the non-finite
    /// check)
    #[arg(value_name = "BLOCKS", default_value_t = 20,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    blocks: usize,
    /// Width of the hidden layer (64: the quickstart's 1348 parameters)
    #[arg(long, default_value_t = 64,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    hidden: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let server = StoreServer::bind("127.0.0.1:0").context("serving the store")?;
    let port = server.local_addr().port();
    let args = &args;
    let results = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let group = ProcessGroup::builder(r, 2)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .host_store(false)
                        .build()?;
                    rank(group, args)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect::<Result<Vec<_>, _>>()
    })
    .context("benchmark rank")?;
    let [both, no_desync, no_non_finite] = &results[0];
    let params = 16 * args.hidden + args.hidden + args.hidden * 4 + 4;
    println!(
        "bench_reducer: MLP 16-{}-4 ({params} parameters), world 2, {} rounds of blocks of {} \
         steps",
        args.hidden, args.blocks, args.steps
    );
    println!(
        "  step with both checks, median of blocks: {:8.1} us",
        median(both.clone())
    );
    for (check, without) in [("desync", no_desync), ("non-finite", no_non_finite)] {
        let diffs: Vec<f64> = both.iter().zip(without).map(|(a, b)| a - b).collect();
        let (cost, se) = mean_se(&diffs);
        let step = median(without.clone());
        println!(
            "  cost of the {check} check (mean of paired block differences): {cost:+.2} us +- \
             {se:.2} us per step = {:+.2}% +- {:.2}% of the step ({step:.1} us without it)",
            cost / step * 100.0,
            se / step * 100.0
        );
    }
    Ok(())
}
