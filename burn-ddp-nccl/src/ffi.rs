//! Every `unsafe` call of the NCCL backend (the crate denies `unsafe_code` elsewhere): library
//! presence checks, the NCCL communicator on raw device pointers, and the stream query that
//! bounds its waits.
//!
//! Safety argument, in one place:
//! - cudarc loads libcuda and libnccl lazily and panics when one is missing; every function
//!   here that reaches them is only called after [`libraries_present`] returned true for both
//!   (the presence checks themselves only try to `dlopen` and report). cudarc also panics on a
//!   missing symbol: [`nccl_version`] reads `ncclGetVersion` alone, without panicking, and NCCL
//!   older than 2.14 (which lacks symbols used here) is refused before any other NCCL call.
//! - A [`RawComm`] owns its `ncclComm_t`: created by `ncclCommInitRankConfig`, used only through
//!   `&mut self` (its owner keeps it behind a mutex), and released exactly once: finalized and
//!   destroyed on drop when healthy, aborted otherwise, and never used after an abort.
//! - The caller binds the communicator's CUDA context to the calling thread before every call
//!   here that reaches the GPU (init, enqueue, stream query, finalize, abort).
//! - [`RawComm::enqueue`] receives device pointers and counts that the caller took from live,
//!   contiguous CubeCL buffers (of `count` elements; `world * count` for a gather's output) it
//!   keeps pinned (a `ManagedResource`) until [`stream_finished`] said NCCL's stream finished
//!   (after an abort too: the caller aborts first, then waits for the stream to drain, and
//!   leaks the buffers if it does not), so NCCL reads and writes memory that stays allocated. No CubeCL
//!   kernel touches it meanwhile: the caller waited for the fence CubeCL's stream recorded after
//!   the kernels that produced the input, and hands the output to burn only after the wait.
//! - Strings from `ncclGetErrorString` / `ncclGetLastError` are static or owned by NCCL and
//!   copied at once.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use cudarc::driver::sys as cu;
use cudarc::nccl::sys;

use crate::tables::{DType, ReduceOp};

/// Whether libcuda and libnccl can be loaded (never panics).
pub(crate) fn libraries_present() -> (bool, bool) {
    // SAFETY: both only attempt to dlopen the candidate names and report the outcome.
    unsafe { (cu::is_culib_present(), sys::is_culib_present()) }
}

/// Whether libnvrtc (which compiles burn's CUDA kernels) can be loaded.
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only attempts to dlopen the candidate names and reports the outcome.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// `ncclGetVersion`'s code, read through cudarc's own handle on libnccl (the library every
/// later call goes to) without touching any other NCCL symbol: cudarc panics on a missing one,
/// and an NCCL older than this crate needs lacks some. `Err`: why it could not be read. Only
/// called once [`libraries_present`] found libnccl.
pub(crate) fn nccl_version() -> Result<i32, String> {
    type GetVersion = unsafe extern "C" fn(*mut c_int) -> sys::ncclResult_t;
    let mut code: c_int = 0;
    // SAFETY: libnccl is present (the caller checked), so `culib` loads it instead of
    // panicking; the symbol is looked up without panicking, and NCCL declares it
    // `ncclResult_t ncclGetVersion(int *version)`; `code` is a valid out-pointer.
    let result = unsafe {
        let get = sys::culib()
            .get::<GetVersion>(b"ncclGetVersion\0")
            .map_err(|e| format!("libnccl has no ncclGetVersion: {e}"))?;
        get(&mut code)
    };
    if result != sys::ncclResult_t::ncclSuccess {
        return Err(format!("ncclGetVersion failed: {result:?}"));
    }
    Ok(code)
}

/// A failed NCCL or CUDA driver call: the result code and, for NCCL, its words for it and the
/// communicator's last error (`ncclGetLastError`, which says for instance "Duplicate GPU
/// detected").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// The result code's name (`ncclRemoteError`, `CUDA_ERROR_LAUNCH_FAILED`...).
    pub(crate) code: String,
    /// What the library said beyond the code (may be empty).
    pub(crate) detail: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.detail.is_empty() {
            f.write_str(&self.code)
        } else {
            write!(f, "{}: {}", self.code, self.detail)
        }
    }
}

impl Failure {
    /// A failure of this crate's own making (a call on an aborted communicator).
    fn ours(detail: &str) -> Self {
        Failure {
            code: "aborted".into(),
            detail: detail.into(),
        }
    }
}

/// NCCL's words for a result code (empty if it has none).
fn error_string(code: sys::ncclResult_t) -> String {
    // SAFETY: only called once libnccl is loaded; the pointer is a static C string.
    unsafe {
        let p = sys::ncclGetErrorString(code);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// A fresh 128-byte NCCL unique id (needs only libnccl, no GPU).
pub(crate) fn unique_id() -> Result<[u8; 128], Failure> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer; libnccl is loaded (module invariant).
    let code = unsafe { sys::ncclGetUniqueId(&mut id) };
    if code != sys::ncclResult_t::ncclSuccess {
        return Err(failure_of(code, String::new()));
    }
    Ok(id.internal.map(|c| c as u8))
}

/// The first fields of `ncclConfig_t` (NCCL 2.18's whole struct, `version` saying 2.17). Later
/// versions only append fields, and NCCL's `parseCommConfig` starts from
/// `NCCL_CONFIG_INITIALIZER`, copies `size` bytes of what it is given over it and resets the
/// fields newer than `version` to their defaults, so this prefix works with every NCCL from
/// 2.17 on, whatever version cudarc's bindings were generated for. (`NCCL_COMM_BLOCKING` in
/// the environment overrides `blocking`.)
#[repr(C)]
struct ConfigV2_17 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

/// `NCCL_CONFIG_UNDEF_INT`: "NCCL's default" for an int field.
const UNDEF_INT: c_int = c_int::MIN;

impl ConfigV2_17 {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
    fn non_blocking() -> Self {
        ConfigV2_17 {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef,
            // NCCL_VERSION(2, 17, 0)
            version: 2 * 10_000 + 17 * 100,
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
        }
    }
}

/// Where a non-blocking communicator's last call stands (`ncclCommGetAsyncError`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    /// Everything asked of it so far has been issued.
    Ready,
    /// Still joining, or still issuing a collective.
    InProgress,
    /// It failed (NCCL's words, with `ncclGetLastError`'s).
    Failed(Failure),
}

/// One collective on raw device addresses, enqueued by [`RawComm::enqueue`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum RawOp {
    /// `count` elements from `send` reduced into `recv`.
    AllReduce {
        send: u64,
        recv: u64,
        count: usize,
        op: ReduceOp,
    },
    /// `count` elements of `root`'s `send` land in every rank's `recv`.
    Broadcast {
        send: u64,
        recv: u64,
        count: usize,
        root: usize,
    },
    /// `count` elements from `send` on every rank land at `recv + rank * count`.
    AllGather { send: u64, recv: u64, count: usize },
    /// `world * count` elements from `send` reduced; part `rank` (`count` elements) lands in
    /// `recv`.
    ReduceScatter {
        send: u64,
        recv: u64,
        count: usize,
        op: ReduceOp,
    },
}

/// An owned, non-blocking NCCL communicator.
pub(crate) struct RawComm {
    comm: sys::ncclComm_t,
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; RawComm is only reached through &mut (behind a Mutex in NcclComm).
unsafe impl Send for RawComm {}

impl RawComm {
    /// Starts joining communicator `id` as `rank` of `world` on the current context's GPU,
    /// without blocking: poll [`RawComm::state`] until it is ready.
    pub(crate) fn start(world: usize, id: &[u8; 128], rank: usize) -> Result<Self, Failure> {
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        let mut config = ConfigV2_17::non_blocking();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer and `config` a valid, initialised config of the
        // layout its `size` and `version` declare (see ConfigV2_17); libnccl is loaded.
        let code = unsafe {
            sys::ncclCommInitRankConfig(
                &mut comm,
                world as c_int,
                uid,
                rank as c_int,
                (&mut config as *mut ConfigV2_17).cast::<sys::ncclConfig_t>(),
            )
        };
        let ok = matches!(
            code,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        );
        if comm.is_null() {
            return Err(failure_of(code, String::new()));
        }
        let mut raw = RawComm {
            comm,
            aborted: false,
        };
        if !ok {
            let failure = raw.failure(code);
            raw.abort();
            return Err(failure);
        }
        Ok(raw)
    }

    /// The communicator's last error message (`ncclGetLastError`).
    fn last_error(&self) -> String {
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

    /// `code` with NCCL's words for it and for the communicator's last error.
    fn failure(&self, code: sys::ncclResult_t) -> Failure {
        failure_of(code, self.last_error())
    }

    /// Where the communicator stands (`ncclCommGetAsyncError`): a join or a collective still
    /// being issued, ready, or failed (a peer's network error included).
    pub(crate) fn state(&mut self) -> State {
        if self.aborted {
            return State::Failed(Failure::ours("the communicator was aborted"));
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator, valid out-pointer.
        let code = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        if code != sys::ncclResult_t::ncclSuccess {
            return State::Failed(self.failure(code));
        }
        match state {
            sys::ncclResult_t::ncclSuccess => State::Ready,
            sys::ncclResult_t::ncclInProgress => State::InProgress,
            other => State::Failed(self.failure(other)),
        }
    }

    /// Enqueues `op` on elements of `dtype` on `stream`; returns at once (the call may still be
    /// in progress: poll [`RawComm::state`] before waiting for the stream).
    pub(crate) fn enqueue(
        &mut self,
        op: RawOp,
        dtype: DType,
        stream: cu::CUstream,
    ) -> Result<(), Failure> {
        if self.aborted {
            return Err(Failure::ours(
                "the communicator was aborted after an earlier failure",
            ));
        }
        let (dtype, stream) = (dtype.raw(), stream as sys::cudaStream_t);
        // SAFETY: see the module docs: the addresses and counts describe pinned, contiguous
        // buffers of `dtype` elements (the gather's `recv` and the reduce-scatter's `send` of
        // `world * count`), and `stream`
        // belongs to the context that owns them.
        let code = unsafe {
            match op {
                RawOp::AllReduce {
                    send,
                    recv,
                    count,
                    op,
                } => sys::ncclAllReduce(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype,
                    op.raw(),
                    self.comm,
                    stream,
                ),
                RawOp::Broadcast {
                    send,
                    recv,
                    count,
                    root,
                } => sys::ncclBroadcast(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype,
                    root as c_int,
                    self.comm,
                    stream,
                ),
                RawOp::AllGather { send, recv, count } => sys::ncclAllGather(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype,
                    self.comm,
                    stream,
                ),
                RawOp::ReduceScatter {
                    send,
                    recv,
                    count,
                    op,
                } => sys::ncclReduceScatter(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype,
                    op.raw(),
                    self.comm,
                    stream,
                ),
            }
        };
        match code {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            other => Err(self.failure(other)),
        }
    }

    /// `ncclCommAbort`: stops pending work so no rank hangs; the communicator is unusable after.
    pub(crate) fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: the communicator is live and never used after this.
            let _ = unsafe { sys::ncclCommAbort(self.comm) };
        }
    }

    /// Starts `ncclCommFinalize` (flushes what was issued, without blocking): poll
    /// [`RawComm::state`], then drop.
    pub(crate) fn start_finalize(&mut self) -> Result<(), Failure> {
        if self.aborted {
            return Err(Failure::ours("the communicator was aborted"));
        }
        // SAFETY: live communicator.
        match unsafe { sys::ncclCommFinalize(self.comm) } {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            other => Err(self.failure(other)),
        }
    }
}

impl Drop for RawComm {
    /// Destroys a communicator that is still healthy (its owner finalized it first), aborts
    /// any other: either way its resources go, exactly once.
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        if self.state() == State::Ready {
            // SAFETY: the communicator is live and dropped exactly once.
            let _ = unsafe { sys::ncclCommDestroy(self.comm) };
        } else {
            self.abort();
        }
    }
}

/// Whether `stream` finished its work: `Ok(true)` done, `Ok(false)` still running.
pub(crate) fn stream_finished(stream: cu::CUstream) -> Result<bool, Failure> {
    // SAFETY: `stream` is a live stream of the context bound to this thread.
    match unsafe { cu::cuStreamQuery(stream) } {
        cu::CUresult::CUDA_SUCCESS => Ok(true),
        cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(Failure {
            code: format!("{other:?}"),
            detail: "cuStreamQuery on the NCCL stream".into(),
        }),
    }
}

/// The failure of NCCL result `code`, with the communicator's last error when there is one.
fn failure_of(code: sys::ncclResult_t, last: String) -> Failure {
    let words = error_string(code);
    let detail = match (words.is_empty(), last.is_empty()) {
        (_, true) => words,
        (true, false) => last,
        (false, false) => format!("{words} ({last})"),
    };
    Failure {
        code: format!("{code:?}"),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config NCCL is given is the 2.17 prefix of `ncclConfig_t` as NCCL_CONFIG_INITIALIZER
    /// fills it, but non-blocking.
    #[test]
    fn the_config_is_ncclconfig_initializer_non_blocking() {
        let c = ConfigV2_17::non_blocking();
        assert_eq!(
            c.size, 48,
            "size, magic, version, 4 ints, a pointer and an int, padded"
        );
        assert_eq!((c.magic, c.version), (0xcafe_beef, 21_700));
        assert_eq!(c.blocking, 0);
        assert_eq!(
            [c.cga_cluster_size, c.min_ctas, c.max_ctas, c.split_share],
            [i32::MIN; 4]
        );
        assert!(c.net_name.is_null());
    }
}
