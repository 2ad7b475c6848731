//! NCCL backend tests. Those that need libnccl or a GPU skip with a printed reason when these
//! are missing, so `cargo test` passes on machines without them.

#[cfg(feature = "cuda")]
mod cuda {
    use std::time::Duration;

    use burn::tensor::{DType, Device, Tensor, TensorData};
    use burn_ddp_nccl::{NcclComm, NcclError, ReduceOp, check_libraries, unique_id};

    /// Skips (with the reason printed) unless libcuda and libnccl load.
    fn libraries_or_skip(test: &str) -> bool {
        match check_libraries() {
            Ok(()) => true,
            Err(e) => {
                eprintln!("SKIPPED {test}: {e}");
                false
            }
        }
    }

    #[test]
    fn missing_libraries_are_an_error_not_a_panic() {
        let result = std::panic::catch_unwind(|| check_libraries().map_err(|e| e.to_string()));
        let result = result.expect("checking the libraries must never panic");
        if let Err(msg) = result {
            assert!(
                msg.contains("not found") && msg.contains("looked for"),
                "{msg}"
            );
            // Joining a communicator without the libraries is the same error, not a panic.
            let joined = NcclComm::new(0, 1, 0, &[0; 128], Duration::from_secs(1), &mut || None);
            assert!(matches!(joined, Err(NcclError::MissingLibrary { .. })));
        }
    }

    #[test]
    fn unique_ids_are_fresh_where_nccl_is_installed() {
        match unique_id(0) {
            Ok(a) => {
                let b = unique_id(0).unwrap();
                assert_ne!(a, b, "two ids must differ");
            }
            Err(NcclError::MissingLibrary { .. }) => {
                eprintln!("SKIPPED unique_ids_are_fresh: libnccl not installed");
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// Set in the child process of [`an_nccl_older_than_2_14_is_refused_not_a_panic`].
    const FAKE_NCCL_CHILD: &str = "BURN_DDP_NCCL_FAKE_OLD_CHILD";

    /// An NCCL older than 2.14 lacks symbols cudarc would panic on: a fake `libnccl.so` that
    /// exports only `ncclGetVersion` (saying 2.13.0) must be refused with an error naming both
    /// versions. cudarc loads NCCL once per process, from the library path the process started
    /// with, so the check runs in a child (this test binary, `old_nccl_child`) whose
    /// `LD_LIBRARY_PATH` holds the fake.
    #[test]
    fn an_nccl_older_than_2_14_is_refused_not_a_panic() {
        let dir = std::env::temp_dir().join(format!("bddp-fake-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = dir.join("fake_nccl.c");
        std::fs::write(
            &source,
            "int ncclGetVersion(int *version) { *version = 21300; return 0; }\n",
        )
        .unwrap();
        let built = std::process::Command::new("gcc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join("libnccl.so"))
            .arg(&source)
            .status();
        match built {
            Ok(status) if status.success() => {}
            other => {
                eprintln!(
                    "SKIPPED an_nccl_older_than_2_14_is_refused_not_a_panic: gcc could not build \
                     the fake libnccl.so ({other:?}); THIS CHECK DID NOT RUN"
                );
                return;
            }
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "cuda::old_nccl_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("LD_LIBRARY_PATH", &dir)
            .env(FAKE_NCCL_CHILD, "1")
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "the child failed:\n{text}");
        let refusal = text
            .lines()
            .find_map(|l| l.split_once("REFUSED: ").map(|(_, refusal)| refusal))
            .unwrap_or_else(|| panic!("no refusal in the child's output:\n{text}"));
        assert!(
            refusal.contains("2.13.0") && refusal.contains("21300") && refusal.contains("2.14"),
            "{refusal}"
        );
    }

    /// The child of [`an_nccl_older_than_2_14_is_refused_not_a_panic`]; does nothing unless
    /// that test started it.
    #[test]
    fn old_nccl_child() {
        if std::env::var_os(FAKE_NCCL_CHILD).is_none() {
            return;
        }
        match unique_id(0) {
            Err(e @ NcclError::UnsupportedNccl { .. }) => println!("REFUSED: {e}"),
            other => panic!("an NCCL 2.13 was not refused: {other:?}"),
        }
        // Joining refuses it too (after libcuda, which this machine may lack).
        let joined = NcclComm::new(0, 1, 0, &[0; 128], Duration::from_secs(1), &mut || None);
        assert!(
            matches!(
                joined,
                Err(NcclError::UnsupportedNccl { .. } | NcclError::MissingLibrary { .. })
            ),
            "{:?}",
            joined.err()
        );
    }

    /// World size 1 on GPU 0: every collective writes a fresh buffer (the output equals the
    /// input only if NCCL read the input's memory and wrote the output's), started on this
    /// thread and finished on another; the input is left as it was (a clone shares its buffer).
    #[test]
    fn world_of_one_collectives_on_the_gpu() {
        if !libraries_or_skip("world_of_one_collectives_on_the_gpu") {
            return;
        }
        let id = unique_id(0).unwrap();
        let comm = NcclComm::new(0, 1, 0, &id, Duration::from_secs(60), &mut || None).unwrap();
        let device = Device::cuda(0);
        let host = |t: Tensor<1>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let mut dtypes = vec![DType::F32, DType::F16, DType::BF16];
        if device.supports_dtype(DType::F64) {
            dtypes.push(DType::F64);
        }
        for dtype in dtypes {
            for n in [1usize, 7, 1_000_003] {
                let values: Vec<f32> = (0..n).map(|i| (i % 97) as f32 - 48.0).collect();
                let input = Tensor::<1>::from_data(
                    TensorData::new(values.clone(), [n]).convert_dtype(dtype),
                    &device,
                );
                let gathered = comm.start_all_gather(input.clone()).unwrap();
                let out = std::thread::spawn(move || gathered.wait(&mut || None))
                    .join()
                    .unwrap();
                assert_eq!(host(out.unwrap()), values, "{dtype:?} n = {n}, gathered");
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    let again = comm.all_reduce(input.clone(), op).unwrap();
                    assert_eq!(host(again), values, "{dtype:?} n = {n}, {op:?}");
                }
                let sent = comm.start_broadcast(input.clone(), 0).unwrap();
                assert_eq!(
                    host(sent.wait(&mut || None).unwrap()),
                    values,
                    "{dtype:?} broadcast"
                );
                assert_eq!(
                    host(input),
                    values,
                    "{dtype:?} n = {n}, the input is untouched"
                );
                println!("NCCL world 1 all_gather, all_reduce, broadcast {dtype:?} n={n}: ok");
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_feature_off() {
    eprintln!(
        "SKIPPED: burn-ddp-nccl built without its `cuda` feature; only the library finder is tested"
    );
    let msg = burn_ddp_nccl::library::locate(vec![])
        .missing("libnccl")
        .to_string();
    assert!(msg.contains("libnccl not found"), "{msg}");
}
