//! All of burn-ddp's `unsafe` code, kept small and in one place (the crate denies `unsafe`
//! everywhere else):
//! - `mapping`: a shared-memory file mapped into this process, and the raw copies in and out of
//!   it (the shared-memory transport);
//! - `signal`: a raw handler that holds the stop signals arriving while signal-hook's handlers
//!   are being installed (see [`crate::signals`]).

#![allow(unsafe_code)]

pub(crate) mod mapping;
#[cfg(unix)]
pub(crate) mod signal;
