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
