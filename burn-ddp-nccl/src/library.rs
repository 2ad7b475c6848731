//! Finds libcuda and libnccl before anything loads them: cudarc's loader panics on a missing
//! library, so the NCCL backend checks first and turns absence into an [`NcclError`] that says
//! what was looked for and how to fix it.
//!
//! Search order: the directory in `BURN_DDP_NCCL_DIR`, `LD_LIBRARY_PATH`, the usual system and
//! CUDA directories, and the `nvidia/nccl/lib` folder of Python installations (where the
//! `nvidia-nccl-cu13` wheel puts `libnccl.so.2`). cudarc 0.19 loads NCCL only under the names
//! `libnccl.so`, `libnccl.so.13`... (not `libnccl.so.2`): a wheel's library needs a
//! `libnccl.so` symlink in a directory on `LD_LIBRARY_PATH`, which the launcher
//! (`burn_ddp::launch`) can set up for its ranks and the error message spells out otherwise.

use std::path::{Path, PathBuf};

use crate::error::NcclError;

/// Environment variable naming the directory that holds `libnccl.so*`.
pub const NCCL_DIR_VAR: &str = "BURN_DDP_NCCL_DIR";

/// NCCL file names cudarc 0.19 (CUDA 13.0 bindings) tries, in order.
pub const NCCL_LOADABLE: &[&str] = &[
    "libnccl.so",
    "libnccl.so.13",
    "libnccl.so.12",
    "libnccl.so.11",
    "libnccl.so.10",
    "libnccl.so.9",
    "libnccl.so.1",
];
/// The name NCCL's own packages and the pip wheel ship.
pub const NCCL_SONAME: &str = "libnccl.so.2";
/// CUDA driver file names.
pub const CUDA_LOADABLE: &[&str] = &["libcuda.so", "libcuda.so.1"];

/// Where the libraries are, as far as a file search can tell.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Located {
    /// A loadable libcuda.
    pub cuda: Option<PathBuf>,
    /// A libnccl under a name cudarc loads.
    pub nccl: Option<PathBuf>,
    /// `libnccl.so.2`, when present (loadable once linked as `libnccl.so`).
    pub nccl_soname: Option<PathBuf>,
    /// Directories searched, in order.
    pub searched: Vec<PathBuf>,
}

/// Directories to search, from the environment read through `env`.
pub fn search_dirs(env: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = env(NCCL_DIR_VAR) {
        dirs.push(d.into());
    }
    if let Some(p) = env("LD_LIBRARY_PATH") {
        dirs.extend(p.split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/lib",
    ] {
        dirs.push(d.into());
    }
    // Python site-packages of the usual prefixes (the NCCL wheel).
    let mut prefixes: Vec<PathBuf> = ["/usr/local/lib", "/usr/lib"].map(PathBuf::from).to_vec();
    if let Some(v) = env("VIRTUAL_ENV") {
        prefixes.push(Path::new(&v).join("lib"));
    }
    if let Some(h) = env("HOME") {
        prefixes.push(Path::new(&h).join(".local/lib"));
        if let Ok(versions) = std::fs::read_dir(Path::new(&h).join(".pyenv/versions")) {
            prefixes.extend(versions.flatten().map(|v| v.path().join("lib")));
        }
    }
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(&prefix) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("python3") {
                for site in ["site-packages", "dist-packages"] {
                    dirs.push(e.path().join(site).join("nvidia/nccl/lib"));
                }
            }
        }
    }
    dirs.dedup();
    dirs.retain(|d| d.is_dir());
    dirs
}

/// Looks for the libraries in `dirs`.
pub fn locate(dirs: Vec<PathBuf>) -> Located {
    let find = |names: &[&str]| {
        dirs.iter()
            .flat_map(|d| names.iter().map(move |n| d.join(n)))
            .find(|p| p.is_file())
    };
    Located {
        cuda: find(CUDA_LOADABLE),
        nccl: find(NCCL_LOADABLE),
        nccl_soname: find(&[NCCL_SONAME]),
        searched: dirs,
    }
}

impl Located {
    /// Searches the directories the process environment names.
    pub fn from_env() -> Self {
        locate(search_dirs(&|k| std::env::var(k).ok()))
    }

    /// The error for a library the loader could not load, with the fix that fits what the
    /// search found.
    pub fn missing(&self, library: &'static str) -> NcclError {
        let (looked_for, fix) = if library == "libcuda" {
            (
                CUDA_LOADABLE.to_vec(),
                "install the NVIDIA driver (libcuda.so.1 comes with it); this machine may have \
                 no GPU"
                    .to_string(),
            )
        } else {
            let mut names = NCCL_LOADABLE.to_vec();
            names.push(NCCL_SONAME);
            let fix = match &self.nccl_soname {
                Some(so2) => {
                    let dir = so2.parent().unwrap_or(Path::new("."));
                    format!(
                        "found {} but the loader only takes the name libnccl.so: run \
                         `ln -s {} <dir>/libnccl.so` in a directory of your choice and start \
                         the program with LD_LIBRARY_PATH=<dir> (burn-ddp's launcher does this \
                         for its ranks when {NCCL_DIR_VAR}={} is set)",
                        so2.display(),
                        so2.display(),
                        dir.display()
                    )
                }
                None => format!(
                    "install NCCL (for example `pip install nvidia-nccl-cu13`) and set \
                     {NCCL_DIR_VAR} to the directory holding libnccl.so.2"
                ),
            };
            (names, fix)
        };
        NcclError::MissingLibrary {
            library,
            looked_for,
            searched: self.searched.clone(),
            fix,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wheel_name_is_found_and_the_fix_names_it() {
        let dir = std::env::temp_dir().join(format!("bddp-nccl-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(NCCL_SONAME), b"not really a library").unwrap();
        let found = locate(vec![dir.clone()]);
        assert_eq!(found.nccl, None);
        assert_eq!(found.nccl_soname, Some(dir.join(NCCL_SONAME)));
        let msg = found.missing("libnccl").to_string();
        assert!(
            msg.contains("libnccl.so.2") && msg.contains("ln -s"),
            "{msg}"
        );
        std::fs::write(dir.join("libnccl.so"), b"x").unwrap();
        assert_eq!(locate(vec![dir.clone()]).nccl, Some(dir.join("libnccl.so")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_documented_variable_is_searched_first() {
        let dirs = search_dirs(&|k| match k {
            NCCL_DIR_VAR => Some("/opt/nccl/lib".into()),
            "LD_LIBRARY_PATH" => Some("/a:/b".into()),
            _ => None,
        });
        // Only directories that exist are kept.
        assert!(!dirs.iter().any(|d| d == Path::new("/opt/nccl/lib")));
        let here = std::env::temp_dir().display().to_string();
        let dirs = search_dirs(&|k| (k == NCCL_DIR_VAR).then(|| here.clone()));
        assert_eq!(
            dirs[0],
            PathBuf::from(&here),
            "the documented variable comes first"
        );
        let msg = locate(vec!["/nonexistent".into()])
            .missing("libnccl")
            .to_string();
        assert!(
            msg.contains(NCCL_DIR_VAR) && msg.contains("pip install"),
            "{msg}"
        );
    }
}
