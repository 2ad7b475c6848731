//! Where each rank is: phase (training, validation, checkpointing...), epoch, step, what the
//! training thread does and which collective the collective thread runs. Every rank publishes
//! its status to the store (phase changes at once, the rest at most every
//! 100 ms), so a failed or timed-out collective can say where every rank was, and a
//! dead rank's last report says what it was doing: "rank 3: validation, epoch 2, step 118;
//! ranks 0-2: training, epoch 2, step 118, waits for bucket 4 of 7".

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::store::Store;
use crate::wire::{DecodeError, Reader, Writer};

/// How often a changed status is published (phase changes are published at once).
pub(crate) const PUBLISH_INTERVAL: Duration = Duration::from_millis(100);

/// The store key of a rank's status.
pub(crate) fn status_key(rank: usize) -> String {
    crate::store::keys::status(rank)
}

/// What a rank is doing, coarsely.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Phase {
    /// Joined the group, not training (yet).
    #[default]
    Idle,
    /// Agreeing on the model and settings, broadcasting rank 0's parameters.
    Starting,
    /// Reading a checkpoint and restoring the training state.
    Resuming,
    /// In a training epoch.
    Training,
    /// In a validation epoch.
    Validation,
    /// Writing (rank 0) or waiting for (the others) a checkpoint.
    Checkpointing,
    /// Training ended on this rank.
    Finished,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Idle => "idle",
            Phase::Starting => "starting",
            Phase::Resuming => "resuming",
            Phase::Training => "training",
            Phase::Validation => "validation",
            Phase::Checkpointing => "checkpointing",
            Phase::Finished => "finished",
        }
    }

    const ALL: [Phase; 7] = [
        Phase::Idle,
        Phase::Starting,
        Phase::Resuming,
        Phase::Training,
        Phase::Validation,
        Phase::Checkpointing,
        Phase::Finished,
    ];
}

/// One rank's status.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RankStatus {
    /// The phase.
    pub phase: Phase,
    /// Epoch (1-based, as burn-train counts), if in one.
    pub epoch: Option<usize>,
    /// Step within the epoch (1-based), if in one.
    pub step: Option<usize>,
    /// What the training thread does now, e.g. "waits for bucket 4 of 7".
    pub activity: Option<String>,
    /// The collective the collective thread runs now, e.g. "all_reduce #240 of 4096 x f32".
    pub collective: Option<String>,
}

impl fmt::Display for RankStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.phase.name())?;
        if let Some(e) = self.epoch {
            write!(f, ", epoch {e}")?;
        }
        if let Some(s) = self.step {
            write!(f, ", step {s}")?;
        }
        if let Some(a) = &self.activity {
            write!(f, ", {a}")?;
        }
        if let Some(c) = &self.collective {
            write!(f, ", in {c}")?;
        }
        Ok(())
    }
}

impl RankStatus {
    fn encode(&self) -> Vec<u8> {
        let opt = |v: Option<usize>| v.map_or(0, |v| v as u64 + 1);
        let mut w = Writer::default();
        w.u8(self.phase as u8)
            .u64(opt(self.epoch))
            .u64(opt(self.step))
            .bytes(self.activity.as_deref().unwrap_or("").as_bytes())
            .bytes(self.collective.as_deref().unwrap_or("").as_bytes());
        w.buf
    }

    fn decode(raw: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(raw);
        let code = r.u8()?;
        let phase = *Phase::ALL
            .get(code as usize)
            .ok_or(DecodeError::UnknownCode {
                what: "phase",
                code,
            })?;
        let opt = |v: u64| v.checked_sub(1).map(|v| v as usize);
        let text = |s: String| (!s.is_empty()).then_some(s);
        let status = RankStatus {
            phase,
            epoch: opt(r.u64()?),
            step: opt(r.u64()?),
            activity: text(r.string()?),
            collective: text(r.string()?),
        };
        r.finish()?;
        Ok(status)
    }

    /// Reads rank `rank`'s last published status from `store`: `None` if it never published.
    pub fn fetch(store: &Store, rank: usize) -> crate::Result<Option<Self>> {
        Ok(store
            .try_get(&status_key(rank))?
            .and_then(|raw| Self::decode(&raw).ok()))
    }

    /// Decodes a status read from the store by other means (the launcher reads its own server).
    pub(crate) fn from_bytes(raw: &[u8]) -> Option<Self> {
        Self::decode(raw).ok()
    }
}

/// The shared state: the training thread, the collective thread and the publisher update it.
pub(crate) struct StatusCell {
    rank: usize,
    world: usize,
    store: Arc<Store>,
    state: Mutex<RankStatus>,
    version: AtomicU64,
    published: AtomicU64,
}

impl StatusCell {
    fn lock(&self) -> std::sync::MutexGuard<'_, RankStatus> {
        crate::sync::lock(&self.state)
    }

    /// Changes the status; the publisher sends it within [`PUBLISH_INTERVAL`].
    pub(crate) fn update(&self, f: impl FnOnce(&mut RankStatus)) {
        f(&mut self.lock());
        self.version.fetch_add(1, Ordering::Release);
    }

    /// Sends the status now, if it changed since the last publication.
    pub(crate) fn publish(&self) {
        let version = self.version.load(Ordering::Acquire);
        if self.published.swap(version, Ordering::AcqRel) == version {
            return;
        }
        let raw = self.lock().encode();
        if let Err(e) = self.store.set(&status_key(self.rank), &raw) {
            log::debug!("rank {}: cannot publish the status: {e}", self.rank);
        }
    }

    /// Every rank's last published status, ranks with the same status grouped:
    /// `rank 1: validation, epoch 2, step 5; ranks 0, 2-3: training, epoch 2, step 7`.
    pub(crate) fn report(&self) -> String {
        self.publish();
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        for r in 0..self.world {
            let text = match RankStatus::fetch(&self.store, r) {
                Ok(Some(s)) => s.to_string(),
                Ok(None) => "no report".to_string(),
                Err(_) => return "unknown (the store is unreachable)".to_string(),
            };
            match groups.iter_mut().find(|(t, _)| *t == text) {
                Some((_, ranks)) => ranks.push(r),
                None => groups.push((text, vec![r])),
            }
        }
        groups
            .iter()
            .map(|(text, ranks)| format!("{}: {text}", name_ranks(ranks)))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// "rank 3", "ranks 0-2, 5".
pub(crate) fn name_ranks(ranks: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if j == i {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    let plural = ranks.len() > 1;
    format!("rank{} {}", if plural { "s" } else { "" }, parts.join(", "))
}

/// A rank's status and the thread that publishes it. Reached through
/// [`ProcessGroup::status`](crate::ProcessGroup::status).
pub struct StatusBoard {
    cell: Arc<StatusCell>,
    stop: Option<Sender<()>>,
    publisher: Option<JoinHandle<()>>,
}

impl StatusBoard {
    pub(crate) fn start(rank: usize, world: usize, store: Arc<Store>) -> Self {
        let cell = Arc::new(StatusCell {
            rank,
            world,
            store,
            state: Mutex::new(RankStatus::default()),
            version: AtomicU64::new(1),
            published: AtomicU64::new(0),
        });
        let (stop, stopped) = mpsc::channel::<()>();
        let publisher = (world > 1)
            .then(|| {
                let cell = cell.clone();
                std::thread::Builder::new()
                    .name(format!("burn-ddp-status{rank}"))
                    .spawn(move || {
                        while let Err(RecvTimeoutError::Timeout) =
                            stopped.recv_timeout(PUBLISH_INTERVAL)
                        {
                            cell.publish();
                        }
                    })
                    .ok()
            })
            .flatten();
        StatusBoard {
            cell,
            stop: Some(stop),
            publisher,
        }
    }

    pub(crate) fn cell(&self) -> Arc<StatusCell> {
        self.cell.clone()
    }

    /// Enters `phase` (at `epoch`), clearing step and activity; published at once.
    pub fn enter(&self, phase: Phase, epoch: Option<usize>) {
        self.cell.update(|s| {
            s.phase = phase;
            s.epoch = epoch;
            s.step = None;
            s.activity = None;
        });
        if self.cell.world > 1 {
            self.cell.publish();
        }
    }

    /// Sets the step within the epoch.
    pub fn step(&self, step: usize) {
        self.cell.update(|s| s.step = Some(step));
    }

    /// Says what the training thread does now (`None`: computing).
    pub fn activity(&self, activity: Option<String>) {
        self.cell.update(|s| s.activity = activity);
    }

    /// This rank's current status.
    pub fn current(&self) -> RankStatus {
        self.cell.lock().clone()
    }

    /// Every rank's last published status, as in collective errors.
    pub fn report(&self) -> String {
        self.cell.report()
    }
}

impl Drop for StatusBoard {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.publisher.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_round_trip_and_read_well() {
        let s = RankStatus {
            phase: Phase::Training,
            epoch: Some(2),
            step: Some(118),
            activity: Some("waits for bucket 4 of 7".into()),
            collective: Some("all_reduce #240 of 4096 x f32".into()),
        };
        assert_eq!(RankStatus::decode(&s.encode()).unwrap(), s);
        assert_eq!(
            s.to_string(),
            "training, epoch 2, step 118, waits for bucket 4 of 7, in all_reduce #240 of 4096 x f32"
        );
        let idle = RankStatus::default();
        assert_eq!(RankStatus::decode(&idle.encode()).unwrap(), idle);
        assert!(RankStatus::decode(&[9]).is_err());
        assert_eq!(name_ranks(&[0, 1, 2, 5]), "ranks 0-2, 5");
        assert_eq!(name_ranks(&[3]), "rank 3");
    }
}
