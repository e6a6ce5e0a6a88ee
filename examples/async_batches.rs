//! The seed's async pipeline, as it was meant: requests as a `Stream`, batched with
//! `ready_chunks(32)`, the model run under `spawn_blocking` — while the producers are separate
//! processes writing into shared memory.
//!
//! `cargo run --release --example async_batches -- [PRODUCERS] [IMAGES]`

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tensorport::stream::RequestStream;
use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};
use tensorport_dfdx::dfdx::prelude::Cpu;
use tensorport_dfdx::{stack_images, ImageClassifier, ModelConfig};
use tensorport_farm::record::scores_to_bytes;
use tensorport_vision::{prepare, Source};

const SIZE: usize = 32;

fn producer(socket: &Path, id: u64, count: u64) -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = ProducerConfig::new(format!("async-producer-{id}"));
    cfg.slot_size = (3 * SIZE * SIZE * 4) as u64;
    let mut p = Producer::connect(socket, cfg)?;
    let spec = TensorSpec::new(DType::F32, &[3, SIZE as u64, SIZE as u64]);
    let mut answered = 0;
    for n in 0..count {
        let mut lease = p.lease(Duration::from_secs(10))?;
        let px: &mut [f32] =
            bytemuck::cast_slice_mut(&mut lease.bytes_mut()[..3 * SIZE * SIZE * 4]);
        prepare(&Source::Synthetic(id * 1000 + n), SIZE as u32, px)?;
        lease.submit(&spec)?;
        while let Some(c) = p.try_recv_result()? {
            c.result?;
            answered += 1;
        }
    }
    while p.in_flight() > 0 {
        p.recv_result(Duration::from_secs(10))?.result?;
        answered += 1;
    }
    println!("producer {id}: {answered} answers");
    Ok(p.close()?)
}

/// Says what went wrong with the arguments and exits with status 2.
fn usage_error(message: &str) -> ! {
    eprintln!("{message}");
    std::process::exit(2)
}

/// The counts given on the command line, in order, or their defaults; anything else is refused
/// with the usage line.
fn counts<const N: usize>(
    args: &[String],
    defaults: [u64; N],
    usage: &str,
) -> Result<[u64; N], String> {
    if args.len() > N {
        return Err(format!("{usage}\nunexpected argument '{}'", args[N]));
    }
    let mut out = defaults;
    for (slot, a) in out.iter_mut().zip(args) {
        *slot = match a.parse() {
            Ok(n) if n > 0 => n,
            _ => return Err(format!("{usage}\n'{a}' is not a positive count")),
        };
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("producer") {
        return producer(Path::new(&args[2]), args[3].parse()?, args[4].parse()?);
    }
    let [producers, images] = counts(
        &args[1..],
        [2, 64],
        "usage: async_batches [PRODUCERS=2] [IMAGES=64]",
    )
    .unwrap_or_else(|e| usage_error(&e));
    let dir = std::env::temp_dir().join(format!("tensorport-async-{}", std::process::id()));
    let socket = dir.join("tp.sock");
    let config = ModelConfig {
        image_size: SIZE,
        ..ModelConfig::default()
    };
    let model = Arc::new(ImageClassifier::from_seed(&Cpu::default(), config, 0)?);
    let server = Server::bind(ServerConfig::new(&socket))?;
    let mut children = Vec::new();
    for id in 0..producers {
        children.push(
            Command::new(std::env::current_exe()?)
                .args([
                    "producer",
                    socket.to_str().unwrap(),
                    &id.to_string(),
                    &images.to_string(),
                ])
                .spawn()?,
        );
    }
    let mut batches = RequestStream::new(server, 64).ready_chunks(32);
    let (mut served, mut count) = (0u64, 0u64);
    while served < producers * images {
        let Some(batch) = batches.next().await else {
            break;
        };
        served += batch.len() as u64;
        count += 1;
        let model = model.clone();
        // The model is CPU-bound: run it off the async threads.
        tokio::task::spawn_blocking(move || {
            let stacked = stack_images(&Cpu::default(), &batch, config.input_shape());
            let mut responders: Vec<_> = batch.into_iter().map(|r| Some(r.release())).collect();
            if let Some(x) = stacked.input {
                for (row, &i) in model.forward(x).iter().zip(&stacked.used) {
                    let _ = responders[i].take().unwrap().respond(&scores_to_bytes(row));
                }
            }
        })
        .await?;
    }
    for mut c in children {
        assert!(c.wait()?.success(), "a producer failed");
    }
    println!("served {served} images in {count} batches");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
