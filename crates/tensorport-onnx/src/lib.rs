//! ONNX models in the tensorport server, through ONNX Runtime (the `ort` binding), whose library
//! is loaded at run time: the product builds and runs without it, and asking for an ONNX model
//! without it is one error that says how to get it ([`runtime`]).
//!
//! - [`runtime`]: finds and loads `libonnxruntime.so` once per process.
//! - [`spec`]: what the server needs of a model's graph — one image input `[N, 3, S, S]` with a
//!   dynamic batch axis, f32 or f16; a first output `[N, K]` — checked before anything runs,
//!   each refusal one line naming the problem.
//! - [`model`]: a session on the CPU (or CUDA) that takes a batch of normalised `f32` images
//!   and returns each image's `K` scores.
//!
//! - [`external`]: the model's bytes as ONNX Runtime gets them: the file read once, every
//!   tensor's external data read by the server from the model's own folder and put inside, so
//!   ONNX Runtime opens no file itself.
//!
//! Nothing from the file is trusted: its size is bounded before it is read, its protobuf walked
//! with every length checked, its external data confined to its folder, a file ONNX Runtime
//! cannot parse refused with its message, a library older than [`runtime::MIN_VERSION`] refused
//! before it is set up, and the graph's declared input and output checked before the first
//! batch.

mod error;
pub mod external;
pub mod model;
mod proto;
pub mod runtime;
pub mod spec;

pub use error::{Error, Result};
pub use model::{GpuProvider, OnnxModel, OnnxOptions, Provider};
pub use spec::{Elem, ModelSpec, MAX_MODEL_BYTES};
