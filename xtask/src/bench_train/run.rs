//! One kind of quickstart run in `bench-train` ([`TrainRun`]: its label, its ranks and its own
//! program flags) and what one run measured ([`Timing`]), with the medians the tables show;
//! what the runner, the lists of runs and their summaries share.

/// One quickstart run's figures, read from its `--report` file.
pub(super) struct Timing {
    pub(super) seconds: f64,
    pub(super) steps: f64,
    pub(super) samples: f64,
    /// Bytes each rank sends into the gradient all-reduces per step.
    pub(super) bytes: f64,
    /// Bytes each rank sends per step on a ring (with sharding: the reduce-scatter and the
    /// parameters' all-gather).
    pub(super) sent: f64,
    /// Each rank's optimizer-state bytes at the end, and its peak resident memory.
    pub(super) ranks: Vec<(f64, f64)>,
    /// Milliseconds per step rank 0 waited for gradient communication.
    pub(super) exposed_ms: f64,
}

impl Timing {
    pub(super) fn per_step_ms(&self) -> f64 {
        self.seconds * 1e3 / self.steps
    }
    pub(super) fn samples_per_sec(&self) -> f64 {
        self.samples / self.seconds
    }
}

pub(super) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// One kind of quickstart run in `bench-train`: its label, its ranks and where they run, and
/// its own program flags (after the flags every run gets, `Runner::args`).
pub(super) struct TrainRun {
    pub(super) label: String,
    /// Ranks (per host when `across_hosts`).
    pub(super) nproc: usize,
    /// The run's own program flags: `--plain`, compression, the transformer's shape, sharding.
    pub(super) args: Vec<&'static str>,
    /// `BURN_DDP_TRANSPORT`.
    pub(super) transport: &'static str,
    /// On every host of the cluster instead of on this host.
    pub(super) across_hosts: bool,
    /// Each rank bound to one core of its own (core `RANK` modulo the cores), as each rank
    /// would have a device of its own: ranks sharing every core slow each other down at
    /// random, and the one behind makes the others wait at every collective.
    pub(super) pinned: bool,
}

impl TrainRun {
    /// `nproc` ranks of DdpLearner on this host over TCP, with no flags of its own.
    pub(super) fn here(label: impl Into<String>, nproc: usize) -> Self {
        TrainRun {
            label: label.into(),
            nproc,
            args: Vec::new(),
            transport: "tcp",
            across_hosts: false,
            pinned: false,
        }
    }
    /// burn's own Learner, one process (`--plain`).
    pub(super) fn burn_learner() -> Self {
        TrainRun::here("burn Learner, 1 process", 1).args(&["--plain"])
    }
    /// Adds program flags.
    pub(super) fn args(mut self, args: &[&'static str]) -> Self {
        self.args.extend_from_slice(args);
        self
    }
    pub(super) fn transport(mut self, transport: &'static str) -> Self {
        self.transport = transport;
        self
    }
    /// On every host of the cluster, `nproc` ranks each.
    pub(super) fn across_hosts(mut self) -> Self {
        self.across_hosts = true;
        self
    }
    /// Each rank bound to a core of its own ([`TrainRun::pinned`]).
    pub(super) fn pinned(mut self) -> Self {
        self.pinned = true;
        self
    }
}

/// Median milliseconds per step.
pub(super) fn step(t: &[Timing]) -> f64 {
    median(t.iter().map(Timing::per_step_ms).collect())
}

/// Median samples per second.
pub(super) fn rate(t: &[Timing]) -> f64 {
    median(t.iter().map(Timing::samples_per_sec).collect())
}
