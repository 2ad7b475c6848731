//! Shared libraries the ranks need found: cudarc loads CUDA's and NCCL's libraries by their
//! bare names, so the folders where they were found outside the loader's own path (NVIDIA's
//! Python wheels: `nvidia/nccl/lib`, `nvidia/cu13/lib`; `/usr/local/cuda/lib64`) go on the
//! ranks' `LD_LIBRARY_PATH`, and NCCL installed only as `libnccl.so.2` (the pip wheel
//! `nvidia-nccl-cu13`) is linked as `libnccl.so` in a private directory put first on it,
//! because cudarc looks for `libnccl.so` but not `libnccl.so.2`.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use burn_ddp_nccl::library::Located;

use crate::error::{DdpError, Result};

/// The ranks' `LD_LIBRARY_PATH`, and the private directory holding the `libnccl.so` link
/// (removed when dropped), if one was made.
pub(crate) struct LibraryLinks {
    dir: Option<PathBuf>,
    path: OsString,
}

/// `link` (the `libnccl.so` link's directory), then `dirs`, then the old value `old`.
fn joined(link: Option<&Path>, dirs: &[PathBuf], old: Option<&OsStr>) -> OsString {
    let parts = link
        .into_iter()
        .map(Path::as_os_str)
        .chain(dirs.iter().map(|d| d.as_os_str()))
        .chain(old.filter(|o| !o.is_empty()));
    let mut path = OsString::new();
    for (i, part) in parts.enumerate() {
        if i > 0 {
            path.push(":");
        }
        path.push(part);
    }
    path
}

impl LibraryLinks {
    /// Puts the folders of the libraries found outside the loader's path on the ranks'
    /// `LD_LIBRARY_PATH`, and links `libnccl.so.2` as `libnccl.so` when NCCL is found only
    /// under the former; `None` when the ranks need nothing (libraries absent, or loadable as
    /// they are).
    pub(crate) fn prepare() -> Result<Option<Self>> {
        let found = Located::from_env();
        let old = std::env::var_os("LD_LIBRARY_PATH");
        let dirs = found.library_dirs(old.as_deref().and_then(OsStr::to_str));
        let dir = match (&found.nccl, &found.nccl_soname) {
            (None, Some(soname)) => Some(link_nccl(soname)?),
            _ => None,
        };
        if dir.is_none() && dirs.is_empty() {
            return Ok(None);
        }
        let path = joined(dir.as_deref(), &dirs, old.as_deref());
        log::info!("the ranks' LD_LIBRARY_PATH: {}", path.to_string_lossy());
        Ok(Some(LibraryLinks { dir, path }))
    }

    /// The `LD_LIBRARY_PATH` for the ranks.
    pub(crate) fn library_path(&self) -> &OsString {
        &self.path
    }
}

/// Links `soname` as `libnccl.so` in a private directory; returns the directory.
fn link_nccl(soname: &Path) -> Result<PathBuf> {
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
    Ok(dir)
}

impl Drop for LibraryLinks {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_then_the_found_folders_then_the_old_path() {
        let dirs = [PathBuf::from("/venv/nvidia/cu13/lib")];
        let link = Path::new("/tmp/link");
        assert_eq!(
            joined(Some(link), &dirs, Some(OsStr::new("/a:/b"))),
            OsString::from("/tmp/link:/venv/nvidia/cu13/lib:/a:/b")
        );
        assert_eq!(
            joined(None, &dirs, Some(OsStr::new(""))),
            OsString::from("/venv/nvidia/cu13/lib")
        );
        assert_eq!(joined(None, &[], None), OsString::new());
    }
}
