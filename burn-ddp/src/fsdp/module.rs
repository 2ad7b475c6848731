//! [`Fsdp`] as a burn [`Module`]: visitors and mappers (the optimizer, records, devices) see one
//! float parameter, the shard, under the field [`SHARD_FIELD`] of a container named
//! [`CONTAINER`]; that is how the rest of burn-ddp tells a shard from a replicated parameter.

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param,
};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use super::state::{self, Mode};
use super::{Fsdp, flat};

/// The field name of the shard in module paths (`blocks.0.fsdp_shard`).
pub(crate) const SHARD_FIELD: &str = "fsdp_shard";
/// The container type visitors see around the shard.
pub(crate) const CONTAINER: &str = "burn_ddp::fsdp::Fsdp";

impl<M: Module> Module for Fsdp<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.shard.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        Fsdp {
            shard: self.shard.fork(device),
            template: self.template.map_module(|m| m.fork(device)),
            shared: self.shared,
        }
    }

    fn to_device(self, device: &Device) -> Self {
        Fsdp {
            shard: self.shard.to_device(device),
            template: self.template.map_module(|m| m.to_device(device)),
            shared: self.shared,
        }
    }

    fn train(self) -> Self {
        Fsdp {
            shard: self.shard.train(),
            template: self.template.map_module(|m| m.train()),
            shared: self.shared,
        }
    }

    fn valid(&self) -> Self {
        Fsdp {
            shard: self.shard.valid(),
            template: self.template.clone().map_module(|m| m.valid()),
            shared: self.shared.clone(),
        }
    }

    fn materialize(self) -> Self {
        self
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        match state::mode() {
            Mode::Sharded | Mode::Load => {
                visitor.enter_module(SHARD_FIELD, CONTAINER);
                self.shard.visit(visitor);
                visitor.exit_module(SHARD_FIELD, CONTAINER);
            }
            // The whole block, where the block itself would be (no field of its own).
            Mode::Save { keep } => match self.gathered() {
                Ok(block) if keep => block.visit(visitor),
                Ok(_) => {}
                Err(e) => state::fail(e),
            },
            Mode::Replicated => {}
            Mode::List => {
                state::list(state::Listed {
                    shared: self.shared.clone(),
                    shard: self.shard.id.val(),
                    params: self.template.ids(),
                });
                visitor.enter_module(SHARD_FIELD, CONTAINER);
                self.shard.visit(visitor);
                visitor.exit_module(SHARD_FIELD, CONTAINER);
            }
        }
    }

    fn map<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
        match state::mode() {
            Mode::Load => return self.load_whole(mapper),
            Mode::Replicated => return self,
            Mode::Sharded | Mode::Save { .. } | Mode::List => {}
        }
        mapper.enter_module(SHARD_FIELD, CONTAINER);
        let shard = Module::map(self.shard, mapper);
        mapper.exit_module(SHARD_FIELD, CONTAINER);
        Fsdp { shard, ..self }
    }
}

impl<M: Module> ModuleDisplayDefault for Fsdp<M> {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .add("name", &self.shared.name)
            .add("strategy", &self.shared.strategy.name().to_string())
            .add("numel", &self.shared.layout.numel)
            .add("shard", &self.shared.shard_len)
            .optional()
    }
}

impl<M: Module> ModuleDisplay for Fsdp<M> {}

/// A visitor that finds the module path of every wrapped block, in visit order (`""` for a
/// model that is the block), in the sharded and listing modes (where a block shows its shard).
#[derive(Default)]
pub(super) struct BlockPaths {
    path: Vec<String>,
    /// The paths found.
    pub(super) found: Vec<String>,
}

impl ModuleVisitor for BlockPaths {
    fn enter_module(&mut self, name: &str, container: &str) {
        if container == CONTAINER {
            self.found.push(self.path.join("."));
        }
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
}

/// The module path of the first wrapped block in `module` (`None` without one): for errors
/// of the data-parallel machinery about a model with wrapped blocks.
pub(crate) fn first_block<M: Module>(module: &M) -> Option<String> {
    let mut paths = BlockPaths::default();
    state::sharded(|| module.visit(&mut paths));
    paths.found.into_iter().next()
}

/// Each wrapped block's gradient in `grads` on this rank (its shard's), in visit order, and
/// whether it is a piece of the block (sharded) or the whole block, the same on every rank
/// ([`super::ShardingStrategy::NoShard`]).
pub(crate) fn block_gradients<M: Module>(
    module: &M,
    grads: &GradientsParams,
) -> Vec<(Tensor<1>, bool)> {
    struct Nothing;
    impl ModuleVisitor for Nothing {}
    let listed = state::listing(|| module.visit(&mut Nothing));
    (listed.iter())
        .filter_map(|b| {
            let grad = grads.get::<1>(burn::module::ParamId::from(b.shard))?;
            Some((grad, b.shared.strategy.shards()))
        })
        .collect()
}

impl<M: Module> Fsdp<M> {
    /// The block's parameters taken from `mapper` (a record being loaded) as the whole block,
    /// then cut to this rank's piece, which replaces the shard (its id kept).
    fn load_whole<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
        let layout = &self.shared.layout;
        let whole = self.template.lazy(layout).map(mapper);
        let flat = flat::flatten(&whole, layout);
        let piece = match self.shared.strategy.shards() {
            true => {
                let start = self.shared.group.rank() * self.shared.shard_len;
                flat::piece(flat, start, self.shared.shard_len, &layout.device)
            }
            false => flat,
        };
        let current = self.shard.val();
        let device = current.device();
        let piece = crate::collectives::backend::slices::on_device(
            piece.to_device(&device.clone().inner()),
            &device,
        );
        let piece = match current.is_require_grad() {
            true => piece.require_grad(),
            false => piece,
        };
        // The block's parameters now carry the record's ids, which its optimizer state is
        // keyed by ([`super::optim_state`]).
        Fsdp {
            shard: Param::initialized(self.shard.id, piece),
            template: super::flat::Template::of(whole),
            shared: self.shared,
        }
    }
}
