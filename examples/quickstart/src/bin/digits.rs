//! `digits`: the quickstart's MLP on a real data set, the UCI handwritten digits bundled with
//! this example (CC BY 4.0, see `data/README.md`); reports validation accuracy.
//!
//! ```text
//! cargo xtask multi-cpu --nproc 2 --example digits
//! ```
//!
//! Same flags as `quickstart` (`digits --help`); defaults: 30 epochs, learning rate 0.1, batch
//! 32 per rank.

use quickstart::{Config, Digits};

fn main() -> std::process::ExitCode {
    quickstart::exit(quickstart::main_with(Config {
        epochs: 30,
        lr: 0.1,
        digits: Some(Digits::bundled_path()),
        artifacts: std::env::temp_dir().join("burn-ddp-digits"),
        ..Config::default()
    }))
}
