//! Parameters in module visit order: their layout, the start-up agreement across ranks, and the
//! broadcast of rank 0's values.
//!
//! Parameters are identified by their position in visit order and their module path, never by
//! `ParamId`, which is random per process.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Tensor};

use crate::ProcessGroup;
use crate::collectives::backend::slices::{cut, on_device};
use crate::error::{DdpError, Result};
use crate::wire::Writer;

/// One float tensor of a module (a parameter or a buffer such as a running mean).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    /// Module path, for example `layers.1.weight`.
    pub path: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type, as burn names it.
    pub dtype: String,
    /// Whether it receives gradients (false for buffers and frozen parameters).
    pub trainable: bool,
}

impl ParamInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Tracks the module path while a visitor or mapper walks a module.
#[derive(Default)]
struct PathTracker(Vec<String>);

impl PathTracker {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    fn exit(&mut self) {
        self.0.pop();
    }
    fn path(&self) -> String {
        self.0.join(".")
    }
}

struct LayoutVisitor {
    path: PathTracker,
    out: Vec<ParamInfo>,
}

impl ModuleVisitor for LayoutVisitor {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        self.out.push(ParamInfo {
            path: self.path.path(),
            shape: t.dims().to_vec(),
            dtype: format!("{:?}", t.dtype()),
            trainable: t.is_require_grad(),
        });
    }
}

/// The float tensors of `module` in visit order.
pub fn layout<M: Module>(module: &M) -> Vec<ParamInfo> {
    let mut v = LayoutVisitor {
        path: PathTracker::default(),
        out: Vec::new(),
    };
    crate::fsdp::replicated(|| module.visit(&mut v));
    v.out
}

/// Checks that every rank has the same parameter layout and the same training settings;
/// otherwise every rank returns an error naming the first difference and the ranks involved.
pub fn check_agreement(
    group: &ProcessGroup,
    params: &[ParamInfo],
    settings: &[(String, String)],
) -> Result<()> {
    let mut lines: Vec<String> = vec![format!("setting world_size = {}", group.world_size())];
    lines.extend(settings.iter().map(|(k, v)| format!("setting {k} = {v}")));
    lines.extend(params.iter().enumerate().map(|(i, p)| {
        format!(
            "parameter {i} `{}`: shape {:?}, {}{}",
            p.path,
            p.shape,
            p.dtype,
            if p.trainable { "" } else { ", not trained" }
        )
    }));
    lines.push(format!("{} float tensors", params.len()));
    let mut mine = Writer::default();
    mine.u32(lines.len() as u32);
    for line in &lines {
        mine.bytes(line.as_bytes());
    }
    let said = group.all_gather_object(mine.buf)?;
    let all = said.decode_each("its settings and layout", |r| {
        (0..r.u32()?)
            .map(|_| r.string())
            .collect::<std::result::Result<Vec<_>, _>>()
    })?;
    let reference = &all[0];
    for rank in said.differing() {
        let theirs = &all[rank];
        let n = reference.len().max(theirs.len());
        if let Some(i) = (0..n).find(|i| reference.get(*i) != theirs.get(*i)) {
            let show = |l: Option<&String>| l.map_or("nothing".to_string(), |s| s.clone());
            return Err(DdpError::Disagreement(format!(
                "rank 0 has {} but rank {rank} has {}",
                show(reference.get(i)),
                show(theirs.get(i))
            )));
        }
    }
    Ok(())
}

struct Collect {
    select: Select,
    data: Vec<f32>,
}

impl ModuleVisitor for Collect {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !self.select.takes(param) {
            return;
        }
        let data = param.val().into_data().convert::<f32>();
        self.data
            .extend_from_slice(data.as_slice::<f32>().expect("converted to f32"));
    }
}

/// Which float tensors of a module a [`Flatten`] or [`Assign`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Select {
    /// Parameters and buffers.
    All,
    /// Trainable parameters only.
    Parameters,
    /// Buffers only: float tensors that receive no gradient (running statistics and the like).
    Buffers,
}

impl Select {
    fn takes<const D: usize>(self, param: &Param<Tensor<D>>) -> bool {
        match self {
            Select::All => true,
            Select::Parameters => param.val().is_require_grad(),
            Select::Buffers => !param.val().is_require_grad(),
        }
    }
}

/// The selected float tensors of a module, flattened in visit order on the device they live on,
/// in one element type that holds each of them exactly: `f64` when any is `f64`, else `f32`
/// (which holds `f16` and `bf16` exactly).
pub(crate) struct Flatten {
    select: Select,
    parts: Vec<Tensor<1>>,
}

impl Flatten {
    /// The selected tensors of `module` as one flat tensor (`None` if there are none).
    pub(crate) fn module<M: Module>(module: &M, select: Select) -> Option<Tensor<1>> {
        let mut flatten = Flatten {
            select,
            parts: Vec::new(),
        };
        crate::fsdp::replicated(|| module.visit(&mut flatten));
        let carrier = if flatten.parts.iter().any(|t| t.dtype() == DType::F64) {
            DType::F64
        } else {
            DType::F32
        };
        let parts: Vec<Tensor<1>> = flatten
            .parts
            .into_iter()
            .map(|t| {
                if t.dtype() == carrier {
                    t
                } else {
                    t.cast(carrier)
                }
            })
            .collect();
        (!parts.is_empty()).then(|| Tensor::cat(parts, 0))
    }
}

impl ModuleVisitor for Flatten {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !self.select.takes(param) {
            return;
        }
        let t = param.val().inner();
        let n = t.shape().num_elements();
        self.parts.push(t.reshape([n]));
    }
}

/// Replaces the selected float tensors with their slices of `flat` (as [`Flatten`] laid them
/// out), each in its own shape and element type.
pub(crate) struct Assign {
    select: Select,
    flat: Tensor<1>,
    offset: usize,
}

impl Assign {
    /// `module` with its selected tensors taken from `flat`.
    pub(crate) fn module<M: Module>(module: M, select: Select, flat: Tensor<1>) -> M {
        let mut assign = Assign {
            select,
            flat,
            offset: 0,
        };
        crate::fsdp::replicated(|| module.map(&mut assign))
    }
}

impl ModuleMapper for Assign {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.select.takes(&param) {
            return param;
        }
        param.map(|t| {
            let (dims, dtype, device) = (t.dims(), t.dtype(), t.device());
            let grad = t.is_require_grad();
            let n = t.shape().num_elements();
            let values = cut(&self.flat, self.offset, n);
            self.offset += n;
            let values = values.reshape(dims).cast(dtype);
            // Back where the parameter was (autodiff, its checkpointing strategy).
            on_device(values, &device).set_require_grad(grad)
        })
    }
}

/// Every float tensor of `module` (parameters and buffers) as `f32`, flattened in visit order,
/// as PyTorch's `torch.nn.utils.parameters_to_vector`: for comparing replicas and checking
/// results.
pub fn parameters_to_vector<M: Module>(module: &M) -> Vec<f32> {
    flat_values(module, Select::All)
}

/// The selected float tensors of `module` as `f32` on the host, flattened in visit order.
pub(crate) fn flat_values<M: Module>(module: &M, select: Select) -> Vec<f32> {
    let mut collect = Collect {
        select,
        data: Vec::new(),
    };
    module.visit(&mut collect);
    collect.data
}

/// Returns `module` with every float tensor (parameters and buffers) replaced by rank 0's
/// values, so replicas start identical whatever their seeds. Every rank must build the same
/// model (`DdpLearner` checks that the ranks' layouts agree before it broadcasts).
///
/// Each rank keeps its own `ParamId`s (burn draws them at random per process), so optimizer
/// and learning-rate groups a rank built from its model's ids (`ParamGroup::from_ids`) keep
/// matching its parameters. Where the ranks need one identity for a parameter (who owns it
/// when the optimizer is sharded, a sharded checkpoint's optimizer records), it is its position
/// in visit order.
///
/// The values travel as one flat tensor on the module's device, through the group's tensor
/// broadcast (so by the device's own backend, NCCL on CUDA).
pub fn broadcast_module<M: Module>(module: M, group: &ProcessGroup) -> Result<M> {
    if group.world_size() == 1 {
        return Ok(module);
    }
    let Some(flat) = Flatten::module(&module, Select::All) else {
        return Ok(module);
    };
    let flat = group.broadcast(flat, 0).wait()?;
    Ok(Assign::module(module, Select::All, flat))
}

/// Every trainable parameter's `ParamId` (as `u64`), in visit order.
pub(crate) fn param_ids<M: Module>(module: &M) -> Vec<u64> {
    let mut ids = Ids::default();
    crate::fsdp::replicated(|| module.visit(&mut ids));
    ids.0
}

/// Every trainable parameter's `ParamId`, in visit order.
#[derive(Default)]
struct Ids(Vec<u64>);

impl ModuleVisitor for Ids {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if Select::Parameters.takes(param) {
            self.0.push(param.id.val());
        }
    }
}
