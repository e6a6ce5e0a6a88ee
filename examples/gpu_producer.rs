//! A producer that prepares its tensors on the GPU, in its own CUDA context, and hands them to
//! the inference server without a host round trip.
//!
//! Each image is decoded on the host (here: generated), uploaded once as raw pixels, converted to
//! CHW and normalised on the GPU with dfdx, copied device-to-device into one of this producer's
//! shared buffers (VMM allocations sent as file descriptors, where the device supports them), and
//! handed over with a timeline fence. The server copies it into its model's input on its own
//! stream. For a check, each answer is compared with the same model run here on the CPU pipeline.
//!
//! ```sh
//! scripts/build-gpu.sh
//! dist/gpu/tensorport serve --device cuda --image-size 256 --socket /tmp/tp-$USER/tp.sock &
//! dist/gpu/gpu_producer /tmp/tp-$USER/tp.sock 32
//! ```

use std::time::Duration;

use tensorport::{DType, TensorSpec};
use tensorport_cuda::{DevicePtr, Gpu, GpuProducer, GpuProducerConfig};
use tensorport_dfdx::dfdx::prelude::*;
use tensorport_dfdx::{ImageClassifier, ModelConfig};
use tensorport_farm::record::scores_from_bytes;
use tensorport_vision::{synthetic, to_nchw, IMAGENET_MEAN, IMAGENET_STD};

const SIZE: usize = 256;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let usage = |why: String| -> ! {
        eprintln!("usage: gpu_producer SOCKET [IMAGES=16]\n{why}");
        std::process::exit(2)
    };
    let Some(socket) = args.get(1) else {
        usage("give the server's socket path".into())
    };
    if let Some(extra) = args.get(3) {
        usage(format!("unexpected argument '{extra}'"));
    }
    let images: u64 = match args.get(2) {
        None => 16,
        Some(a) => match a.parse() {
            Ok(n) if n > 0 => n,
            _ => usage(format!("'{a}' is not a positive count")),
        },
    };
    let gpu = Gpu::open(0)?;
    let dev = Cuda::try_build(0, 0).map_err(|e| format!("dfdx on CUDA: {e:?}"))?; // same primary context
    let bytes = 3 * SIZE * SIZE * 4;
    let mut p = GpuProducer::connect(socket, &gpu, &GpuProducerConfig::new("gpu-prep", 4, bytes))?;
    let spec = TensorSpec::new(DType::F32, &[3, SIZE as u64, SIZE as u64]);
    let mean = dev.tensor_from_vec(IMAGENET_MEAN.to_vec(), (3usize,));
    let std = dev.tensor_from_vec(IMAGENET_STD.to_vec(), (3usize,));
    let chw = (3usize, SIZE, SIZE);
    // The reference: the CPU pipeline and the same model on the CPU.
    let model = ImageClassifier::from_seed(
        &Cpu::default(),
        ModelConfig {
            image_size: SIZE,
            classes: 10,
            width: 16,
        },
        0,
    )?;
    let mut worst = 0f32;
    for i in 0..images {
        let img = synthetic(i, SIZE as u32, SIZE as u32);
        // Upload the raw pixels (HWC), then do the preprocessing on the GPU.
        let raw: Vec<f32> = img.as_raw().iter().map(|&b| b as f32).collect();
        let x = dev.tensor_from_vec(raw, (SIZE, SIZE, 3usize));
        let x = x
            .permute::<(usize, usize, usize), Axes3<2, 0, 1>>()
            .reshape_like(&chw);
        let x = (x / 255.0 - mean.clone().broadcast_like::<_, Axes2<1, 2>>(&chw))
            / std.clone().broadcast_like::<_, Axes2<1, 2>>(&chw);
        dev.synchronize(); // dfdx's stream is done with `x` before ours copies it
        let b = p.acquire(Duration::from_secs(10))?;
        // SAFETY: `x` is ours alone, contiguous, and `bytes` long; the buffer holds `bytes`; the
        // stream is synchronised below, before `x` is dropped.
        unsafe {
            p.stream().copy_device_to_device_async(
                p.buffer(b).ptr(),
                DevicePtr::new(x.tensorport_device_ptr()).expect("a tensor of images has memory"),
                bytes,
            )?
        };
        p.submit(b, &spec)?;
        p.stream().synchronize()?;
        let done = p.producer().recv_result(Duration::from_secs(30))?;
        let got = scores_from_bytes(&done.result?).ok_or("malformed scores")?;
        let mut px = vec![0f32; 3 * SIZE * SIZE];
        to_nchw(&img, SIZE as u32, &mut px)?;
        let want = &model.forward_flat(px, 1)[0];
        for (g, w) in got.iter().zip(want) {
            worst = worst.max((g - w).abs() / (1.0 + w.abs()));
        }
        let class = got
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(c, _)| c)
            .unwrap_or(0);
        println!("image {i:>3} -> class {class}");
    }
    p.close()?;
    println!(
        "{images} images prepared on the GPU and classified by the server; max relative difference from the CPU pipeline {worst:.2e}"
    );
    if worst > 1e-3 {
        return Err(format!("GPU and CPU pipelines disagree by {worst}").into());
    }
    Ok(())
}
