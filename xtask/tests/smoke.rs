//! Smoke test of every program in the workspace: each binary and example answers `--help` with
//! its flags and suggests the right flag for a misspelled one; each one that forms a group runs
//! to the end under the launcher (`burn-ddp-run`, that is `burn_ddp::launch`) with tiny sizes;
//! each xtask task that starts ranks runs (`multi-cpu`, `bench-collectives --debug`,
//! `bench-train --debug`). `soak` is left out: it runs `cargo test` itself, which builds the
//! integration tests of burn-ddp a second time and runs for minutes.
//!
//! The programs are built once per run, in the dev profile and this test's target directory,
//! by the `cargo build` the xtask tasks run themselves (`--workspace --bins --examples`: the
//! feature unification of `cargo test --workspace`, so after that command nothing new is
//! compiled but the binaries cargo test does not link), with burn-ddp's `wgpu` feature when this
//! build has it (the test command `cargo test --workspace --features burn-ddp/wgpu`), so that
//! burn is not built a second time. A separate test binary, so that cargo runs it after, not
//! beside, the timing-sensitive integration tests of burn-ddp.

#[path = "smoke/harness.rs"]
mod harness;

use std::process::Command;

use harness::{Scratch, program, programs, run, tiny_training, xtask};

/// The launcher's flags (burn-ddp-run, xtask multi-cpu and multi-gpu).
const LAUNCHER_FLAGS: [&str; 10] = [
    "--nproc-per-node",
    "--nproc",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--max-restarts",
    "--log-dir",
    "--tee",
    "--local-ranks-filter",
];
/// The quickstart's flags (quickstart, digits).
const QUICKSTART_FLAGS: [&str; 20] = [
    "--model",
    "--buffer-sync",
    "--compression",
    "--profile",
    "--epochs",
    "--batch-size",
    "--lr",
    "--seed",
    "--device",
    "--save-model",
    "--params-out",
    "--samples",
    "--digits",
    "--artifacts",
    "--plain",
    "--quiet",
    "--report",
    "--checkpoint-dir",
    "--checkpoint-every",
    "--no-desync-check",
];

/// `--help` of every program and xtask task lists its flags.
#[test]
fn every_program_lists_its_flags() {
    let help = |mut cmd: Command| {
        cmd.arg("--help");
        run(cmd)
    };
    help(program("burn-ddp-run")).succeeds_printing(&LAUNCHER_FLAGS);
    help(program("quickstart")).succeeds_printing(&QUICKSTART_FLAGS);
    help(program("digits"))
        .succeeds_printing(&[&QUICKSTART_FLAGS[..], &["[default: 30]"]].concat());
    help(program("hello_ddp")).succeeds_printing(&["Usage: hello_ddp"]);
    help(program("charlm")).succeeds_printing(&["--seq-len", "--dropout", "--warmup", "--plain"]);
    help(program("bench_collectives")).succeeds_printing(&[
        "--sizes",
        "--chunk",
        "--spin-us",
        "--op",
        "--dtype",
    ]);
    help(program("bench_reducer")).succeeds_printing(&["STEPS_PER_BLOCK", "BLOCKS"]);
    let tasks = [
        "multi-cpu",
        "multi-gpu",
        "bench-collectives",
        "bench-train",
        "gpu-bundle",
        "soak",
    ];
    run(xtask(&["--help"])).succeeds_printing(&tasks);
    for task in ["multi-cpu", "multi-gpu"] {
        let mut flags = LAUNCHER_FLAGS.to_vec();
        flags.extend(["--example", "--release", "-- <ARGS>"]);
        run(xtask(&[task, "--help"])).succeeds_printing(&flags);
    }
    let bench = [
        "--world",
        "--sizes",
        "--chunk",
        "--spin-us",
        "--op",
        "--dtype",
        "--hosts",
        "--link-rate",
        "--debug",
    ];
    run(xtask(&["bench-collectives", "--help"])).succeeds_printing(&bench);
    let train = [
        "--epochs",
        "--repeats",
        "--batch-size",
        "--samples",
        "--hosts",
        "--nproc-per-host",
        "--link-rate",
        "--debug",
    ];
    run(xtask(&["bench-train", "--help"])).succeeds_printing(&train);
    run(xtask(&["gpu-bundle", "--help"])).succeeds_printing(&["--out"]);
    run(xtask(&["soak", "--help"])).succeeds_printing(&["--iters"]);
}

/// A misspelled flag or a value out of range: clap's usage error, with the right flag named.
#[test]
fn every_program_suggests_the_right_flag() {
    let tip = |flag: &str| format!("tip: a similar argument exists: '{flag}'");
    let mut cmd = program("quickstart");
    cmd.args(["--epoch", "2"]);
    run(cmd).refuses_with(&tip("--epochs"));
    let mut cmd = program("digits");
    cmd.args(["--batchsize", "2"]);
    run(cmd).refuses_with(&tip("--batch-size"));
    let mut cmd = program("charlm");
    cmd.args(["--dropout", "1.5"]);
    run(cmd).refuses_with("a probability in [0, 1)");
    let mut cmd = program("burn-ddp-run");
    cmd.args(["--nprc", "2", "./train"]);
    run(cmd).refuses_with(&tip("--nproc"));
    let mut cmd = program("bench_collectives");
    cmd.args(["--size", "4K"]);
    run(cmd).refuses_with(&tip("--sizes"));
    let mut cmd = program("hello_ddp");
    cmd.arg("--bogus");
    run(cmd).refuses_with("unexpected argument '--bogus'");
    let mut cmd = program("bench_reducer");
    cmd.arg("many");
    run(cmd).refuses_with("invalid value 'many'");
    run(xtask(&["multi-cpu", "--nprc", "2"])).refuses_with(&tip("--nproc"));
    run(xtask(&["bench-train", "--epoch", "1"])).refuses_with(&tip("--epochs"));
    run(xtask(&["multi-cpux"])).refuses_with("similar subcommands exist: 'multi-gpu', 'multi-cpu'");
}

/// `burn-ddp-run --nproc 2 PROGRAM ARGS`.
fn launched(name: &str, args: &[String]) -> Command {
    let mut cmd = program("burn-ddp-run");
    cmd.args(["--nproc", "2"]).arg(&programs()[name]).args(args);
    cmd
}

#[test]
fn every_example_runs_under_the_launcher() {
    let ran = run(launched("hello_ddp", &[]));
    ran.succeeds_printing(&["rank 0 of 2: sum of ranks 1 over 2 ranks", "rank 1 of 2"]);

    let artifacts = Scratch::new("quickstart");
    let params = artifacts.0.join("params.f32");
    let mut args = tiny_training(&artifacts);
    // With SyncBatchNorm: the digest covers its running statistics, which must agree too.
    args.extend(["--params-out".into(), params.display().to_string()]);
    args.extend(["--model".into(), "mlp-syncbn".into()]);
    let ran = run(launched("quickstart", &args));
    ran.succeeds_printing(&["2 rank(s), 1 epochs, batch 16 per rank: validation accuracy"]);
    let digests = ran.digests();
    assert_eq!(digests.len(), 2, "{}", ran.describe());
    assert_eq!(
        digests[0],
        digests[1],
        "the ranks ended different: {}",
        ran.describe()
    );
    // --params-out holds exactly the parameters the digest is taken of (FNV-1a of their bytes).
    let written = std::fs::read(&params).expect("--params-out file");
    let fnv = written.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    });
    assert_eq!(format!("{fnv:016x}"), digests[0], "{}", ran.describe());

    let artifacts = Scratch::new("digits");
    let args = ["--epochs", "1", "--quiet", "--artifacts", &artifacts.arg()].map(String::from);
    let ran = run(launched("digits", &args));
    ran.succeeds_printing(&["2 rank(s), 1 epochs, batch 32 per rank: validation accuracy"]);
    assert_eq!(ran.digests().len(), 2, "{}", ran.describe());

    // The transformer, a few steps: the replicas end identical.
    let args = [
        "--epochs",
        "1",
        "--quiet",
        "--max-sequences",
        "32",
        "--batch-size",
        "8",
    ];
    let ran = run(launched("charlm", &args.map(String::from)));
    ran.succeeds_printing(&["2 rank(s), 1 epochs, batch 8 per rank"]);
    let digests = ran.digests();
    assert_eq!(digests.len(), 2, "{}", ran.describe());
    assert_eq!(digests[0], digests[1], "{}", ran.describe());

    let args = ["--sizes", "4K,64K"].map(String::from);
    let ran = run(launched("bench_collectives", &args));
    ran.succeeds_printing(&["world 2", "busbw(GB/s)", "4 KiB", "64 KiB"]);
    let args = ["--sizes", "64K", "--dtype", "bf16"].map(String::from);
    let ran = run(launched("bench_collectives", &args));
    ran.succeeds_printing(&["world 2, bf16", "64 KiB"]);

    // Two ranks as threads of one process: it starts no ranks, so it runs alone.
    let mut cmd = program("bench_reducer");
    cmd.args(["2", "1"]);
    run(cmd).succeeds_printing(&["cost of the desync check", "cost of the non-finite check"]);
}

#[test]
fn xtask_tasks_that_start_ranks_run() {
    let ran = run(xtask(&[
        "multi-cpu",
        "--nproc",
        "2",
        "--example",
        "hello_ddp",
    ]));
    ran.succeeds_printing(&["rank 1 of 2: sum of ranks 1 over 2 ranks"]);

    let mut args = vec!["multi-cpu", "--nproc", "2", "--example", "quickstart", "--"];
    let artifacts = Scratch::new("xtask-quickstart");
    let training = tiny_training(&artifacts);
    args.extend(training.iter().map(String::as_str));
    let ran = run(xtask(&args));
    ran.succeeds_printing(&["validation accuracy"]);
    assert_eq!(ran.digests().len(), 2, "{}", ran.describe());

    let args = [
        "bench-collectives",
        "--debug",
        "--world",
        "2",
        "--sizes",
        "4K,1M",
    ];
    run(xtask(&args)).succeeds_printing(&["busbw(GB/s)", "4 KiB", "1 MiB"]);

    let args = [
        "bench-train",
        "--debug",
        "--epochs",
        "1",
        "--repeats",
        "1",
        "--samples",
        "64",
    ];
    run(xtask(&args)).succeeds_printing(&["ms/step", "DdpLearner, world 2", "scaling world 2"]);

    // Without GPUs multi-gpu stops before building anything, and says what to use instead.
    let mut cmd = xtask(&["multi-gpu", "--example", "hello_ddp"]);
    cmd.env("CUDA_VISIBLE_DEVICES", "");
    let ran = run(cmd);
    assert_eq!(ran.code, Some(1), "{}", ran.describe());
    assert!(
        ran.stderr.contains("0 GPU(s) visible"),
        "{}",
        ran.describe()
    );
    assert!(
        ran.stderr.contains("cargo xtask multi-cpu"),
        "{}",
        ran.describe()
    );
}

/// `bench-train --fsdp` with a tiny transformer: the table of DDP, ZeRO-2 and FSDP at worlds 2
/// and 4, with each rank's parameters, gradients and optimizer state counted, and FSDP full
/// holding at most `1/N` of DDP's (+ 2 %); the capped pair runs or says why it was skipped.
#[test]
fn bench_train_fsdp_prints_its_table() {
    let args = [
        "bench-train",
        "--debug",
        "--fsdp",
        "--width",
        "64",
        "--heads",
        "4",
        "--layers",
        "2",
        "--steps",
        "1",
    ];
    let ran = run(xtask(&args));
    ran.succeeds_printing(&[
        "state/rank",
        "peak RSS",
        "world 2, DDP",
        "world 2, ZeRO-2",
        "world 4, FSDP full",
        "world 4, FSDP grad-op",
        "world 2: FSDP full holds",
        "(target <= 0.5200): met",
        "(target <= 0.2700): met",
    ]);
    assert!(
        ran.stdout.contains("capped at") || ran.stdout.contains("capped runs skipped"),
        "neither the capped runs nor why they were skipped: {}",
        ran.describe()
    );
}
