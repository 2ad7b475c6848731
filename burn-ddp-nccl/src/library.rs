//! Finds libcuda, libnccl and NVRTC before anything loads them: cudarc's loader panics on a
//! missing library, so the NCCL backend checks first and turns absence into an [`NcclError`]
//! that says what was looked for and how to fix it.
//!
//! Search order: the directory in `BURN_DDP_NCCL_DIR`, `LD_LIBRARY_PATH`, the usual system and
//! CUDA directories, and the library folders of NVIDIA's Python wheels in Python installations
//! (the usual prefixes, `VIRTUAL_ENV`, and the prefix of every `python3` on `PATH`, such as a
//! virtual environment's): `nvidia/nccl/lib` (the `nvidia-nccl-cu13` wheel's `libnccl.so.2`),
//! `nvidia/cu13/lib` (CUDA 13 wheels: `nvidia-cuda-nvrtc`'s `libnvrtc.so.13`) and
//! `nvidia/cuda_nvrtc/lib` (CUDA 12 wheels). cudarc loads every library by its bare name, so a
//! library found outside the loader's path needs its folder on `LD_LIBRARY_PATH`
//! ([`Located::library_dirs`]; burn-ddp's launcher puts them there for its ranks).
//! cudarc 0.19 loads NCCL only under the names
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
/// NVRTC file names cudarc 0.19 (CUDA 13.0 bindings) tries that NVIDIA ships (CUDA 13's
/// toolkit and wheel: `libnvrtc.so.13`).
pub const NVRTC_LOADABLE: &[&str] = &["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"];
/// The library folders of NVIDIA's Python wheels, under a `site-packages` folder.
pub const WHEEL_LIB_DIRS: &[&str] = &[
    "nvidia/nccl/lib",
    "nvidia/cu13/lib",
    "nvidia/cuda_nvrtc/lib",
];
/// Folders the loader searches without `LD_LIBRARY_PATH` on the usual Linux systems.
const LOADER_DIRS: &[&str] = &[
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/local/lib",
];

/// Where the libraries are, as far as a file search can tell.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Located {
    /// A loadable libcuda.
    pub cuda: Option<PathBuf>,
    /// A libnccl under a name cudarc loads.
    pub nccl: Option<PathBuf>,
    /// `libnccl.so.2`, when present (loadable once linked as `libnccl.so`).
    pub nccl_soname: Option<PathBuf>,
    /// A loadable NVRTC (burn's CUDA kernels are compiled with it).
    pub nvrtc: Option<PathBuf>,
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
    dirs.extend(wheel_dirs(env));
    dirs.dedup();
    dirs.retain(|d| d.is_dir());
    dirs
}

/// The library folders of NVIDIA's wheels in the Python installations the environment read
/// through `env` points to (see the module's documentation).
fn wheel_dirs(env: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = ["/usr/local/lib", "/usr/lib"].map(PathBuf::from).to_vec();
    if let Some(v) = env("VIRTUAL_ENV") {
        prefixes.push(Path::new(&v).join("lib"));
    }
    // The prefix of every python3 on PATH (`<prefix>/bin/python3`): a virtual environment's.
    if let Some(path) = env("PATH") {
        for bin in path.split(':').filter(|s| !s.is_empty()).map(Path::new) {
            if bin.join("python3").exists()
                && let Some(prefix) = bin.parent()
            {
                prefixes.push(prefix.join("lib"));
            }
        }
    }
    if let Some(h) = env("HOME") {
        prefixes.push(Path::new(&h).join(".local/lib"));
        if let Ok(versions) = std::fs::read_dir(Path::new(&h).join(".pyenv/versions")) {
            prefixes.extend(versions.flatten().map(|v| v.path().join("lib")));
        }
    }
    let mut dirs = Vec::new();
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(&prefix) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("python3") {
                for site in ["site-packages", "dist-packages"] {
                    let site = e.path().join(site);
                    dirs.extend(WHEEL_LIB_DIRS.iter().map(|d| site.join(d)));
                }
            }
        }
    }
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
        nvrtc: find(NVRTC_LOADABLE),
        searched: dirs,
    }
}

impl Located {
    /// Searches the directories the process environment names.
    pub fn from_env() -> Self {
        locate(search_dirs(&|k| std::env::var(k).ok()))
    }

    /// The folders of the libraries found (NCCL, NVRTC) that the loader searches only if they
    /// are on `LD_LIBRARY_PATH` (`ld_library_path`, the current value), in the order found:
    /// neither on it already nor one of the loader's own folders.
    pub fn library_dirs(&self, ld_library_path: Option<&str>) -> Vec<PathBuf> {
        let on_path: Vec<&Path> = ld_library_path
            .unwrap_or_default()
            .split(':')
            .filter(|s| !s.is_empty())
            .map(Path::new)
            .collect();
        let mut dirs: Vec<PathBuf> = Vec::new();
        let found = [&self.nccl, &self.nccl_soname, &self.nvrtc];
        for dir in found.into_iter().flatten().filter_map(|f| f.parent()) {
            let known = on_path.contains(&dir) || LOADER_DIRS.iter().any(|d| Path::new(d) == dir);
            if !known && !dirs.iter().any(|d| d == dir) {
                dirs.push(dir.to_path_buf());
            }
        }
        dirs
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
        } else if library == "libnvrtc" {
            let fix = match &self.nvrtc {
                Some(found) => format!(
                    "found {} but the loader does not search its folder: start the program with \
                     that folder on LD_LIBRARY_PATH (burn-ddp's launcher does this for its ranks)",
                    found.display()
                ),
                None => "install CUDA 13's NVRTC (the CUDA toolkit, or `pip install \
                         nvidia-cuda-nvrtc`) and put its folder on LD_LIBRARY_PATH"
                    .to_string(),
            };
            (NVRTC_LOADABLE.to_vec(), fix)
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

    /// The GPU machine's image: NCCL and NVRTC as wheels in a virtual environment whose python3
    /// is on PATH (no VIRTUAL_ENV set), NVRTC in CUDA 13's wheel layout (`nvidia/cu13/lib`).
    #[test]
    fn wheels_of_a_python_on_the_path_are_found_and_their_folders_listed() {
        let root = std::env::temp_dir().join(format!("bddp-venv-test-{}", std::process::id()));
        let site = root.join("venv/lib/python3.12/site-packages");
        for dir in [
            "venv/bin",
            "venv/lib/python3.12/site-packages/nvidia/cu13/lib",
        ] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
        }
        std::fs::create_dir_all(site.join("nvidia/nccl/lib")).unwrap();
        std::fs::write(root.join("venv/bin/python3"), b"").unwrap();
        std::fs::write(site.join("nvidia/nccl/lib").join(NCCL_SONAME), b"x").unwrap();
        std::fs::write(site.join("nvidia/cu13/lib/libnvrtc.so.13"), b"x").unwrap();
        let path = format!("/nonexistent:{}", root.join("venv/bin").display());
        let found = locate(search_dirs(&|k| (k == "PATH").then(|| path.clone())));
        let (nccl, nvrtc) = (site.join("nvidia/nccl/lib"), site.join("nvidia/cu13/lib"));
        assert_eq!(found.nccl_soname, Some(nccl.join(NCCL_SONAME)));
        assert_eq!(found.nvrtc, Some(nvrtc.join("libnvrtc.so.13")));
        assert_eq!(found.library_dirs(None), vec![nccl.clone(), nvrtc.clone()]);
        let already = format!("/a:{}", nccl.display());
        assert_eq!(found.library_dirs(Some(&already)), vec![nvrtc]);
        let msg = locate(vec![]).missing("libnvrtc").to_string();
        assert!(
            msg.contains("libnvrtc.so.13") && msg.contains("nvidia-cuda-nvrtc"),
            "{msg}"
        );
        std::fs::remove_dir_all(&root).unwrap();
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
