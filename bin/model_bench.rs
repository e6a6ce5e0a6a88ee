//! `tensorport model-bench`: the bundled model on its own, on the CPU or a GPU.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensorport_dfdx::dfdx::prelude::*;
use tensorport_dfdx::ImageClassifier;

use crate::common::Device as On;
use crate::common::{CliError, CliResult, ModelArgs};

/// Run the bundled classifier on batches already on its device, as the server runs it (scores
/// back on the host after each batch), and report images per second and time per batch: what
/// the model alone allows, to compare with the farm's rate.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Images per batch.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// How long to measure, in seconds (after three warm-up batches).
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    a.model.config().check()?;
    if a.batch == 0 {
        return Err(CliError::usage("--batch must be positive"));
    }
    match a.model.device {
        On::Cpu => bench(&Cpu::seed_from_u64(a.model.seed), &a),
        #[cfg(feature = "cuda")]
        On::Cuda(n) => {
            let dev = Cuda::try_build(n as usize, a.model.seed).map_err(|e| {
                CliError::new(format!("cannot start dfdx on CUDA device {n}: {e:?}"))
            })?;
            bench(&dev, &a)
        }
        #[cfg(not(feature = "cuda"))]
        On::Cuda(_) => Err(CliError::usage(
            "--device cuda: this tensorport was built without CUDA; rebuild with `--features cuda` \
             (see docs/operations.md), or use --device cpu",
        )),
    }
}

fn bench<D: Device<f32>>(dev: &D, a: &Args) -> CliResult<ExitCode>
where
    ImageClassifier<D>: Sized,
{
    let cfg = a.model.config();
    let model = match &a.model.weights {
        Some(p) => ImageClassifier::load(dev, cfg, p)?,
        None => ImageClassifier::from_seed(dev, cfg, a.model.seed)?,
    };
    let s = cfg.image_size;
    let x = dev.sample_normal_like(&(a.batch, 3usize, s, s));
    for _ in 0..3 {
        model.forward(x.clone());
    }
    let limit = Duration::from_secs_f64(a.seconds.max(0.01));
    let t = Instant::now();
    let mut batches = 0u64;
    while t.elapsed() < limit {
        let scores = model.forward(x.clone());
        assert_eq!(scores.len(), a.batch);
        batches += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "model 3x{s}x{s}, width {}, batch {} on {}: {:.1} ms per batch, {:.0} images/s ({batches} batches in {secs:.1} s)",
        cfg.width,
        a.batch,
        a.model.device,
        secs * 1e3 / batches as f64,
        (batches * a.batch as u64) as f64 / secs
    );
    Ok(ExitCode::SUCCESS)
}
