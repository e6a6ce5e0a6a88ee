//! tensorport's NIXL layer: a process reads tensors straight out of another process's registered
//! host memory — on another host or this one — with NIXL's one-sided reads over UCX (RDMA where
//! the network has it, TCP otherwise, shared memory or CUDA IPC within a host).
//!
//! ```no_run
//! # fn f(metadata: Vec<u8>, layout: tensorport_nixl::SlotLayout) -> tensorport_nixl::Result<()> {
//! use std::sync::Arc;
//! use tensorport_nixl::{Agent, Capi, Reader};
//! let capi = Arc::new(Capi::load()?);
//! let agent = Agent::new(&capi, "inference")?;
//! // The producer's metadata and slot layout came over an authenticated channel.
//! let peer = agent.add_peer(&metadata, "producer-0", layout)?;
//! let region = agent.register(8, layout.slot_len)?;
//! let mut reader = Reader::new(region, peer)?;
//! reader.start(3, 0)?; // the producer's slot 3 into our slot 0
//! reader.wait(0, std::time::Duration::from_secs(5))?;
//! let tensor = reader.slot(0).expect("idle");
//! # let _ = tensor; Ok(()) }
//! ```
//!
//! NIXL and UCX carry no authentication: a peer that has an agent's metadata can read and write
//! whatever memory that agent registered. Exchange metadata only over an authenticated channel,
//! and only from the side whose memory is read (the producer) to the side that reads it (the
//! inference host): the reader's own region stays out of reach, since no peer has its metadata.
//!
//! The library is loaded at run time ([`Capi::load`]) from PyPI's `nixl-cu13` wheel (it bundles
//! NIXL, its C API and UCX): `scripts/fetch-nixl.sh` unpacks it into `target/nixl`.

mod agent;
mod capi;
mod error;
mod fetch;
mod gpu;
mod pool;
mod read;

pub use agent::{
    tcp_transports, Agent, Memory, Peer, Region, SlotLayout, MAX_GPU, MAX_METADATA, MAX_SLOTS,
    MAX_SLOT_LEN,
};
pub use capi::Capi;
pub use error::{Error, Result};
pub use fetch::fetch_into_checkout;
pub use gpu::GpuReader;
pub use pool::PoolReader;
pub use read::Reader;
