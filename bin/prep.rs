//! `tensorport prep`: the producers' preprocessing on its own, on one thread — what it costs per
//! step, and the tensors it makes (to check them against another implementation).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensorport_vision::{list_images, Preprocessor, Stages};

use crate::common::{CliError, CliResult, TransformArg};

/// Preprocess a folder of images on one thread, exactly as a producer does, and report the
/// cost of each step per image (decode, resize and crop, normalise) and images per second on one
/// core. Files are read into memory first, so the figures leave the disk out. With --dump, write
/// the tensors to a safetensors file, one float32 [3, S, S] tensor per file name, to compare with
/// torchvision's (`bench/peers/torch_jpeg.py DIR --dump K ref.pt`, then
/// `bench/peers/compare_tensors.py`).
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Folder of JPEG/PNG images.
    #[arg(long)]
    pub input: PathBuf,
    /// Use only the first N files (by name).
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Side of the model's square input, in pixels.
    #[arg(long, default_value_t = 224)]
    pub image_size: u32,
    /// The preprocessing.
    #[arg(long, value_enum, default_value_t)]
    pub transform: TransformArg,
    /// Passes over the files for the timing (the best pass counts).
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Write the tensors of the first pass to this safetensors file.
    #[arg(long, value_name = "FILE")]
    pub dump: Option<PathBuf>,
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    if a.image_size == 0 || a.repeat == 0 {
        return Err(CliError::usage(
            "--image-size and --repeat must be positive",
        ));
    }
    let mut files = list_images(&a.input)?;
    if let Some(k) = a.limit {
        files.truncate(k.max(1));
    }
    let encoded: Vec<(PathBuf, Vec<u8>)> = files
        .into_iter()
        .map(|f| std::fs::read(&f).map(|b| (f.clone(), b)))
        .collect::<Result<_, _>>()
        .map_err(|e| CliError::usage(format!("reading {}: {e}", a.input.display())))?;
    let mut prep = Preprocessor::new(a.transform.for_size(a.image_size));
    let n = prep.out_len();
    let mut out = vec![0f32; n];
    let mut dumped: Vec<(String, Vec<u8>)> = Vec::new();
    let mut best: Option<(Duration, Stages)> = None;
    for pass in 0..a.repeat {
        let mut sum = Stages::default();
        let t = Instant::now();
        for (path, bytes) in &encoded {
            prep.prepare_encoded(bytes, path, &mut out)?;
            sum += prep.last_stages();
            if pass == 0 && a.dump.is_some() {
                let name = path.file_name().map_or_else(
                    || path.display().to_string(),
                    |s| s.to_string_lossy().into_owned(),
                );
                dumped.push((name, bytemuck::cast_slice(&out).to_vec()));
            }
        }
        let wall = t.elapsed();
        if best.is_none_or(|(w, _)| wall < w) {
            best = Some((wall, sum));
        }
    }
    let (wall, s) = best.expect("at least one pass");
    let k = encoded.len() as f64;
    let us = |d: Duration| d.as_secs_f64() * 1e6 / k;
    println!(
        "{} images, {} transform to 3x{}x{} f32, one thread, best of {} passes:",
        encoded.len(),
        a.transform.name(),
        a.image_size,
        a.image_size,
        a.repeat
    );
    println!(
        "decode {:.0} us, resize+crop {:.0} us, normalise {:.0} us per image; {:.0} images/s on one core",
        us(s.decode),
        us(s.resize),
        us(s.normalise),
        k / wall.as_secs_f64()
    );
    if let Some(path) = &a.dump {
        let side = a.image_size as usize;
        let shape = [3, side, side];
        let views = dumped
            .iter()
            .map(|(name, data)| {
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), data)
                    .map(|v| (name.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CliError::new(format!("--dump: {e}")))?;
        safetensors::serialize_to_file(views, None, path)
            .map_err(|e| CliError::new(format!("--dump {}: {e}", path.display())))?;
        println!("tensors of {} files in {}", dumped.len(), path.display());
    }
    Ok(ExitCode::SUCCESS)
}
