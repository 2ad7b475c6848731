//! The optimizer's state of wrapped blocks in the whole model's terms (PyTorch FSDP's full
//! optimizer state dict). The optimizer keeps one entry per shard: each state tensor (Adam's
//! moments, SGD's momentum) holds the shard's elements. A whole record holds, instead, one
//! entry per parameter of the block, of the parameter's shape, keyed by the parameter ids the
//! whole model's record ([`super::full_record`]) carries: the record the unwrapped model's
//! optimizer would hold, which it loads as it is.
//!
//! Saving gathers each state tensor of each block in turn (no rank holds more than one whole
//! state tensor besides rank 0's record) and cuts it by parameter on rank 0; loading cuts each
//! rank's piece out of the concatenated parameters' state, as the parameters themselves are.
//! Scalars (Adam's step count) are the shard's for every parameter of the block.

use std::collections::{BTreeMap, HashMap};

use burn::module::Module;
use burn::optim::OptimizerRecord;
use burn::tensor::{Bytes, DType, Tensor, TensorData};
use burn_pack::Scalar;

use super::module::{BlockPaths, SHARD_FIELD};
use super::state::{self, Listed};
use crate::ProcessGroup;
use crate::error::{DdpError, Result};
use crate::records::{self, Parts, split_key};
use crate::wire::Writer;

/// The scalar field burn's optimizer records hold each parameter's number of dimensions in.
const RANK_FIELD: &str = ".__rank";

/// A wrapped block of a model and its module path (`""` when the model is the block).
struct Block {
    listed: Listed,
    path: String,
}

impl Block {
    /// The module path of the block's parameter `i` in the unwrapped model.
    fn param_path(&self, i: usize) -> String {
        let inner = &self.listed.shared.layout.params[i].path;
        match self.path.is_empty() {
            true => inner.clone(),
            false => format!("{}.{inner}", self.path),
        }
    }

    fn error(&self, reason: impl Into<String>) -> DdpError {
        self.listed.shared.error(reason)
    }
}

/// The wrapped blocks of `model`, in visit order.
fn blocks<M: Module>(model: &M) -> Vec<Block> {
    let mut paths = BlockPaths::default();
    let listed = state::listing(|| model.visit(&mut paths));
    (listed.into_iter().zip(paths.found))
        .map(|(listed, path)| Block { listed, path })
        .collect()
}

/// The parameter ids of `model`'s shards (its wrapped blocks' optimizer parameters).
pub(crate) fn shard_ids<M: Module>(model: &M) -> Vec<u64> {
    blocks(model).iter().map(|b| b.listed.shard).collect()
}

/// One block's entries in an optimizer record, by field (`""` or `".{name}"`).
#[derive(Default)]
struct Entries {
    tensors: BTreeMap<String, burn_pack::Tensor>,
    scalars: BTreeMap<String, Scalar>,
}

/// Takes out of `parts` the entries whose id `of` maps to a block index: each block's, by field.
fn take_entries(parts: &mut Parts, n: usize, of: impl Fn(u64) -> Option<usize>) -> Vec<Entries> {
    let mut out: Vec<Entries> = (0..n).map(|_| Entries::default()).collect();
    let block = |key: &str| split_key(key).and_then(|(id, rest)| Some((of(id)?, rest.to_string())));
    for t in std::mem::take(&mut parts.tensors) {
        match block(&t.name) {
            Some((b, field)) => drop(out[b].tensors.insert(field, t)),
            None => parts.tensors.push(t),
        }
    }
    for (key, value) in std::mem::take(&mut parts.scalars) {
        match block(&key) {
            Some((b, field)) => drop(out[b].scalars.insert(field, value)),
            None => parts.scalars.push((key, value)),
        }
    }
    parts.metadata.retain(|(key, _)| block(key).is_none());
    out
}

/// `record` (this rank's optimizer's) with every wrapped block's shard entries replaced: on
/// `keep`'s rank (rank 0 of a checkpoint), by the entries of the block's parameters, whole; on
/// the others by nothing. A collective: every rank of `group` calls it with its own record
/// (`Err` when it has none, for the others to fail alike). The outer error is one every rank
/// meets together (a collective's, or a disagreement found before the gathers); the inner one,
/// this rank's alone after them (every rank went through every gather), for the caller to
/// hand on without leaving the others waiting.
pub(crate) fn whole_state<M: Module>(
    model: &M,
    group: &ProcessGroup,
    record: std::result::Result<&[u8], String>,
    keep: bool,
) -> Result<std::result::Result<Vec<u8>, String>> {
    let blocks = blocks(model);
    let index: HashMap<u64, usize> = (blocks.iter().enumerate())
        .map(|(i, b)| (b.listed.shard, i))
        .collect();
    let taken = record
        .and_then(|r| records::read(r.to_vec()))
        .map(|mut parts| {
            let entries = take_entries(&mut parts, blocks.len(), |id| index.get(&id).copied());
            (parts, entries)
        });
    // Every rank says what state its shards have (or why it cannot): the gathers below need
    // the same fields, of the same shard lengths, on every rank.
    let described = match &taken {
        Ok((parts, entries)) => describe(&blocks, parts, entries),
        Err(e) => Err(e.clone()),
    };
    let mut w = Writer::default();
    match &described {
        Ok(d) => w.u8(0).bytes(d.as_bytes()),
        Err(e) => w.u8(1).bytes(e.as_bytes()),
    };
    let said = group.all_gather_object(w.buf.clone())?;
    let theirs = said.decode_each("a description of its shards' optimizer state", |r| {
        Ok((r.u8()? == 0, r.string()?))
    })?;
    if let Some((rank, (_, why))) = theirs.iter().enumerate().find(|(_, (ok, _))| !ok) {
        return Err(fail(
            group,
            format!("rank {rank} cannot say its optimizer state: {why}"),
        ));
    }
    if let Some(rank) = said.differing().first() {
        return Err(fail(
            group,
            format!(
                "the ranks' optimizer states of the wrapped blocks differ (rank 0: {}; rank \
                 {rank}: {})",
                theirs[0].1, theirs[*rank].1
            ),
        ));
    }
    let Ok((mut parts, entries)) = taken else {
        unreachable!("every rank said its state")
    };
    // This rank's first failure after the agreement: it goes on through every gather.
    let mut failed: Option<String> = None;
    for (block, entries) in blocks.iter().zip(entries) {
        let shared = &block.listed.shared;
        for (field, tensor) in entries.tensors {
            let (dtype, n) = (tensor.dtype, shared.shard_len);
            let bytes = tensor.into_parts().map(|p| p.4).unwrap_or_else(|e| {
                let e = block.error(format!("its optimizer state {field}: {e}"));
                failed.get_or_insert(e.to_string());
                Bytes::from_bytes_vec(vec![0; n * dtype.size()])
            });
            let device = shared.layout.device.clone().inner();
            let local = Tensor::<1>::from_data(TensorData::from_bytes(bytes, [n], dtype), &device);
            let work = match shared.strategy.shards() && shared.group.world_size() > 1 {
                true => (shared.group).all_gather_parts(local, &vec![n; shared.group.world_size()]),
                false => crate::Work::done(group.rank(), Ok(local)),
            };
            let whole = work.wait()?;
            if !keep {
                continue;
            }
            let whole = whole.into_data();
            if whole.dtype() != dtype {
                let e = block.error(format!(
                    "its optimizer state {field} of {dtype:?} came back from its gather as {:?}",
                    whole.dtype()
                ));
                failed.get_or_insert(e.to_string());
                continue;
            }
            let size = dtype.size();
            for (i, p) in shared.layout.params.iter().enumerate() {
                let id = block.listed.params[i];
                let at = p.offset * size..(p.offset + p.numel()) * size;
                let piece = Bytes::from_bytes_vec(whole.as_bytes()[at].to_vec());
                let name = format!("{id}{field}");
                let t = burn_pack::Tensor::new(name, dtype, p.shape.clone(), Some(id), piece);
                parts.tensors.push(t);
            }
        }
        if !keep {
            continue;
        }
        for (i, p) in shared.layout.params.iter().enumerate() {
            let id = block.listed.params[i];
            for (field, value) in &entries.scalars {
                let value = match field.as_str() {
                    RANK_FIELD => Scalar::from(p.shape.len()),
                    _ => *value,
                };
                parts.scalars.push((format!("{id}{field}"), value));
            }
            if !entries.scalars.is_empty() {
                parts.metadata.push((id.to_string(), block.param_path(i)));
            }
        }
    }
    Ok(match failed {
        Some(e) => Err(e),
        None => records::write(parts),
    })
}

/// What `entries` hold of each block: each state tensor's field, type and length; why not,
/// when a tensor is not of the shard's length, or when two parameters would be written under
/// one id (blocks cloned from one module share their parameters' ids; an optimizer already
/// holding state under a block parameter's id, from a whole record loaded as it is).
fn describe(
    blocks: &[Block],
    parts: &Parts,
    entries: &[Entries],
) -> std::result::Result<String, String> {
    let mut ids: HashMap<u64, String> = HashMap::new();
    for block in blocks {
        for (i, id) in block.listed.params.iter().enumerate() {
            let path = block.param_path(i);
            if let Some(other) = ids.insert(*id, path.clone()) {
                return Err(format!(
                    "{other} and {path} have one parameter id ({id}): blocks wrapped from clones \
                     of one module share their parameters' ids; build each block on its own"
                ));
            }
        }
    }
    let kept = (parts.tensors.iter().filter_map(|t| t.param_id))
        .chain(parts.scalars.iter().filter_map(|(k, _)| records::key_id(k)));
    for id in kept {
        if let Some(path) = ids.get(&id) {
            return Err(format!(
                "the optimizer holds state of {path} as a parameter of its own (id {id}), \
                 besides its block's shard: load a whole optimizer record with \
                 fsdp::load_full_optimizer_record, not as it is"
            ));
        }
    }
    let mut out = Vec::new();
    for (block, entries) in blocks.iter().zip(entries) {
        let shard = block.listed.shared.shard_len;
        for (field, t) in &entries.tensors {
            let n = t.shape.num_elements();
            if n != shard {
                return Err(format!(
                    "fsdp {}: its optimizer state {field} holds {n} elements, not the shard's \
                     {shard}: the optimizer keeps state of another shape, which cannot be cut \
                     by parameter",
                    block.listed.shared.name
                ));
            }
            out.push(format!(
                "{}{field} {:?} {n}",
                block.listed.shared.name, t.dtype
            ));
        }
        let scalars: Vec<&String> = entries.scalars.keys().collect();
        out.push(format!("{} scalars {scalars:?}", block.listed.shared.name));
    }
    Ok(out.join("; "))
}

/// `record` (a whole model's optimizer record, as [`whole_state`] writes it or the unwrapped
/// model's optimizer holds it) with every wrapped block's parameters' entries replaced by this
/// rank's shard entries: the parameters' state concatenated in the block's order, cut as the
/// parameters are. `model` must have been loaded from the record's model ([`super::load_full_record`]):
/// the blocks' parameter ids are that record's. No collective.
pub(crate) fn shard_state<M: Module>(model: &M, record: Vec<u8>) -> Result<Vec<u8>> {
    let blocks = blocks(model);
    if blocks.is_empty() {
        return Ok(record);
    }
    // Every parameter of every block, in order: (block, parameter in it).
    let flat: Vec<(usize, usize)> = (blocks.iter().enumerate())
        .flat_map(|(b, block)| (0..block.listed.params.len()).map(move |i| (b, i)))
        .collect();
    let index: HashMap<u64, usize> = (flat.iter().enumerate())
        .map(|(k, &(b, i))| (blocks[b].listed.params[i], k))
        .collect();
    let first = &blocks[0];
    let mut parts = records::read(record).map_err(|e| first.error(e))?;
    // Where the record says each parameter with state is (`{id}` -> module path).
    let paths: HashMap<String, String> = (parts.metadata.iter())
        .map(|(id, path)| (path.clone(), id.clone()))
        .collect();
    let mut taken = take_entries(&mut parts, flat.len(), |id| index.get(&id).copied()).into_iter();
    let by_param: Vec<Vec<Entries>> = (blocks.iter())
        .map(|b| taken.by_ref().take(b.listed.params.len()).collect())
        .collect();
    for (block, params) in blocks.iter().zip(by_param) {
        let shared = &block.listed.shared;
        let shard = block.listed.shard;
        // State of a block parameter under another id: the model was not loaded from the
        // record saved with this one, and its state would be lost without a word.
        for (i, p) in params.iter().enumerate() {
            let path = block.param_path(i);
            let other = paths.get(&path).filter(|_| p.tensors.is_empty());
            if let Some(id) = other {
                return Err(block.error(format!(
                    "the optimizer record holds state of {path} under parameter id {id}, not \
                     the model's {}: load the model from the record saved with this one first \
                     (fsdp::load_full_record)",
                    block.listed.params[i]
                )));
            }
        }
        let fields: std::collections::BTreeSet<&String> =
            params.iter().flat_map(|p| p.tensors.keys()).collect();
        for field in fields {
            // Each parameter's state, checked, then only this rank's part of it copied: the
            // block's whole state is never joined.
            let mut dtype: Option<DType> = None;
            let mut states = Vec::with_capacity(params.len());
            for (i, p) in shared.layout.params.iter().enumerate() {
                let Some(t) = params[i].tensors.get(field) else {
                    return Err(block.error(format!(
                        "the optimizer record has state {field} for some of the block's \
                         parameters but not for {}",
                        block.param_path(i)
                    )));
                };
                if *dtype.get_or_insert(t.dtype) != t.dtype || t.shape.num_elements() != p.numel() {
                    return Err(block.error(format!(
                        "the optimizer state {field} of {} is {:?} of {:?}, the parameter {:?} of \
                         {:?}",
                        block.param_path(i),
                        t.dtype,
                        t.shape,
                        dtype,
                        p.shape
                    )));
                }
                states.push(t.to_bytes().map_err(|e| block.error(e.to_string()))?);
            }
            let Some(dtype) = dtype else { continue };
            let size = dtype.size();
            let n = shared.shard_len;
            let start = match shared.strategy.shards() {
                true => shared.group.rank() * n,
                false => 0,
            };
            // The padding past the block's last element stays zero.
            let mut piece = vec![0u8; n * size];
            for (p, state) in shared.layout.params.iter().zip(&states) {
                let (lo, hi) = (start.max(p.offset), (start + n).min(p.offset + p.numel()));
                if lo < hi {
                    piece[(lo - start) * size..(hi - start) * size]
                        .copy_from_slice(&state[(lo - p.offset) * size..(hi - p.offset) * size]);
                }
            }
            let name = format!("{shard}{field}");
            let t =
                burn_pack::Tensor::new(name, dtype, [n], Some(shard), Bytes::from_bytes_vec(piece));
            parts.tensors.push(t);
        }
        // The scalars of the first parameter that has any (a block's parameters are stepped
        // together), the shard's own number of dimensions.
        if let Some(first) = params.iter().find(|p| !p.scalars.is_empty()) {
            for (field, value) in &first.scalars {
                let value = match field.as_str() {
                    RANK_FIELD => Scalar::from(1usize),
                    _ => *value,
                };
                parts.scalars.push((format!("{shard}{field}"), value));
            }
            let path = match block.path.is_empty() {
                true => SHARD_FIELD.to_string(),
                false => format!("{}.{SHARD_FIELD}", block.path),
            };
            parts.metadata.push((shard.to_string(), path));
        }
    }
    records::write(parts).map_err(|e| first.error(e))
}

/// A checkpoint's error on this rank.
fn fail(group: &ProcessGroup, reason: String) -> DdpError {
    DdpError::Checkpoint {
        rank: group.rank(),
        reason,
    }
}

/// The optimizer's record of `model` as the unwrapped model's optimizer would hold it, to go
/// with [`full_record`](super::full_record): each wrapped block's state gathered and cut by
/// parameter, keyed by the parameter ids of the full record. `Some` on rank 0, `None` on the
/// others. A collective: every rank of `group` calls it with its own optimizer's record
/// (`optimizer.to_record()`); no rank holds more than one whole state tensor of a block
/// besides rank 0's record. Parameters outside the wrapped blocks keep their entries as
/// rank 0's optimizer has them.
///
/// # Errors
///
/// [`DdpError::Checkpoint`] if a record cannot be read or the ranks' states differ in shape;
/// a gather's error.
pub fn full_optimizer_record<M: Module>(
    model: &M,
    record: OptimizerRecord,
    group: &ProcessGroup,
) -> Result<Option<OptimizerRecord>> {
    let keep = group.rank() == 0;
    let bytes = record
        .into_bytes()
        .map(|b| b.to_vec())
        .map_err(|e| e.to_string());
    let whole = whole_state(model, group, bytes.as_deref().map_err(Clone::clone), keep)?
        .map_err(|e| fail(group, e))?;
    match keep {
        true => OptimizerRecord::from_bytes(Bytes::from_bytes_vec(whole))
            .map(Some)
            .map_err(|e| fail(group, e.to_string())),
        false => Ok(None),
    }
}

/// This rank's optimizer record for `model`, from a whole model's one
/// ([`full_optimizer_record`], or the unwrapped model's optimizer's), for
/// `optimizer.load_record`: each wrapped block's parameters' state cut to this rank's piece, at
/// any world size. Load the model first with [`load_full_record`](super::load_full_record) from
/// the record saved with it (the blocks then carry its parameter ids). No collective.
///
/// # Errors
///
/// [`DdpError::Fsdp`] naming the block if the record holds state for only some of its
/// parameters, or state not of their shapes.
pub fn load_full_optimizer_record<M: Module>(
    model: &M,
    record: OptimizerRecord,
    group: &ProcessGroup,
) -> Result<OptimizerRecord> {
    let bytes =
        (record.into_bytes().map(|b| b.to_vec())).map_err(|e| fail(group, e.to_string()))?;
    let sharded = shard_state(model, bytes)?;
    OptimizerRecord::from_bytes(Bytes::from_bytes_vec(sharded))
        .map_err(|e| fail(group, e.to_string()))
}
