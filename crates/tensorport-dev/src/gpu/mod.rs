//! `tensorport-dev gpu`: the CUDA probe, the host-to-device benchmark, and the CUDA IPC hand-off
//! benchmark (its two sides in `ipc_bench.rs`).

use crate::common::{CliError, CliResult};

mod fault;
mod ipc_bench;

use ipc_bench::{ipc_producer, ipc_server, staged_producer};
pub use ipc_bench::{FenceArg, ServerFences, ServerSync, Work};

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
    /// CUDA IPC hand-off, producer process to usable in the server's stream: a producer fills one
    /// of its device buffers (--pool) on its GPU stream and hands it over; the server makes its
    /// stream wait on the fence, copies the tensor device-to-device, releases the buffer, and
    /// answers (--server-batch, --server-fences and --server-sync say how). Measured like
    /// PyTorch's torch.multiprocessing benchmark (bench/peers/torch_ipc.py cuda). With
    /// TENSORPORT_BENCH_TRACE=1 both sides print where their time went, per step.
    BenchIpc {
        /// Hand-offs per size.
        #[arg(long, default_value_t = 2000)]
        handoffs: usize,
        /// Tensor sizes in bytes (default: 4 KiB, and a [32,3,224,224] f32 batch).
        #[arg(long, value_delimiter = ',', default_value = "4096,19267584")]
        bytes: Vec<usize>,
        /// Fences to measure: event (interprocess CUDA events), timeline (semaphores in IPC
        /// memory), or both; or staged (no device hand-off: through host memory, to compare).
        #[arg(long, value_enum, default_value_t = FenceArg::Both)]
        fence: FenceArg,
        /// What the producer's GPU does per hand-off: fill the tensor (as PyTorch's benchmark
        /// does), or nothing (the tensor is ready; only the hand-off is measured).
        #[arg(long, value_enum, default_value_t = Work::Fill)]
        producer_work: Work,
        /// The GPU the producer works on (the server uses GPU 0): another one measures the
        /// cross-GPU hand-off (IPC opened with peer access, fences across the two devices).
        #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
        producer_gpu: i32,
        /// The server takes up to N hand-offs at once (those that have arrived), waits on each
        /// one's fence, copies each, and synchronises its stream once for them all, as a server
        /// that batches does; 1: one at a time, a synchronisation each. Device hand-offs only.
        #[arg(long, default_value_t = 1, value_name = "N")]
        server_batch: usize,
        /// When the server answers: after synchronising its stream once per batch (each copy
        /// has run), or at once (none): the wait, copy and release are enqueued and the release
        /// fence alone orders the producer's reuse after the copy, so the host never waits for
        /// the GPU; the stream is synchronised once at the end, inside the timed span.
        #[arg(long, value_enum, default_value_t = ServerSync::Batch)]
        server_sync: ServerSync,
        /// How the server fences and copies the device tensors of a batch: each one alone
        /// (wait, copy, release: three driver calls per tensor), or all together
        /// (`tensorport_cuda::Gatherer`: one batched wait, one kernel launch for the copies,
        /// one batched release).
        #[arg(long, value_enum, default_value_t = ServerFences::Gather)]
        server_fences: ServerFences,
        /// Device buffers in the producer's pool (how many hand-offs may be in flight).
        #[arg(long, default_value_t = 4, value_name = "N")]
        pool: usize,
        /// (internal) run as the benchmark's producer on this socket.
        #[arg(long, hide = true)]
        producer_socket: Option<std::path::PathBuf>,
    },
    /// For fault tests: launch a kernel that writes out of bounds and report the error the driver
    /// gives. Under MPS (CUDA_MPS_PIPE_DIRECTORY naming a daemon) this is a fatal fault in one
    /// client of a server other processes share. Exits 0 when the fault was reported.
    Fault {
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: i32,
    },
}

pub(crate) fn cuda(e: tensorport_cuda::Error) -> CliError {
    CliError::new(e.to_string())
}

pub fn run(a: Args) -> CliResult<u8> {
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
        What::Fault { device } => {
            let error = fault::run(device)?;
            println!("the GPU reported the fault: {error}");
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
        What::BenchIpc {
            handoffs,
            bytes,
            fence,
            producer_work,
            producer_gpu,
            server_batch,
            server_sync,
            server_fences,
            pool,
            producer_socket,
        } => match producer_socket {
            Some(sock) => {
                let gpu = tensorport_cuda::Gpu::open(producer_gpu).map_err(cuda)?;
                if fence == FenceArg::Staged {
                    staged_producer(&gpu, &sock, handoffs, bytes[0], producer_work)?
                } else {
                    ipc_producer(&gpu, &sock, handoffs, bytes[0], fence, producer_work, pool)?
                }
            }
            None => {
                let gpu = tensorport_cuda::Gpu::open(0).map_err(cuda)?;
                let batch = server_batch.max(1);
                println!(
                    "CUDA IPC hand-off, producer process on GPU {producer_gpu} -> usable in the server's stream on GPU 0 (pool of {pool} buffers; the server takes up to {batch} at once, fences and copies them {}, and answers {}):",
                    match server_fences {
                        ServerFences::Each => "one by one",
                        ServerFences::Gather => "together",
                    },
                    match server_sync {
                        ServerSync::Batch => "after synchronising its stream",
                        ServerSync::None => "without waiting for its stream",
                    }
                );
                let fences = match fence {
                    FenceArg::Both => vec![FenceArg::Event, FenceArg::Timeline],
                    f => vec![f],
                };
                for f in fences {
                    for &b in &bytes {
                        ipc_server(
                            &gpu,
                            ipc_bench::IpcRun {
                                handoffs,
                                bytes: b,
                                fence: f,
                                work: producer_work,
                                producer_gpu,
                                batch,
                                sync: server_sync,
                                fences: server_fences,
                                pool,
                            },
                        )?;
                    }
                }
            }
        },
    }
    Ok(0)
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}
