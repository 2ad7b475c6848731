//! burn-ddp's integration tests: real ranks over loopback TCP, as threads and as processes.

mod c10d;
mod bins;
mod collectives;
mod common;
mod env;
mod faults;
mod output;
mod preemption;
mod flood;
mod mpi;
mod netif;
mod processes;
mod security;
mod soak;
mod store;
mod torchrun;
mod train;
