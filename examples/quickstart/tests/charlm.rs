//! The transformer trained data-parallel (ranks as threads over loopback) equals one process
//! with the global batch: world 2 with batch b against world 1 with batch 2b, dropout off. And
//! its blocks wrapped in burn-ddp's `Fsdp` (`--fsdp`): the flag, runs of the program alone with
//! each strategy, the same training as the unwrapped model alone at worlds 2 and 4 over 3
//! epochs with AdamW and with SGD with momentum, and a wrapped model gathered back into the one
//! it was made from.

use std::sync::Arc;

use burn::module::Module;
use burn_ddp::ProcessGroup;
use burn_ddp::fsdp::ShardingStrategy;
use burn_ddp::store::StoreServer;
use quickstart::charlm::{CharLm, LmConfig, LmOptimizer, device, train_model};

/// The final parameters of every rank of a world of `n` training `model` with `cfg`.
fn world(n: usize, cfg: &LmConfig, model: &CharLm) -> Vec<Vec<f32>> {
    let ranks = world_counting_gathers(n, cfg, model);
    ranks.into_iter().map(|(params, _)| params).collect()
}

/// ||a - b|| / ||b||.
fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (diff / norm).sqrt()
}

#[test]
fn world_2_with_batch_b_equals_world_1_with_batch_2b_without_dropout() {
    let base = LmConfig {
        epochs: 2,
        seq_len: 16,
        d_model: 32,
        layers: 1,
        dropout: 0.0,
        warmup: 4,
        quiet: true,
        max_sequences: Some(96),
        ..LmConfig::default()
    };
    let dir =
        |name: &str| std::env::temp_dir().join(format!("charlm-{name}-{}", std::process::id()));
    let device = device();
    device.seed(base.seed);
    let model = CharLm::init(&device, &base).materialize();
    let pair = LmConfig {
        batch_size: 4,
        artifacts: dir("pair"),
        ..base.clone()
    };
    let alone = LmConfig {
        batch_size: 8,
        artifacts: dir("alone"),
        ..base
    };
    let two = world(2, &pair, &model);
    let one = world(1, &alone, &model);
    assert_eq!(two[0], two[1], "the replicas differ");
    let initial = burn_ddp::train::parameters_to_vector(&model);
    assert!(
        relative_error(&one[0], &initial) > 1e-3,
        "training did not move the parameters"
    );
    let error = relative_error(&two[0], &one[0]);
    eprintln!("world 2 x 4 against world 1 x 8: relative error {error:.2e}");
    assert!(error <= 1e-5, "relative error {error:.2e}");
    for d in [dir("pair"), dir("alone")] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A scratch directory of this process, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("charlm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How `charlm ARGS` ended: its exit code (`None` when a signal ended it), stdout and stderr.
struct Ended {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (code, out, err) = (self.code, &self.stdout, &self.stderr);
        write!(f, "exit code {code:?}\n--- stdout\n{out}--- stderr\n{err}")
    }
}

/// Runs the `charlm` program alone (a world of one: no launcher's variables), with its files
/// in `scratch` (burn-train's artifacts go to the temporary directory), killed after 120 s.
fn charlm(scratch: &Scratch, args: &[&str]) -> Ended {
    use std::process::{Command, Stdio};
    let (out, err) = (scratch.0.join("stdout"), scratch.0.join("stderr"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_charlm"));
    cmd.args(args)
        .env("TMPDIR", &scratch.0)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap());
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
    ] {
        cmd.env_remove(var);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("charlm {args:?} ran past 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Ended {
        code: status.code(),
        stdout: std::fs::read_to_string(out).unwrap(),
        stderr: std::fs::read_to_string(err).unwrap(),
    }
}

#[test]
fn the_fsdp_flag_takes_full_grad_op_or_none_and_refuses_anything_else() {
    let scratch = Scratch::new("flag");
    let refused = charlm(&scratch, &["--fsdp", "zero3"]);
    assert_eq!(refused.code, Some(2), "{refused}");
    for said in [
        "invalid value 'zero3' for '--fsdp <STRATEGY>'",
        "[possible values: full, grad-op, none]",
    ] {
        assert!(refused.stderr.contains(said), "{said:?} missing: {refused}");
    }
    let refused = charlm(&scratch, &["--fsdp", "none", "--plain"]);
    assert_eq!(refused.code, Some(2), "{refused}");
    assert!(refused.stderr.contains("cannot be used with"), "{refused}");

    // A few steps alone with each strategy: two blocks wrapped, training ends.
    for strategy in ["full", "grad-op", "none"] {
        let args = [
            "--fsdp",
            strategy,
            "--epochs",
            "1",
            "--quiet",
            "--max-sequences",
            "16",
            "--batch-size",
            "8",
            "--seq-len",
            "16",
            "--d-model",
            "32",
            "--heads",
            "2",
        ];
        let ran = charlm(&scratch, &args);
        assert_eq!(ran.code, Some(0), "{ran}");
        for said in [
            &format!("rank 0: fsdp {strategy}: 2 blocks wrapped"),
            "1 rank(s), 1 epochs, batch 8 per rank: validation accuracy",
            "parameters digest",
        ] {
            assert!(ran.stdout.contains(said), "{said:?} missing: {ran}");
        }
    }
}

/// The small transformer of the fsdp tests: two blocks (so that one block's gather is
/// prefetched while the other computes), dropout off, and clipping out of reach (burn clips each
/// parameter tensor's gradient on its own, and a wrapped block is one tensor to the optimizer).
fn two_blocks(name: &str, fsdp: Option<ShardingStrategy>) -> LmConfig {
    LmConfig {
        epochs: 1,
        batch_size: 8,
        seq_len: 16,
        d_model: 32,
        heads: 2,
        layers: 2,
        dropout: 0.0,
        warmup: 4,
        clip: 1e9,
        quiet: true,
        max_sequences: Some(48),
        fsdp,
        artifacts: std::env::temp_dir().join(format!("charlm-{name}-{}", std::process::id())),
        ..LmConfig::default()
    }
}

#[test]
fn world_1_with_each_fsdp_strategy_ends_where_the_unwrapped_model_does() {
    let unwrapped = two_blocks("unwrapped", None);
    let device = device();
    device.seed(unwrapped.seed);
    let model = CharLm::init(&device, &unwrapped).materialize();
    let reference = world(1, &unwrapped, &model).remove(0);
    let initial = burn_ddp::train::parameters_to_vector(&model);
    assert!(
        relative_error(&reference, &initial) > 1e-3,
        "training did not move the parameters"
    );
    for strategy in EVERY_STRATEGY {
        let cfg = two_blocks(strategy.name(), Some(strategy));
        let trained = world(1, &cfg, &model).remove(0);
        assert_eq!(
            trained.len(),
            reference.len(),
            "{strategy:?}: not the whole model"
        );
        let error = relative_error(&trained, &reference);
        eprintln!(
            "fsdp {} against unwrapped, alone: relative error {error:.2e}",
            strategy.name()
        );
        assert!(error <= 1e-6, "{strategy:?}: relative error {error:.2e}");
        let _ = std::fs::remove_dir_all(&cfg.artifacts);
    }
    let _ = std::fs::remove_dir_all(&unwrapped.artifacts);
}

#[test]
fn a_wrapped_model_gathers_back_into_the_model_it_was_made_from_on_every_rank() {
    let cfg = two_blocks("gather", None);
    let device = device();
    device.seed(cfg.seed);
    let model = CharLm::init(&device, &cfg).materialize();
    let original = burn_ddp::train::parameters_to_vector(&model);
    for strategy in EVERY_STRATEGY {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().port();
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let model = model.clone();
                    s.spawn(move || {
                        let group = ProcessGroup::builder(rank, 2)
                            .master_addr("127.0.0.1")
                            .master_port(port)
                            .host_store(false)
                            .build()
                            .unwrap();
                        let group = Arc::new(group);
                        let sharded = model.shard(strategy, &group).unwrap();
                        assert_eq!(sharded.sharding(), Some(strategy));
                        let held = burn_ddp::train::parameters_to_vector(&sharded).len();
                        let twice = sharded.clone().shard(strategy, &group).unwrap_err();
                        assert!(
                            format!("{twice:#}").contains("already wrapped"),
                            "{twice:#}"
                        );
                        let back = sharded.gathered().unwrap();
                        assert_eq!(back.sharding(), None);
                        (held, burn_ddp::train::parameters_to_vector(&back))
                    })
                })
                .collect();
            for (rank, r) in ranks.into_iter().enumerate() {
                let (held, back) = r.join().unwrap();
                assert_eq!(
                    back, original,
                    "{strategy:?}, rank {rank}: gathered differs"
                );
                match strategy {
                    ShardingStrategy::NoShard => assert_eq!(held, original.len()),
                    _ => assert!(
                        held < original.len(),
                        "{strategy:?}: rank {rank} holds {held}"
                    ),
                }
            }
        });
    }
}

/// Trains `model` with `cfg` on each rank of a world of `n`: every rank's final parameters and
/// the gathers its wrapped blocks started (`burn_ddp::fsdp::stats`, on the rank's thread).
fn world_counting_gathers(n: usize, cfg: &LmConfig, model: &CharLm) -> Vec<(Vec<f32>, u64)> {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..n)
            .map(|rank| {
                s.spawn(move || {
                    let group = ProcessGroup::builder(rank, n)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .host_store(false)
                        .build()
                        .unwrap();
                    let before = burn_ddp::fsdp::stats();
                    let report = train_model(Arc::new(group), cfg, model.clone()).unwrap();
                    (report.params, (burn_ddp::fsdp::stats() - before).gathers)
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
}

/// [`two_blocks`] at world `n` (8 sequences a step in all, as world 1) for `epochs` epochs.
fn ranks_of(n: usize, epochs: usize, name: &str, fsdp: Option<ShardingStrategy>) -> LmConfig {
    LmConfig {
        batch_size: 8 / n,
        epochs,
        ..two_blocks(name, fsdp)
    }
}

/// Every sharding strategy, in the order the tests train them.
const EVERY_STRATEGY: [ShardingStrategy; 3] = [
    ShardingStrategy::FullShard,
    ShardingStrategy::ShardGradOp,
    ShardingStrategy::NoShard,
];

/// Optimizer steps of an epoch of [`ranks_of`]: 48 sequences, 8 a step.
const STEPS_PER_EPOCH: u64 = 6;

/// Trains the unwrapped model and then each of `strategies` at world `n` for `epochs` epochs;
/// checks that every rank of every strategy ends within 1e-6 of the unwrapped model and that
/// the replicas agree, and returns rank 0's gathers per strategy.
fn against_unwrapped(
    n: usize,
    epochs: usize,
    name: &str,
    strategies: &[ShardingStrategy],
) -> Vec<u64> {
    against_unwrapped_with(n, epochs, name, strategies, LmOptimizer::AdamW)
}

/// [`against_unwrapped`] with `optimizer`.
fn against_unwrapped_with(
    n: usize,
    epochs: usize,
    name: &str,
    strategies: &[ShardingStrategy],
    optimizer: LmOptimizer,
) -> Vec<u64> {
    let unwrapped = LmConfig {
        optimizer,
        ..ranks_of(n, epochs, &format!("{name}-unwrapped"), None)
    };
    let device = device();
    device.seed(unwrapped.seed);
    let model = CharLm::init(&device, &unwrapped).materialize();
    let reference = world(n, &unwrapped, &model).remove(0);
    let _ = std::fs::remove_dir_all(&unwrapped.artifacts);
    let moved = relative_error(&reference, &burn_ddp::train::parameters_to_vector(&model));
    eprintln!("{optimizer:?}: training moved the parameters by {moved:.2e} (relative)");
    assert!(
        moved > 1e-3,
        "{optimizer:?}: training did not move the parameters ({moved:.2e})"
    );
    let mut gathers = Vec::new();
    for &strategy in strategies {
        let cfg = LmConfig {
            optimizer,
            ..ranks_of(
                n,
                epochs,
                &format!("{name}-{}", strategy.name()),
                Some(strategy),
            )
        };
        let ranks = world_counting_gathers(n, &cfg, &model);
        let _ = std::fs::remove_dir_all(&cfg.artifacts);
        for (rank, (params, _)) in ranks.iter().enumerate() {
            let error = relative_error(params, &reference);
            eprintln!(
                "world {n}, {epochs} epoch(s), {optimizer:?}, fsdp {} against unwrapped, rank \
                 {rank}: relative error {error:.2e}",
                strategy.name()
            );
            assert!(
                error <= 1e-6,
                "{strategy:?}, rank {rank}: relative error {error:.2e}"
            );
            assert_eq!(
                params, &ranks[0].0,
                "{strategy:?}: rank {rank}'s replica differs"
            );
        }
        gathers.push(ranks[0].1);
    }
    gathers
}

#[test]
fn world_2_with_each_strategy_ends_where_the_unwrapped_model_does_after_3_epochs() {
    let gathers = against_unwrapped(2, 3, "w2", &EVERY_STRATEGY);
    // Validation gathers too (the same batches under every strategy): grad-op's training
    // gathers are 2 blocks a step. `full` trains under gradient checkpointing: burn drops each
    // gathered block after the forward pass, and each step's backward gathers its 2 blocks
    // again. none never gathers.
    assert!(
        gathers[1] >= 3 * STEPS_PER_EPOCH * 2,
        "grad-op: {gathers:?}"
    );
    assert_eq!(
        gathers[0] - gathers[1],
        3 * STEPS_PER_EPOCH * 2,
        "gathers: {gathers:?}"
    );
    assert_eq!(gathers[2], 0, "fsdp none gathered");
}

#[test]
fn world_2_with_sgd_momentum_and_each_strategy_ends_where_the_unwrapped_model_does() {
    against_unwrapped_with(2, 3, "w2-sgd", &EVERY_STRATEGY, LmOptimizer::SgdMomentum);
}

#[test]
fn world_4_with_each_strategy_ends_where_the_unwrapped_model_does_after_3_epochs() {
    let gathers = against_unwrapped(4, 3, "w4", &EVERY_STRATEGY);
    assert_eq!(
        gathers[0] - gathers[1],
        3 * STEPS_PER_EPOCH * 2,
        "gathers: {gathers:?}"
    );
    assert_eq!(gathers[2], 0, "fsdp none gathered");
}

#[test]
fn world_4_with_sgd_momentum_and_each_strategy_ends_where_the_unwrapped_model_does() {
    against_unwrapped_with(4, 3, "w4-sgd", &EVERY_STRATEGY, LmOptimizer::SgdMomentum);
}
