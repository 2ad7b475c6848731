//! Every `unsafe` call of the NCCL backend: library presence checks, NCCL communicator calls on
//! raw device pointers, and the stream query that bounds their wait.
//!
//! Safety argument, in one place:
//! - cudarc loads libcuda and libnccl lazily and panics when one is missing; every function
//!   here that reaches them is only called after [`libraries_present`] returned true for both
//!   (the presence checks themselves only try to `dlopen` and report).
//! - A [`RawComm`] owns its `ncclComm_t`: created by `ncclCommInitRank`, used only through
//!   `&self`/`&mut self`, and released exactly once (destroyed on drop, or aborted on failure
//!   and then never used again).
//! - [`RawComm::all_reduce`] receives device pointers and a count that the caller took from
//!   live, contiguous CubeCL buffers of at least `count` elements it keeps pinned (a `ManagedResource`) until the
//!   stream has been synchronised, so NCCL reads and writes exactly `count` elements of memory
//!   that stays allocated and that no CubeCL kernel touches meanwhile (the caller synchronised
//!   CubeCL's stream before, and synchronises NCCL's stream before handing the tensor back).
//! - Strings from `ncclGetErrorString` / `ncclGetLastError` are static or owned by NCCL and
//!   copied at once.

use std::ffi::{CStr, c_void};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;

/// Whether libcuda and libnccl can be loaded (never panics).
pub(crate) fn libraries_present() -> (bool, bool) {
    // SAFETY: both only attempt to dlopen the candidate names and report the outcome.
    unsafe { (cu::is_culib_present(), sys::is_culib_present()) }
}

/// NCCL's message for a result code.
pub(crate) fn error_string(code: sys::ncclResult_t) -> String {
    // SAFETY: only called once libnccl is loaded; the pointer is a static C string.
    unsafe {
        let p = sys::ncclGetErrorString(code);
        if p.is_null() {
            format!("{code:?}")
        } else {
            format!("{code:?}: {}", CStr::from_ptr(p).to_string_lossy())
        }
    }
}

/// A fresh 128-byte NCCL unique id (needs only libnccl, no GPU).
pub(crate) fn unique_id() -> Result<[u8; 128], String> {
    let id = nccl::get_uniqueid().map_err(|e| error_string(e.0))?;
    Ok(id.internal.map(|c| c as u8))
}

/// The element types NCCL reduces here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DType {
    F32,
    F16,
    BF16,
}

/// The reductions NCCL performs here.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RedOp {
    Sum,
    Avg,
    Max,
}

/// An owned NCCL communicator.
pub(crate) struct RawComm {
    comm: sys::ncclComm_t,
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; RawComm is only reached through &mut or a Mutex in NcclComm.
unsafe impl Send for RawComm {}

impl RawComm {
    /// `ncclCommInitRank` (blocking; the caller's context must be current).
    pub(crate) fn init(world: usize, id: &[u8; 128], rank: usize) -> Result<Self, String> {
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; libnccl is loaded (module invariant).
        unsafe { nccl::comm_init_rank(&mut comm, world as i32, uid, rank as i32) }
            .map_err(|e| error_string(e.0))?;
        Ok(RawComm {
            comm,
            aborted: false,
        })
    }

    /// The communicator's last error message (`ncclGetLastError`).
    pub(crate) fn last_error(&self) -> String {
        // SAFETY: the communicator is live; the returned string is owned by NCCL.
        unsafe {
            let p = sys::ncclGetLastError(self.comm);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    /// Reduces `count` elements from device address `send` into `recv` (the same address for
    /// in place) on `stream`, then waits for the stream at most `timeout` (polling it); on
    /// timeout the communicator is aborted.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn all_reduce(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: RedOp,
        stream: cu::CUstream,
        timeout: Duration,
    ) -> Result<(), String> {
        if self.aborted {
            return Err("the communicator was aborted after an earlier failure".into());
        }
        let dtype = match dtype {
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::F16 => sys::ncclDataType_t::ncclFloat16,
            DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        };
        let op = match op {
            RedOp::Sum => sys::ncclRedOp_t::ncclSum,
            RedOp::Avg => sys::ncclRedOp_t::ncclAvg,
            RedOp::Max => sys::ncclRedOp_t::ncclMax,
        };
        // SAFETY: see the module docs: `send`/`recv` and `count` describe pinned, contiguous
        // buffers of `dtype` elements, and `stream` belongs to the context that owns them.
        unsafe {
            nccl::all_reduce(
                send as *const c_void,
                recv as *mut c_void,
                count,
                dtype,
                op,
                self.comm,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| format!("{} ({})", error_string(e.0), self.last_error()))?;
        let start = Instant::now();
        loop {
            // SAFETY: `stream` is a live stream of the current context.
            match unsafe { cu::cuStreamQuery(stream) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(format!("waiting for the NCCL stream: {other:?}")),
            }
            if start.elapsed() >= timeout {
                self.abort();
                return Err(format!("timed out after {timeout:?}"));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// `ncclCommAbort`: stops pending work so no rank hangs; the communicator is unusable after.
    pub(crate) fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: the communicator is live and never used after this.
            let _ = unsafe { nccl::comm_abort(self.comm) };
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        if !self.aborted {
            // SAFETY: the communicator is live and dropped exactly once.
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }
}
