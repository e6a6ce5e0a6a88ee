//! How a farm runs its processes: the options a front end takes as they are given, each
//! declared, documented and given its default here alone. With the `clap` feature they are
//! also the flags of `tensorport farm` (`#[command(flatten)]`): a field's comment is its
//! `--help`, and its default the one [`RunOptions::default`] gives.

use crate::mps::MpsMode;

/// How a farm runs its processes ([`crate::FarmConfig::run`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct RunOptions {
    /// Model workers per server (`serve --workers`): threads that each run their own copy of
    /// the model on their share of the producers.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunOptions::default().workers))]
    pub workers: usize,
    /// Restarts of one producer (or of the server) in a row without a result in between before
    /// the farm gives up on it.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = RunOptions::default().max_restarts))]
    pub max_restarts: u32,
    /// With CPU and GPU producers: who takes plain JPEGs (the JPEG engines' kind). Progressive
    /// JPEGs and PNGs go to the CPU producers either way, and large plain JPEGs to whoever has
    /// room (with measured: to CPU producers only while the GPU producers are the slower side).
    #[cfg_attr(
        feature = "clap",
        arg(long, value_enum, default_value_t = RunOptions::default().routing)
    )]
    pub routing: Routing,
    /// Where the server and GPU producers share a GPU: run them as clients of one CUDA MPS
    /// server, so their kernels overlap instead of taking turns. auto does so for an ONNX model
    /// (a network of yours; with the bundled model or none the GPU producers' decoding is the
    /// bound, and MPS slows it): it joins a running MPS daemon, else starts a private one for the
    /// run (its own pipe folder; quit at the end), and goes without where MPS cannot be had,
    /// saying why; on does so for any model, and refuses to start where MPS cannot be had; off
    /// never uses MPS. Under MPS a fatal GPU fault in one process can end the GPU work of all:
    /// the farm restarts them and redoes their inputs (docs/operations.md).
    #[cfg_attr(
        feature = "clap",
        arg(long, value_enum, default_value_t = RunOptions::default().mps)
    )]
    pub mps: MpsMode,
    /// Run the producers this much lower in CPU priority than the servers (a nice increment,
    /// 0 to 19), so that a server launching its model's GPU work keeps its core when the
    /// producers want every core.
    #[cfg_attr(
        feature = "clap",
        arg(long, default_value_t = RunOptions::default().producer_nice,
            value_parser = clap::value_parser!(u8).range(0..=19))
    )]
    pub producer_nice: u8,
    /// In a farm with GPU producers, run the CPU producers this much lower again (a nice
    /// increment on top of `--producer-nice`, 0 to 19), so that the GPU producers' host work —
    /// parsing and nvJPEG's calls, which keep the JPEG engines fed — does not wait behind CPU
    /// decoding, which takes the cores left over.
    #[cfg_attr(
        feature = "clap",
        arg(long, default_value_t = RunOptions::default().cpu_producer_nice,
            value_parser = clap::value_parser!(u8).range(0..=19))
    )]
    pub cpu_producer_nice: u8,
}

impl Default for RunOptions {
    fn default() -> RunOptions {
        RunOptions {
            workers: 1,
            max_restarts: 8,
            routing: Routing::Shared,
            mps: MpsMode::Auto,
            producer_nice: 0,
            cpu_producer_nice: 0,
        }
    }
}

impl RunOptions {
    /// How many steps below the farm's own CPU priority a producer runs: `producer_nice`, and
    /// for a CPU producer in a farm that has GPU producers `cpu_producer_nice` more; at most 19.
    pub fn producer_nice_of(&self, gpu_producer: bool, farm_has_gpu_producers: bool) -> u8 {
        let extra = if !gpu_producer && farm_has_gpu_producers {
            self.cpu_producer_nice
        } else {
            0
        };
        self.producer_nice.saturating_add(extra).min(19)
    }
}

/// Who takes plain JPEGs (8-bit sequential, the JPEG engines' kind) in a farm with CPU and GPU
/// producers. The rest (progressive, 12-bit, PNG) goes to the CPU producers first, and large plain
/// JPEGs to whoever has room (with [`Routing::Measured`], to CPU producers only while the GPU
/// producers are the slower side).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[non_exhaustive]
pub enum Routing {
    /// The GPU producers only (the CPU producers only when no GPU producer runs).
    ByKind,
    /// The GPU producers first; the CPU producers take those the GPU producers have no room
    /// for, once each GPU producer has returned a result.
    #[default]
    Shared,
    /// As shared, while the GPU producers are the slower side: the work left for each kind
    /// (inputs held, queued, and the unread shared as the read ones were) over the rate each
    /// kind has shown; otherwise the CPU producers keep to their own kind of input, large plain
    /// JPEGs included.
    Measured,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_producers_go_lower_only_beside_gpu_producers() {
        let run = RunOptions {
            producer_nice: 3,
            cpu_producer_nice: 5,
            ..RunOptions::default()
        };
        assert_eq!(run.producer_nice_of(false, true), 8);
        assert_eq!(run.producer_nice_of(true, true), 3);
        assert_eq!(run.producer_nice_of(false, false), 3);
        let deep = RunOptions {
            producer_nice: 15,
            cpu_producer_nice: 19,
            ..RunOptions::default()
        };
        assert_eq!(deep.producer_nice_of(false, true), 19);
        assert_eq!(RunOptions::default().producer_nice_of(false, true), 0);
    }
}
