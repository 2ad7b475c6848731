//! The table of `bench-train --fsdp` and what it concludes: per run the largest rank's
//! parameters, gradients and optimizer state and its peak resident memory, rank 0's step time
//! and bytes sent per step, each against DDP's at the same world; then the targets (FSDP full's
//! state at most `1/N` of DDP's + 2 %, its peak at world 4 at most 0.45 of DDP's), whether burn
//! dropped the gathered parameters between forward and backward, and the capped runs.

use super::figures::{Measured, Outcome};
use super::{FsdpBench, Mode, Row};

const MB: f64 = 1e6;

/// Prints the heading, the legend, one line per run and the summary. `capping`: how the
/// capped runs were capped, or why they were skipped.
pub(super) fn print(b: &FsdpBench, seq_len: usize, rows: &[Row], capping: Result<String, String>) {
    let ddp_params = find(rows, rows[0].world, Mode::Ddp).map_or(0.0, |m| m.state()[0] / 4.0);
    let profile = if b.debug { "debug" } else { "release" };
    let repeats = match b.repeats {
        1 => String::new(),
        n => format!(", median of {n}"),
    };
    println!(
        "bench-train --fsdp: transformer of {:.1} M parameters ({} blocks of width {}, {} heads), \
         AdamW, batch {} x {seq_len} characters per rank, 1 warm-up + {} measured step(s), \
         shared memory, {profile} build{repeats}",
        ddp_params / MB,
        b.layers,
        b.width,
        b.heads,
        b.batch,
        b.steps
    );
    println!(
        "state/rank: parameter elements stored + gradient elements held after the reduction \
         (x 4 bytes) + the optimizer record's tensors (AdamW's moments), of the rank holding \
         the most; peak RSS: VmHWM at the end of the rank, the largest rank; ms/step: rank 0; \
         sent/step: bytes a rank sends on a ring (DDP, ZeRO-2: GradientReducer::sent_per_step; \
         FSDP: fsdp::stats gathered + reduced elements x 4 x (N-1)/N); xDDP: against DDP at \
         the same world"
    );
    println!(
        "{:<40} {:>8} {:>8} {:>8} {:>10} {:>6} {:>10} {:>6} {:>9} {:>6} {:>10} {:>6} {:>8}",
        "run",
        "params",
        "grads",
        "optim",
        "state/rank",
        "xDDP",
        "peak RSS",
        "xDDP",
        "ms/step",
        "xDDP",
        "sent/step",
        "xDDP",
        "gathers"
    );
    for r in rows {
        let mut label = format!("world {}, {}", r.world, r.mode.label());
        if let Some(cap) = r.capped {
            label = format!("{label}, capped {} MiB", cap >> 20);
        }
        let base = find(rows, r.world, Mode::Ddp);
        match &r.outcome {
            Outcome::Ran(m) => print_row(&label, m, base),
            Outcome::Failed { reason, oom_kills } => println!(
                "{label:<40} FAILED: {reason} ({oom_kills} OOM kill(s) in the ranks' cgroups)"
            ),
        }
    }
    for world in super::WORLDS {
        summarise_world(rows, world);
    }
    summarise_checkpointing(rows);
    summarise_prefetch(rows);
    match capping {
        Ok(how) => summarise_capped(rows, &how),
        Err(why) => println!("capped runs skipped: {why}"),
    }
}

/// The uncapped run of `mode` at `world`, if it finished.
fn find(rows: &[Row], world: usize, mode: Mode) -> Option<&Measured> {
    rows.iter()
        .find(|r| r.world == world && r.mode == mode && r.capped.is_none())
        .and_then(|r| r.outcome.measured())
}

fn ratio(x: f64, base: f64) -> f64 {
    if base > 0.0 { x / base } else { f64::NAN }
}

fn print_row(label: &str, m: &Measured, base: Option<&Measured>) {
    let [p, g, o] = m.state();
    let state = p + g + o;
    let (base_state, base_peak, base_ms, base_sent) = base.map_or((0.0, 0.0, 0.0, 0.0), |d| {
        let [p, g, o] = d.state();
        (
            p + g + o,
            d.peak_rss() as f64,
            d.ms_per_step(),
            d.sent_per_step(),
        )
    });
    let peak = m.peak_rss() as f64;
    println!(
        "{label:<40} {:>8.1} {:>8.1} {:>8.1} {:>7.1} MB {:>6.3} {:>7.1} MB {:>6.3} {:>9.1} {:>6.2} \
         {:>7.1} MB {:>6.2} {:>8.1}",
        p / MB,
        g / MB,
        o / MB,
        state / MB,
        ratio(state, base_state),
        peak / MB,
        ratio(peak, base_peak),
        m.ms_per_step(),
        ratio(m.ms_per_step(), base_ms),
        m.sent_per_step() / MB,
        ratio(m.sent_per_step(), base_sent),
        m.gathers_per_step()
    );
}

/// FSDP full against DDP at `world`: its state per rank (target: at most `1/N` + 2 %), its
/// peak (target at world 4: at most 0.45), step time and bytes sent.
fn summarise_world(rows: &[Row], world: usize) {
    let (Some(ddp), Some(full)) = (find(rows, world, Mode::Ddp), find(rows, world, Mode::Full))
    else {
        return;
    };
    let total = |m: &Measured| m.state().iter().sum::<f64>();
    let state = ratio(total(full), total(ddp));
    let target = 1.0 / world as f64 + 0.02;
    let peak = ratio(full.peak_rss() as f64, ddp.peak_rss() as f64);
    let met = |ok: bool| if ok { "met" } else { "NOT met" };
    let peak_target = match world {
        4 => format!(" (target <= 0.45): {}", met(peak <= 0.45)),
        _ => String::new(),
    };
    println!(
        "world {world}: FSDP full holds {state:.4} of DDP's per-rank state (target <= \
         {target:.4}): {}; peak RSS {peak:.3} of DDP's{peak_target}; step time {:.2}x DDP's; \
         sent per step {:.2}x DDP's ({:.1} MB handed to its collectives per step, fsdp::stats \
         elements x 4)",
        met(state <= target),
        ratio(full.ms_per_step(), ddp.ms_per_step()),
        ratio(full.sent_per_step(), ddp.sent_per_step()),
        full.coll_bytes_per_step() / MB
    );
}

/// Whether burn dropped FSDP full's gathered parameters after forward (gradient
/// checkpointing) and gathered them again in backward: its gathers per step against grad-op's.
fn summarise_checkpointing(rows: &[Row]) {
    let world = super::WORLDS[super::WORLDS.len() - 1];
    let (Some(op), Some(full)) = (
        find(rows, world, Mode::GradOp),
        find(rows, world, Mode::Full),
    ) else {
        return;
    };
    let (g_op, g_full) = (op.gathers_per_step(), full.gathers_per_step());
    let what = if g_full > g_op {
        format!(
            "burn dropped the gathered parameters of {:.0} block(s) after forward and gathered \
             them again in backward",
            g_full - g_op
        )
    } else {
        "burn kept every gathered block from forward to backward (no gather in backward)".into()
    };
    let (p_full, p_op) = (full.peak_rss() as f64, op.peak_rss() as f64);
    // Within 5 %: dropping them saved nothing at the peak.
    let saved = match p_full < 0.95 * p_op {
        true => "lower",
        false => "no lower (shardlm --memory-trace says in which phase of a step the peak falls)",
    };
    println!(
        "gradient checkpointing (FSDP full, world {world}): {g_full:.0} gathers per step against \
         grad-op's {g_op:.0}: {what}; peak RSS {:.1} MB against grad-op's {:.1} MB, {saved}",
        p_full / MB,
        p_op / MB
    );
}

/// What backward prefetch changes in FSDP full at each world: step time and peak against the
/// run without it.
fn summarise_prefetch(rows: &[Row]) {
    for world in super::WORLDS {
        let (Some(on), Some(off)) = (
            find(rows, world, Mode::Full),
            find(rows, world, Mode::FullNoPrefetch),
        ) else {
            continue;
        };
        println!(
            "backward prefetch (FSDP full, world {world}): {:.1} ms per step against {:.1} \
             without ({:.2}x); exposed communication {:.1} against {:.1} ms per step; peak RSS \
             {:.1} MB against {:.1} MB",
            on.ms_per_step(),
            off.ms_per_step(),
            ratio(on.ms_per_step(), off.ms_per_step()),
            on.exposed_ms_per_step(),
            off.exposed_ms_per_step(),
            on.peak_rss() as f64 / MB,
            off.peak_rss() as f64 / MB
        );
    }
}

/// The capped runs' outcomes, in one line.
fn summarise_capped(rows: &[Row], how: &str) {
    let capped: Vec<&Row> = rows.iter().filter(|r| r.capped.is_some()).collect();
    let Some(cap) = capped.first().and_then(|r| r.capped) else {
        return;
    };
    let outcomes: Vec<String> = (capped.iter())
        .map(|r| {
            let what = match &r.outcome {
                Outcome::Ran(m) => format!(
                    "trained and finished (peak RSS {:.1} MB)",
                    m.peak_rss() as f64 / MB
                ),
                Outcome::Failed { oom_kills, .. } if *oom_kills > 0 => {
                    format!("was OOM-killed ({oom_kills} kill(s))")
                }
                Outcome::Failed { .. } => "failed (no OOM kill counted)".into(),
            };
            format!("{} {what}", r.mode.label())
        })
        .collect();
    println!(
        "capped at {} MiB ({how}), world {}: {}",
        cap >> 20,
        capped[0].world,
        outcomes.join("; ")
    );
}
