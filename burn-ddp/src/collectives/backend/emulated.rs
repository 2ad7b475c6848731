//! NCCL's plans run on the host collectives (feature `test-support`): everything the NCCL
//! backend does around its NCCL calls (the agreement, the padding, the cutting, the choice of
//! call and its lengths) runs here exactly as on a GPU, with the equal-part host collective in
//! place of each NCCL call. This is how CI, which has no GPU, tests the NCCL backend's logic:
//! only the calls into NCCL are left for the device check.

use burn::tensor::Tensor;

use super::plan::{self, Call, Plan};
use super::{Request, staged};
use crate::collectives::Work;
use crate::collectives::worker::Queue;
use crate::collectives::worker::Worker;
use crate::error::Result;

/// Starts `request` on `tensor` as the NCCL backend would, with host collectives for NCCL.
pub(crate) fn start<T: Send + 'static>(
    queue: &Queue,
    tensor: Tensor<1>,
    request: Request,
    done: impl FnOnce(Vec<Tensor<1>>) -> T + Send + 'static,
) -> Work<T> {
    plan::run(
        queue,
        tensor,
        request,
        |call, input| (call, input),
        call,
        done,
    )
}

/// NCCL's collective `call` on `input`, by the host collectives: equal parts only, as NCCL.
fn call(w: &mut Worker, plan: &Plan, (call, input): (Call, Tensor<1>)) -> Result<Tensor<1>> {
    let (slot, world) = (plan.slot(), plan.world());
    let expected = match call {
        Call::ReduceScatter(_) => slot * world,
        _ => slot,
    };
    let given = input.shape().num_elements();
    if given != expected {
        let reason =
            format!("internal error: NCCL's {call:?} given {given} elements, not {expected}");
        return Err(super::invalid(w.rank(), plan.name, reason));
    }
    let equal = vec![slot; world];
    match call {
        Call::AllReduce(op) => staged::all_reduce(w, input, op),
        Call::Broadcast(root) => staged::broadcast(w, input, root),
        Call::AllGather => staged::all_gather_parts(w, input, &equal),
        Call::ReduceScatter(op) => staged::reduce_scatter(w, input, &equal, op),
    }
}
