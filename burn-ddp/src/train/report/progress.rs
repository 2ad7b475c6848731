//! Progress as readable lines, for rank 0's output when it is not a terminal (a launcher's pipe,
//! a log file, a cluster's job output): burn-train's TUI needs a terminal, and its fallback
//! prints one debug dump per batch. [`LineRenderer`] prints at most one line every few seconds
//! per split, and a summary at the end of each split:
//!
//! ```text
//! [train] epoch 1/10  1536/4096 items (37.5%)  loss 0.6931  1234 samples/s  eta 2.1s
//! [train] epoch 1/10 done: 4096 items in 3.3s (1241 samples/s)  loss 0.6904
//! ```
//!
//! [`ProgressOutput`] chooses between it and burn-train's renderers.

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricEntry, MetricId};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

/// How `DdpLearner` shows progress on rank 0 (the other ranks show none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressOutput {
    /// burn-train's TUI when rank 0's stdout is a terminal and burn-ddp's `tui` feature is on,
    /// [`LineRenderer`] lines otherwise (the default).
    #[default]
    Auto,
    /// Always [`LineRenderer`] lines.
    Lines,
    /// Leave the renderer of the `SupervisedTraining` alone (the one given with `.renderer(..)`,
    /// or burn-train's default).
    Keep,
}

impl ProgressOutput {
    /// The renderer to install on rank 0, or `None` to keep the training's own (also for
    /// burn's own `Learner`: `if let Some(r) = ProgressOutput::Auto.renderer() { training =
    /// training.renderer(r) }`).
    pub fn renderer(self) -> Option<Box<dyn MetricsRenderer>> {
        use std::io::IsTerminal;
        let tui = cfg!(feature = "tui") && std::io::stdout().is_terminal();
        match self {
            ProgressOutput::Keep => None,
            ProgressOutput::Auto if tui => None,
            ProgressOutput::Auto | ProgressOutput::Lines => Some(Box::new(LineRenderer::new())),
        }
    }
}

/// The split being shown.
#[derive(Debug)]
struct Split {
    name: String,
    total: usize,
    done: usize,
    started: Instant,
    printed: Instant,
}

/// Renders training progress as plain lines on stdout (see the module documentation).
#[derive(Debug)]
pub struct LineRenderer {
    interval: Duration,
    epoch: usize,
    epochs: usize,
    split: Option<Split>,
    /// Metric names by id, from their definitions.
    names: HashMap<MetricId, String>,
    /// The current split's metrics, in the order first seen: (name, running value).
    metrics: Vec<(String, String)>,
}

impl Default for LineRenderer {
    fn default() -> Self {
        Self::new()
    }
}

impl LineRenderer {
    /// A renderer printing at most every 5 seconds per split.
    pub fn new() -> Self {
        LineRenderer {
            interval: Duration::from_secs(5),
            epoch: 1,
            epochs: 0,
            split: None,
            names: HashMap::new(),
            metrics: Vec::new(),
        }
    }

    /// The shortest time between two progress lines of a split.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    fn update_metric(&mut self, state: MetricState) {
        let entry: MetricEntry = match state {
            MetricState::Generic(entry) | MetricState::Numeric(entry, _) => entry,
        };
        let name = self
            .names
            .get(&entry.metric_id)
            .cloned()
            .unwrap_or_else(|| "metric".to_string());
        let value = running_value(&entry.serialized_entry.formatted);
        match self.metrics.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.metrics.push((name, value)),
        }
    }

    fn metrics_text(&self) -> String {
        self.metrics
            .iter()
            .map(|(name, value)| format!("  {} {value}", name.to_lowercase()))
            .collect()
    }

    fn print(&self, line: &str) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }

    fn progress_line(&self, split: &Split) -> String {
        let elapsed = split.started.elapsed().as_secs_f64();
        let rate = split.done as f64 / elapsed.max(1e-9);
        let percent = 100.0 * split.done as f64 / split.total.max(1) as f64;
        let left = split.total.saturating_sub(split.done) as f64 / rate.max(1e-9);
        format!(
            "[{}] epoch {}/{}  {}/{} items ({percent:.1}%){}  {rate:.0} samples/s  eta {}",
            split.name,
            self.epoch,
            self.epochs,
            split.done,
            split.total,
            self.metrics_text(),
            seconds(left)
        )
    }
}

/// The running (epoch) value of a burn-train metric's display string
/// (`epoch 0.693 - batch 0.701` gives `0.693`); other strings are shown whole.
fn running_value(formatted: &str) -> String {
    formatted
        .strip_prefix("epoch ")
        .and_then(|rest| rest.split(" - batch").next())
        .unwrap_or(formatted)
        .trim()
        .to_string()
}

/// A duration for people: `2.1s`, `3m05s`, `1h02m`.
fn seconds(s: f64) -> String {
    if !s.is_finite() {
        return "?".into();
    }
    let whole = s as u64;
    match whole {
        0..60 => format!("{s:.1}s"),
        60..3600 => format!("{}m{:02}s", whole / 60, whole % 60),
        _ => format!("{}h{:02}m", whole / 3600, whole / 60 % 60),
    }
}

impl MetricsRendererTraining for LineRenderer {
    fn update_train(&mut self, state: MetricState) {
        self.update_metric(state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.update_metric(state);
    }
    fn on_train_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        if let Some(summary) = summary {
            self.print(&summary.to_string());
        }
        Ok(())
    }
}

impl MetricsRendererEvaluation for LineRenderer {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        self.update_metric(state);
    }
}

impl TrainingProgressLogger for LineRenderer {
    fn start(
        &mut self,
        epochs: usize,
        starting_epoch: usize,
        _: Option<usize>,
        label: Option<&str>,
    ) {
        self.epochs = epochs;
        self.epoch = starting_epoch.max(1);
        let what = label.unwrap_or("training");
        if starting_epoch > 1 {
            self.print(&format!(
                "{what}: {epochs} epochs, resuming at epoch {starting_epoch}"
            ));
        } else {
            self.print(&format!("{what}: {epochs} epochs"));
        }
    }
    fn update_epoch(&mut self, epoch: usize) {
        self.epoch = epoch + 1;
    }
    fn start_split(&mut self, split: &str, total_items: usize) {
        let now = Instant::now();
        self.metrics.clear();
        self.split = Some(Split {
            name: split.to_lowercase(),
            total: total_items,
            done: 0,
            started: now,
            printed: now,
        });
    }
    fn update_split(&mut self, items_processed: usize) {
        let Some(mut split) = self.split.take() else {
            return;
        };
        split.done = items_processed;
        if split.printed.elapsed() >= self.interval {
            split.printed = Instant::now();
            self.print(&self.progress_line(&split));
        }
        self.split = Some(split);
    }
    fn end_split(&mut self) {
        let Some(split) = self.split.take() else {
            return;
        };
        let elapsed = split.started.elapsed();
        let rate = split.done as f64 / elapsed.as_secs_f64().max(1e-9);
        self.print(&format!(
            "[{}] epoch {}/{} done: {} items in {} ({rate:.0} samples/s){}",
            split.name,
            self.epoch,
            self.epochs,
            split.done,
            seconds(elapsed.as_secs_f64()),
            self.metrics_text()
        ));
    }
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for LineRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, name: &str, total_items: usize) {
        self.start_split(name, total_items);
    }
    fn update_test_progress(&mut self, items_processed: usize) {
        self.update_split(items_processed);
    }
    fn end_test(&mut self) {
        self.end_split();
    }
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for LineRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names
            .insert(definition.metric_id.clone(), definition.name.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_values_and_durations_read_well() {
        assert_eq!(running_value("epoch 0.693 - batch 0.701"), "0.693");
        assert_eq!(running_value("epoch 54.10 % - batch 50.00 %"), "54.10 %");
        assert_eq!(running_value("12 items"), "12 items");
        assert_eq!(seconds(2.14), "2.1s");
        assert_eq!(seconds(185.0), "3m05s");
        assert_eq!(seconds(3720.0), "1h02m");
        assert_eq!(seconds(f64::INFINITY), "?");
    }
}
