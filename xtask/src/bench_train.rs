//! `bench-train`: the quickstart's step time and samples/s under `DdpLearner` against burn's
//! `Learner` and across world sizes, transports and gradient compressions (with `--hosts`,
//! across hosts of network namespaces on a slow link; with `--shard`, the sharded optimizer's
//! memory and speed; with `--fsdp`, each rank's memory under DDP, ZeRO-2 and fully sharded
//! blocks, see `fsdp`; with `--overlap`, the communication a step waits for when the blocks'
//! all-reduces start inside backward, against after it). It prints figures, it does not pass or
//! fail; it builds in the release profile unless given `--debug` (the smoke test's way to run it
//! quickly).

mod fsdp;
mod run;
mod runner;
mod runs;

use anyhow::Result;
use clap::Args;

use run::{Timing, TrainRun, median, rate, step};
use runner::{Runner, Shared, TRANSFORMER};
use runs::{
    OVERLAP_LINK, across_hosts_runs, overlap_runs, print_shard_table, shard_runs,
    summarise_across_hosts, summarise_overlap, summarise_shard, summarise_this_host,
    summarise_transformer, this_host_runs, transformer_runs,
};

/// Quickstart step time of DdpLearner at world size 1 against burn's Learner, and samples/s at
/// world size 2 against 1; with `--hosts`, step time and scaling across hosts of network
/// namespaces on a slow link, against the same world on one host, with and without bf16
/// gradients.
#[derive(Debug, Args)]
pub struct BenchTrain {
    /// Epochs per run [default: 3; with --shard: 1]
    #[arg(long, value_name = "N")]
    epochs: Option<usize>,
    /// Runs of each kind (the median is reported) [default: 3; with --fsdp: 1]
    #[arg(long, value_name = "N")]
    repeats: Option<usize>,
    /// Batch size per rank [default: 32; with --shard: 4; with --fsdp: 2 sequences]
    #[arg(long, value_name = "B")]
    batch_size: Option<usize>,
    /// Training samples per epoch [default: the quickstart's]
    #[arg(long, value_name = "N")]
    samples: Option<usize>,
    /// The network: the quickstart's (`mlp`, or `mlp-large`: 784-1024-1024-10), or
    /// `transformer` (the `charlm` program's decoder-only transformer on its text) [default:
    /// mlp; with --hosts: mlp-large]
    #[arg(long, value_name = "KIND")]
    model: Option<String>,
    /// Train across this many hosts made of network namespaces (root; see `cargo xtask
    /// cluster`): world 1, the same world on one host, and across the hosts, each with and
    /// without bf16 gradients
    #[arg(long, value_name = "N")]
    hosts: Option<usize>,
    /// With --hosts: ranks per host
    #[arg(long, value_name = "N", default_value_t = 1, requires = "hosts")]
    nproc_per_host: usize,
    /// With --hosts or --overlap: rate of each host's link in tc syntax (`1gbit`) [default:
    /// unlimited; with --overlap: 1gbit]
    #[arg(long, value_name = "RATE")]
    link_rate: Option<String>,
    /// The sharded optimizer: a 20.6 M-parameter transformer (the `charlm` program's, 26
    /// blocks of width 256) with AdamW at world 1, 2 and 4, unsharded and sharded (optimizer;
    /// optimizer and gradients): each rank's optimizer-state bytes, peak resident memory, step
    /// time and bytes sent per step
    #[arg(long, conflicts_with_all = ["hosts", "model", "samples"])]
    shard: bool,
    /// Fully sharded blocks (ZeRO-3) against DDP and ZeRO-2: a transformer of 100.9 M
    /// parameters (8 blocks of width 1024) with AdamW at worlds 2 and 4, in a hand-written loop
    /// (the `shardlm` program): each rank's parameters, gradients and optimizer state, peak
    /// resident memory, step time and bytes sent per step; as root with a cgroup memory
    /// controller, DDP and FSDP at world 4 with each rank capped between their peaks
    #[arg(long, conflicts_with_all = ["hosts", "model", "samples", "shard", "epochs"])]
    fsdp: bool,
    /// Overlap of communication with backward: the `charlm` transformer (8 blocks of width
    /// 256) across 2 hosts of network namespaces (root) on a link of --link-rate [default:
    /// 1gbit], with its gradients reduced after backward (DdpLearner's reducer) and with each
    /// block's all-reduce started inside backward (`--fsdp none`): the communication each step
    /// waits for. Each rank is bound to a core of its own (`taskset`), as each rank would have
    /// a device of its own
    #[arg(long, conflicts_with_all = ["hosts", "model", "samples", "shard", "fsdp"])]
    overlap: bool,
    /// With --fsdp: width of the transformer
    #[arg(long, value_name = "D", default_value_t = 1024, requires = "fsdp")]
    width: usize,
    /// With --fsdp: attention heads (dividing --width)
    #[arg(long, value_name = "N", default_value_t = 16, requires = "fsdp")]
    heads: usize,
    /// With --fsdp: transformer blocks
    #[arg(long, value_name = "N", default_value_t = 8, requires = "fsdp")]
    layers: usize,
    /// With --fsdp: measured steps per run (after one warm-up step)
    #[arg(long, value_name = "N", default_value_t = 2, requires = "fsdp")]
    steps: usize,
    /// With --fsdp: no capped runs
    #[arg(long, requires = "fsdp")]
    no_cap: bool,
    /// Build in the dev profile (quick to build, not for figures)
    #[arg(long)]
    debug: bool,
}

impl BenchTrain {
    fn epochs(&self) -> usize {
        self.epochs
            .unwrap_or(if self.shard || self.overlap { 1 } else { 3 })
    }

    fn batch_size(&self) -> usize {
        let default = match (self.shard, self.fsdp, self.overlap) {
            (true, _, _) => 4,
            (_, true, _) => 2,
            (_, _, true) => 16,
            _ => 32,
        };
        self.batch_size.unwrap_or(default)
    }

    fn repeats(&self) -> usize {
        self.repeats.unwrap_or(if self.fsdp { 1 } else { 3 }).max(1)
    }

    /// The network: the transformer with --shard and --overlap.
    fn model(&self) -> Option<&str> {
        if self.shard || self.overlap {
            Some(runner::TRANSFORMER)
        } else {
            self.model.as_deref()
        }
    }
}

/// Runs `bench-train`.
pub fn bench_train(task: BenchTrain) -> Result<()> {
    let repeats = task.repeats();
    if task.fsdp {
        return fsdp::bench(&fsdp::FsdpBench {
            width: task.width,
            heads: task.heads,
            layers: task.layers,
            batch: task.batch_size(),
            steps: task.steps,
            repeats,
            cap: !task.no_cap,
            debug: task.debug,
        });
    }
    if task.link_rate.is_some() && task.hosts.is_none() && !task.overlap {
        anyhow::bail!("--link-rate needs --hosts or --overlap");
    }
    let link_rate = match task.overlap {
        true => Some(task.link_rate.as_deref().unwrap_or(OVERLAP_LINK)),
        false => task.link_rate.as_deref(),
    };
    let runner = Runner::new(Shared {
        epochs: task.epochs(),
        batch_size: task.batch_size(),
        samples: task.samples,
        model: task.model(),
        hosts: if task.overlap { Some(2) } else { task.hosts },
        link_rate,
        debug: task.debug,
    })?;
    let transformer = task.model() == Some(TRANSFORMER);
    let runs = match task.hosts {
        _ if task.overlap => overlap_runs(link_rate.unwrap_or(OVERLAP_LINK)),
        Some(hosts) => across_hosts_runs(hosts, task.nproc_per_host, task.link_rate.as_deref()),
        None if task.shard => shard_runs(),
        None if transformer => transformer_runs(),
        None => this_host_runs(),
    };
    let mut timings: Vec<Vec<Timing>> = runs.iter().map(|_| Vec::new()).collect();
    for round in 0..repeats {
        eprintln!("bench-train: round {} of {repeats}", round + 1);
        for (r, t) in runs.iter().zip(&mut timings) {
            t.push(runner.run(r)?);
        }
    }
    let model = runner.finish();
    if task.shard {
        print_shard_table((task.epochs(), task.batch_size()), repeats, &runs, &timings);
        summarise_shard(&timings);
        return Ok(());
    }
    print_table(&task, &model, repeats, &runs, &timings);
    match task.hosts {
        _ if task.overlap => summarise_overlap(&timings),
        Some(hosts) => summarise_across_hosts(&timings, hosts * task.nproc_per_host),
        None if transformer => summarise_transformer(&timings),
        None => summarise_this_host(&timings),
    }
    Ok(())
}

/// Prints the heading and one line per run: median step time and rate, bytes per step.
fn print_table(
    task: &BenchTrain,
    model: &str,
    repeats: usize,
    runs: &[TrainRun],
    timings: &[Vec<Timing>],
) {
    let (epochs, batch) = (task.epochs(), task.batch_size());
    println!(
        "bench-train: --model {model}, {epochs} epochs, batch {batch} per rank, median of \
         {repeats}"
    );
    println!(
        "{:<50} {:>10} {:>12} {:>12} {:>11}",
        "run", "ms/step", "samples/s", "bytes/step", "exposed ms"
    );
    for (r, t) in runs.iter().zip(timings) {
        let bytes = t.first().map_or(0.0, |t| t.bytes);
        let exposed = median(t.iter().map(|t| t.exposed_ms).collect());
        println!(
            "{:<50} {:>10.3} {:>12.0} {:>12.0} {:>11.3}",
            r.label,
            step(t),
            rate(t),
            bytes,
            exposed
        );
    }
}
