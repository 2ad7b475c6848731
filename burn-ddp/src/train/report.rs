//! Reporting (feature `train`): rank 0's progress output ([`ProgressOutput`]) and the other
//! ranks' silence, the metrics gathered from every rank ([`GlobalItem`]), and the telemetry of
//! each step ([`Telemetry`]: where a step's time goes, bytes sent, traces).

pub(crate) mod metrics;
pub(crate) mod progress;
pub(crate) mod quiet;
pub(crate) mod telemetry;

pub use metrics::GlobalItem;
pub use progress::{LineRenderer, ProgressOutput};
pub use quiet::QuietRenderer;
pub use telemetry::{DdpMetric, JobStats, StepInput, StepStats, Telemetry};
