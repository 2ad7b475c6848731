//! Telemetry: each step's figures reach rank 0's burn-train metrics (a rank made slow is named
//! the straggler, with its lag), and `DdpLearner::profile` writes a Chrome trace per rank with
//! every step's forward and backward pass, buckets and optimizer step.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::data::dataloader::DataLoaderBuilder;
use burn::optim::SgdConfig;
use burn::train::SupervisedTraining;
use burn_ddp::ProcessGroup;
use burn_ddp::train::{DdpLearner, DdpTraining, DistributedSampler, ProgressOutput, QuietRenderer};

use super::evaluation::{Recorded, number};
use super::model::{DATA, Points, SLOW_FORWARD, ToBatch, flex, new_net};
use super::small_buckets;
use crate::common::{options, run_world};

#[test]
fn the_straggler_is_measured_and_every_rank_writes_its_trace() {
    let device = flex();
    let model = new_net(&device, Some(3), false);
    let dir = std::env::temp_dir().join(format!("burn-ddp-trace-{}", std::process::id()));
    let recorded = |_| Arc::new(Mutex::new(Vec::new()));
    let (lag, comm) = (recorded(0), recorded(1));
    let slow = Duration::from_millis(20);
    run_world(2, options(60), |group: ProcessGroup| {
        let group = Arc::new(group);
        // Rank 1's forward passes are 20 ms slower.
        SLOW_FORWARD.set(if group.rank() == 1 {
            slow
        } else {
            Duration::ZERO
        });
        let sampler = DistributedSampler::for_group(&group);
        let loader = || {
            DataLoaderBuilder::new(ToBatch)
                .batch_size(8)
                .build(sampler.dataset(Points(DATA)))
        };
        let artifacts = super::thread_dir("telemetry");
        let learner = DdpLearner::with_group(group, model.clone(), SgdConfig::new().init(), 0.1)
            .sampler(&sampler)
            .valid_sampler(&sampler)
            .buckets(small_buckets())
            .profile(&dir)
            .progress(ProgressOutput::Keep);
        let figures = learner.telemetry();
        let training = SupervisedTraining::new(&artifacts, loader(), loader())
            .metric_train_numeric(figures.compute())
            .metric_train(Recorded {
                inner: figures.straggler_lag(),
                epochs: lag.clone(),
            })
            .metric_train(Recorded {
                inner: figures.communication(),
                epochs: comm.clone(),
            })
            .renderer(Box::new(QuietRenderer))
            .with_application_logger(None)
            .num_epochs(1);
        let result = training.launch_ddp(learner).expect("training");
        SLOW_FORWARD.set(Duration::ZERO);
        assert!(result.error.is_none(), "{:?}", result.error);
        let _ = std::fs::remove_dir_all(&artifacts);
    });
    let epoch_value = |v: &Arc<Mutex<Vec<String>>>| number(&v.lock().unwrap()[0]);
    let lag_ms = epoch_value(&lag);
    let comm_ms = epoch_value(&comm);
    eprintln!("straggler lag {lag_ms:.2} ms, communication {comm_ms:.3} ms per step");
    assert!(
        (15.0..200.0).contains(&lag_ms),
        "rank 1 sleeps 20 ms per forward pass: lag {lag_ms} ms"
    );
    // Rank 0 waits for the slow rank in the all-reduce.
    assert!(comm_ms >= 10.0, "communication {comm_ms} ms");

    let steps = DATA / 2 / 8;
    for rank in 0..2 {
        let events = crate::common::trace_events(&dir, rank);
        let spans = crate::common::spans_of(&events);
        let count = |prefix: &str| spans.iter().filter(|(n, _)| n.starts_with(prefix)).count();
        assert_eq!(count("forward+backward"), steps, "rank {rank}");
        assert_eq!(count("optimizer step"), steps, "rank {rank}");
        assert_eq!(count("unpack"), steps, "rank {rank}");
        assert!(
            count("pack bucket") >= 2 * steps,
            "rank {rank}: several buckets per step"
        );
        assert_eq!(
            count("pack bucket"),
            count("all-reduce bucket"),
            "rank {rank}"
        );
        assert!(
            events.iter().all(|e| e["pid"] == rank),
            "rank {rank}: one process lane"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
