//! Forming the group the environment describes, with a program's own options underneath.
//!
//! Every in-tree program forms its group here, so that a program started by a launcher uses
//! what the launcher set up (its store, its job secret) instead of re-creating it.

use super::{GroupOptions, ProcessGroup};
use crate::env::LaunchEnv;
use crate::error::Result;

/// Forms the process group described by the environment (see [`LaunchEnv`]); a world of one
/// when no launcher variables are set.
pub fn init_process_group() -> Result<ProcessGroup> {
    ProcessGroup::from_env()
}

/// As [`init_process_group`], with `options` instead of the defaults. The environment still
/// has the last word: `BURN_DDP_TIMEOUT` and `BURN_DDP_RENDEZVOUS_TIMEOUT`, when set, replace
/// the timeouts of `options`.
///
/// ```no_run
/// use std::time::Duration;
/// use burn_ddp::{GroupOptions, init_process_group_with};
/// let group = init_process_group_with(GroupOptions {
///     chunk_bytes: 1 << 20,
///     timeout: Duration::from_secs(120),
///     ..GroupOptions::default()
/// })?;
/// # Ok::<(), burn_ddp::DdpError>(())
/// ```
pub fn init_process_group_with(options: GroupOptions) -> Result<ProcessGroup> {
    ProcessGroup::from_env_with(options)
}

impl ProcessGroup {
    /// Forms the group described by the process environment, with `options` under the
    /// environment's settings (see [`init_process_group_with`]). For more control, start
    /// from [`ProcessGroup::builder_from_env`]. A failure is also written to torchrun's error
    /// file, when there is one ([`crate::elastic::record_error`]).
    pub fn from_env_with(options: GroupOptions) -> Result<Self> {
        crate::elastic::die_with_launcher();
        let group =
            LaunchEnv::from_env().and_then(|env| Self::builder_from_env(&env, options).build());
        group.inspect_err(|e| crate::elastic::record_error(e))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> LaunchEnv {
        LaunchEnv::from_lookup(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
        .expect("valid variables")
    }

    #[test]
    fn options_lie_under_the_environment() {
        let options = GroupOptions {
            chunk_bytes: 64 << 10,
            timeout: Duration::from_secs(120),
            rendezvous_timeout: Duration::from_secs(60),
            ..GroupOptions::default()
        };
        let launched = env(&[("BURN_DDP_TIMEOUT", "7")]);
        let group = ProcessGroup::builder_from_env(&launched, options.clone())
            .build()
            .unwrap();
        let got = group.options();
        assert_eq!(got.chunk_bytes, 64 << 10, "the program's option stays");
        assert_eq!(got.timeout, Duration::from_secs(7), "BURN_DDP_TIMEOUT wins");
        assert_eq!(
            got.rendezvous_timeout,
            Duration::from_secs(60),
            "not set: kept"
        );
        assert_eq!((group.rank(), group.world_size()), (0, 1));

        let plain = ProcessGroup::builder_from_env(&env(&[]), options)
            .build()
            .unwrap();
        assert_eq!(plain.options().timeout, Duration::from_secs(120));
    }
}
