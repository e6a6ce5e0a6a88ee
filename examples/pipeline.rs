//! The pipeline tensorport was made for: prepare in several processes, infer in one.
//!
//! `cargo run --release --example pipeline -- [PRODUCERS] [IMAGES]` starts an inference server
//! with the dfdx classifier here and PRODUCERS producer processes (this program again). Each
//! producer decodes/resizes/normalises its share of generated images straight into its shared
//! pool; the server batches whatever has arrived (up to 32, waiting at most 5 ms), runs the model
//! once per batch, and sends each image's scores back to the producer that asked.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};
use tensorport_dfdx::dfdx::prelude::Cpu;
use tensorport_dfdx::{stack_images, ImageClassifier, ModelConfig};
use tensorport_farm::record::{scores_from_bytes, scores_to_bytes};
use tensorport_vision::{prepare, Source};

const SIZE: usize = 64;

fn producer(
    socket: &Path,
    id: u64,
    count: u64,
    stride: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = ProducerConfig::new(format!("producer-{id}"));
    cfg.slots = 4;
    cfg.slot_size = (3 * SIZE * SIZE * 4) as u64;
    let mut p = Producer::connect(socket, cfg)?;
    let spec = TensorSpec::new(DType::F32, &[3, SIZE as u64, SIZE as u64]);
    let mine: Vec<u64> = (id..count).step_by(stride as usize).collect();
    let mut next = mine.iter();
    let mut inputs = std::collections::HashMap::new();
    loop {
        // Keep up to 4 images in flight: prepare the next while the server works.
        while p.in_flight() < 4 {
            let Some(&n) = next.next() else { break };
            let mut lease = p.lease(Duration::from_secs(10))?;
            let px: &mut [f32] =
                bytemuck::cast_slice_mut(&mut lease.bytes_mut()[..3 * SIZE * SIZE * 4]);
            prepare(&Source::Synthetic(n), SIZE as u32, px)?; // straight into shared memory
            inputs.insert(lease.submit(&spec)?, n);
        }
        if p.in_flight() == 0 {
            break;
        }
        let done = p.recv_result(Duration::from_secs(10))?;
        let scores = scores_from_bytes(&done.result?).unwrap_or_default();
        let best = scores
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i);
        println!(
            "image {:>3} -> class {:?} (producer {id})",
            inputs[&done.request_id],
            best.unwrap_or(0)
        );
    }
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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("producer") {
        let n = |i: usize| args[i].parse::<u64>().unwrap();
        return producer(Path::new(&args[2]), n(3), n(4), n(5));
    }
    let [producers, images] = counts(
        &args[1..],
        [3, 96],
        "usage: pipeline [PRODUCERS=3] [IMAGES=96]",
    )
    .unwrap_or_else(|e| usage_error(&e));
    let dir = std::env::temp_dir().join(format!("tensorport-pipeline-{}", std::process::id()));
    let socket = dir.join("tp.sock");
    let config = ModelConfig {
        image_size: SIZE,
        ..ModelConfig::default()
    };
    let dev = Cpu::default();
    let model = ImageClassifier::from_seed(&dev, config, 0)?;
    let server = Server::bind(ServerConfig::new(&socket))?;
    let t0 = Instant::now();
    let mut children = Vec::new();
    for id in 0..producers {
        children.push(
            Command::new(std::env::current_exe()?)
                .args(["producer", socket.to_str().unwrap()])
                .args([id.to_string(), images.to_string(), producers.to_string()])
                .spawn()?,
        );
    }
    let (mut served, mut batches) = (0u64, 0u64);
    while served < images {
        let batch = server.recv_batch(32, Duration::from_secs(10), Duration::from_millis(5))?;
        served += batch.len() as u64;
        batches += 1;
        let stacked = stack_images(&dev, &batch, config.input_shape()); // the one copy
                                                                        // The batch holds its own copy now: give the slots back before the model runs.
        let mut responders: Vec<_> = batch.into_iter().map(|r| Some(r.release())).collect();
        for (i, e) in stacked.rejected {
            responders[i].take().unwrap().fail(e.to_string())?;
        }
        if let Some(x) = stacked.input {
            for (row, &i) in model.forward(x).iter().zip(&stacked.used) {
                responders[i]
                    .take()
                    .unwrap()
                    .respond(&scores_to_bytes(row))?;
            }
        }
    }
    for mut c in children {
        assert!(c.wait()?.success(), "a producer failed");
    }
    println!(
        "{images} images from {producers} producer processes in {batches} batches, {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
