//! The checkpoint file's format from the outside (the layout is the one documented in
//! `burn-ddp/src/train/checkpoint/format.rs`, rebuilt here by hand): a version 1 checkpoint
//! (`u32` record lengths, what burn-ddp wrote before) still resumes exactly; a checkpoint over
//! 4 GiB is checked streaming (a sparse file: no 4 GiB is written here), and one cut short or
//! claiming more than it holds is named from its header alone.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::time::Instant;

use burn_ddp::train::{CheckpointConfig, Position, inspect_checkpoint};

use super::super::job::{Job, run_job};
use super::scratch_dir;
use crate::common::digest;

/// FNV-1a's offset basis and prime (64-bit).
const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x100_0000_01b3;
/// A version 2 header: magic, version, 4 position fields, 3 record lengths.
const HEADER_LEN: usize = 8 + 4 + 32 + 24;

/// FNV-1a of `bytes`, continuing from the hash `h`.
fn fnv(h: u64, bytes: &[u8]) -> u64 {
    (bytes.iter()).fold(h, |h, b| (h ^ *b as u64).wrapping_mul(PRIME))
}

/// `x` to the power `n` modulo 2^64, by squaring: FNV-1a over `n` zero bytes multiplies the
/// hash by `PRIME` to the power `n`.
fn pow(mut x: u64, mut n: u64) -> u64 {
    let mut out = 1u64;
    while n > 0 {
        if n & 1 == 1 {
            out = out.wrapping_mul(x);
        }
        x = x.wrapping_mul(x);
        n >>= 1;
    }
    out
}

/// A version 2 header.
fn header(position: [u64; 4], lengths: [u64; 3]) -> Vec<u8> {
    let mut out = b"BDDPCKPT".to_vec();
    out.extend(2u32.to_le_bytes());
    for v in position.into_iter().chain(lengths) {
        out.extend(v.to_le_bytes());
    }
    out
}

/// The version 1 file holding what the version 2 file `v2` holds.
fn to_version_1(v2: &[u8]) -> Vec<u8> {
    assert_eq!(v2[8..12], 2u32.to_le_bytes(), "burn-ddp writes version 2");
    let mut out = b"BDDPCKPT".to_vec();
    out.extend(1u32.to_le_bytes());
    out.extend(&v2[12..44]);
    let mut at = HEADER_LEN;
    for i in 0..3 {
        let n = u64::from_le_bytes(v2[44 + 8 * i..52 + 8 * i].try_into().unwrap()) as usize;
        out.extend((n as u32).to_le_bytes());
        out.extend(&v2[at..at + n]);
        at += n;
    }
    assert_eq!(at + 8, v2.len(), "the header's lengths tell the whole file");
    let sum = fnv(OFFSET, &out);
    out.extend(sum.to_le_bytes());
    out
}

/// A checkpoint written by a run, turned into a version 1 file, resumes bit-identically to the
/// run that never stopped.
#[test]
fn a_version_1_checkpoint_still_resumes_exactly() {
    let uninterrupted = run_job(&Job::plain(2, None));
    let expected = digest(bytemuck::cast_slice(uninterrupted[0].as_ref().unwrap()));
    let dir = scratch_dir("version-1");
    let config = CheckpointConfig::new(&dir).every(2);
    let crashed = run_job(&Job {
        fail_at: Some((2, 17)),
        ..Job::plain(2, Some(config.clone()))
    });
    assert!(crashed.iter().all(Result::is_err));
    let v1 = to_version_1(&std::fs::read(config.path()).unwrap());
    std::fs::write(config.path(), &v1).unwrap();
    let at = inspect_checkpoint(&config.path()).unwrap();
    assert_eq!((at.epoch, at.batches, at.samples), (2, 4, 32));
    let resumed = run_job(&Job::plain(2, Some(config.clone())));
    for (r, params) in resumed.into_iter().enumerate() {
        let params = params.unwrap();
        assert_eq!(
            digest(bytemuck::cast_slice(&params)),
            expected,
            "rank {r} differs from the uninterrupted run"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint whose model record is 4 GiB + 3 bytes (zeros, a hole in a sparse file) is
/// checked whole, its checksum over every byte, reading it in bounded pieces; cut by one byte,
/// or with a header that claims more than the file holds, it is named from the header alone.
#[test]
fn a_checkpoint_over_4_gib_is_checked_streaming_and_one_cut_short_is_named() {
    let dir = scratch_dir("over-4-gib");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("checkpoint.bddp");
    let model = (1u64 << 32) + 3;
    let optim = b"opt";
    let head = header([2, 4, 32, 2], [model, optim.len() as u64, 0]);
    let total = (HEADER_LEN + optim.len() + 8) as u64 + model;
    let sum = fnv(fnv(OFFSET, &head).wrapping_mul(pow(PRIME, model)), optim);
    {
        let mut f = File::create(&path).unwrap();
        f.write_all(&head).unwrap();
        f.set_len(HEADER_LEN as u64 + model).unwrap();
        f.seek(SeekFrom::End(0)).unwrap();
        f.write_all(optim).unwrap();
        f.write_all(&sum.to_le_bytes()).unwrap();
    }
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), total);
    eprintln!(
        "sparse checkpoint of {total} bytes, {} on disk",
        meta.blocks() * 512
    );

    let start = Instant::now();
    let at = inspect_checkpoint(&path).unwrap();
    let took = start.elapsed();
    let expected = Position {
        epoch: 2,
        batches: 4,
        samples: 32,
        world_size: 2,
    };
    assert_eq!(at, expected);
    eprintln!(
        "checked {total} bytes in {took:.2?}: {:.2} GiB/s",
        total as f64 / (1u64 << 30) as f64 / took.as_secs_f64()
    );

    // One byte cut off the end: named from the header, before any record is read.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(total - 1)
        .unwrap();
    let start = Instant::now();
    let e = inspect_checkpoint(&path).unwrap_err().to_string();
    eprintln!("cut short: {e} (in {:.2?})", start.elapsed());
    let sizes = format!("a file of {total} bytes, but it holds {}", total - 1);
    assert!(e.contains(&sizes) && e.contains("cut short"), "{e}");

    // A small file whose header claims a 1 TiB model.
    let mut claims = header([1, 0, 0, 1], [1 << 40, 0, 0]);
    claims.extend(0u64.to_le_bytes());
    std::fs::write(&path, &claims).unwrap();
    let e = inspect_checkpoint(&path).unwrap_err().to_string();
    let sizes = format!("a file of {} bytes, but it holds 76", (1u64 << 40) + 76);
    assert!(e.contains(&sizes), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
