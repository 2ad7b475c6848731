//! Optimizer records of a sharded run: each rank's holds the state of its own parameters, in
//! burn's record format (burnpack), keyed by that rank's parameter ids. A checkpoint holds them
//! merged into one record keyed by rank 0's ids (the ranks' ids matched by visit order), as an
//! unsharded run would write it; a rank that resumes sharded keeps the entries of the
//! parameters it owns under the new world size. How the records reach rank 0: `gather.rs`.

use std::collections::{HashMap, HashSet};

use burn_pack::Tensor;

use crate::records::{Parts, key_id};
use crate::train::learner::checkpoint::SnapshotError;

/// The parts of a copy of `record`.
fn read(record: &[u8]) -> std::result::Result<Parts, SnapshotError> {
    crate::records::read(record.to_vec()).map_err(SnapshotError::Encode)
}

/// The record of `parts`.
fn write(parts: Parts) -> std::result::Result<Vec<u8>, SnapshotError> {
    crate::records::write(parts).map_err(SnapshotError::Encode)
}

/// One rank's optimizer record and its parameter ids in visit order.
pub(crate) struct Keyed<'a> {
    /// The record (burnpack bytes).
    pub record: &'a [u8],
    /// The rank's parameter ids, in the model's visit order.
    pub ids: &'a [u64],
}

/// The ranks' records merged into one keyed by the ids `to` (rank 0's, in visit order): every
/// tensor, scalar and path of each, its ids replaced by those of the same parameters in `to`.
pub(crate) fn merge(
    records: &[Keyed<'_>],
    to: &[u64],
) -> std::result::Result<Vec<u8>, SnapshotError> {
    let mut all = Parts {
        tensors: Vec::new(),
        scalars: Vec::new(),
        metadata: Vec::new(),
    };
    for (rank, keyed) in records.iter().enumerate() {
        if keyed.ids.len() != to.len() {
            return Err(SnapshotError::Encode(format!(
                "rank {rank}'s model has {} parameters, rank 0's {}",
                keyed.ids.len(),
                to.len()
            )));
        }
        let map: HashMap<u64, u64> = keyed.ids.iter().copied().zip(to.iter().copied()).collect();
        let parts = rekey(read(keyed.record)?, &map);
        all.tensors.extend(parts.tensors);
        all.scalars.extend(parts.scalars);
        all.metadata.extend(parts.metadata);
    }
    write(all)
}

/// `key` with its id replaced by the one `map` gives it (unchanged if it has none there).
fn rekey_key(key: &str, map: &HashMap<u64, u64>) -> String {
    match key_id(key).and_then(|id| map.get(&id)) {
        Some(to) => match key.split_once('.') {
            Some((_, rest)) => format!("{to}.{rest}"),
            None => to.to_string(),
        },
        None => key.to_string(),
    }
}

/// `parts` with every id (tensors' parameter ids and names, scalars' and paths' keys) replaced
/// by the one `map` gives it.
fn rekey(mut parts: Parts, map: &HashMap<u64, u64>) -> Parts {
    if map.iter().all(|(from, to)| from == to) {
        return parts;
    }
    for t in &mut parts.tensors {
        t.name = rekey_key(&t.name, map);
        t.param_id = t.param_id.map(|id| map.get(&id).copied().unwrap_or(id));
    }
    for (key, _) in &mut parts.scalars {
        *key = rekey_key(key, map);
    }
    for (key, _) in &mut parts.metadata {
        *key = rekey_key(key, map);
    }
    parts
}

/// `record` with only the entries of the parameters `ids`.
pub(crate) fn keep(
    record: Vec<u8>,
    ids: &HashSet<u64>,
) -> std::result::Result<Vec<u8>, SnapshotError> {
    let mut parts = crate::records::read(record).map_err(SnapshotError::Encode)?;
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
        let ids = [weight, bias];
        let keyed = |record| Keyed { record, ids: &ids };
        let merged = merge(&[keyed(&only_weight), keyed(&only_bias)], &ids).unwrap();
        assert_eq!(state_bytes(&merged).unwrap(), state_bytes(&both).unwrap());
        let kept = keep(merged.clone(), &HashSet::from([weight])).unwrap();
        assert_eq!(state_bytes(&kept).unwrap(), 2 * 6 * 4);
        assert_eq!(
            read(&kept).unwrap().scalars,
            read(&only_weight).unwrap().scalars
        );
        assert!(
            keep(vec![1, 2, 3], &HashSet::new()).is_err(),
            "not a record"
        );
        // Another rank's record, keyed by its own ids (7 and 8 for the same parameters), merges
        // into one keyed by rank 0's, matched by visit order.
        let map = HashMap::from([(weight, 7), (bias, 8)]);
        let foreign = write(rekey(read(&only_bias).unwrap(), &map)).unwrap();
        let bias_only = HashSet::from([bias]);
        assert_eq!(
            state_bytes(&keep(foreign.clone(), &bias_only).unwrap()).unwrap(),
            0
        );
        let theirs = [7, 8];
        let foreign = Keyed {
            record: &foreign,
            ids: &theirs,
        };
        let merged = merge(&[keyed(&only_weight), foreign], &ids).unwrap();
        let kept = keep(merged, &bias_only).unwrap();
        assert_eq!(state_bytes(&kept).unwrap(), 2 * 2 * 4);
        let (kept, mine) = (read(&kept).unwrap(), read(&only_bias).unwrap());
        let names = |p: &Parts| p.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&kept), names(&mine));
        assert_eq!((kept.scalars, kept.metadata), (mine.scalars, mine.metadata));
        let too_few = Keyed {
            record: &only_bias,
            ids: &ids[..1],
        };
        assert!(merge(&[too_few], &ids).is_err(), "parameters differ");
    }
}
