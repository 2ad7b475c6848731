//! The training checks of `crate::train` on burn's wgpu backend (CubeCL on Vulkan), so that
//! device buffers and queues, not only host memory, go through DdpLearner and the reducer. In CI
//! this runs on Mesa's software Vulkan driver (lavapipe, Debian's `mesa-vulkan-drivers`); with
//! no Vulkan driver installed the tests say SKIPPED and pass, unless [`REQUIRE_VAR`] is set (CI
//! sets it: there a missing driver fails every test). Only with burn-ddp's `wgpu` feature.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use burn::tensor::{Device, DeviceKind};

use burn_ddp::train::Compression;

use crate::train::{equivalence, lockstep};

/// The first Vulkan driver manifest (ICD) the Vulkan loader would consider: the files named by
/// `VK_DRIVER_FILES` / `VK_ICD_FILENAMES` when set, else a `*.json` in the loader's
/// `vulkan/icd.d` search directories (XDG configuration and data directories, `/etc`).
fn vulkan_driver() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    let manifests_in = |dir: &Path| -> Option<PathBuf> {
        std::fs::read_dir(dir)
            .ok()?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "json") && p.is_file())
    };
    for key in ["VK_DRIVER_FILES", "VK_ICD_FILENAMES"] {
        if let Some(list) = var(key) {
            return std::env::split_paths(&list).find_map(|p| {
                if p.is_dir() {
                    manifests_in(&p)
                } else {
                    p.is_file().then_some(p)
                }
            });
        }
    }
    let home = var("HOME").map(PathBuf::from).unwrap_or_default();
    let list = |key: &str, default: &str| -> Vec<PathBuf> {
        std::env::split_paths(&var(key).unwrap_or_else(|| default.into())).collect()
    };
    let one = |key: &str, default: PathBuf| var(key).map_or(default, PathBuf::from);
    let mut dirs = vec![one("XDG_CONFIG_HOME", home.join(".config"))];
    dirs.extend(list("XDG_CONFIG_DIRS", "/etc/xdg"));
    dirs.push("/etc".into());
    dirs.push(one("XDG_DATA_HOME", home.join(".local/share")));
    dirs.extend(list("XDG_DATA_DIRS", "/usr/local/share:/usr/share"));
    dirs.iter()
        .find_map(|d| manifests_in(&d.join("vulkan/icd.d")))
}

/// Set (to anything but empty or `0`), a test that finds no Vulkan driver fails instead of
/// skipping: `.ci/run` sets it, since CI installs lavapipe and a skip there hides a broken setup.
const REQUIRE_VAR: &str = "BDDP_REQUIRE_WGPU";

/// Whether a value of [`REQUIRE_VAR`] asks for the wgpu tests to run.
fn required_by(value: Option<&str>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// What a test does without a Vulkan driver: skips (`Ok`, a developer's machine), or fails
/// with the reason when `required` (CI).
fn without_driver(required: bool) -> Result<(), String> {
    if !required {
        return Ok(());
    }
    Err(format!(
        "no Vulkan driver found, and {REQUIRE_VAR} requires the wgpu tests to run (install \
         mesa-vulkan-drivers, or unset {REQUIRE_VAR})"
    ))
}

/// The autodiff wgpu device the ranks train on (all ranks of a test are threads of this
/// process, sharing it), or `None`, said loudly, when no Vulkan driver is installed (a failure
/// when [`REQUIRE_VAR`] is set).
fn device() -> Option<Device> {
    match vulkan_driver() {
        Some(driver) => {
            let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
            // Opens the device: a driver that is installed but does not work fails the test.
            let adapter = device
                .identity()
                .map_or_else(|| "?".to_string(), |id| id.name);
            eprintln!(
                "wgpu: training on {adapter} (Vulkan driver {})",
                driver.display()
            );
            Some(device)
        }
        None => {
            let required = required_by(std::env::var(REQUIRE_VAR).ok().as_deref());
            if let Err(why) = without_driver(required) {
                panic!("{why}");
            }
            println!("SKIPPED: no Vulkan driver (install mesa-vulkan-drivers)");
            None
        }
    }
}

/// How long one check may take on the wgpu device (about 15 s each on lavapipe, 2 cores).
const LIMIT: Duration = Duration::from_secs(300);

/// Runs `check` on the wgpu device; fails the test if it has not finished within [`LIMIT`]
/// (the group's timeouts bound the collectives, not a hang inside the driver). Skips without a
/// Vulkan driver.
fn on_wgpu(check: fn(&Device)) {
    let Some(device) = device() else { return };
    let (done, finished) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        check(&device);
        let _ = done.send(());
    });
    match finished.recv_timeout(LIMIT) {
        Ok(()) => {}
        Err(RecvTimeoutError::Disconnected) => {
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(RecvTimeoutError::Timeout) => panic!("the check did not finish within {LIMIT:?}"),
    }
}

#[test]
fn wgpu_sync_batch_norm_matches_batch_norm_over_the_global_batch() {
    on_wgpu(|device| crate::syncbn::matches_reference(device, &[3, 5]));
}

#[test]
fn wgpu_compressed_gradients_train_like_one_process() {
    on_wgpu(|device| {
        for compression in [Compression::Bf16, Compression::Fp16] {
            let err = equivalence::compressed(device, compression);
            eprintln!("wgpu, {compression}: relative error against one process {err:e}");
            assert!(err <= 5e-3, "{compression}: {err:e}");
        }
    });
}

#[test]
fn wgpu_world_2_matches_one_process_with_the_global_batch() {
    on_wgpu(|device| equivalence::equivalence(device, 2, None));
}

#[test]
fn wgpu_fully_sharded_blocks_train_as_one_process_with_every_strategy() {
    on_wgpu(crate::fsdp::every_strategy_trains_as_one_process_on);
}

#[test]
fn wgpu_ranks_hold_identical_parameters_after_every_step() {
    on_wgpu(lockstep::identical_after_every_step);
}

#[test]
fn wgpu_accumulation_reduces_once_per_optimizer_step() {
    on_wgpu(equivalence::accumulation);
}

#[test]
fn wgpu_a_parameter_without_gradient_in_some_steps_neither_hangs_nor_diverges() {
    on_wgpu(equivalence::unused_parameter);
}

#[test]
fn wgpu_tensor_collectives_match_host_collectives() {
    if device().is_some() {
        crate::tensors::check_tensor_collectives(2, || Device::wgpu(DeviceKind::DefaultDevice));
    }
}

/// A missing driver fails the test when [`REQUIRE_VAR`] is set (to anything but empty or `0`),
/// and only then (whether or not this machine has a driver).
#[test]
fn wgpu_a_missing_driver_fails_when_required_and_skips_otherwise() {
    for (value, required) in [(None, false), (Some(""), false), (Some("0"), false)] {
        assert_eq!(required_by(value), required, "{value:?}");
    }
    assert!(required_by(Some("1")));
    assert_eq!(without_driver(false), Ok(()));
    let why = without_driver(true).expect_err("a required run skipped");
    assert!(why.contains(REQUIRE_VAR), "{why}");
}
