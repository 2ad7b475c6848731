//! [`Fsdp`] as a burn [`Module`]: visitors and mappers (the optimizer, records, devices) see one
//! float parameter, the shard, under the field [`SHARD_FIELD`] of a container named
//! [`CONTAINER`]; that is how the rest of burn-ddp tells a shard from a replicated parameter.

use std::collections::HashSet;

use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param, ParamId,
};
use burn::tensor::{Device, Tensor};

use super::Fsdp;

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
        visitor.enter_module(SHARD_FIELD, CONTAINER);
        self.shard.visit(visitor);
        visitor.exit_module(SHARD_FIELD, CONTAINER);
    }

    fn map<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
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

/// The ids of every shard in `module` (the parameters of its [`Fsdp`] blocks), which the
/// data-parallel machinery leaves alone: they differ between ranks by design, and their
/// gradients are reduced in backward.
pub(crate) fn shard_ids<M: Module>(module: &M) -> HashSet<ParamId> {
    #[derive(Default)]
    struct Find {
        depth_in_shard: usize,
        ids: HashSet<ParamId>,
    }
    impl ModuleVisitor for Find {
        fn enter_module(&mut self, _: &str, container: &str) {
            if container == CONTAINER || self.depth_in_shard > 0 {
                self.depth_in_shard += 1;
            }
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.depth_in_shard = self.depth_in_shard.saturating_sub(1);
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.depth_in_shard > 0 {
                self.ids.insert(param.id);
            }
        }
    }
    let mut find = Find::default();
    module.visit(&mut find);
    find.ids
}
