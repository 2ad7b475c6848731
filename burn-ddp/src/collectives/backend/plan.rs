//! What the NCCL backend does around each NCCL call, as data: what every rank must agree on
//! before it, how this rank's tensor is cut and padded into NCCL's input, which equal-part NCCL
//! collective runs, and how its output is cut back into the result.
//!
//! NCCL moves equal lengths only (a gather or a reduce-scatter cuts its buffer in `world`
//! equal parts), so unequal parts travel padded with zeros to the longest ("slot") and the
//! padding is cut away on arrival. Every rank's request is described in words and the
//! descriptions compared (one small host all-gather) before NCCL runs: a rank that asks for
//! another length, element type, reduction, root or parts is an error that names it on every
//! rank, never a hang nor a read past a shorter rank's buffer. A rank whose own request is
//! invalid says so in the same message, so every rank fails alike.
//!
//! burn 0.22's `Tensor::narrow` panics on a length of 0: every cut here goes through
//! [`cut`], which makes an empty tensor instead, and a request with nothing to move (slot 0) makes no
//! NCCL call at all.
//!
//! The plans are device-independent: CI runs every one of them on host tensors against the host
//! collectives ([`super::emulated`], feature `test-support`); on a GPU only the NCCL call differs.

use burn::tensor::{DType, Device, Tensor};

use super::slices::{concat, cut, empty};
use super::{Request, invalid};
use crate::collectives::agreement::Gathered;
use crate::collectives::worker::Queue;
use crate::collectives::worker::Worker;
use crate::collectives::{ReduceOp, Work};
use crate::error::{DdpError, Result};
use crate::wire::Writer;

/// The NCCL collective a plan runs, on `count` elements per rank (the slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// `ncclAllReduce` of `count` elements.
    AllReduce(ReduceOp),
    /// `ncclBroadcast` of `count` elements from a root.
    Broadcast(usize),
    /// `ncclAllGather` of `count` elements per rank (`world * count` out).
    AllGather,
    /// `ncclReduceScatter` of `world * count` elements (`count` out).
    ReduceScatter(ReduceOp),
}

/// One collective of one rank, planned for NCCL.
pub(crate) struct Plan {
    /// The collective's name in errors ("all_reduce", ...).
    pub name: &'static str,
    rank: usize,
    /// Ranks in the group (read by the host emulation, feature `test-support`).
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    world: usize,
    /// What every rank must ask for alike, in words.
    described: String,
    /// What is wrong with this rank's own request, if anything.
    problem: Option<String>,
    /// The NCCL call; `None` when there is nothing to move or the request is invalid.
    call: Option<Call>,
    /// Elements per rank NCCL moves.
    slot: usize,
    /// Lengths that cut this rank's tensor, in order; each travels padded to `slot`.
    pieces: Vec<usize>,
    /// Ranges `(start, len)` of NCCL's output that make the result, in order.
    keep: Vec<(usize, usize)>,
    device: Device,
    dtype: DType,
}

impl Plan {
    /// The plan of `request` on `tensor` for `rank` of `world`.
    fn new(request: &Request, rank: usize, world: usize, tensor: &Tensor<1>) -> Plan {
        let (n, dtype) = (tensor.shape().num_elements(), tensor.dtype());
        let mut plan = Plan {
            name: request.name(),
            rank,
            world,
            described: String::new(),
            problem: None,
            call: None,
            slot: n,
            pieces: vec![n],
            keep: vec![(0, n)],
            device: tensor.device(),
            dtype,
        };
        let call = match request {
            Request::AllReduce(op) => {
                plan.described = format!("all_reduce ({op:?}) of {n} x {dtype:?}");
                Call::AllReduce(*op)
            }
            Request::Broadcast(root) => {
                plan.described = format!("broadcast from rank {root} of {n} x {dtype:?}");
                if *root >= world {
                    plan.problem = Some(format!("broadcast root {root} >= world size {world}"));
                }
                Call::Broadcast(*root)
            }
            Request::AllGather => {
                plan.described = format!("all_gather of {n} x {dtype:?} from every rank");
                plan.keep = (0..world).map(|r| (r * n, n)).collect();
                Call::AllGather
            }
            Request::AllGatherParts(parts) => {
                plan.described = format!("all_gather of {dtype:?} in parts {parts:?}");
                plan.slot = parts.iter().copied().max().unwrap_or(0);
                plan.keep = (parts.iter().enumerate())
                    .map(|(r, &p)| (r * plan.slot, p))
                    .collect();
                if parts.len() != world {
                    plan.problem = Some(format!("{} parts for {world} ranks", parts.len()));
                } else if parts[rank] != n {
                    plan.problem = Some(format!(
                        "rank {rank} gives {n} elements but its part of {parts:?} is {}",
                        parts[rank]
                    ));
                }
                Call::AllGather
            }
            Request::ReduceScatter(parts, op) => {
                plan.described =
                    format!("reduce_scatter ({op:?}) of {n} x {dtype:?} in parts {parts:?}");
                plan.slot = parts.iter().copied().max().unwrap_or(0);
                plan.pieces = parts.clone();
                plan.keep = vec![(0, parts.get(rank).copied().unwrap_or(0))];
                if parts.len() != world || parts.iter().sum::<usize>() != n {
                    plan.problem = Some(format!(
                        "parts {parts:?} do not cut {n} elements among {world} ranks"
                    ));
                }
                Call::ReduceScatter(*op)
            }
        };
        plan.call = (plan.problem.is_none() && plan.slot > 0).then_some(call);
        plan
    }

    /// Elements per rank the call moves.
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub(crate) fn slot(&self) -> usize {
        self.slot
    }

    /// Ranks in the group.
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// NCCL's input: `tensor` cut into the plan's pieces, each padded with zeros to the slot
    /// (the tensor itself when nothing needs padding); `None` when no call is made.
    fn input(&self, tensor: Tensor<1>) -> Option<Tensor<1>> {
        self.call?;
        if self.pieces.iter().all(|&p| p == self.slot) {
            return Some(tensor);
        }
        let mut start = 0;
        let mut padded = Vec::new();
        for &piece in &self.pieces {
            padded.push(cut(&tensor, start, piece));
            start += piece;
            if piece < self.slot {
                let zeros = Tensor::zeros([self.slot - piece], (&self.device, self.dtype));
                padded.push(zeros);
            }
        }
        Some(concat(padded, &self.device, self.dtype))
    }

    /// This rank's message for the agreement: its description and its own problem, if any.
    fn message(&self) -> Vec<u8> {
        let problem = self.problem.as_deref().unwrap_or("");
        Writer::default()
            .bytes(self.described.as_bytes())
            .bytes(problem.as_bytes())
            .buf
            .clone()
    }

    /// Checks every rank's message (gathered by [`Plan::message`]): the first rank whose request
    /// differs from rank 0's, or whose own request is invalid, fails the collective on every
    /// rank with the same words.
    fn agree(&self, said: &Gathered) -> Result<()> {
        let all = said.decode_each("a collective's description", |r| {
            Ok((r.string()?, r.string()?))
        })?;
        let (first, _) = &all[0];
        if let Some(other) = all.iter().position(|(described, _)| described != first) {
            let reason = format!(
                "rank 0 runs {first} but rank {other} {}: every rank must give the same length, \
                 element type and parts, in the same order of collectives",
                all[other].0
            );
            return Err(invalid(self.rank, self.name, reason));
        }
        match all.iter().position(|(_, problem)| !problem.is_empty()) {
            Some(r) => Err(invalid(
                self.rank,
                self.name,
                format!("rank {r}: {}", all[r].1),
            )),
            None => Ok(()),
        }
    }

    /// The result's tensors, cut from NCCL's output (`None` when no call was made: every kept
    /// range is then empty).
    fn pieces_of(&self, output: Option<Tensor<1>>) -> Result<Vec<Tensor<1>>> {
        let empty = || empty(&self.device, self.dtype);
        let Some(output) = output else {
            return match self.keep.iter().all(|&(_, len)| len == 0) {
                true => Ok(self.keep.iter().map(|_| empty()).collect()),
                false => Err(self.broken("no output for a non-empty result")),
            };
        };
        let have = output.shape().num_elements();
        if let Some(&(start, len)) = self.keep.iter().find(|(s, l)| s + l > have) {
            let reason = format!("output of {have} elements, cut at {start}..{}", start + len);
            return Err(self.broken(&reason));
        }
        Ok(self.keep.iter().map(|&(s, l)| cut(&output, s, l)).collect())
    }

    /// An output that does not fit the plan: a defect of the backend, named as such.
    fn broken(&self, what: &str) -> DdpError {
        let reason = format!("internal error: {what} ({})", self.described);
        invalid(self.rank, self.name, reason)
    }
}

/// Runs `request` on `tensor` by its plan: on the caller's thread the plan is made and `begin`
/// starts NCCL's call on the padded input (NCCL's pending collective, or the input itself for
/// the host emulation); on the collective thread every rank's request is agreed first, then
/// `finish` makes NCCL's output from what `begin` returned, and the result is cut from it and
/// handed to `done`. With no call to make (on every rank alike) only the agreement runs.
pub(crate) fn run<S: Send + 'static, T: Send + 'static>(
    queue: &Queue,
    tensor: Tensor<1>,
    request: Request,
    begin: impl FnOnce(Call, Tensor<1>) -> S,
    finish: impl FnOnce(&mut Worker, &Plan, S) -> Result<Tensor<1>> + Send + 'static,
    done: impl FnOnce(Vec<Tensor<1>>) -> T + Send + 'static,
) -> Work<T> {
    let plan = Plan::new(&request, queue.rank(), queue.world(), &tensor);
    let started = (plan.call.zip(plan.input(tensor))).map(|(call, input)| begin(call, input));
    queue.on_worker(move |w| {
        let said = w.all_gather_object(&plan.message())?;
        plan.agree(&said)?;
        let output = match started {
            Some(started) => Some(finish(w, &plan, started)?),
            None => None,
        };
        Ok(done(plan.pieces_of(output)?))
    })
}
