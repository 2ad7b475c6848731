//! Shared libraries the ranks need found: NCCL installed only as `libnccl.so.2` (the pip wheel
//! `nvidia-nccl-cu13`) is linked as `libnccl.so` in a private directory put first on the ranks'
//! `LD_LIBRARY_PATH`, because cudarc looks for `libnccl.so` but not `libnccl.so.2`.

use std::ffi::OsString;
use std::path::PathBuf;

use burn_ddp_nccl::library::Located;

use crate::error::{DdpError, Result};

/// A private directory holding the `libnccl.so` link, removed when dropped.
pub(crate) struct LibraryLinks {
    dir: PathBuf,
    path: OsString,
}

impl LibraryLinks {
    /// Links `libnccl.so.2` as `libnccl.so` when NCCL is found only under the former; `None`
    /// when nothing needs linking (NCCL absent, or loadable as it is).
    pub(crate) fn prepare() -> Result<Option<Self>> {
        let found = Located::from_env();
        let (None, Some(soname)) = (&found.nccl, &found.nccl_soname) else {
            return Ok(None);
        };
        let dir = std::env::temp_dir().join(format!("burn-ddp-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| DdpError::io("creating the directory of the libnccl.so link", e))?;
        let link = dir.join("libnccl.so");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(soname, &link)
            .map_err(|e| DdpError::io("linking libnccl.so.2 as libnccl.so", e))?;
        log::info!(
            "NCCL is installed as {}; linked as {}",
            soname.display(),
            link.display()
        );
        let mut path = dir.clone().into_os_string();
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            path.push(":");
            path.push(old);
        }
        Ok(Some(LibraryLinks { dir, path }))
    }

    /// The `LD_LIBRARY_PATH` for the ranks.
    pub(crate) fn library_path(&self) -> &OsString {
        &self.path
    }
}

impl Drop for LibraryLinks {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
