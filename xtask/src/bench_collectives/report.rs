//! The rank program's `--report` file (one line per size: bytes, median time, bus bandwidth)
//! and the sizes as the tables show them; what `bench-collectives` reads here and across hosts.

use std::path::Path;

use anyhow::{Context, Result};

/// One size's figures: bytes, median time in microseconds, bus bandwidth in GB/s.
pub(super) type Row = (u64, f64, f64);

/// Reads a `bench_collectives --report` file.
pub(super) fn read_report(path: &Path) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the report {}", path.display()))?;
    text.lines()
        .map(|line| {
            let parse = |line: &str| -> Option<Row> {
                let mut f = line.split_whitespace().map(str::trim);
                let row = (
                    f.next()?.parse().ok()?,
                    f.next()?.parse().ok()?,
                    f.next()?.parse().ok()?,
                );
                f.next().is_none().then_some(row)
            };
            parse(line).with_context(|| format!("a bad line {line:?} in {}", path.display()))
        })
        .collect()
}

/// `bytes` in K/M/G (binary) units.
pub(super) fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
