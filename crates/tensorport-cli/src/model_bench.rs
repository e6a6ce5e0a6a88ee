//! `tensorport model-bench`: the bundled model on its own, on the CPU or a GPU.

use std::time::{Duration, Instant};

use tensorport_dfdx::dfdx::prelude::*;
use tensorport_dfdx::Tensor4;

use crate::common::Device as On;
use crate::common::{CliError, CliResult, ModelArgs};

/// Run the bundled classifier on batches already on its device, as the server runs it (the
/// scores back on the host after each batch), and print a table of images per second and time
/// per batch for each batch size and engine: what the model alone allows, to compare with the
/// farm's rate and, line by line, with bench/peers/torch_model.py (the same architecture in
/// PyTorch). On a GPU the engines are cuDNN at each --precision (every one unless given) and
/// dfdx's own kernels (fp32). With `--model PATH.onnx`, that model on ONNX Runtime's CPU
/// provider (beside bench/peers/onnx_model.py: the same file in onnxruntime's Python API).
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Images per batch; several, comma-separated, give one row each.
    #[arg(long, value_delimiter = ',', default_value = "32,256")]
    pub batch: Vec<usize>,
    /// How long to measure each row, in seconds (after three warm-up batches).
    #[arg(long, default_value_t = 3.0, value_parser = crate::common::parse_seconds)]
    pub seconds: f64,
    /// On a GPU, also measure every convolution run by cuDNN apart from its bias, residual
    /// and ReLU (a kernel of ours after each): no fused cuDNN call, and the first layer on
    /// cuDNN too (after converting the input) rather than the patch kernel of ours.
    #[arg(long)]
    pub unfused: bool,
}

pub fn run(a: Args) -> CliResult<u8> {
    let model = a.model.options();
    model.check().map_err(tensorport_farm::Error::from)?;
    if a.batch.is_empty() || a.batch.contains(&0) {
        return Err(CliError::usage(
            "--batch: give positive batch sizes, e.g. 32,256",
        ));
    }
    if let tensorport_farm::config::ModelKind::Onnx(path) = &model.kind {
        return onnx(path, &a).map(|()| 0);
    }
    let cfg = model.config;
    println!(
        "model 3x{s}x{s}, width {}, {} classes, on {}; scores to the host after each batch",
        cfg.width,
        cfg.classes,
        a.model.device,
        s = cfg.image_size
    );
    print_header();
    match a.model.device {
        On::Cpu => {
            let dev = Cpu::seed_from_u64(a.model.seed);
            let m = a
                .model
                .options()
                .dfdx_model(&dev)
                .map_err(tensorport_farm::Error::from)?;
            for &b in &a.batch {
                row(&dev, &mut |x| Ok(m.forward(x)), b, "dfdx", "f32", &a);
            }
        }
        #[cfg(feature = "cuda")]
        On::Cuda(n) => cuda(n, &a)?,
        #[cfg(not(feature = "cuda"))]
        On::Cuda(_) => {
            return Err(
                tensorport_farm::Error::from(tensorport_farm::ConfigError::NoCudaBuild).into(),
            )
        }
    }
    Ok(0)
}

fn print_header() {
    println!("| batch | engine | precision | ms per batch | images/s |");
    println!("| ---: | --- | --- | ---: | ---: |");
}

#[cfg(feature = "cuda")]
fn cuda(n: u32, a: &Args) -> CliResult<()> {
    use tensorport_cudnn::Precision;
    let dev = Cuda::try_build(n as usize, a.model.seed)
        .map_err(|e| CliError::new(format!("cannot start dfdx on CUDA device {n}: {e:?}")))?;
    let gpu = tensorport_cuda::Gpu::open(n as i32).map_err(|e| CliError::new(e.to_string()))?;
    let precisions = match a.model.precision {
        Some(p) => vec![p],
        None => Precision::ALL.to_vec(),
    };
    let dfdx = a
        .model
        .options()
        .dfdx_model(&dev)
        .map_err(tensorport_farm::Error::from)?;
    for &b in &a.batch {
        match tensorport_cudnn::ConvNet::cudnn_version() {
            Ok(_) => {
                for layout in tensorport_cudnn::Layout::ALL {
                    for &p in &precisions {
                        let mut m = a
                            .model
                            .options()
                            .cudnn_model(&dev, &gpu, (p, layout))
                            .map_err(tensorport_farm::Error::from)?;
                        m.prepare(b)?;
                        let engine = format!("cudnn {layout}");
                        let mut run = |x: Tensor4<Cuda>| m.forward(&x).map_err(|e| e.to_string());
                        row(&dev, &mut run, b, &engine, p.name(), a);
                        if a.unfused {
                            m.set_fused(false);
                            let engine = format!("cudnn {layout}, unfused");
                            let mut run =
                                |x: Tensor4<Cuda>| m.forward(&x).map_err(|e| e.to_string());
                            row(&dev, &mut run, b, &engine, p.name(), a);
                        }
                    }
                }
            }
            Err(e) => eprintln!("no cuDNN rows: {e}"),
        }
        if a.model.precision.unwrap_or_default() == Precision::F32 {
            row(
                &dev,
                &mut |x| Ok(dfdx.forward(x)),
                b,
                "dfdx kernels",
                "f32",
                a,
            );
        }
    }
    Ok(())
}

/// The scores of a batch, or why not.
type Forward<'a, D> = dyn FnMut(Tensor4<D>) -> Result<Vec<Vec<f32>>, String> + 'a;

/// Measures `model` on batches of `batch` random images and prints its row.
fn row<D: Device<f32>>(
    dev: &D,
    model: &mut Forward<'_, D>,
    batch: usize,
    engine: &str,
    precision: &str,
    a: &Args,
) {
    let s = a.model.image_size;
    let x: Tensor4<D> = dev.sample_normal_like(&(batch, 3usize, s, s));
    let mut run = || match model(x.clone()) {
        Ok(scores) => scores.len() == batch,
        Err(e) => {
            eprintln!("{engine} {precision}, batch {batch}: {e}");
            false
        }
    };
    time_row(&mut run, batch, engine, precision, a);
}

/// An ONNX model on ONNX Runtime: a row per batch size, on batches of random images already
/// where the server would hand them over (host memory on the CPU; device memory on a GPU,
/// bound in place), the scores back on the host after each batch.
fn onnx(path: &std::path::Path, a: &Args) -> CliResult<()> {
    let provider = match a.model.device {
        On::Cpu => tensorport_onnx::Provider::Cpu,
        On::Cuda(n) => a.model.ort_provider.on(n),
    };
    // The model's own image size, or --image-size where it leaves the size open.
    let opts = tensorport_onnx::OnnxOptions {
        provider,
        image_size: Some(a.model.image_size),
        tf32: a.model.tf32.on(),
        ..Default::default()
    };
    let mut m = tensorport_onnx::OnnxModel::open(path, &opts)
        .map_err(|e| tensorport_farm::Error::from(tensorport_farm::ConfigError::from(e)))?;
    println!(
        "{}: 3x{s}x{s}, {} scores, on {} (ONNX Runtime); scores to the host after each batch",
        path.display(),
        m.spec().classes,
        a.model.device,
        s = m.image_size()
    );
    print_header();
    let precision = m.spec().input_elem.name();
    let engine = format!("onnxruntime {}", provider.name().to_lowercase());
    let gpu = match a.model.device {
        On::Cuda(n) => {
            Some(tensorport_cuda::Gpu::open(n as i32).map_err(|e| CliError::new(e.to_string()))?)
        }
        On::Cpu => None,
    };
    for &b in &a.batch {
        // A fixed pseudo-random batch (the values do not matter to the time).
        let x: Vec<f32> = (0..b * m.image_len())
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / (1u32 << 24) as f32)
            .collect();
        let fail = |e: tensorport_onnx::Error| {
            eprintln!("{engine} {precision}, batch {b}: {e}");
            false
        };
        match &gpu {
            None => {
                let mut run = || m.run(&x, b).map_or_else(fail, |s| s.len() == b);
                time_row(&mut run, b, &engine, precision, a);
            }
            Some(gpu) => {
                let bytes: Vec<u8> = match m.spec().input_elem {
                    tensorport_onnx::Elem::F32 => x.iter().flat_map(|v| v.to_ne_bytes()).collect(),
                    tensorport_onnx::Elem::F16 => x
                        .iter()
                        .flat_map(|&v| half::f16::from_f32(v).to_ne_bytes())
                        .collect(),
                };
                let cuda = |e: tensorport_cuda::Error| CliError::new(e.to_string());
                let buf = tensorport_cuda::DeviceBuffer::new(gpu, bytes.len()).map_err(cuda)?;
                let stream = tensorport_cuda::Stream::new(gpu).map_err(cuda)?;
                // SAFETY: `buf` holds exactly these bytes; the copy is waited for before
                // `bytes` or `buf` is used again.
                unsafe { stream.copy_host_to_device_async(buf.ptr(), &bytes) }.map_err(cuda)?;
                stream.synchronize().map_err(cuda)?;
                let mut run = || {
                    m.run_on_device(gpu, &buf, b)
                        .map_or_else(fail, |s| s.len() == b)
                };
                time_row(&mut run, b, &engine, precision, a);
            }
        }
    }
    Ok(())
}

/// Times `run` (one batch of `batch` images a call; false: it failed, and said so) for
/// `--seconds` after three warm-up batches, and prints its row.
fn time_row(run: &mut dyn FnMut() -> bool, batch: usize, engine: &str, precision: &str, a: &Args) {
    for _ in 0..3 {
        if !run() {
            return;
        }
    }
    let limit = Duration::from_secs_f64(a.seconds.max(0.01));
    let t = Instant::now();
    let mut batches = 0u64;
    while t.elapsed() < limit {
        if !run() {
            return;
        }
        batches += 1;
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "| {batch} | {engine} | {precision} | {:.2} | {:.0} |",
        secs * 1e3 / batches as f64,
        (batches * batch as u64) as f64 / secs
    );
}
