//! Global metrics: every rank's step output is gathered to rank 0 and concatenated, so the
//! metrics rank 0 reports (loss, accuracy, validation) cover the global batch.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, RegressionOutput};

use crate::ProcessGroup;
use crate::collectives::Work;
use crate::error::{DdpError, Result};
use crate::wire::{Reader, Writer};

/// A training or validation output that can be combined across ranks: each rank encodes its
/// own, the bytes are gathered, and rank 0 decodes all ranks' outputs into one (the
/// concatenation of their batches). Implemented for burn-train's [`ClassificationOutput`] and
/// [`RegressionOutput`]; implement it for your own output types.
pub trait GlobalItem: Sized {
    /// This rank's output as bytes.
    fn encode(self) -> Result<Vec<u8>>;
    /// Every rank's output (in rank order) combined into one, on `device`.
    fn decode_all(parts: &[Vec<u8>], device: &Device) -> Result<Self>;
}

fn put_float<const D: usize>(w: &mut Writer, t: Tensor<D>) {
    put(w, t.into_data().convert::<f32>())
}

fn put_int<const D: usize>(w: &mut Writer, t: Tensor<D, Int>) {
    put(w, t.into_data().convert::<i64>())
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
) -> std::result::Result<TensorData, String> {
    let n = r.u32()? as usize;
    if n > 8 {
        return Err(format!("tensor of rank {n}"));
    }
    let dims: Vec<usize> = (0..n)
        .map(|_| r.u64().map(|d| d as usize))
        .collect::<std::result::Result<_, _>>()?;
    let bytes = r.bytes()?;
    let count = dims.iter().try_fold(1usize, |a, d| a.checked_mul(*d));
    if count.and_then(|c| c.checked_mul(size_of::<E>())) != Some(bytes.len()) {
        return Err(format!("{} bytes for shape {dims:?}", bytes.len()));
    }
    let values: Vec<E> = bytemuck::pod_collect_to_vec(bytes);
    Ok(TensorData::new(values, dims))
}

fn float<const D: usize>(
    r: &mut Reader<'_>,
    device: &Device,
) -> std::result::Result<Tensor<D>, String> {
    Ok(Tensor::from_data(get::<f32>(r)?, device))
}

fn int<const D: usize>(
    r: &mut Reader<'_>,
    device: &Device,
) -> std::result::Result<Tensor<D, Int>, String> {
    Ok(Tensor::from_data(get::<i64>(r)?, device))
}

/// Decodes each rank's bytes with `decode` and concatenates the parts field by field.
fn decode_each<T>(
    parts: &[Vec<u8>],
    decode: impl Fn(&mut Reader<'_>) -> std::result::Result<T, String>,
) -> Result<Vec<T>> {
    parts
        .iter()
        .enumerate()
        .map(|(rank, bytes)| {
            let mut r = Reader::new(bytes);
            decode(&mut r)
                .and_then(|t| r.finish().map(|()| t))
                .map_err(|e| DdpError::Tensor(format!("metrics item from rank {rank}: {e}")))
        })
        .collect()
}

impl GlobalItem for ClassificationOutput {
    fn encode(self) -> Result<Vec<u8>> {
        let mut w = Writer::default();
        put_float(&mut w, self.loss);
        put_float(&mut w, self.output);
        put_int(&mut w, self.targets);
        Ok(w.buf)
    }

    fn decode_all(parts: &[Vec<u8>], device: &Device) -> Result<Self> {
        let items = decode_each(parts, |r| {
            Ok((
                float::<1>(r, device)?,
                float::<2>(r, device)?,
                int::<1>(r, device)?,
            ))
        })?;
        let (loss, (output, targets)): (Vec<_>, (Vec<_>, Vec<_>)) =
            items.into_iter().map(|(l, o, t)| (l, (o, t))).unzip();
        Ok(ClassificationOutput {
            loss: Tensor::cat(loss, 0),
            output: Tensor::cat(output, 0),
            targets: Tensor::cat(targets, 0),
        })
    }
}

impl GlobalItem for RegressionOutput {
    fn encode(self) -> Result<Vec<u8>> {
        let mut w = Writer::default();
        put_float(&mut w, self.loss);
        put_float(&mut w, self.output);
        put_float(&mut w, self.targets);
        Ok(w.buf)
    }

    fn decode_all(parts: &[Vec<u8>], device: &Device) -> Result<Self> {
        let items = decode_each(parts, |r| {
            Ok((
                float::<1>(r, device)?,
                float::<2>(r, device)?,
                float::<2>(r, device)?,
            ))
        })?;
        let (loss, (output, targets)): (Vec<_>, (Vec<_>, Vec<_>)) =
            items.into_iter().map(|(l, o, t)| (l, (o, t))).unzip();
        Ok(RegressionOutput {
            loss: Tensor::cat(loss, 0),
            output: Tensor::cat(output, 0),
            targets: Tensor::cat(targets, 0),
        })
    }
}

/// An output on its way to rank 0: gathered in the background while the next step computes.
pub(crate) enum PendingItem<T> {
    /// A world of one: the output itself.
    Local(T),
    /// The all-gather of every rank's encoded output.
    Gathering(Work<Vec<Vec<u8>>>),
}

impl<T: GlobalItem> PendingItem<T> {
    /// Starts combining `item` across the ranks of `group`.
    pub(crate) fn start(item: T, group: &ProcessGroup) -> Result<Self> {
        if group.world_size() == 1 {
            return Ok(PendingItem::Local(item));
        }
        Ok(PendingItem::Gathering(group.all_gather(item.encode()?)))
    }

    /// Waits for the gather; rank 0 gets the combined output, the others `None`.
    pub(crate) fn finish(self, rank: usize, device: &Device) -> Result<Option<T>> {
        match self {
            PendingItem::Local(item) => Ok(Some(item)),
            PendingItem::Gathering(work) => {
                let parts = work.wait()?;
                if rank == 0 {
                    T::decode_all(&parts, device).map(Some)
                } else {
                    Ok(None)
                }
            }
        }
    }
}
