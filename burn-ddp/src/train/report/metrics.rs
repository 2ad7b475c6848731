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

use crate::ProcessGroup;
use crate::collectives::Work;
use crate::error::{DdpError, Result};
use crate::train::report::telemetry::{JobStats, StepStats};
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
    /// Decodes a field sent by a peer: a shape of another number of dimensions than the type's,
    /// or one its data does not fill, is an error (burn would panic on it).
    fn get(r: &mut Reader<'_>, device: &Device) -> std::result::Result<Self, DecodeError>;
    fn cat(parts: Vec<Self>) -> Self;
    /// The shape.
    fn shape(&self) -> Vec<usize>;
}

impl<const D: usize> Field for Tensor<D> {
    fn put(self, w: &mut Writer) {
        put(w, self.into_data().convert::<f32>())
    }
    fn get(r: &mut Reader<'_>, device: &Device) -> std::result::Result<Self, DecodeError> {
        Ok(Tensor::from_data(get::<f32>(r, D)?, device))
    }
    fn cat(parts: Vec<Self>) -> Self {
        Tensor::cat(parts, 0)
    }
    fn shape(&self) -> Vec<usize> {
        self.dims().to_vec()
    }
}

impl<const D: usize> Field for Tensor<D, Int> {
    fn put(self, w: &mut Writer) {
        put(w, self.into_data().convert::<i64>())
    }
    fn get(r: &mut Reader<'_>, device: &Device) -> std::result::Result<Self, DecodeError> {
        Ok(Tensor::from_data(get::<i64>(r, D)?, device))
    }
    fn cat(parts: Vec<Self>) -> Self {
        Tensor::cat(parts, 0)
    }
    fn shape(&self) -> Vec<usize> {
        self.dims().to_vec()
    }
}

fn put(w: &mut Writer, data: TensorData) {
    let dims = data.shape().clone();
    w.u32(dims.num_dims() as u32);
    for d in dims.iter() {
        w.u64(*d as u64);
    }
    w.long_bytes(data.as_bytes());
}

/// A tensor's data of `rank` dimensions, checked against its shape.
fn get<E: burn::tensor::Element + bytemuck::Pod>(
    r: &mut Reader<'_>,
    rank: usize,
) -> std::result::Result<TensorData, DecodeError> {
    let n = r.u32()? as usize;
    if n != rank {
        let reason = format!("a tensor of {n} dimensions where {rank} are expected");
        return Err(DecodeError::Invalid(reason));
    }
    let dims: Vec<usize> = (0..n)
        .map(|_| r.u64().map(|d| usize::try_from(d).unwrap_or(usize::MAX)))
        .collect::<std::result::Result<_, _>>()?;
    let bytes = r.long_bytes()?;
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
/// Outputs (or targets) whose shapes differ beyond dimension 0 do not concatenate: an error.
fn decode3<B: Field, C: Field>(parts: &[Vec<u8>], device: &Device) -> Result<(Tensor<1>, B, C)> {
    let item = |i: usize| match parts.len() {
        1 => "the metrics item".to_string(),
        _ => format!("metrics item {i}"),
    };
    let (mut xs, mut ys, mut zs) = (Vec::new(), Vec::new(), Vec::new());
    for (i, bytes) in parts.iter().enumerate() {
        let mut r = Reader::new(bytes);
        let field = |what: &'static str| {
            let item = item(i);
            move |e| DdpError::Tensor(format!("{item}: its {what}: {e}"))
        };
        xs.push(Tensor::<1>::get(&mut r, device).map_err(field("loss"))?);
        ys.push(B::get(&mut r, device).map_err(field("output"))?);
        zs.push(C::get(&mut r, device).map_err(field("targets"))?);
        r.finish()
            .map_err(|e| DdpError::Tensor(format!("{}: {e}", item(i))))?;
    }
    for (what, shapes) in [
        ("output", ys.iter().map(Field::shape).collect::<Vec<_>>()),
        ("targets", zs.iter().map(Field::shape).collect()),
    ] {
        if let Some(i) = (1..shapes.len()).find(|&i| shapes[i][1..] != shapes[0][1..]) {
            return Err(DdpError::Tensor(format!(
                "{}'s {what} of shape {:?} does not concatenate with {}'s of shape {:?}",
                item(i),
                shapes[i],
                item(0),
                shapes[0]
            )));
        }
    }
    let rows: Vec<usize> = ys.iter().map(|y| y.shape()[0]).collect();
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

/// An output on its way to rank 0, with the step's [telemetry](crate::train::report::telemetry): gathered in
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

/// A rank's part of the gather: the flags, its figures and its encoded output (each if any).
fn part(item: Option<&[u8]>, stats: Option<StepStats>) -> Vec<u8> {
    let flags = u8::from(item.is_some()) * HAS_ITEM + u8::from(stats.is_some()) * HAS_STATS;
    let mut w = Writer::default();
    w.u8(flags);
    if let Some(stats) = stats {
        stats.encode(&mut w);
    }
    if let Some(item) = item {
        w.long_bytes(item);
    }
    w.buf
}

/// The error of combining the step's metrics `items` (sent by the ranks `senders`; combining
/// them all failed with `error`), naming a rank: the first whose item does not decode alone,
/// else the first whose item does not combine with the first sender's.
fn blame<T: GlobalItem>(
    items: &[Vec<u8>],
    senders: &[usize],
    device: &Device,
    error: DdpError,
) -> DdpError {
    let words = |e: DdpError| match e {
        DdpError::Tensor(why) => why,
        e => e.to_string(),
    };
    let alone = |i: usize| T::decode_all(std::slice::from_ref(&items[i]), device).err();
    let with_first = |i: usize| T::decode_all(&[items[0].clone(), items[i].clone()], device).err();
    let why = match (0..items.len()).find_map(|i| alone(i).map(|e| (i, e))) {
        Some((i, e)) => format!("rank {} sent a malformed item: {}", senders[i], words(e)),
        None => match (1..items.len()).find_map(|i| with_first(i).map(|e| (i, e))) {
            Some((i, e)) => format!(
                "rank {}'s item does not combine with rank {}'s: {}",
                senders[i],
                senders[0],
                words(e)
            ),
            None => format!(
                "the items of ranks {senders:?} do not combine: {}",
                words(error)
            ),
        },
    };
    DdpError::Tensor(format!("gathering a step's metrics to rank 0: {why}"))
}

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
        let item = item.map(T::encode).transpose()?;
        Ok(PendingItem::Gathering(
            group.all_gather(part(item.as_deref(), stats)),
        ))
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
        let (mut items, mut senders) = (Vec::new(), Vec::new());
        let mut stats = Vec::with_capacity(parts.len());
        for (r, part) in parts.into_iter().enumerate() {
            let malformed =
                |e| DdpError::Tensor(format!("metrics item from rank {r}: malformed ({e})"));
            let mut reader = Reader::new(&part);
            let flags = reader.u8().map_err(malformed)?;
            let mine = (flags & HAS_STATS != 0).then(|| StepStats::decode(&mut reader));
            stats.push(mine.transpose().map_err(malformed)?);
            if flags & HAS_ITEM != 0 {
                items.push(reader.long_bytes().map_err(malformed)?.to_vec());
                senders.push(r);
            }
            reader.finish().map_err(malformed)?;
        }
        let item = if items.is_empty() {
            None
        } else {
            let combined = T::decode_all(&items, device);
            Some(combined.map_err(|e| blame::<T>(&items, &senders, device, e))?)
        };
        Ok((item, JobStats::combine(&stats)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn device() -> Device {
        Device::flex()
    }

    /// A classification part whose output has `dims` (zeros) for 2 samples.
    fn part_with_output<const D: usize>(dims: [usize; D]) -> Vec<u8> {
        let d = device();
        let loss = Tensor::<1>::from_floats([0.5], &d);
        let targets = Tensor::<1, Int>::from_ints([1, 0], &d);
        encode3(loss, Tensor::<D>::zeros(dims, &d), targets)
    }

    /// The parts decoded and combined, or the error in words.
    fn decode(parts: &[Vec<u8>]) -> std::result::Result<(), String> {
        ClassificationOutput::decode_all(parts, &device())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// A peer's output with another number of dimensions than the type's, a shape its data
    /// does not fill, or a width other than the other ranks' is an error naming the field, not
    /// a panic.
    #[test]
    fn malformed_metrics_tensors_are_errors_not_panics() {
        assert_eq!(decode(&[part_with_output([2, 3])]), Ok(()));
        let e = decode(&[part_with_output([2, 3, 1])]).unwrap_err();
        assert!(e.contains("3 dimensions") && e.contains("output"), "{e}");

        // Shape [2, 3] over 5 values.
        let mut w = Writer::default();
        Tensor::<1>::from_floats([0.5], &device()).put(&mut w);
        w.u32(2).u64(2).u64(3);
        w.long_bytes(bytemuck::cast_slice(&[0f32; 5]));
        Tensor::<1, Int>::from_ints([1, 0], &device()).put(&mut w);
        let e = decode(&[w.buf]).unwrap_err();
        assert!(e.contains("20 bytes for shape [2, 3]"), "{e}");

        let parts = [part_with_output([2, 3]), part_with_output([2, 4])];
        let e = decode(&parts).unwrap_err();
        assert!(e.contains("[2, 4]") && e.contains("[2, 3]"), "{e}");
    }

    /// Rank 0's outcome of gathering one step whose rank `r` sends `items[r]` (ranks are
    /// threads over loopback TCP); the other ranks only send.
    fn gather_step(items: Vec<Vec<u8>>) -> String {
        let options = crate::GroupOptions {
            timeout: Duration::from_secs(30),
            rendezvous_timeout: Duration::from_secs(30),
            ..crate::GroupOptions::default()
        };
        let outcomes = crate::group::thread_world(items.len(), options, |rank, group| {
            let pending = PendingItem::<ClassificationOutput>::Gathering(
                group.all_gather(part(Some(&items[rank]), None)),
            );
            match pending.finish(rank, &device()) {
                Ok(_) => "ok".to_string(),
                Err(e) => e.to_string(),
            }
        });
        assert!(outcomes[1..].iter().all(|o| o == "ok"), "{outcomes:?}");
        outcomes[0].clone()
    }

    /// A peer that sends rank 0 an output of the wrong number of dimensions, or one that does
    /// not concatenate with rank 0's: rank 0's gather of the step's metrics is an error that
    /// names the operation and that rank, and rank 0 does not panic.
    #[test]
    fn a_peers_malformed_metrics_item_is_an_error_naming_it() {
        let e = gather_step(vec![part_with_output([2, 3]), part_with_output([2, 3, 1])]);
        let named = "gathering a step's metrics to rank 0: rank 1 sent a malformed item";
        assert!(e.contains(named) && e.contains("3 dimensions"), "{e}");
        let e = gather_step(vec![
            part_with_output([2, 3]),
            part_with_output([1, 3]),
            part_with_output([2, 4]),
        ]);
        let named = "rank 2's item does not combine with rank 0's";
        assert!(e.contains(named) && e.contains("[2, 4]"), "{e}");
    }
}
