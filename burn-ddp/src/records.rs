//! burn's optimizer records (burnpack) taken apart and put back together: each parameter's
//! state tensors, scalars and module path, keyed `"{param_id}"` or `"{param_id}.{field}"`.
//! Checkpoints of sharded runs merge and split them by parameter; wrapped blocks
//! ([`crate::fsdp`]) turn a shard's entries into the whole block's parameters' and back.

use burn::tensor::Bytes;
use burn_pack::{Reader, Scalar, Tensor, Writer};

/// One optimizer record's parts.
pub(crate) struct Parts {
    /// State tensors, each named by its key and carrying its parameter id.
    pub(crate) tensors: Vec<Tensor>,
    /// Scalars by key (`"{id}.__rank"`: the parameter's number of dimensions).
    pub(crate) scalars: Vec<(String, Scalar)>,
    /// Module paths by key (`"{id}"`).
    pub(crate) metadata: Vec<(String, String)>,
}

/// The parts of `record` (burnpack bytes), or why it is not a record. The parts' tensors are
/// views of `record`'s buffer, not copies.
pub(crate) fn read(record: Vec<u8>) -> Result<Parts, String> {
    let bad = |e: burn_pack::Error| format!("an optimizer record: {e}");
    let reader = Reader::from_bytes(Bytes::from_bytes_vec(record)).map_err(bad)?;
    let scalars = reader.scalars().clone().into_iter().collect();
    let metadata = reader.metadata().clone().into_iter().collect();
    let tensors = reader.into_tensors().map_err(bad)?;
    Ok(Parts {
        tensors,
        scalars,
        metadata,
    })
}

/// The record of `parts` (burnpack bytes).
pub(crate) fn write(parts: Parts) -> Result<Vec<u8>, String> {
    let mut writer = Writer::new(parts.tensors);
    for (key, value) in &parts.scalars {
        writer = writer.with_scalar(key, *value);
    }
    for (key, value) in &parts.metadata {
        writer = writer.with_metadata(key, value);
    }
    let bytes = writer
        .into_bytes()
        .map_err(|e| format!("an optimizer record: {e}"))?;
    Ok(bytes.to_vec())
}

/// The id a record's key belongs to: `"{id}"` or `"{id}.{field}"`.
pub(crate) fn key_id(key: &str) -> Option<u64> {
    split_key(key).map(|(id, _)| id)
}

/// A key's id and the rest of it (`""` or `".{field}"`).
pub(crate) fn split_key(key: &str) -> Option<(u64, &str)> {
    let end = key.find('.').unwrap_or(key.len());
    Some((key[..end].parse().ok()?, &key[end..]))
}
