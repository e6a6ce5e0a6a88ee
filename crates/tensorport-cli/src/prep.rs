//! `tensorport prep`: the producers' preprocessing on its own, on one thread — what it costs per
//! step, and the tensors it makes (to check them against another implementation).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tensorport_vision::{list_images, Stages};

use crate::common::{CliError, CliResult, PrepArgs};

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
    #[arg(long, default_value_t = tensorport_dfdx::ModelConfig::default().image_size as u32)]
    pub image_size: u32,
    #[command(flatten)]
    pub prep: PrepArgs,
    /// Passes over the files for the timing (the best pass counts).
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Also time libjpeg-turbo's least work per file for the transform: entropy-decode every row
    /// down to the last one the transform needs, turn only a 16×16 corner into pixels. No
    /// decoding with libjpeg-turbo can cost less, whatever else it leaves out.
    #[arg(long)]
    pub entropy_floor: bool,
    /// Write the tensors of the first pass to this safetensors file.
    #[arg(long, value_name = "FILE")]
    pub dump: Option<PathBuf>,
    /// Prepare on the GPU as `produce --nvjpeg` does (nvJPEG batches and the resize/normalise
    /// kernel) and report images per second for this one process, and the GPU's time per image
    /// in the decode and in the kernel, instead of per-step costs. Files nvJPEG does not decode
    /// in batches (progressive JPEGs on the JPEG engines, PNGs) are left out, saying how many.
    #[arg(long)]
    pub nvjpeg: bool,
    /// The GPU for --nvjpeg.
    #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
    pub gpu: u32,
    /// Images per nvJPEG batch.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Host threads of the GPU pipeline for --nvjpeg: the hybrid decoder's, which takes 4:4:4
    /// files with --gpu-decode by-chroma and colour files with split (as many as a GPU producer
    /// beside CPU producers has).
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub cpu_threads: usize,
}

pub fn run(a: Args) -> CliResult<u8> {
    if a.image_size == 0 || a.repeat == 0 {
        return Err(CliError::usage(
            "--image-size and --repeat must be positive",
        ));
    }
    let mut files = list_images(&a.input)?;
    if let Some(k) = a.limit {
        files.truncate(k.max(1));
    }
    // A file that cannot be read (a FIFO, a device, one over the size limit) is left out with
    // a warning, as the farm gives it an error line: the timing is of the rest.
    let encoded: Vec<(PathBuf, Vec<u8>)> = files
        .into_iter()
        .filter_map(|f| {
            let mut bytes = Vec::new();
            match tensorport_vision::read_file(&f, &mut bytes) {
                Ok(()) => Some((f, bytes)),
                Err(e) => {
                    eprintln!("warning: left out: {e}");
                    None
                }
            }
        })
        .collect();
    if encoded.is_empty() {
        return Err(CliError::usage(format!(
            "no file of {} could be read",
            a.input.display()
        )));
    }
    if a.nvjpeg {
        let (wall, dumped, n, times) = on_gpu(&a, &encoded)?;
        println!(
            "{} images, {} transform to 3x{}x{} f32, nvJPEG batches of {} on GPU {}, best of {} passes: {:.0} images/s",
            n,
            a.prep.transform.name(),
            a.image_size,
            a.image_size,
            a.batch.max(1),
            a.gpu,
            a.repeat,
            n as f64 / wall.as_secs_f64()
        );
        if let Some(t) = times.filter(|t| t.images > 0) {
            let per = |ms: f64| ms * 1e3 / t.images as f64;
            println!(
                "per image, all passes ({:.2} megapixels on average): nvJPEG's host calls {:.0} us, \
                 GPU decode {:.0} us, resize+crop+normalise kernel {:.0} us",
                t.pixels as f64 / t.images as f64 / 1e6,
                per(t.host_ms),
                per(t.decode_ms),
                per(t.kernel_ms)
            );
            if t.hybrid_images > 0 {
                println!(
                    "hybrid decoder: {} of {} images ({:.0}%), its threads' time {:.0} us per image \
                     it decoded (summed over the threads)",
                    t.hybrid_images,
                    t.images,
                    100.0 * t.hybrid_images as f64 / t.images as f64,
                    t.hybrid_host_ms * 1e3 / t.hybrid_images as f64
                );
            }
        }
        return dump(&a, dumped);
    }
    let mut prep = a
        .prep
        .options(tensorport_farm::config::Pixels::F32)
        .preprocessor(a.image_size)
        .map_err(tensorport_farm::Error::from)?;
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
                dumped.push((file_name(path), bytemuck::cast_slice(&out).to_vec()));
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
        "{} images, {} transform to 3x{}x{} f32, {} decoder, one thread, best of {} passes:",
        encoded.len(),
        a.prep.transform.name(),
        a.image_size,
        a.image_size,
        prep.jpeg_decoder().name(),
        a.repeat
    );
    println!(
        "decode {:.0} us, resize+crop {:.0} us, normalise {:.0} us per image; {:.0} images/s on one core",
        us(s.decode),
        us(s.resize),
        us(s.normalise),
        k / wall.as_secs_f64()
    );
    if a.entropy_floor {
        let jpegs: Vec<&[u8]> = encoded
            .iter()
            .filter(|(_, b)| b.starts_with(&[0xFF, 0xD8, 0xFF]))
            .map(|(_, b)| b.as_slice())
            .collect();
        match tensorport_vision::jpeg_entropy_floor(
            &jpegs,
            prep.transform(),
            a.repeat,
            a.prep.coarse_progressive.on(),
        ) {
            None => return Err(CliError::usage(
                "--entropy-floor needs libjpeg-turbo, which this build does not have",
            )),
            Some(Err(e)) => return Err(CliError::new(format!("--entropy-floor: {e}"))),
            Some(Ok(d)) => println!(
                "entropy decoding alone (libjpeg-turbo, {} JPEG files, every row down to the last the \
                 transform needs): {:.0} us per image; no decode with it can go faster than {:.0} \
                 images/s on one core",
                jpegs.len(),
                d.as_secs_f64() * 1e6,
                1.0 / d.as_secs_f64().max(1e-9)
            ),
        }
    }
    dump(&a, dumped)
}

/// Tensors to dump: a name and the tensor's bytes, per file.
type Dumped = Vec<(String, Vec<u8>)>;

/// Writes `--dump`'s file, if asked for.
fn dump(a: &Args, dumped: Dumped) -> CliResult<u8> {
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
    Ok(0)
}

fn file_name(path: &std::path::Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// What `--nvjpeg` measured: the best pass's time, the first pass's tensors, the images
/// decoded, and where the GPU's time went.
type GpuRun = (
    Duration,
    Dumped,
    usize,
    Option<tensorport_nvjpeg::JpegTimes>,
);

/// `--nvjpeg`: every file nvJPEG decodes in batches through the GPU pipeline, a batch at a
/// time, waiting for each batch (the others are left out, saying how many).
fn on_gpu(a: &Args, encoded: &[(PathBuf, Vec<u8>)]) -> CliResult<GpuRun> {
    use tensorport_cuda::{DeviceBuffer, Gpu, Stream};
    use tensorport_nvjpeg::{GpuJpeg, JpegJob};
    let gpu = Gpu::open(a.gpu as i32)?;
    let mut jpeg = GpuJpeg::open(
        &gpu,
        tensorport_vision::IMAGENET_MEAN,
        tensorport_vision::IMAGENET_STD,
        a.prep.gpu_decode,
        a.cpu_threads,
    )?;
    jpeg.set_upsampling(a.prep.gpu_upsampling);
    let hybrid = jpeg.decoders().hybrid_threads;
    println!(
        "{}{} (from {}), chroma upsampling: {}, decoding: {}{}",
        jpeg.backend(),
        if jpeg.memory_pool() {
            ", memory pool"
        } else {
            ""
        },
        jpeg.library(),
        a.prep.gpu_upsampling.name(),
        a.prep.gpu_decode.name(),
        if hybrid > 0 {
            let which = if a.prep.gpu_decode == tensorport_nvjpeg::GpuDecode::Split {
                "colour files"
            } else {
                "4:4:4"
            };
            format!(" ({which} shared with nvJPEG's hybrid decoder on {hybrid} host threads)")
        } else {
            String::new()
        }
    );
    let transform = a.prep.transform.for_size(a.image_size);
    let sized: Vec<_> = encoded
        .iter()
        .filter_map(|(path, bytes)| jpeg.probe(bytes).map(|wh| (path, bytes, wh)))
        .collect();
    if sized.len() < encoded.len() {
        println!(
            "left out {} of {} files that nvJPEG does not decode in batches here (progressive \
             JPEGs on the JPEG engines, PNGs, ...: produce --nvjpeg prepares those on the CPU)",
            encoded.len() - sized.len(),
            encoded.len()
        );
    }
    if sized.is_empty() {
        return Err(CliError::usage(
            "none of the files is one nvJPEG decodes in batches here",
        ));
    }
    jpeg.set_timing(true);
    let batch = a.batch.max(1);
    let image_bytes = 3 * (a.image_size as usize).pow(2) * 4;
    let out = DeviceBuffer::new(&gpu, batch * image_bytes)?;
    let stream = Stream::new(&gpu)?;
    let mut best: Option<Duration> = None;
    let mut dumped = Vec::new();
    for pass in 0..a.repeat {
        let t = Instant::now();
        for chunk in sized.chunks(batch) {
            let jobs: Vec<JpegJob<'_>> = chunk
                .iter()
                .enumerate()
                .map(|(k, (_, bytes, size))| {
                    tensorport_farm::produce::gpu_jpeg_job(
                        &transform,
                        bytes,
                        *size,
                        (&out, k * image_bytes),
                    )
                })
                .collect();
            // SAFETY: `sized` and `out` outlive the loop, and the stream is synchronised
            // right after, before either changes.
            unsafe { jpeg.run(&jobs, &stream) }?;
            stream.synchronize()?;
            if pass == 0 && a.dump.is_some() {
                let mut host = vec![0u8; chunk.len() * image_bytes];
                out.copy_to_host(&mut host)?;
                for (k, (path, _, _)) in chunk.iter().enumerate() {
                    dumped.push((
                        file_name(path),
                        host[k * image_bytes..(k + 1) * image_bytes].to_vec(),
                    ));
                }
            }
        }
        let wall = t.elapsed();
        if best.is_none_or(|b| wall < b) {
            best = Some(wall);
        }
    }
    jpeg.wait_idle()?;
    Ok((
        best.expect("at least one pass"),
        dumped,
        sized.len(),
        jpeg.times(),
    ))
}
