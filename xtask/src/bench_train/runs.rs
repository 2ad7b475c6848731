//! What `bench-train` runs and what it concludes: the kinds of quickstart run on this host and
//! across hosts, and the summaries printed under the table.

use super::run::{Timing, TrainRun, median, rate, step};

const BF16: &[&str] = &["--compression", "bf16"];
const FP16: &[&str] = &["--compression", "fp16"];

/// The runs of `bench-train` on this host.
pub(super) fn this_host_runs() -> Vec<TrainRun> {
    let w2 = "DdpLearner, world 2 (tcp)";
    vec![
        TrainRun::burn_learner(),
        TrainRun::here("DdpLearner, world 1", 1),
        TrainRun::here(w2, 2),
        TrainRun::here(format!("{w2}, no desync check"), 2).args(&["--no-desync-check"]),
        TrainRun::here(format!("{w2}, bf16 gradients"), 2).args(BF16),
        TrainRun::here(format!("{w2}, fp16 gradients"), 2).args(FP16),
        TrainRun::here(format!("{w2}, shared memory"), 2).transport("shm"),
        TrainRun::here(format!("{w2}, shm, bf16"), 2)
            .args(BF16)
            .transport("shm"),
    ]
}

/// The runs of `bench-train --model transformer`: burn's Learner and DdpLearner at world 1,
/// DdpLearner at world 2 over TCP and over shared memory.
pub(super) fn transformer_runs() -> Vec<TrainRun> {
    vec![
        TrainRun::burn_learner(),
        TrainRun::here("DdpLearner, world 1", 1),
        TrainRun::here("DdpLearner, world 2 (tcp)", 2),
        TrainRun::here("DdpLearner, world 2, shared memory", 2).transport("shm"),
    ]
}

/// The summary of [`transformer_runs`].
pub(super) fn summarise_transformer(timings: &[Vec<Timing>]) {
    let [plain, ddp1, tcp, shm] = timings else {
        unreachable!("one timing list per run")
    };
    println!(
        "overhead of DdpLearner at world 1: {:+.1}% (ratio {:.3})",
        (step(ddp1) / step(plain) - 1.0) * 100.0,
        step(ddp1) / step(plain)
    );
    for (name, t) in [("tcp", tcp), ("shared memory", shm)] {
        let exposed = median(t.iter().map(|t| t.exposed_ms).collect());
        println!(
            "world 2 ({name}): {:.3} ms per step ({:.2}x world 1's), {exposed:.3} ms of it waiting \
             for communication, {:.0} bytes sent per step",
            step(t),
            step(t) / step(ddp1),
            t[0].bytes
        );
    }
}

pub(super) fn summarise_this_host(timings: &[Vec<Timing>]) {
    let [plain, ddp1, ddp2, unchecked, bf16, _fp16, shm, _shm_bf16] = timings else {
        unreachable!("one timing list per run")
    };
    println!(
        "cost of the desync check at world 2: {:+.1}% of step time (ratio {:.3})",
        (step(ddp2) / step(unchecked) - 1.0) * 100.0,
        step(ddp2) / step(unchecked)
    );
    println!(
        "overhead of DdpLearner at world 1: {:+.1}% (ratio {:.3})",
        (step(ddp1) / step(plain) - 1.0) * 100.0,
        step(ddp1) / step(plain)
    );
    println!(
        "scaling world 2 / world 1: {:.2}x samples/s ({:.0}% efficiency)",
        rate(ddp2) / rate(ddp1),
        rate(ddp2) / rate(ddp1) / 2.0 * 100.0
    );
    println!(
        "bf16 gradients at world 2: step time ratio {:.3}, bytes per step ratio {:.3}",
        step(bf16) / step(ddp2),
        bf16[0].bytes / ddp2[0].bytes.max(1.0)
    );
    println!(
        "shared memory at world 2: step time ratio {:.3} against TCP",
        step(shm) / step(ddp2)
    );
}

/// The runs of `bench-train --hosts`: world 1, then the world of `hosts` x `per_host` ranks on
/// one host and across the hosts, each without and with bf16 gradients. Every DdpLearner run
/// uses the default transport (`auto`: shared memory within a host, TCP between hosts).
pub(super) fn across_hosts_runs(
    hosts: usize,
    per_host: usize,
    link: Option<&str>,
) -> Vec<TrainRun> {
    let world = hosts * per_host;
    let here = format!("world {world}, 1 host");
    let across = format!(
        "world {world}, {hosts} hosts x {per_host}, link {}",
        link.unwrap_or("unlimited")
    );
    let auto = |label: String, nproc| TrainRun::here(label, nproc).transport("auto");
    vec![
        auto("world 1".into(), 1),
        auto(here.clone(), world),
        auto(format!("{here}, bf16 gradients"), world).args(BF16),
        auto(across.clone(), per_host).across_hosts(),
        auto(format!("{across}, bf16 gradients"), per_host)
            .args(BF16)
            .across_hosts(),
    ]
}

pub(super) fn summarise_across_hosts(timings: &[Vec<Timing>], world: usize) {
    let [one, here, here_bf16, across, across_bf16] = timings else {
        unreachable!("one timing list per run")
    };
    let w = world as f64;
    for (what, t) in [
        ("1 host", here),
        ("1 host, bf16", here_bf16),
        ("across hosts", across),
        ("across hosts, bf16", across_bf16),
    ] {
        println!(
            "scaling world {world} / world 1, {what}: {:.2}x samples/s ({:.0}% efficiency)",
            rate(t) / rate(one),
            rate(t) / rate(one) / w * 100.0
        );
    }
    let cost = step(across) - step(here);
    println!(
        "the slow link costs {cost:+.1} ms per step ({:.2}x the step time on 1 host)",
        step(across) / step(here)
    );
    let saved = step(across) - step(across_bf16);
    let recovered = if cost > 0.0 {
        format!(", {:.0}% of what the link costs", saved / cost * 100.0)
    } else {
        String::new()
    };
    println!(
        "bf16 gradients across hosts: {saved:+.1} ms per step saved (step time ratio {:.3}, \
         bytes per step ratio {:.3}){recovered}",
        step(across_bf16) / step(across),
        across_bf16[0].bytes / across[0].bytes.max(1.0)
    );
}

/// The link of `bench-train --overlap` unless `--link-rate` says otherwise.
pub(super) const OVERLAP_LINK: &str = "1gbit";

/// The transformer of `bench-train --overlap`: 8 blocks of width 256 (6.4 M parameters), on
/// the text's first 512 sequences.
const OVERLAP_LM: &[&str] = &[
    "--d-model",
    "256",
    "--layers",
    "8",
    "--max-sequences",
    "512",
];

/// The runs of `bench-train --overlap`: world 2 across 2 hosts on `link`, the gradients
/// reduced after backward, then each block's all-reduce started inside backward.
pub(super) fn overlap_runs(link: &str) -> Vec<TrainRun> {
    let across = format!("world 2, 2 hosts, link {link}");
    let run = |label: String| {
        (TrainRun::here(label, 1).args(OVERLAP_LM))
            .transport("auto")
            .across_hosts()
            .pinned()
    };
    vec![
        run(format!("{across}, reduced after backward")),
        run(format!("{across}, --fsdp none")).args(&["--fsdp", "none"]),
    ]
}

/// The summary of [`overlap_runs`]: the communication a step waits for, inside backward
/// against after it (target: at most 0.3).
pub(super) fn summarise_overlap(timings: &[Vec<Timing>]) {
    let [after, inside] = timings else {
        unreachable!("one timing list per run")
    };
    let exposed = |t: &[Timing]| median(t.iter().map(|t| t.exposed_ms).collect());
    let ratio = exposed(inside) / exposed(after).max(f64::MIN_POSITIVE);
    let met = if ratio <= 0.3 { "met" } else { "NOT met" };
    println!(
        "overlap: each block's all-reduce started inside backward (--fsdp none) leaves {:.1} ms \
         per step exposed against {:.1} ms reduced after backward: {ratio:.3} (target <= 0.3: \
         {met}); step time {:.1} against {:.1} ms ({:.3})",
        exposed(inside),
        exposed(after),
        step(inside),
        step(after),
        step(inside) / step(after)
    );
}

/// The transformer of `bench-train --shard`: 26 blocks of width 256 (20.6 M parameters), on
/// the text's first 64 sequences.
const LM: &[&str] = &[
    "--d-model",
    "256",
    "--heads",
    "8",
    "--layers",
    "26",
    "--max-sequences",
    "64",
];

/// The runs of `bench-train --shard`: world 1, then worlds 2 and 4 unsharded, with the
/// optimizer state sharded, and with the gradients too (shared memory).
pub(super) fn shard_runs() -> Vec<TrainRun> {
    let lm = |label: String, world| TrainRun::here(label, world).args(LM).transport("auto");
    let mut runs = vec![lm("world 1".into(), 1)];
    for world in [2, 4] {
        for (what, stage) in [
            ("unsharded", None),
            ("sharded: optimizer", Some("optimizer")),
            ("sharded: optimizer and gradients", Some("gradients")),
        ] {
            let run = lm(format!("world {world}, {what}"), world);
            runs.push(match stage {
                Some(stage) => run.args(&["--shard", stage]),
                None => run,
            });
        }
    }
    runs
}

/// The largest of the ranks' figures `pick` chooses (median over the repeats), in MB.
fn largest(t: &[Timing], pick: impl Fn(&(f64, f64)) -> f64) -> f64 {
    median(
        t.iter()
            .map(|t| t.ranks.iter().map(&pick).fold(0.0, f64::max))
            .collect(),
    ) / 1e6
}

/// Prints the table of [`shard_runs`]: per run the step time, the largest optimizer state and
/// peak resident memory of its ranks, and the bytes each rank sends per step.
pub(super) fn print_shard_table(
    (epochs, batch): (usize, usize),
    repeats: usize,
    runs: &[TrainRun],
    timings: &[Vec<Timing>],
) {
    println!(
        "bench-train --shard: transformer of 20.6 M parameters (26 x 256), AdamW, {} epoch(s) of \
         64 sequences, batch {} per rank, shared memory, median of {repeats}",
        epochs, batch
    );
    println!(
        "{:<42} {:>9} {:>17} {:>15} {:>13}",
        "run", "ms/step", "opt. state/rank", "peak RSS/rank", "sent/step"
    );
    for (r, t) in runs.iter().zip(timings) {
        println!(
            "{:<42} {:>9.1} {:>14.1} MB {:>12.1} MB {:>10.1} MB",
            r.label,
            step(t),
            largest(t, |(state, _)| *state),
            largest(t, |(_, rss)| *rss),
            t[0].sent / 1e6
        );
    }
}

/// The summary of [`shard_runs`]: against the unsharded run of each world, the optimizer state
/// per rank (target: at most 1/N of it + 1 %), the step time (target at world 2: within 10 %)
/// and the bytes sent (target: no more).
pub(super) fn summarise_shard(timings: &[Vec<Timing>]) {
    for (i, world) in [2usize, 4].into_iter().enumerate() {
        let base = &timings[1 + 3 * i];
        let whole = largest(base, |(state, _)| *state);
        for (stage, t) in [
            ("optimizer", &timings[2 + 3 * i]),
            ("optimizer and gradients", &timings[3 + 3 * i]),
        ] {
            let state = largest(t, |(state, _)| *state);
            println!(
                "world {world}, sharded ({stage}): optimizer state per rank {:.4} of unsharded \
                 (target <= {:.4}), step time ratio {:.3}, bytes sent per step ratio {:.3}, peak \
                 RSS per rank ratio {:.3}",
                state / whole,
                1.0 / world as f64 + 0.01,
                step(t) / step(base),
                t[0].sent / base[0].sent.max(1.0),
                largest(t, |(_, rss)| *rss) / largest(base, |(_, rss)| *rss)
            );
        }
    }
}
