//! Cost of the desync check: training steps (forward, backward, bucketed gradient reduction) of
//! the quickstart's MLP on two ranks (threads over loopback), with and without the per-bucket
//! fingerprint, in alternating blocks so that both see the same machine.
//!
//! ```text
//! cargo run --release -p burn-ddp --example bench_reducer [-- STEPS_PER_BLOCK [BLOCKS]]
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
use burn_ddp::train::{BucketConfig, GradientReducer, broadcast_module};
use clap::Parser;
use clap::builder::RangedU64ValueParser;

/// The quickstart's model: 16 features, 64 hidden, 4 classes.
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

/// Per-step times of each block pair, with the check and without.
type Timings = (Vec<f64>, Vec<f64>);

fn rank(group: ProcessGroup, steps: usize, blocks: usize) -> Result<Timings, burn_ddp::DdpError> {
    let group = Arc::new(group);
    let device = Device::flex().autodiff();
    let model = Mlp {
        hidden: LinearConfig::new(16, 64).init(&device),
        out: LinearConfig::new(64, 4).init(&device),
        act: Relu::new(),
    };
    let model = broadcast_module(model, &group)?;
    let checked = GradientReducer::new(&model, group.clone(), BucketConfig::default())?;
    let unchecked =
        GradientReducer::new(&model, group.clone(), BucketConfig::default())?.desync_check(false);
    let x: Vec<f32> = (0..32 * 16).map(|i| ((i * 7) % 13) as f32 / 13.0).collect();
    let y: Vec<i64> = (0..32).map(|i| i % 4).collect();
    let x = Tensor::<2>::from_data(TensorData::new(x, [32, 16]), &device);
    let y = Tensor::<1, Int>::from_data(TensorData::new(y, [32]), &device);
    let loss = CrossEntropyLossConfig::new().init(&device);
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for block in 0..blocks {
        for (reducer, times) in [(&checked, &mut with), (&unchecked, &mut without)] {
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
    Ok((with, without))
}

/// Cost of the desync check per training step, on two ranks (threads).
#[derive(Debug, Parser)]
#[command(name = "bench_reducer")]
struct Args {
    /// Training steps per timed block
    #[arg(value_name = "STEPS_PER_BLOCK", default_value_t = 500,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    steps: usize,
    /// Pairs of blocks (with, then without the check)
    #[arg(value_name = "BLOCKS", default_value_t = 20,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    blocks: usize,
}

fn main() -> anyhow::Result<()> {
    let Args { steps, blocks } = Args::parse();
    let server = StoreServer::bind("127.0.0.1:0").context("serving the store")?;
    let port = server.local_addr().port();
    let results = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let group = ProcessGroup::builder(r, 2)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .host_store(false)
                        .build()?;
                    rank(group, steps, blocks)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect::<Result<Vec<_>, _>>()
    })
    .context("benchmark rank")?;
    let (with, without) = &results[0];
    let diffs: Vec<f64> = with.iter().zip(without).map(|(a, b)| a - b).collect();
    let (cost, se) = mean_se(&diffs);
    let step = median(without.clone());
    println!(
        "bench_reducer: quickstart MLP (1348 parameters, 1 bucket), world 2, {blocks} pairs of \
         blocks of {steps} steps (with, then without the desync check)"
    );
    println!(
        "  step with the check, median of blocks:    {:8.1} us",
        median(with.clone())
    );
    println!("  step without the check, median of blocks: {step:8.1} us");
    println!(
        "  cost of the check (mean of paired block differences): {cost:+.2} us +- {se:.2} us per \
         step = {:+.2}% +- {:.2}% of the step",
        cost / step * 100.0,
        se / step * 100.0
    );
    Ok(())
}
