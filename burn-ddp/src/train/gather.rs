//! Global metrics: every rank's step output is gathered to rank 0 and concatenated, so the
//! metrics rank 0 reports (loss, accuracy, validation) cover the global batch.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, RegressionOutput};

use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::wire::{Reader, Writer};

/// A training or validation output that can be combined across ranks. Implemented for
/// burn-train's [`ClassificationOutput`] and [`RegressionOutput`]; implement it for your own
/// output types (usually: encode each tensor, then concatenate along the batch dimension).
pub trait GlobalItem: Sized {
    /// Collective: every rank calls it with its own output; rank 0 gets the combined output,
    /// the others `None`. With one rank, returns the item unchanged.
    fn gather_to_rank0(self, group: &ProcessGroup) -> Result<Option<Self>>;
}

fn put_float<const D: usize>(w: &mut Writer, t: Tensor<D>) -> Result<()> {
    put(w, t.into_data().convert::<f32>())
}

fn put_int<const D: usize>(w: &mut Writer, t: Tensor<D, Int>) -> Result<()> {
    put(w, t.into_data().convert::<i64>())
}

fn put(w: &mut Writer, data: TensorData) -> Result<()> {
    let dims = data.shape().clone();
    w.u32(dims.num_dims() as u32);
    for d in dims.iter() {
        w.u64(*d as u64);
    }
    w.bytes(data.as_bytes());
    Ok(())
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
        .collect::<Result<_, _>>()?;
    let bytes = r.bytes()?;
    let count = dims.iter().product::<usize>();
    if count * size_of::<E>() != bytes.len() {
        return Err(format!("{} bytes for shape {dims:?}", bytes.len()));
    }
    let values: Vec<E> = bytemuck::pod_collect_to_vec(bytes);
    Ok(TensorData::new(values, dims))
}

/// Encodes with `encode` on every rank, gathers, and on rank 0 decodes every rank's bytes with
/// `decode` and combines them with `combine`.
fn gather_with<T>(
    group: &ProcessGroup,
    encode: impl FnOnce(&mut Writer) -> Result<()>,
    decode: impl Fn(&mut Reader<'_>) -> std::result::Result<T, String>,
    combine: impl FnOnce(Vec<T>) -> T,
) -> Result<Option<T>> {
    let mut w = Writer::default();
    encode(&mut w)?;
    let all = group.all_gather(w.buf).wait()?;
    if group.rank() != 0 {
        return Ok(None);
    }
    let parts = all
        .iter()
        .enumerate()
        .map(|(rank, bytes)| {
            decode(&mut Reader::new(bytes))
                .map_err(|e| DdpError::Tensor(format!("metrics item from rank {rank}: {e}")))
        })
        .collect::<Result<Vec<T>>>()?;
    Ok(Some(combine(parts)))
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

impl GlobalItem for ClassificationOutput {
    fn gather_to_rank0(self, group: &ProcessGroup) -> Result<Option<Self>> {
        if group.world_size() == 1 {
            return Ok(Some(self));
        }
        let device = self.output.device();
        gather_with(
            group,
            |w| {
                put_float(w, self.loss)?;
                put_float(w, self.output)?;
                put_int(w, self.targets)
            },
            |r| {
                Ok((
                    float::<1>(r, &device)?,
                    float::<2>(r, &device)?,
                    int::<1>(r, &device)?,
                ))
            },
            |parts| {
                let (mut l, mut o, mut t) = (vec![], vec![], vec![]);
                for (a, b, c) in parts {
                    l.push(a);
                    o.push(b);
                    t.push(c);
                }
                (Tensor::cat(l, 0), Tensor::cat(o, 0), Tensor::cat(t, 0))
            },
        )
        .map(|o| {
            o.map(|(loss, output, targets)| ClassificationOutput {
                loss,
                output,
                targets,
            })
        })
    }
}

impl GlobalItem for RegressionOutput {
    fn gather_to_rank0(self, group: &ProcessGroup) -> Result<Option<Self>> {
        if group.world_size() == 1 {
            return Ok(Some(self));
        }
        let device = self.output.device();
        gather_with(
            group,
            |w| {
                put_float(w, self.loss)?;
                put_float(w, self.output)?;
                put_float(w, self.targets)
            },
            |r| {
                Ok((
                    float::<1>(r, &device)?,
                    float::<2>(r, &device)?,
                    float::<2>(r, &device)?,
                ))
            },
            |parts| {
                let (mut l, mut o, mut t) = (vec![], vec![], vec![]);
                for (a, b, c) in parts {
                    l.push(a);
                    o.push(b);
                    t.push(c);
                }
                (Tensor::cat(l, 0), Tensor::cat(o, 0), Tensor::cat(t, 0))
            },
        )
        .map(|o| {
            o.map(|(loss, output, targets)| RegressionOutput {
                loss,
                output,
                targets,
            })
        })
    }
}
