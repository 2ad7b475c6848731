//! Chrome traces (JSON `traceEvents`, opened by Perfetto and chrome://tracing) of a rank's
//! training steps, as Horovod's timeline: the forward and backward pass, each bucket's pack,
//! all-reduce and the unpack, the optimizer step. One file per rank, `rank-<r>.json`, brought up
//! to date at each epoch's end and when training ends (a killed job leaves its trace so far).

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use crate::elastic::json_string;

/// Where the computing thread's events go (`tid` 0); all-reduces overlap with it (`tid` 1).
pub(crate) const COMPUTE: u32 = 0;
/// The lane of communication events.
pub(crate) const COMMUNICATION: u32 = 1;

/// The file and the events not written yet.
struct Writer {
    file: std::fs::File,
    /// Serialised events since the last [`Trace::write`].
    pending: Vec<u8>,
}

/// What closes the JSON object; written after the events at each [`Trace::write`], and written
/// over by the next events.
const SUFFIX: &[u8] = b"],\"displayTimeUnit\":\"ms\"}";

/// A rank's trace: events serialised as they come, appended to the file at each write, which
/// leaves a complete JSON document every time (the closing part is written over by the next
/// events), so each event is formatted and written once.
pub struct Trace {
    rank: usize,
    origin: Instant,
    writer: Mutex<Writer>,
}

impl Trace {
    /// A trace of rank `rank`, written to `dir/rank-<rank>.json`.
    pub(crate) fn new(dir: &Path, rank: usize) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path: PathBuf = dir.join(format!("rank-{rank}.json"));
        let mut file = std::fs::File::create(&path)?;
        write!(file, "{{\"traceEvents\":[")?;
        let lanes = [(COMPUTE, "compute"), (COMMUNICATION, "communication")];
        for (i, (lane, name)) in lanes.iter().enumerate() {
            let comma = if i > 0 { "," } else { "" };
            write!(
                file,
                "{comma}{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{rank},\"tid\":{lane},\
                 \"args\":{{\"name\":\"{name}\"}}}}"
            )?;
        }
        file.write_all(SUFFIX)?;
        Ok(Trace {
            rank,
            origin: Instant::now(),
            writer: Mutex::new(Writer {
                file,
                pending: Vec::new(),
            }),
        })
    }

    /// Records `name` on `lane` from `start` to `end`.
    pub(crate) fn span(&self, name: impl AsRef<str>, lane: u32, start: Instant, end: Instant) {
        let us = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        let (ts, dur) = (us(start), (us(end) - us(start)).max(0.0));
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let _ = write!(
            writer.pending,
            ",{{\"name\":{},\"ph\":\"X\",\"pid\":{},\"tid\":{lane},\"ts\":{ts:.1},\"dur\":{dur:.1}}}",
            json_string(name.as_ref()),
            self.rank,
        );
    }

    /// Appends the events recorded since the last write; the file is a complete trace after.
    pub(crate) fn write(&self) -> std::io::Result<()> {
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let Writer { file, pending } = &mut *writer;
        if pending.is_empty() {
            return Ok(());
        }
        file.seek(SeekFrom::End(-(SUFFIX.len() as i64)))?;
        file.write_all(pending)?;
        file.write_all(SUFFIX)?;
        pending.clear();
        Ok(())
    }
}
