//! Offline stand-in for `cubecl-llvm` 0.11.3, patched in with `[patch.crates-io]`.
//!
//! Why it exists: `cubecl-cuda` 0.11.3 depends on `cubecl-llvm` unconditionally, and the real
//! crate's build script (`tracel-llvm-bundler`) downloads a prebuilt LLVM from GitHub, which
//! cannot be reached when building offline. `cubecl-cuda` is used with its `cpp` feature, so
//! kernels go through CUDA C++ and NVRTC and the LLVM backend is never selected.
//!
//! This crate provides only the items `cubecl-cuda` names (`runtime.rs`, `compiler.rs`,
//! `compute/context.rs`):
//! - pure logic, copied from the real crate: [`nvptx::ptx_version::PtxVersion`],
//!   [`shared::lowered_features::GpuTarget`], [`shared::lowered_features::restrict_features`];
//! - the LLVM compiler surface: [`PlironCompiler`], [`PlironOptions`], [`PlironArtifact`],
//!   [`NvptxModule`], [`LlvmTarget`]. [`PlironCompiler`]'s `compile` always returns a
//!   [`CompilationError`]; it never panics.
//!
//! Do not enable burn/cubecl features that really need LLVM (`cpu`, `rocm`/`hip`) with this patch.

use cubecl_core::environment::backtrace::BackTrace;
use cubecl_core::ir::{amd::GfxArch, attributes::BufferIOAttr, nvidia::SmArch};
use cubecl_core::prelude::KernelDefinition;
use cubecl_core::{CompilationError, Compiler};

pub mod nvptx {
    pub mod ptx_version {
        //! The PTX ISA version emitted for the installed driver (copied from cubecl-llvm 0.11.3).

        use core::fmt;
        use std::ffi::CString;

        /// A PTX ISA version, as the NVPTX target feature spells it: 8.7 is `87`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The newest version a driver of CUDA `driver` loads, as `cuDriverGetVersion`
            /// reports it (12.8 is `12080`). `None` below CUDA 10.0.
            pub fn for_driver(driver: i32) -> Option<Self> {
                DRIVER_PTX
                    .iter()
                    .find(|(first_driver, _)| driver >= *first_driver)
                    .map(|(_, ptx)| Self(*ptx))
            }

            /// The NVPTX target feature that selects this version.
            pub fn target_feature(self) -> CString {
                CString::new(format!("+{self}")).expect("the feature has no NUL")
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }

        /// The first CUDA release to load each PTX version, newest first.
        const DRIVER_PTX: &[(i32, u32)] = &[
            (13030, 93),
            (13020, 92),
            (13010, 91),
            (13000, 90),
            (12090, 88),
            (12080, 87),
            (12050, 85),
            (12040, 84),
            (12030, 83),
            (12020, 82),
            (12010, 81),
            (12000, 80),
            (11080, 78),
            (11070, 77),
            (11060, 76),
            (11050, 75),
            (11040, 74),
            (11030, 73),
            (11020, 72),
            (11010, 71),
            (11000, 70),
            (10020, 65),
            (10010, 64),
            (10000, 63),
        ];
    }
}

pub mod shared {
    pub mod lowered_features {
        //! Device features narrowed to what the LLVM backend lowers (NVPTX part copied from
        //! cubecl-llvm 0.11.3). `cubecl-cuda` calls this only when the LLVM backend is selected,
        //! which the `cpp` feature prevents; it is kept faithful anyway.

        use cubecl_core::ir::{
            ComplexKind, DeviceProperties, ElemType, FloatKind, IntKind, OpaqueType, UIntKind,
        };

        const HALF: ElemType = ElemType::Float(FloatKind::F16);
        const BF16: ElemType = ElemType::Float(FloatKind::BF16);

        /// The GPU target a device's features are narrowed for.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            Nvptx,
        }

        /// Narrows `props` to what the LLVM backend lowers for `target`.
        pub fn restrict_features(props: &mut DeviceProperties, target: GpuTarget) {
            match target {
                GpuTarget::Nvptx => keep_nvptx_matrix_forms(props),
            }
            restrict_common(props);
        }

        fn is_half_or_single(ty: ElemType) -> bool {
            matches!(
                ty,
                ElemType::Float(FloatKind::F16) | ElemType::Float(FloatKind::F32)
            )
        }

        fn keep_nvptx_matrix_forms(props: &mut DeviceProperties) {
            let byte = |ty: ElemType| {
                matches!(
                    ty,
                    ElemType::Int(IntKind::I8) | ElemType::UInt(UIntKind::U8)
                )
            };
            let tf32 = ElemType::Float(FloatKind::TF32);
            let f32 = ElemType::Float(FloatKind::F32);
            let matmul = &mut props.features.matmul;
            matmul.cmma.retain(|config| {
                let half = config.a_type == HALF
                    && config.b_type == HALF
                    && is_half_or_single(config.cd_type);
                let bf16 = config.a_type == BF16 && config.b_type == BF16 && config.cd_type == f32;
                let tf32 = config.a_type == tf32
                    && config.b_type == tf32
                    && config.cd_type == f32
                    && (config.m, config.n, config.k) == (16, 16, 8);
                half || bf16 || tf32
            });
            matmul.mma.retain(|config| {
                let floats = (config.a_type == HALF || config.a_type == BF16)
                    && config.b_type == config.a_type
                    && config.cd_type == ElemType::Float(FloatKind::F32);
                let integers = byte(config.a_type)
                    && byte(config.b_type)
                    && config.cd_type == ElemType::Int(IntKind::I32);
                let tf32 = config.a_type == tf32
                    && config.b_type == tf32
                    && config.cd_type == f32
                    && config.m == 16
                    && config.n == 8
                    && matches!(config.k, 4 | 8);
                floats || integers || tf32
            });
        }

        fn restrict_common(props: &mut DeviceProperties) {
            let matmul = &mut props.features.matmul;
            matmul.cube_mma = Default::default();
            matmul.scaled_mma = Default::default();
            matmul.cmma_tensor_addressing = false;
            if matmul.cmma.is_empty() && matmul.mma.is_empty() {
                props.hardware.num_tensor_cores = None;
                props.hardware.min_tensor_cores_dim = None;
            }
            props.features.tma = Default::default();
            props.features.cube_cluster = false;
            props.features.copy_async = false;
            props.features.types.opaque.remove(&OpaqueType::TensorMap);
            props.features.types.opaque.remove(&OpaqueType::Barrier);
            props
                .features
                .types
                .atomic
                .retain(|ty, _| ty.elem_type() != BF16);
            props.features.types.complex.clear();
            for kind in [ComplexKind::C32, ComplexKind::C64] {
                props.features.types.elem.remove(&ElemType::Complex(kind));
            }
            props
                .features
                .types
                .atomic
                .retain(|ty, _| ty.vector_size() == 1);
        }
    }
}

/// LLVM compilation targets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    #[default]
    Cpu,
    Nvptx,
}

/// The LLVM backend's compiler. In this stand-in, compiling always fails.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    pub target: LlvmTarget,
}

/// The fields `cubecl-cuda` sets; the rest of the real struct is left to `..Default::default()`.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    pub arch: Option<GfxArch>,
    pub sm_arch: Option<SmArch>,
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    pub grid_constants: bool,
}

/// Compiled PTX module. Never produced by this stand-in.
#[derive(Clone, Debug)]
pub struct NvptxModule {
    /// NUL-terminated PTX assembly.
    pub ptx: Vec<core::ffi::c_char>,
    /// Kernel entry point symbol.
    pub entrypoint: String,
    /// IR for logging and cache keys.
    pub ir: String,
    /// Shared memory required per launch, in bytes.
    pub shared_memory_size: usize,
    /// Buffer access modes in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// Compiled kernel artifact. `non_exhaustive` so `cubecl-cuda`'s `_ =>` arm stays reachable.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum PlironArtifact {
    NvptxCode(NvptxModule),
}

impl core::fmt::Display for PlironArtifact {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PlironArtifact::NvptxCode(module) => write!(f, "{}", module.ir),
        }
    }
}

impl Compiler for PlironCompiler {
    type Representation = PlironArtifact;
    type CompilationOptions = PlironOptions;

    fn buffer_io(repr: &Self::Representation) -> Option<Vec<BufferIOAttr>> {
        match repr {
            PlironArtifact::NvptxCode(module) => Some(module.io.clone()),
        }
    }

    fn compile(
        &mut self,
        _kernel: KernelDefinition,
        _options: &Self::CompilationOptions,
    ) -> Result<Self::Representation, CompilationError> {
        Err(CompilationError::Generic {
            reason: "cubecl-llvm is replaced by an offline stand-in without LLVM; \
                     build cubecl-cuda with its `cpp` feature (CUDA C++ / NVRTC backend)"
                .to_string(),
            backtrace: BackTrace::capture(),
        })
    }

    fn extension(&self) -> &'static str {
        match self.target {
            LlvmTarget::Cpu => "plir",
            LlvmTarget::Nvptx => "ll",
        }
    }

    fn lang_tag(&self) -> &'static str {
        match self.target {
            LlvmTarget::Cpu => "mlir",
            LlvmTarget::Nvptx => "llvm",
        }
    }
}
