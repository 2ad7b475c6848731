//! A block's float parameters as one flat vector: where each lies ([`FlatLayout`]), flattening
//! them, cutting a rank's piece, and putting gathered values back into the block
//! ([`Template`]).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Device, Shape, Tensor};

/// One float parameter of a block.
#[derive(Debug, Clone)]
pub(crate) struct FlatParam {
    /// Its module path inside the block.
    pub(crate) path: String,
    pub(crate) shape: Vec<usize>,
    /// Where it starts in the flat vector.
    pub(crate) offset: usize,
}

impl FlatParam {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where each float parameter of a block lies in its flat vector (visit order).
#[derive(Debug, Clone)]
pub(crate) struct FlatLayout {
    pub(crate) params: Vec<FlatParam>,
    /// Elements of every parameter together.
    pub(crate) numel: usize,
    pub(crate) dtype: DType,
    /// Whether the parameters receive gradients.
    pub(crate) trainable: bool,
    /// The device the block lives on.
    pub(crate) device: Device,
}

impl FlatLayout {
    /// The layout of `block`'s float parameters, or why it cannot be wrapped.
    pub(crate) fn of<M: Module>(block: &M) -> Result<Self, String> {
        let mut v = Collect::default();
        block.visit(&mut v);
        let Some(first) = v.seen.first() else {
            return Err(
                "the block has no float parameter: there is nothing to shard (wrap a \
                        block with parameters, or leave this one unwrapped)"
                    .into(),
            );
        };
        let (dtype, trainable, device) = (first.1, first.2, first.3.clone());
        if let Some(other) = v.seen.iter().find(|s| s.1 != dtype) {
            return Err(format!(
                "its parameters have more than one element type ({dtype:?} and {:?} at {}): \
                 wrap the parts of each type separately",
                other.1, other.0.path
            ));
        }
        if let Some(other) = v.seen.iter().find(|s| s.2 != trainable) {
            return Err(format!(
                "it mixes trainable and frozen parameters ({} is {}): wrap the frozen part \
                 separately",
                other.0.path,
                if other.2 { "trainable" } else { "frozen" }
            ));
        }
        if let Some(other) = v.seen.iter().find(|s| s.3 != device) {
            return Err(format!(
                "its parameters are on more than one device ({device:?} and {:?} at {})",
                other.3, other.0.path
            ));
        }
        let mut offset = 0;
        let params = (v.seen.into_iter())
            .map(|(mut p, ..)| {
                p.offset = offset;
                offset += p.numel();
                p
            })
            .collect();
        Ok(FlatLayout {
            params,
            numel: offset,
            dtype,
            trainable,
            device,
        })
    }

    /// What the ranks compare: every parameter's path and shape, the type, whether trained.
    pub(crate) fn describe(&self) -> String {
        let params: Vec<String> = (self.params.iter())
            .map(|p| format!("{} {:?}", p.path, p.shape))
            .collect();
        format!(
            "{} parameters of {:?}{}: {}",
            self.params.len(),
            self.dtype,
            if self.trainable { "" } else { " (frozen)" },
            params.join(", ")
        )
    }
}

/// Collects each float parameter's path, shape, type, trainability and device.
#[derive(Default)]
struct Collect {
    path: Vec<String>,
    seen: Vec<(FlatParam, DType, bool, Device)>,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        let param = FlatParam {
            path: self.path.join("."),
            shape: t.dims().to_vec(),
            offset: 0,
        };
        self.seen
            .push((param, t.dtype(), t.is_require_grad(), t.device()));
    }
}

/// `block`'s float parameters flattened and concatenated in visit order, without autodiff.
pub(crate) fn flatten<M: Module>(block: &M, layout: &FlatLayout) -> Tensor<1> {
    struct Flatten(Vec<Tensor<1>>);
    impl ModuleVisitor for Flatten {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val().inner();
            let n = t.shape().num_elements();
            self.0.push(t.reshape([n]));
        }
    }
    let mut v = Flatten(Vec::with_capacity(layout.params.len()));
    block.visit(&mut v);
    let parts: Vec<Tensor<1>> = v.0.into_iter().filter(|t| t.dims()[0] > 0).collect();
    match parts.is_empty() {
        true => Tensor::zeros([0], (&layout.device.clone().inner(), layout.dtype)),
        false => Tensor::cat(parts, 0),
    }
}

/// Elements `start..start + len` of `flat` (no autodiff), zeros where that runs past its end,
/// in memory of their own: a narrow is a view that would keep the whole of `flat` alive (the
/// whole block, for as long as the shard it becomes lives: until the first optimizer step).
pub(crate) fn piece(flat: Tensor<1>, start: usize, len: usize, device: &Device) -> Tensor<1> {
    let piece = view(flat, start, len, device);
    Tensor::from_data(piece.into_data(), &device.clone().inner())
}

/// [`piece`] as a view of `flat` where it lies inside it.
fn view(flat: Tensor<1>, start: usize, len: usize, device: &Device) -> Tensor<1> {
    let total = flat.dims()[0];
    let (from, to) = (start.min(total), (start + len).min(total));
    let dtype = flat.dtype();
    let inner = device.clone().inner();
    let mut parts = Vec::with_capacity(2);
    if to > from {
        parts.push(flat.narrow(0, from, to - from));
    }
    if len > to - from {
        parts.push(Tensor::zeros([len - (to - from)], (&inner, dtype)));
    }
    match parts.len() {
        0 => Tensor::zeros([0], (&inner, dtype)),
        1 => parts.remove(0),
        _ => Tensor::cat(parts, 0),
    }
}

/// A block whose float parameters hold empty tensors (their ids and ranks kept): the shape of
/// the module, without its values.
#[derive(Clone, Debug)]
pub(crate) struct Template<M>(M);

impl<M: Module> Template<M> {
    /// `block` emptied of its float parameters' values.
    pub(crate) fn of(block: M) -> Self {
        struct Empty;
        impl ModuleMapper for Empty {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let (id, value, _) = param.consume();
                let device = value.device();
                let empty = Tensor::<D>::zeros(Shape::new([0; D]), (&device, value.dtype()));
                Param::initialized(id, empty)
            }
        }
        Template(block.map(&mut Empty))
    }

    /// The block with its parameters cut out of `full` (the gathered flat vector, possibly
    /// padded at its end), each reshaped to its own shape; slices of one autodiff tensor when
    /// `full` is one.
    pub(crate) fn fill(&self, layout: &FlatLayout, full: Tensor<1>) -> M {
        struct Fill<'a> {
            layout: &'a FlatLayout,
            full: Tensor<1>,
            next: usize,
        }
        impl ModuleMapper for Fill<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let id: ParamId = param.id;
                let p = &self.layout.params[self.next];
                self.next += 1;
                let shape = Shape::from(p.shape.clone());
                let value = match p.numel() {
                    0 => Tensor::<D>::zeros(shape, (&self.full.device(), self.full.dtype())),
                    _ => super::piece::cut(&self.full, p.offset, shape),
                };
                Param::initialized(id, value)
            }
        }
        let mut fill = Fill {
            layout,
            full,
            next: 0,
        };
        self.0.clone().map(&mut fill)
    }

    /// The block with lazy parameters of their true shapes (never initialized unless read):
    /// what a record is loaded into.
    pub(crate) fn lazy(&self, layout: &FlatLayout) -> M {
        struct Lazy<'a> {
            layout: &'a FlatLayout,
            next: usize,
        }
        impl ModuleMapper for Lazy<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let p = &self.layout.params[self.next];
                self.next += 1;
                let shape = Shape::from(p.shape.clone());
                let (dtype, trainable) = (self.layout.dtype, self.layout.trainable);
                let device = self.layout.device.clone();
                let init_shape = shape.clone();
                Param::uninitialized(
                    param.id,
                    move |device, _| Tensor::<D>::zeros(init_shape, (device, dtype)),
                    device,
                    trainable,
                    shape,
                )
            }
        }
        self.0.clone().map(&mut Lazy { layout, next: 0 })
    }

    /// The ids of the block's float parameters, in visit order.
    pub(crate) fn ids(&self) -> Vec<u64> {
        struct Ids(Vec<u64>);
        impl ModuleVisitor for Ids {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0.push(param.id.val());
            }
        }
        let mut ids = Ids(Vec::new());
        self.0.visit(&mut ids);
        ids.0
    }

    /// The template itself (for moving it between devices).
    pub(crate) fn map_module(self, f: impl FnOnce(M) -> M) -> Self {
        Template(f(self.0))
    }
}
