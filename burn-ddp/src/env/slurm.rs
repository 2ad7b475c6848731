//! Slurm's compact notations, and the defaults burn-ddp derives from them under `srun`.
//!
//! - Node lists (`SLURM_JOB_NODELIST`, `SLURM_STEP_NODELIST`): `node[01-03,7],gpu-a`; several
//!   bracket groups in one name (`rack[1-2]-n[1-2]-ib`) expand as a product, leftmost slowest;
//!   each range keeps the zero padding of its first number (`[08-10,7]` gives `08 09 10 7`).
//! - Tasks per node (`SLURM_STEP_TASKS_PER_NODE`, `SLURM_TASKS_PER_NODE`): `2(x3),1` is four
//!   nodes with 2, 2, 2 and 1 tasks.
//!
//! Without `MASTER_ADDR`, the master is the first host of the step's node list (rank 0 runs
//! there); without `MASTER_PORT`, the port is `10000 + SLURM_JOB_ID % 20000`, the same on
//! every rank of a job, different for neighbouring job ids, and below Linux's ephemeral ports.

use crate::error::{DdpError, Result};

/// Most hosts [`expand_nodelist`] produces (a longer list is refused rather than allocated).
pub const MAX_HOSTS: usize = 1 << 20;
/// First port of the range [`job_port`] maps job ids into.
pub const JOB_PORT_BASE: u16 = 10_000;
/// Number of ports in that range.
pub const JOB_PORT_SPAN: u64 = 20_000;

/// Why a Slurm node list or tasks-per-node list cannot be read.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlurmListError {
    /// Nothing but white space.
    #[error("the list is empty")]
    Empty,
    /// A name with no characters (where: which commas).
    #[error("an empty host name ({0})")]
    EmptyName(&'static str),
    /// Brackets inside brackets.
    #[error("a '[' inside brackets")]
    NestedBracket,
    /// A `[` that is never closed.
    #[error("a '[' without its ']'")]
    UnclosedBracket,
    /// A `]` that was never opened.
    #[error("a ']' without its '['")]
    UnopenedBracket,
    /// Spaces or tabs between names.
    #[error("white space inside the list")]
    WhiteSpace,
    /// A bracket holds something other than digits.
    #[error("[{ranges}] holds {text:?}, not a number")]
    NotANumber {
        /// The inside of the brackets.
        ranges: String,
        /// The text that is not a number.
        text: String,
    },
    /// A bracket holds a number too long to count with.
    #[error("[{ranges}] holds a number with more than 18 digits")]
    TooManyDigits {
        /// The inside of the brackets.
        ranges: String,
    },
    /// A range whose end is below its start.
    #[error("[{ranges}] has the decreasing range {range}")]
    Decreasing {
        /// The inside of the brackets.
        ranges: String,
        /// The range, as in `3-1`.
        range: String,
    },
    /// More hosts than a `u64` counts.
    #[error("the list counts more hosts than fit in 64 bits")]
    CountOverflow,
    /// More hosts than [`MAX_HOSTS`] (the count).
    #[error("the list names {0} hosts, more than {MAX_HOSTS}")]
    TooManyHosts(u64),
    /// A tasks-per-node entry whose count is not a number.
    #[error("{0:?} is not a number")]
    NotACount(String),
    /// A tasks-per-node entry with parentheses not of the form `N(xM)`.
    #[error("{0:?} is not of the form N(xM)")]
    NotARun(String),
    /// A tasks-per-node entry repeated zero times.
    #[error("{0:?} repeats zero times")]
    ZeroRepeat(String),
}

crate::error::debug_as_display!(SlurmListError);

/// One name of a node list: literal text and bracketed ranges, in order.
#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    /// `(first, last, width)` ranges: numbers are printed with at least `width` digits.
    Ranges(Vec<(u64, u64, usize)>),
}

/// Parses a compact node list into its names, each a sequence of parts.
fn parse_nodelist(list: &str) -> std::result::Result<Vec<Vec<Part>>, SlurmListError> {
    let list = list.trim();
    if list.is_empty() {
        return Err(SlurmListError::Empty);
    }
    let mut names = Vec::new();
    let mut parts = Vec::new();
    let mut text = String::new();
    let mut chars = list.chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => {
                if !text.is_empty() {
                    parts.push(Part::Text(std::mem::take(&mut text)));
                }
                if parts.is_empty() {
                    return Err(SlurmListError::EmptyName(
                        "two commas in a row, or a leading or trailing comma",
                    ));
                }
                names.push(std::mem::take(&mut parts));
            }
            '[' => {
                if !text.is_empty() {
                    parts.push(Part::Text(std::mem::take(&mut text)));
                }
                let mut inner = String::new();
                loop {
                    match chars.next() {
                        Some(']') => break,
                        Some('[') => return Err(SlurmListError::NestedBracket),
                        Some(c) => inner.push(c),
                        None => return Err(SlurmListError::UnclosedBracket),
                    }
                }
                parts.push(Part::Ranges(parse_ranges(&inner)?));
            }
            ']' => return Err(SlurmListError::UnopenedBracket),
            c if c.is_whitespace() => return Err(SlurmListError::WhiteSpace),
            c => text.push(c),
        }
    }
    if !text.is_empty() {
        parts.push(Part::Text(text));
    }
    if parts.is_empty() {
        return Err(SlurmListError::EmptyName("a trailing comma"));
    }
    names.push(parts);
    Ok(names)
}

/// Parses `01-03,7` (the inside of brackets).
fn parse_ranges(inner: &str) -> std::result::Result<Vec<(u64, u64, usize)>, SlurmListError> {
    let ranges = || inner.to_string();
    let number = |s: &str| -> std::result::Result<u64, SlurmListError> {
        let not_a_number = || SlurmListError::NotANumber {
            ranges: ranges(),
            text: s.to_string(),
        };
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(not_a_number());
        }
        if s.len() > 18 {
            return Err(SlurmListError::TooManyDigits { ranges: ranges() });
        }
        s.parse().map_err(|_| not_a_number())
    };
    inner
        .split(',')
        .map(|r| {
            let (lo, hi) = r.split_once('-').unwrap_or((r, r));
            let (first, last) = (number(lo)?, number(hi)?);
            if first > last {
                return Err(SlurmListError::Decreasing {
                    ranges: ranges(),
                    range: r.to_string(),
                });
            }
            Ok((first, last, lo.len()))
        })
        .collect()
}

/// How many hosts one parsed name stands for (`None` past `u64`).
fn name_count(parts: &[Part]) -> Option<u64> {
    parts.iter().try_fold(1u64, |n, p| match p {
        Part::Text(_) => Some(n),
        Part::Ranges(rs) => {
            let k = rs
                .iter()
                .try_fold(0u64, |k, (a, b, _)| k.checked_add(b - a + 1))?;
            n.checked_mul(k)
        }
    })
}

/// Number of hosts in a compact node list, without expanding it.
pub fn count_hosts(list: &str) -> std::result::Result<u64, SlurmListError> {
    parse_nodelist(list)?.iter().try_fold(0u64, |n, name| {
        name_count(name)
            .and_then(|k| n.checked_add(k))
            .ok_or(SlurmListError::CountOverflow)
    })
}

/// The first host of a compact node list (`node[01-03,7],gpu-a` gives `node01`), without
/// expanding the rest.
pub fn first_host(list: &str) -> std::result::Result<String, SlurmListError> {
    let names = parse_nodelist(list)?;
    let mut host = String::new();
    for part in &names[0] {
        match part {
            Part::Text(t) => host.push_str(t),
            Part::Ranges(rs) => host.push_str(&format!("{:0w$}", rs[0].0, w = rs[0].2)),
        }
    }
    Ok(host)
}

/// Every host of a compact node list, in Slurm's order; at most [`MAX_HOSTS`].
///
/// ```
/// use burn_ddp::env::slurm::expand_nodelist;
/// assert_eq!(
///     expand_nodelist("node[01-03,7],gpu-a").unwrap(),
///     ["node01", "node02", "node03", "node7", "gpu-a"]
/// );
/// ```
pub fn expand_nodelist(list: &str) -> std::result::Result<Vec<String>, SlurmListError> {
    let total = count_hosts(list)?;
    if total > MAX_HOSTS as u64 {
        return Err(SlurmListError::TooManyHosts(total));
    }
    let mut hosts = Vec::with_capacity(total as usize);
    for name in parse_nodelist(list)? {
        let mut partial = vec![String::new()];
        for part in &name {
            partial = match part {
                Part::Text(t) => partial.into_iter().map(|p| p + t).collect(),
                Part::Ranges(rs) => partial
                    .iter()
                    .flat_map(|p| {
                        rs.iter()
                            .flat_map(|&(a, b, w)| (a..=b).map(move |n| format!("{n:0w$}")))
                            .map(move |n| format!("{p}{n}"))
                    })
                    .collect(),
            };
        }
        hosts.extend(partial);
    }
    Ok(hosts)
}

/// Parses a tasks-per-node list (`2(x3),1`) into `(tasks, nodes)` runs.
pub fn parse_tasks_per_node(
    spec: &str,
) -> std::result::Result<Vec<(usize, usize)>, SlurmListError> {
    let spec = spec.trim();
    if spec.is_empty() {
        return Err(SlurmListError::Empty);
    }
    let number = |s: &str| {
        s.parse::<usize>()
            .ok()
            .filter(|_| s.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| SlurmListError::NotACount(s.to_string()))
    };
    spec.split(',')
        .map(|entry| {
            let (tasks, nodes) = match entry.split_once('(') {
                None => (number(entry)?, 1),
                Some((tasks, rest)) => {
                    let nodes = rest
                        .strip_prefix('x')
                        .and_then(|r| r.strip_suffix(')'))
                        .ok_or_else(|| SlurmListError::NotARun(entry.to_string()))?;
                    (number(tasks)?, number(nodes)?)
                }
            };
            if nodes == 0 {
                return Err(SlurmListError::ZeroRepeat(entry.to_string()));
            }
            Ok((tasks, nodes))
        })
        .collect()
}

/// The number of tasks on node `node` (0-based) of a tasks-per-node list, or `None` past its
/// end.
pub fn tasks_on_node(runs: &[(usize, usize)], node: usize) -> Option<usize> {
    let mut start = 0usize;
    for &(tasks, nodes) in runs {
        start = start.saturating_add(nodes);
        if node < start {
            return Some(tasks);
        }
    }
    None
}

/// The port a Slurm job's ranks agree on without `MASTER_PORT`: `10000 + job_id % 20000`.
pub fn job_port(job_id: u64) -> u16 {
    JOB_PORT_BASE + (job_id % JOB_PORT_SPAN) as u16
}

fn invalid(var: &'static str, value: &str, expected: String) -> DdpError {
    DdpError::InvalidEnv {
        var,
        value: value.to_string(),
        expected,
    }
}

/// The number of tasks on this node from `SLURM_STEP_TASKS_PER_NODE` (or the job's
/// `SLURM_TASKS_PER_NODE`) and `SLURM_NODEID`; `None` when neither list is set.
pub(crate) fn local_world_size(get: &impl Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    let Some((var, spec)) = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
        .into_iter()
        .find_map(|var| get(var).map(|v| (var, v)))
    else {
        return Ok(None);
    };
    let runs = parse_tasks_per_node(&spec).map_err(|why| {
        invalid(
            var,
            &spec,
            format!("a Slurm tasks-per-node list such as 2(x3),1 ({why})"),
        )
    })?;
    let nodes: usize = runs.iter().map(|r| r.1).sum();
    let node = match get("SLURM_NODEID") {
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map_err(|_| invalid("SLURM_NODEID", &v, "a non-negative integer".into()))?,
        None if nodes == 1 => 0,
        None => {
            return Err(DdpError::MissingEnv {
                var: "SLURM_NODEID",
                why: format!("{var}={spec} lists {nodes} nodes; which one is this?"),
            });
        }
    };
    tasks_on_node(&runs, node)
        .filter(|&t| t > 0)
        .map(Some)
        .ok_or_else(|| {
            invalid(
                "SLURM_NODEID",
                &node.to_string(),
                format!("a node with tasks in {var}={spec} ({nodes} nodes)"),
            )
        })
}

/// The first host of the step's node list (`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`,
/// else `SLURM_NODELIST`); `None` when none is set.
pub(crate) fn master_addr(get: &impl Fn(&str) -> Option<String>) -> Result<Option<String>> {
    let Some((var, list)) = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ]
    .into_iter()
    .find_map(|var| get(var).map(|v| (var, v))) else {
        return Ok(None);
    };
    first_host(&list).map(Some).map_err(|why| {
        invalid(
            var,
            &list,
            format!("a Slurm node list such as node[01-03,7],gpu-a ({why})"),
        )
    })
}

/// [`job_port`] of `SLURM_JOB_ID`; `None` when it is not set.
pub(crate) fn master_port(get: &impl Fn(&str) -> Option<String>) -> Result<Option<u16>> {
    get("SLURM_JOB_ID")
        .map(|v| {
            v.trim()
                .parse::<u64>()
                .map(job_port)
                .map_err(|_| invalid("SLURM_JOB_ID", &v, "a numeric job id".into()))
        })
        .transpose()
}

#[cfg(test)]
mod tests;
