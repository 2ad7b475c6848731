//! The open-file limit: rank 0 holds about three descriptors per rank (its store's connections
//! and the data plane) and the launcher more (each rank's pipes), so the common soft limit of
//! 1024 stops a job of a few hundred ranks at once ("Too many open files"). As many launchers
//! do, burn-ddp raises the soft limit to the hard one when it starts a group or a launcher.

/// Raises this process's soft limit on open files to its hard limit (once; a failure is only
/// logged: the old limit stays, and running out of descriptors is reported where it happens).
pub(crate) fn raise_open_files() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(unix)]
        {
            use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
            let limit = getrlimit(Resource::Nofile);
            if limit.current.is_some() && limit.current != limit.maximum {
                let raised = Rlimit {
                    current: limit.maximum,
                    maximum: limit.maximum,
                };
                match setrlimit(Resource::Nofile, raised) {
                    Ok(()) => log::debug!(
                        "raised the open-file limit from {:?} to {:?}",
                        limit.current,
                        limit.maximum
                    ),
                    Err(e) => log::warn!("could not raise the open-file limit: {e}"),
                }
            }
        }
    });
}
