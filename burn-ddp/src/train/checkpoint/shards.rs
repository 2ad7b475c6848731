//! Optimizer records of a sharded run: each rank's holds the state of its own parameters, in
//! burn's record format (burnpack), keyed by parameter id (ids rank 0 gave every rank, see
//! `params::broadcast_module`). A checkpoint holds them merged into one record, as an
//! unsharded run would write it; a rank that resumes sharded keeps the entries of the
//! parameters it owns under the new world size.

use std::collections::HashSet;

use burn::tensor::Bytes;
use burn_pack::{Reader, Tensor, Writer};

use super::SnapshotError;
use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::wire::{self, DecodeError};

/// One record's parts.
struct Parts {
    tensors: Vec<Tensor>,
    scalars: Vec<(String, burn_pack::Scalar)>,
    metadata: Vec<(String, String)>,
}

fn read(record: &[u8]) -> std::result::Result<Parts, SnapshotError> {
    let bad = |e: burn_pack::Error| SnapshotError::Encode(format!("an optimizer record: {e}"));
    let reader = Reader::from_bytes(Bytes::from_bytes_vec(record.to_vec())).map_err(bad)?;
    let scalars = reader.scalars().clone().into_iter().collect();
    let metadata = reader.metadata().clone().into_iter().collect();
    let tensors = reader.into_tensors().map_err(bad)?;
    Ok(Parts {
        tensors,
        scalars,
        metadata,
    })
}

fn write(parts: Parts) -> std::result::Result<Vec<u8>, SnapshotError> {
    let mut writer = Writer::new(parts.tensors);
    for (key, value) in &parts.scalars {
        writer = writer.with_scalar(key, *value);
    }
    for (key, value) in &parts.metadata {
        writer = writer.with_metadata(key, value);
    }
    let bytes = writer
        .into_bytes()
        .map_err(|e| SnapshotError::Encode(format!("an optimizer record: {e}")))?;
    Ok(bytes.to_vec())
}

/// The ranks' records merged into one: every tensor, scalar and path of each.
pub(crate) fn merge(records: &[Vec<u8>]) -> std::result::Result<Vec<u8>, SnapshotError> {
    let mut all = Parts {
        tensors: Vec::new(),
        scalars: Vec::new(),
        metadata: Vec::new(),
    };
    for record in records {
        let parts = read(record)?;
        all.tensors.extend(parts.tensors);
        all.scalars.extend(parts.scalars);
        all.metadata.extend(parts.metadata);
    }
    write(all)
}

/// The id a record's key belongs to: `"{id}"` or `"{id}.{name}"`.
fn key_id(key: &str) -> Option<u64> {
    key.split('.').next()?.parse().ok()
}

/// `record` with only the entries of the parameters `ids`.
pub(crate) fn keep(
    record: &[u8],
    ids: &HashSet<u64>,
) -> std::result::Result<Vec<u8>, SnapshotError> {
    let mut parts = read(record)?;
    let mine = |id: Option<u64>| id.is_some_and(|id| ids.contains(&id));
    parts.tensors.retain(|t| mine(t.param_id));
    parts.scalars.retain(|(key, _)| mine(key_id(key)));
    parts.metadata.retain(|(key, _)| mine(key_id(key)));
    write(parts)
}

/// Bytes of the state tensors in `record`.
pub(crate) fn state_bytes(record: &[u8]) -> std::result::Result<usize, SnapshotError> {
    Ok(read(record)?.tensors.iter().map(Tensor::byte_len).sum())
}

/// Every rank's optimizer record (a sharded run's), or its failure to take it, gathered.
pub(crate) fn gather_optim(
    group: &ProcessGroup,
    mine: std::result::Result<&[u8], &SnapshotError>,
) -> Result<Vec<std::result::Result<Vec<u8>, String>>> {
    let mut w = wire::Writer::default();
    match mine {
        Ok(record) => w.u8(1).bytes(record),
        Err(e) => w.u8(0).bytes(e.to_string().as_bytes()),
    };
    let all = group.all_gather(w.buf).wait()?;
    (all.iter().enumerate())
        .map(|(r, raw)| {
            let mut reader = wire::Reader::new(raw);
            let decoded = (|| Ok::<_, DecodeError>((reader.u8()?, reader.bytes()?.to_vec())))();
            match decoded {
                Ok((1, record)) => Ok(Ok(record)),
                Ok((_, why)) => Ok(Err(String::from_utf8_lossy(&why).into_owned())),
                Err(e) => Err(DdpError::Checkpoint {
                    rank: group.rank(),
                    reason: format!("rank {r} sent a malformed optimizer record: {e}"),
                }),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::nn::LinearConfig;
    use burn::optim::{AdamConfig, GradientsParams};
    use burn::tensor::{Device, Tensor as BurnTensor};

    /// Every float parameter's id and value, in visit order.
    #[derive(Default)]
    struct Ids(Vec<(u64, Vec<usize>)>);

    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<BurnTensor<D>>) {
            self.0.push((param.id.val(), param.val().dims().to_vec()));
        }
    }

    /// burn's optimizers keep state only for the parameters they were given gradients for;
    /// records of parts of the parameters merge into the record of all of them, and split back.
    #[test]
    fn optimizer_state_is_per_parameter_and_records_merge_and_split() {
        let device = Device::flex();
        let model = LinearConfig::new(3, 2).init(&device.clone().autodiff());
        let mut ids = Ids::default();
        model.visit(&mut ids);
        let [(weight, wdims), (bias, bdims)] = [ids.0[0].clone(), ids.0[1].clone()];
        let grad =
            |dims: &[usize]| BurnTensor::<2>::ones([dims[0], *dims.get(1).unwrap_or(&1)], &device);
        let step = |with: &[(u64, &[usize])]| {
            let mut grads = GradientsParams::new();
            for (id, dims) in with {
                match dims.len() {
                    2 => grads.register::<2>((*id).into(), grad(dims)),
                    _ => grads.register::<1>((*id).into(), BurnTensor::ones([dims[0]], &device)),
                }
            }
            let mut optim = AdamConfig::new().init();
            let _ = optim.step(0.1, model.clone(), grads);
            optim.to_record().into_bytes().unwrap().to_vec()
        };
        let only_weight = step(&[(weight, &wdims)]);
        let only_bias = step(&[(bias, &bdims)]);
        let both = step(&[(weight, &wdims), (bias, &bdims)]);
        // Adam's two moments, of the weight's 6 values and the bias' 2, in f32.
        assert_eq!(state_bytes(&only_weight).unwrap(), 2 * 6 * 4);
        assert_eq!(state_bytes(&only_bias).unwrap(), 2 * 2 * 4);
        assert_eq!(state_bytes(&both).unwrap(), 2 * 8 * 4);
        let merged = merge(&[only_weight.clone(), only_bias]).unwrap();
        assert_eq!(state_bytes(&merged).unwrap(), state_bytes(&both).unwrap());
        let kept = keep(&merged, &HashSet::from([weight])).unwrap();
        assert_eq!(state_bytes(&kept).unwrap(), 2 * 6 * 4);
        assert_eq!(
            read(&kept).unwrap().scalars,
            read(&only_weight).unwrap().scalars
        );
        assert!(keep(&[1, 2, 3], &HashSet::new()).is_err(), "not a record");
    }
}
