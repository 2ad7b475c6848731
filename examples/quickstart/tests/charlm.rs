//! The transformer trained data-parallel (ranks as threads over loopback) equals one process
//! with the global batch: world 2 with batch b against world 1 with batch 2b, dropout off.

use std::sync::Arc;

use burn::module::Module;
use burn_ddp::ProcessGroup;
use burn_ddp::store::StoreServer;
use quickstart::charlm::{CharLm, LmConfig, device, train_model};

/// The final parameters of every rank of a world of `n` training `model` with `cfg`.
fn world(n: usize, cfg: &LmConfig, model: &CharLm) -> Vec<Vec<f32>> {
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
                    train_model(Arc::new(group), cfg, model.clone())
                        .unwrap()
                        .params
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    })
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
