//! The bundled model on cuDNN against the CPU model, at every precision.

use tensorport_dfdx::dfdx::prelude::*;
use tensorport_dfdx::{CudnnClassifier, ImageClassifier, Layout, ModelConfig, Precision};

/// Deterministic inputs in roughly the normalised range.
fn images(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32).wrapping_mul(2654435761) ^ seed.wrapping_mul(0x9E37_79B9);
            (h % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// Largest `|got - want| / (1 + |want|)` over every score, and how many rows pick the same class.
fn compare(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f32, usize) {
    let argmax = |s: &[f32]| {
        s.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|m| m.0)
    };
    let mut worst = 0f32;
    let mut same = 0;
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len());
        for (a, b) in g.iter().zip(w) {
            assert!(a.is_finite(), "a non-finite score {a}");
            worst = worst.max((a - b).abs() / (1.0 + b.abs()));
        }
        same += (argmax(g) == argmax(w)) as usize;
    }
    (worst, same)
}

/// The cuDNN model at each precision, in both layouts, against the CPU model (fp32, the reference), on batches of
/// several sizes — 1, 7, 32, 33 and 128, so plans are made for sizes below, at and above a
/// measured power of two, the buffers grow, and 16-bit batches run fused — at the default
/// 224-pixel size.
pub(crate) fn cudnn_model_matches_the_cpu_model() {
    let cfg = ModelConfig::default();
    let s = cfg.image_size;
    let cpu = ImageClassifier::from_seed(&Cpu::default(), cfg, 5).unwrap();
    let dev = Cuda::try_build(0, 0).unwrap();
    let gpu = tensorport_cuda::Gpu::open(0).unwrap();
    println!(
        "  cuDNN {}",
        tensorport_cudnn::ConvNet::cudnn_version().unwrap()
    );
    // (precision, bound on the relative difference, rows that may pick another class).
    let cases = [
        (Precision::F32, 1e-4f32),
        (Precision::Tf32, 2e-2),
        (Precision::F16, 2e-2),
        (Precision::Bf16, 1e-1),
    ];
    // Inputs and the CPU model's scores, once.
    let batches: Vec<(usize, Vec<f32>, Vec<Vec<f32>>)> = [1usize, 7, 32, 33, 128]
        .into_iter()
        .enumerate()
        .map(|(k, batch)| {
            let x = images(batch * 3 * s * s, k as u32 + 1);
            let want = cpu.forward_flat(x.clone(), batch);
            (batch, x, want)
        })
        .collect();
    for ((precision, bound), layout, fused) in cases.into_iter().flat_map(|c| {
        Layout::ALL
            .into_iter()
            .flat_map(move |l| [true, false].map(move |f| (c, l, f)))
    }) {
        let mut m = CudnnClassifier::from_seed(&dev, &gpu, cfg, 5, (precision, layout)).unwrap();
        m.set_fused(fused);
        let (mut worst, mut same, mut rows) = (0f32, 0, 0);
        for (batch, x, want) in &batches {
            let batch = *batch;
            let t = dev.tensor_from_vec(x.clone(), (batch, 3, s, s));
            let got = m.forward(&t).unwrap();
            let (w, sm) = compare(&got, want);
            worst = worst.max(w);
            same += sm;
            rows += batch;
        }
        let how = if fused {
            assert!(
                m.stem_kernel(),
                "the stem cuts the image into patches: a kernel of ours"
            );
            format!(
                "{} of 6 convolutions may fuse, {} on graph plans, the stem a kernel of ours",
                m.fused_layers(),
                m.graph_layers()
            )
        } else {
            assert!(!m.stem_kernel());
            "convolutions apart".to_string()
        };
        println!(
            "  {precision} {layout}, {how}: max relative difference from the CPU model {worst:.2e}; same class {same}/{rows}"
        );
        assert!(
            worst <= bound,
            "{precision} {layout}: scores differ from the CPU model by {worst:.3e} (bound {bound:.0e})"
        );
        if precision == Precision::F32 {
            assert_eq!(same, rows, "f32 must pick the CPU model's class");
        }
    }
    // Switching the stem from our kernel to cuDNN after batches have run makes room for the
    // converted input it then needs, and the scores stay the same.
    let (batch, x, want) = &batches[2];
    let t = dev.tensor_from_vec(x.clone(), (*batch, 3, s, s));
    let mut m =
        CudnnClassifier::from_seed(&dev, &gpu, cfg, 5, (Precision::F16, Layout::Nhwc)).unwrap();
    let ours = m.forward(&t).unwrap();
    m.set_fused(false);
    let theirs = m.forward(&t).unwrap();
    for (label, got) in [("stem kernel", &ours), ("cuDNN stem", &theirs)] {
        let (worst, _) = compare(got, want);
        println!("  f16 NHWC, {label}, one model switched: max relative difference {worst:.2e}");
        assert!(worst <= 2e-2, "{label}: {worst:.3e}");
    }
    // A batch of the wrong shape is an error, not a crash.
    let how = (Precision::F32, Layout::Nchw);
    let mut m = CudnnClassifier::from_seed(&dev, &gpu, cfg, 5, how).unwrap();
    let wrong = dev.tensor_from_vec(vec![0f32; 3 * 8 * 8], (1usize, 3usize, 8usize, 8usize));
    assert!(m.forward(&wrong).is_err());
}
