//! Global metrics: every rank's step output is gathered to rank 0 and combined into the output
//! one process would have produced for the global batch, so the metrics rank 0 reports (loss,
//! accuracy, validation) cover every rank's samples, each counted once.
//!
//! Outputs and targets are concatenated. A loss that is a batch mean (shape `[1]`) is weighted
//! by each rank's batch size, so ranks with different batch sizes (the last batch of an
//! unpadded validation split) give the global mean. A rank without a batch in a step (its
//! shard ran out first) sends nothing.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, RegressionOutput};

use super::telemetry::{JobStats, StepStats};
use crate::ProcessGroup;
use crate::collectives::Work;
use crate::error::{DdpError, Result};
use crate::wire::{DecodeError, Reader, Writer};

/// A training or validation output that can be combined across ranks: each rank encodes its
/// own, the bytes are gathered, and rank 0 decodes all ranks' outputs into one (the
/// concatenation of their batches). Implemented for burn-train's [`ClassificationOutput`] and
/// [`RegressionOutput`]; implement it for your own output types.
pub trait GlobalItem: Sized {
    /// This rank's output as bytes.
    fn encode(self) -> Result<Vec<u8>>;
    /// The outputs of the ranks that had a batch in this step (in rank order, at least one)
    /// combined into one, on `device`.
    fn decode_all(parts: &[Vec<u8>], device: &Device) -> Result<Self>;
}

/// A tensor field of an output: encoded with its shape, concatenated along dimension 0.
trait Field: Sized {
    fn put(self, w: &mut Writer);
    fn get(r: &mut Reader<'_>, device: &Device) -> std::result::Result<Self, DecodeError>;
    fn cat(parts: Vec<Self>) -> Self;
    /// Length of dimension 0 (the batch).
    fn rows(&self) -> usize;
}

impl<const D: usize> Field for Tensor<D> {
    fn put(self, w: &mut Writer) {
        put(w, self.into_data().convert::<f32>())
    }
    fn get(r: &mut Reader<'_>, device: &Device) -> std::result::Result<Self, DecodeError> {
        Ok(Tensor::from_data(get::<f32>(r)?, device))
    }
    fn cat(parts: Vec<Self>) -> Self {
        Tensor::cat(parts, 0)
    }
    fn rows(&self) -> usize {
        self.dims()[0]
    }
}

impl<const D: usize> Field for Tensor<D, Int> {
    fn put(self, w: &mut Writer) {
        put(w, self.into_data().convert::<i64>())
    }
    fn get(r: &mut Reader<'_>, device: &Device) -> std::result::Result<Self, DecodeError> {
        Ok(Tensor::from_data(get::<i64>(r)?, device))
    }
    fn cat(parts: Vec<Self>) -> Self {
        Tensor::cat(parts, 0)
    }
    fn rows(&self) -> usize {
        self.dims()[0]
    }
}

fn put(w: &mut Writer, data: TensorData) {
    let dims = data.shape().clone();
    w.u32(dims.num_dims() as u32);
    for d in dims.iter() {
        w.u64(*d as u64);
    }
    w.bytes(data.as_bytes());
}

fn get<E: burn::tensor::Element + bytemuck::Pod>(
    r: &mut Reader<'_>,
) -> std::result::Result<TensorData, DecodeError> {
    let n = r.u32()? as usize;
    if n > 8 {
        return Err(DecodeError::Invalid(format!("tensor of rank {n}")));
    }
    let dims: Vec<usize> = (0..n)
        .map(|_| r.u64().map(|d| d as usize))
        .collect::<std::result::Result<_, _>>()?;
    let bytes = r.bytes()?;
    let count = dims.iter().try_fold(1usize, |a, d| a.checked_mul(*d));
    if count.and_then(|c| c.checked_mul(size_of::<E>())) != Some(bytes.len()) {
        let reason = format!("{} bytes for shape {dims:?}", bytes.len());
        return Err(DecodeError::Invalid(reason));
    }
    let values: Vec<E> = bytemuck::pod_collect_to_vec(bytes);
    Ok(TensorData::new(values, dims))
}

/// Encodes the three fields of a burn-train output (loss, output, targets).
fn encode3<B: Field, C: Field>(a: Tensor<1>, b: B, c: C) -> Vec<u8> {
    let mut w = Writer::default();
    a.put(&mut w);
    b.put(&mut w);
    c.put(&mut w);
    w.buf
}

/// Decodes the parts' three fields (a loss, outputs, targets) and combines each across them.
fn decode3<B: Field, C: Field>(parts: &[Vec<u8>], device: &Device) -> Result<(Tensor<1>, B, C)> {
    let (mut xs, mut ys, mut zs) = (Vec::new(), Vec::new(), Vec::new());
    for (i, bytes) in parts.iter().enumerate() {
        let mut r = Reader::new(bytes);
        let fields = (|| {
            let fields = (
                Tensor::<1>::get(&mut r, device)?,
                B::get(&mut r, device)?,
                C::get(&mut r, device)?,
            );
            r.finish().map(|()| fields)
        })()
        .map_err(|e| DdpError::Tensor(format!("metrics item {i} of a step: {e}")))?;
        xs.push(fields.0);
        ys.push(fields.1);
        zs.push(fields.2);
    }
    let rows: Vec<usize> = ys.iter().map(Field::rows).collect();
    Ok((combine_losses(xs, &rows), B::cat(ys), C::cat(zs)))
}

/// The loss of the union of the parts' batches: batch means (`[1]` each) weighted by the
/// batches' sizes, per-sample losses concatenated.
fn combine_losses(losses: Vec<Tensor<1>>, rows: &[usize]) -> Tensor<1> {
    if losses.len() == 1 || losses.iter().any(|l| l.dims() != [1]) {
        return Tensor::cat(losses, 0);
    }
    let total: usize = rows.iter().sum();
    let weighted: Vec<Tensor<1>> = losses
        .into_iter()
        .zip(rows)
        .map(|(l, &n)| l.mul_scalar(n as f64 / total.max(1) as f64))
        .collect();
    Tensor::cat(weighted, 0).sum()
}

impl GlobalItem for ClassificationOutput {
    fn encode(self) -> Result<Vec<u8>> {
        Ok(encode3(self.loss, self.output, self.targets))
    }

    fn decode_all(parts: &[Vec<u8>], device: &Device) -> Result<Self> {
        let (loss, output, targets) = decode3(parts, device)?;
        Ok(ClassificationOutput {
            loss,
            output,
            targets,
        })
    }
}

impl GlobalItem for RegressionOutput {
    fn encode(self) -> Result<Vec<u8>> {
        Ok(encode3(self.loss, self.output, self.targets))
    }

    fn decode_all(parts: &[Vec<u8>], device: &Device) -> Result<Self> {
        let (loss, output, targets) = decode3(parts, device)?;
        Ok(RegressionOutput {
            loss,
            output,
            targets,
        })
    }
}

/// An output on its way to rank 0, with the step's [telemetry](super::telemetry): gathered in
/// the background while the next step computes.
pub(crate) enum PendingItem<T> {
    /// A world of one: the output itself (if the step had a batch) and the step's figures.
    Local(Option<T>, Option<StepStats>),
    /// The all-gather of every rank's encoded output and figures.
    Gathering(Work<Vec<Vec<u8>>>),
}

/// First byte of a rank's part: which of the figures and the output follow.
const HAS_ITEM: u8 = 1;
const HAS_STATS: u8 = 2;

impl<T: GlobalItem> PendingItem<T> {
    /// Starts combining `item` (`None`: this rank had no batch in this step) and the step's
    /// figures (`None`: no optimizer step) across the ranks of `group`.
    pub(crate) fn start(
        item: Option<T>,
        stats: Option<StepStats>,
        group: &ProcessGroup,
    ) -> Result<Self> {
        if group.world_size() == 1 {
            return Ok(PendingItem::Local(item, stats));
        }
        let flags = u8::from(item.is_some()) * HAS_ITEM + u8::from(stats.is_some()) * HAS_STATS;
        let mut w = Writer::default();
        w.u8(flags);
        if let Some(stats) = stats {
            stats.encode(&mut w);
        }
        if let Some(item) = item {
            w.bytes(&item.encode()?);
        }
        Ok(PendingItem::Gathering(group.all_gather(w.buf)))
    }

    /// Waits for the gather; rank 0 gets the combined output (`None` if no rank had a batch)
    /// and the job's figures of the step, the others nothing.
    pub(crate) fn finish(
        self,
        rank: usize,
        device: &Device,
    ) -> Result<(Option<T>, Option<JobStats>)> {
        let parts = match self {
            PendingItem::Local(item, stats) => return Ok((item, JobStats::combine(&[stats]))),
            PendingItem::Gathering(work) => work.wait()?,
        };
        if rank != 0 {
            return Ok((None, None));
        }
        let mut items = Vec::new();
        let mut stats = Vec::with_capacity(parts.len());
        for (r, part) in parts.into_iter().enumerate() {
            let malformed =
                |e| DdpError::Tensor(format!("metrics item from rank {r}: malformed ({e})"));
            let mut reader = Reader::new(&part);
            let flags = reader.u8().map_err(malformed)?;
            let mine = (flags & HAS_STATS != 0).then(|| StepStats::decode(&mut reader));
            stats.push(mine.transpose().map_err(malformed)?);
            if flags & HAS_ITEM != 0 {
                items.push(reader.bytes().map_err(malformed)?.to_vec());
            }
            reader.finish().map_err(malformed)?;
        }
        let item = if items.is_empty() {
            None
        } else {
            Some(T::decode_all(&items, device)?)
        };
        Ok((item, JobStats::combine(&stats)))
    }
}
