//! tensorport's application layer: the producer, the inference server's batch loop and the farm
//! that supervises them, as a library. The `tensorport` binary is a thin face over it: it maps
//! flags to these configuration types and shows what a farm reports.
//!
//! - [`config`]: [`ProduceConfig`], [`ServeConfig`], [`FarmConfig`] and their parts, each
//!   default set once; a child's configuration travels as one JSON document (`to_data`).
//! - [`record`]: the result line, its stage times, the worklist line.
//! - [`feed`]: a producer's inputs, read ahead on a thread of their own.
//! - [`produce`]: the CPU and GPU producer loops on one skeleton.
//! - [`serve`]: the inference server and its [`serve::BatchLoop`].
//! - [`farm`]: the supervisor of servers and producers, reporting through [`farm::Report`].
//! - [`mps`]: CUDA's Multi-Process Service for a run's GPU processes (join, or a private
//!   daemon), so they share the GPU instead of taking turns.
//! - [`process`]: [`process::Stop`], how a caller stops a server or farm (the binary connects
//!   the signals to it), and dying with the farm.
//!
//! ```no_run
//! use tensorport_farm::{config::Inputs, ProduceConfig};
//! # fn cfg() -> ProduceConfig { unimplemented!() }
//! let mut cfg: ProduceConfig = cfg();
//! cfg.inputs = Inputs::Synthetic(64);
//! let lines = tensorport_farm::produce::run(&cfg)?;
//! # Ok::<(), tensorport_farm::Error>(())
//! ```

#![forbid(unsafe_code)]

pub mod config;
mod error;
pub mod farm;
pub mod feed;
pub mod mps;
pub mod process;
pub mod produce;
pub mod record;
pub mod serve;

pub use config::{FarmConfig, ModelOptions, PrepOptions, ProduceConfig, ServeConfig};
pub use error::{ConfigError, Error, Result};

/// The largest `--max-batch` a server's configuration takes, far above what any batch needs;
/// each engine says its own limit too ([`serve::Engine::max_batch`]), checked as it loads.
pub const MAX_BATCH: usize = 65_535;
