//! Collective operations over flat buffers: element types, reduction operators, the buffers
//! collectives accept and the [`Work`] handle of an operation started now and waited for later.
//!
//! The operations themselves are methods of [`crate::ProcessGroup`], generic over the buffer
//! ([`Reducible`], [`Broadcastable`], [`Gatherable`]), which the group hands to its backends
//! (`backend`, c10d's layer below the process group):
//! - host vectors travel by the host transport (`host`), on the collective thread (`worker`):
//!   the TCP ring (`tcp`), shared memory (`shm`) when ranks share a host, or the hierarchical
//!   all-reduce across hosts, all cutting buffers by one `schedule`;
//! - burn tensors by the backend of their device kind (`device`, feature `train`: NCCL for CUDA
//!   from `burn-ddp-nccl`, host staging over the host transport for every other device).
//!
//! `agreement` is how ranks check that they agree on something (one gather, compared with rank
//! 0). How an operation is described on the wire and in errors (`OpKind`, `OpDesc`) is
//! internal: errors carry it as text, as in `all_reduce #12 of 4096 x f32`.

#[cfg(feature = "train")]
pub(crate) mod agreement;
#[cfg(feature = "train")]
pub(crate) mod backend;
pub(crate) mod backends;
pub(crate) mod transport;
pub(crate) mod worker;

use half::{bf16, f16};

pub use backends::{Broadcastable, Gatherable, Reducible};
pub use worker::Work;

/// The [`Element`] types a collective can carry, as a value: named in messages and sent as a
/// wire code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DType {
    /// Raw bytes.
    U8 = 1,
    /// IEEE half precision.
    F16 = 2,
    /// bfloat16.
    BF16 = 3,
    /// IEEE single precision.
    F32 = 4,
    /// IEEE double precision.
    F64 = 5,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// Short name, as in `f32`.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        [DType::U8, DType::F16, DType::BF16, DType::F32, DType::F64]
            .into_iter()
            .find(|d| *d as u8 == code)
    }
}

/// A plain element type that collectives can move (`broadcast`); [`DType`] names it at run
/// time.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// Its wire code.
    const DTYPE: DType;
}

/// An element type that can be reduced (`all_reduce`).
pub trait Reduce: Element {
    /// `acc[i] = acc[i] (op) other[i]`. Sum and average both add here.
    fn combine(acc: &mut [Self], other: &[Self], op: ReduceOp);
    /// `data[i] /= divisor` (the last step of an average).
    fn divide(data: &mut [Self], divisor: usize);
}

impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}

/// How `all_reduce` and `reduce_scatter` combine the ranks' buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size (PyTorch's `ReduceOp.AVG`).
    Avg,
    /// Element-wise maximum; NaN wins, so a NaN on any rank shows on all.
    Max,
    /// Element-wise minimum; NaN wins.
    Min,
}

/// The kinds of collective, as named in errors and on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum OpKind {
    /// `all_reduce`.
    AllReduce = 1,
    /// `broadcast`.
    Broadcast = 2,
    /// The size exchange that starts an `all_gather`.
    AllGatherSizes = 3,
    /// `all_gather`.
    AllGather = 4,
    /// `barrier`.
    Barrier = 5,
    /// `reduce_scatter`.
    ReduceScatter = 6,
}

impl OpKind {
    /// The name used in messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGatherSizes => "all_gather (sizes)",
            OpKind::AllGather => "all_gather",
            OpKind::Barrier => "barrier",
            OpKind::ReduceScatter => "reduce_scatter",
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        [
            OpKind::AllReduce,
            OpKind::Broadcast,
            OpKind::AllGatherSizes,
            OpKind::AllGather,
            OpKind::Barrier,
            OpKind::ReduceScatter,
        ]
        .into_iter()
        .find(|k| *k as u8 == code)
    }
}

/// One collective call: which one, its sequence number in the group, element type and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpDesc {
    /// What it is.
    pub kind: OpKind,
    /// Position among the group's collectives (0-based), the same on every rank.
    pub seq: u64,
    /// Element type.
    pub dtype: DType,
    /// Buffer length in bytes (for `all_gather`: the total of all ranks).
    pub bytes: u64,
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let elems = self.bytes / self.dtype.size() as u64;
        write!(
            f,
            "{} #{} of {} x {}",
            self.kind.name(),
            self.seq,
            elems,
            self.dtype.name()
        )
    }
}
