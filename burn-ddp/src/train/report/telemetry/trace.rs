//! Chrome traces (JSON `traceEvents`, opened by Perfetto and chrome://tracing) of a rank's
//! training steps, as Horovod's timeline: the forward and backward pass, each bucket's pack,
//! all-reduce and the unpack, the optimizer step. One file per rank, `rank-<r>.json`, brought up
//! to date at each epoch's end and when training ends (a killed job leaves its trace so far).

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use crate::wire::json_string;

/// Where the computing thread's events go (`tid` 0); all-reduces overlap with it (`tid` 1).
pub(crate) const COMPUTE: u32 = 0;
/// The lane of communication events.
pub(crate) const COMMUNICATION: u32 = 1;

/// What a span is of: a fixed name, and for bucket spans the bucket (1-based).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    name: &'static str,
    bucket: Option<usize>,
}

impl Span {
    /// A span named `name`.
    pub(crate) const fn named(name: &'static str) -> Self {
        Span { name, bucket: None }
    }

    /// `name` of bucket `index` (0-based; shown 1-based).
    pub(crate) const fn bucket(name: &'static str, index: usize) -> Self {
        Span {
            name,
            bucket: Some(index + 1),
        }
    }
}

/// One event as recorded during a step: formatted only when written.
struct Event {
    span: Span,
    lane: u32,
    start: Instant,
    end: Instant,
}

/// The file and the events not written yet.
struct Writer {
    file: std::fs::File,
    /// Events since the last [`Trace::write`].
    pending: Vec<Event>,
}

/// What closes the JSON object; written after the events at each [`Trace::write`], and written
/// over by the next events.
const SUFFIX: &[u8] = b"],\"displayTimeUnit\":\"ms\"}";

/// A rank's trace: events kept as they come (a push per span), formatted and appended to the
/// file at each write, which leaves a complete JSON document every time (the closing part is
/// written over by the next events), so each event is formatted and written once.
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

    /// Records `span` on `lane` from `start` to `end` (kept as is: formatting waits for the
    /// next write, off the training step).
    pub(crate) fn span(&self, span: Span, lane: u32, start: Instant, end: Instant) {
        let event = Event {
            span,
            lane,
            start,
            end,
        };
        let mut writer = crate::sync::lock(&self.writer);
        writer.pending.push(event);
    }

    /// Appends the events recorded since the last write; the file is a complete trace after.
    pub(crate) fn write(&self) -> std::io::Result<()> {
        let mut writer = crate::sync::lock(&self.writer);
        let Writer { file, pending } = &mut *writer;
        if pending.is_empty() {
            return Ok(());
        }
        let us = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        let mut out = Vec::with_capacity(pending.len() * 96);
        for e in pending.drain(..) {
            let (ts, dur) = (us(e.start), (us(e.end) - us(e.start)).max(0.0));
            let name = match e.span.bucket {
                Some(b) => json_string(&format!("{} {b}", e.span.name)),
                None => json_string(e.span.name),
            };
            write!(
                out,
                ",{{\"name\":{name},\"ph\":\"X\",\"pid\":{},\"tid\":{},\"ts\":{ts:.1},\
                 \"dur\":{dur:.1}}}",
                self.rank, e.lane,
            )?;
        }
        file.seek(SeekFrom::End(-(SUFFIX.len() as i64)))?;
        file.write_all(&out)?;
        file.write_all(SUFFIX)?;
        Ok(())
    }
}
