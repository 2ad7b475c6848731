//! `burn-ddp-run`: starts N ranks of a program with the torchrun variables set.
//!
//! ```text
//! burn-ddp-run --nproc 4 [--nnodes M --node-rank R --master-addr A --master-port P]
//!              [--max-restarts K] PROGRAM [ARGS...]
//! ```

use std::process::ExitCode;

use burn_ddp::launch::{LaunchConfig, launch};

const USAGE: &str = "usage: burn-ddp-run --nproc N [--nnodes M] [--node-rank R] \
                     [--master-addr HOST] [--master-port PORT] [--max-restarts K] PROGRAM [ARGS...]";

fn parse(args: Vec<String>) -> Result<LaunchConfig, String> {
    let mut cfg = LaunchConfig::new("", 1);
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let number = |name: &str, v: String| {
            v.parse::<usize>()
                .map_err(|_| format!("{name} expects a number, got {v:?}"))
        };
        match arg.as_str() {
            "--nproc" | "--nproc-per-node" => cfg.nproc_per_node = number(&arg, value(&arg)?)?,
            "--nnodes" => cfg.nnodes = number(&arg, value(&arg)?)?,
            "--node-rank" => cfg.node_rank = number(&arg, value(&arg)?)?,
            "--master-addr" => cfg.master_addr = value(&arg)?,
            "--master-port" => {
                let v = value(&arg)?;
                cfg.master_port = Some(v.parse().map_err(|_| format!("bad port {v:?}"))?);
            }
            "--max-restarts" => cfg.max_restarts = number(&arg, value(&arg)?)?,
            "-h" | "--help" => return Err(USAGE.into()),
            _ if arg.starts_with("--") => return Err(format!("unknown option {arg}\n{USAGE}")),
            _ => {
                cfg.program = arg.into();
                cfg.args = it.map(Into::into).collect();
                return Ok(cfg);
            }
        }
    }
    Err(format!("no program given\n{USAGE}"))
}

fn main() -> ExitCode {
    let cfg = match parse(std::env::args().skip(1).collect()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match launch(&cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("burn-ddp-run: {e}");
            ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1))
        }
    }
}
