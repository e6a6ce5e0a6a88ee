//! `tensorport gpu`: the CUDA probe and the host-to-device benchmark.

use std::process::ExitCode;

use crate::common::{CliError, CliResult};

/// Inspect the machine's CUDA support.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand, Debug)]
pub enum What {
    /// Driver version, devices, compute capability, host registration, VMM/POSIX-fd and IPC support.
    Probe,
    /// Host-to-device bandwidth from a registered tensorport pool, from cuMemAllocHost memory (the
    /// pinned ceiling) and from pageable memory, measured in one run.
    BenchH2d {
        /// MiB per copy.
        #[arg(long, default_value_t = 256)]
        mib: usize,
        /// Copies timed per source.
        #[arg(long, default_value_t = 20)]
        iters: usize,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: i32,
    },
}

fn cuda(e: tensorport_cuda::Error) -> CliError {
    CliError::new(e.to_string())
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    match a.what {
        What::Probe => {
            let c = tensorport_cuda::probe().map_err(cuda)?;
            println!(
                "driver: CUDA {}.{}",
                c.driver_version / 1000,
                c.driver_version % 1000 / 10
            );
            for d in &c.devices {
                println!(
                    "device {}: {}, compute {}.{}, {:.1} GiB; host register {}; VMM {}; POSIX-fd handles {}; legacy IPC {}",
                    d.ordinal,
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.total_mem as f64 / (1u64 << 30) as f64,
                    yes(d.host_register),
                    yes(d.vmm),
                    yes(d.posix_fd_handles),
                    yes(d.legacy_ipc)
                );
            }
            if c.devices.is_empty() {
                return Err(CliError::new("the driver sees no CUDA device"));
            }
        }
        What::BenchH2d { mib, iters, device } => {
            let gpu = tensorport_cuda::Gpu::open(device).map_err(cuda)?;
            let r = tensorport_cuda::bench_h2d(&gpu, mib << 20, iters.max(1)).map_err(cuda)?;
            println!(
                "host-to-device, {} MiB per copy, {} copies each (CUDA events):",
                mib, r.iters
            );
            println!(
                "  registered tensorport pool  {:>6.1} GB/s  ({:.0}% of cuMemAllocHost; registering took {:.1} ms)",
                r.registered_pool_gbps,
                100.0 * r.registered_pool_gbps / r.alloc_host_gbps,
                r.register_ms
            );
            println!(
                "  cuMemAllocHost (pinned)     {:>6.1} GB/s",
                r.alloc_host_gbps
            );
            println!(
                "  pageable memory             {:>6.1} GB/s",
                r.pageable_gbps
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}
