//! The user guide's pages (`docs/guide/`) as doc tests: every Rust code block of each page
//! compiles and runs (`cargo test --doc`), as README.md's do (see `ReadmeDoctests` in lib.rs).

/// `docs/guide/README.md`: the guide's contents.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/README.md")]
struct Contents;

/// `docs/guide/from-burn-train.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/from-burn-train.md")]
struct FromBurnTrain;

/// `docs/guide/from-pytorch.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/from-pytorch.md")]
struct FromPytorch;

/// `docs/guide/launchers.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/launchers.md")]
struct Launchers;

/// `docs/guide/gpus.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/gpus.md")]
struct Gpus;

/// `docs/guide/zero.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/zero.md")]
struct Zero;

/// `docs/guide/fsdp.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/fsdp.md")]
struct FullySharded;

/// `docs/guide/checkpoints.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/checkpoints.md")]
struct Checkpoints;

/// `docs/guide/performance.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/performance.md")]
struct Performance;

/// `docs/guide/troubleshooting.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/troubleshooting.md")]
struct Troubleshooting;

/// `docs/guide/development.md`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/development.md")]
struct Development;
