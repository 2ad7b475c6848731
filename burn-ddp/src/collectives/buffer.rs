//! What the group's collectives accept: host vectors (moved by the host transport) and, with the
//! `train` feature, burn tensors on any device (moved by the backend of their device kind, see
//! [`backend`](super::backend)). [`crate::ProcessGroup::all_reduce`] and its siblings are generic
//! over these traits, so one call serves every kind of buffer, as `torch.distributed` does; each
//! implementation hands its buffer to the backend it travels by ([`Backends`]).

#[cfg(feature = "train")]
use burn::tensor::Tensor;

#[cfg(feature = "train")]
use super::backend::{Request, one};
use super::backends::Backends;
use super::{Element, Reduce, ReduceOp, Work};

pub(crate) mod sealed {
    /// Keeps the buffer traits closed: the group knows how to move each of them.
    pub trait Sealed {}
}

/// A buffer [`ProcessGroup::all_reduce`](crate::ProcessGroup::all_reduce) and [`ProcessGroup::reduce_scatter`](crate::ProcessGroup::reduce_scatter) can reduce:
/// `Vec<T>` of a [`Reduce`] element type, or (feature `train`) a flat burn `Tensor<1>` of floats
/// on any device.
pub trait Reducible: sealed::Sealed + Sized + Send + 'static {
    /// Starts the all-reduce of `self` by its backend (use [`ProcessGroup::all_reduce`](crate::ProcessGroup::all_reduce)).
    #[doc(hidden)]
    fn start_all_reduce(self, backends: &Backends, op: ReduceOp) -> Work<Self>;
    /// Starts the reduce-scatter of `self` cut into `parts` (element counts by rank, checked
    /// to sum to its length by the backend); the result is this rank's part (use
    /// [`ProcessGroup::reduce_scatter`](crate::ProcessGroup::reduce_scatter)).
    #[doc(hidden)]
    fn start_reduce_scatter(
        self,
        backends: &Backends,
        parts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<Self>;
    /// Its length in elements.
    #[doc(hidden)]
    fn elements(&self) -> usize;
}

/// A buffer [`ProcessGroup::broadcast`](crate::ProcessGroup::broadcast) can send: `Vec<T>` of an element type, or (feature
/// `train`) a flat burn `Tensor<1>` on any device.
pub trait Broadcastable: sealed::Sealed + Sized + Send + 'static {
    /// Starts the broadcast of `self` from `root` (use [`ProcessGroup::broadcast`](crate::ProcessGroup::broadcast)).
    #[doc(hidden)]
    fn start_broadcast(self, backends: &Backends, root: usize) -> Work<Self>;
}

/// A buffer [`ProcessGroup::all_gather`](crate::ProcessGroup::all_gather) can gather: `Vec<u8>` (lengths may differ between
/// ranks), or (feature `train`) a flat burn `Tensor<1>` (the same length on every rank).
pub trait Gatherable: sealed::Sealed + Sized + Send + 'static {
    /// What the gather returns: every rank's buffer, indexed by rank.
    type Gathered: Send + 'static;
    /// Starts the all-gather of `self` (use [`ProcessGroup::all_gather`](crate::ProcessGroup::all_gather)).
    #[doc(hidden)]
    fn start_all_gather(self, backends: &Backends) -> Work<Self::Gathered>;
}

impl<T: Element> sealed::Sealed for Vec<T> {}

impl<T: Reduce> Reducible for Vec<T> {
    fn start_all_reduce(mut self, backends: &Backends, op: ReduceOp) -> Work<Self> {
        if backends.host().world() == 1 {
            return Work::done(backends.host().rank(), Ok(self));
        }
        backends
            .host()
            .submit(move |t| t.all_reduce(&mut self, op).map(|()| self))
    }

    fn start_reduce_scatter(
        mut self,
        backends: &Backends,
        parts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<Self> {
        backends.host().submit(move |t| {
            let mine = t.reduce_scatter(&mut self, &parts, op)?;
            self.truncate(mine.end);
            self.drain(..mine.start);
            Ok(self)
        })
    }

    fn elements(&self) -> usize {
        self.len()
    }
}

impl<T: Element> Broadcastable for Vec<T> {
    fn start_broadcast(mut self, backends: &Backends, root: usize) -> Work<Self> {
        if backends.host().world() == 1 && root == 0 {
            return Work::done(backends.host().rank(), Ok(self));
        }
        backends
            .host()
            .submit(move |t| t.broadcast(&mut self, root).map(|()| self))
    }
}

impl Gatherable for Vec<u8> {
    type Gathered = Vec<Vec<u8>>;

    fn start_all_gather(self, backends: &Backends) -> Work<Vec<Vec<u8>>> {
        if backends.host().world() == 1 && self.len() <= backends.host().limits().max_gather_bytes {
            return Work::done(backends.host().rank(), Ok(vec![self]));
        }
        backends.host().submit(move |t| t.all_gather(&self))
    }
}

#[cfg(feature = "train")]
impl sealed::Sealed for Tensor<1> {}

#[cfg(feature = "train")]
impl Reducible for Tensor<1> {
    fn start_all_reduce(self, backends: &Backends, op: ReduceOp) -> Work<Self> {
        backends.start_tensor(self, Request::AllReduce(op), one)
    }

    fn start_reduce_scatter(
        self,
        backends: &Backends,
        parts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<Self> {
        backends.start_tensor(self, Request::ReduceScatter(parts, op), one)
    }

    fn elements(&self) -> usize {
        self.shape().num_elements()
    }
}

#[cfg(feature = "train")]
impl Broadcastable for Tensor<1> {
    fn start_broadcast(self, backends: &Backends, root: usize) -> Work<Self> {
        backends.start_tensor(self, Request::Broadcast(root), one)
    }
}

#[cfg(feature = "train")]
impl Gatherable for Tensor<1> {
    type Gathered = Vec<Tensor<1>>;

    fn start_all_gather(self, backends: &Backends) -> Work<Vec<Tensor<1>>> {
        backends.start_tensor(self, Request::AllGather, |pieces, _, _| pieces)
    }
}
