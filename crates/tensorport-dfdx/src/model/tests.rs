//! The bundled network on small images: batch against single, save and load, seeds, and a
//! direct convolution as the reference.

use super::*;

fn small() -> ModelConfig {
    ModelConfig {
        image_size: 16,
        classes: 5,
        width: 4,
    }
}

fn image(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

#[test]
fn batch_and_single_agree_bitwise() {
    let dev = Cpu::default();
    let m = ImageClassifier::from_seed(&dev, small(), 7).unwrap();
    let n = 3 * 16 * 16;
    let imgs: Vec<Vec<f32>> = (0..5).map(|i| image(i, n)).collect();
    let batch = m.forward_flat(imgs.concat(), 5);
    for (i, img) in imgs.iter().enumerate() {
        let single = m.forward_flat(img.clone(), 1);
        let a: Vec<u32> = batch[i].iter().map(|x| x.to_bits()).collect();
        let b: Vec<u32> = single[0].iter().map(|x| x.to_bits()).collect();
        assert_eq!(a, b, "image {i}");
    }
    assert_eq!(batch[0].len(), 5);
    assert!(batch[0].iter().all(|x| x.is_finite()));
    assert_ne!(batch[0], batch[1]);
}

#[test]
fn save_load_roundtrip_and_clear_errors() {
    let dev = Cpu::default();
    let m = ImageClassifier::from_seed(&dev, small(), 3).unwrap();
    let dir = std::env::temp_dir().join(format!("tp-w-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("w.safetensors");
    ImageClassifier::<Cpu>::save_seeded(small(), 3, &p).unwrap();
    let m2 = ImageClassifier::load(&dev, small(), &p).unwrap();
    let x = image(1, 3 * 16 * 16);
    assert_eq!(m.forward_flat(x.clone(), 1), m2.forward_flat(x, 1));
    let mut other = small();
    other.classes = 7;
    let e = ImageClassifier::load(&dev, other, &p).err().unwrap();
    assert!(e.to_string().contains("head.weight has shape"), "{e}");
    let mut odd = small();
    odd.image_size = 12;
    assert!(ImageClassifier::from_seed(&dev, odd, 1).is_err());
    let e = ImageClassifier::load(&dev, small(), &dir.join("missing"))
        .err()
        .unwrap();
    assert!(e.to_string().contains("existing weights file"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn same_seed_same_weights_different_seed_differs() {
    let dev = Cpu::default();
    let x = image(9, 3 * 16 * 16);
    let a = ImageClassifier::from_seed(&dev, small(), 1)
        .unwrap()
        .forward_flat(x.clone(), 1);
    let b = ImageClassifier::from_seed(&dev, small(), 1)
        .unwrap()
        .forward_flat(x.clone(), 1);
    let c = ImageClassifier::from_seed(&dev, small(), 2)
        .unwrap()
        .forward_flat(x, 1);
    assert_eq!(a, b);
    assert_ne!(a, c);
}

/// Direct-loop NCHW reference of the same network, from the PyTorch-layout parameters.
fn naive(c: &ModelConfig, p: &HashMap<&'static str, Vec<f32>>, x: &[f32]) -> Vec<f32> {
    /// `x` of `(cin, h, w)` through `wt` and `b` into `cout` channels, with `(k, stride, pad)`.
    fn conv(
        x: &[f32],
        (cin, h, w): (usize, usize, usize),
        (wt, b): (&[f32], &[f32]),
        cout: usize,
        (k, stride, pad): (usize, usize, usize),
    ) -> (Vec<f32>, usize, usize) {
        let (ho, wo) = (
            (h + 2 * pad - k) / stride + 1,
            (w + 2 * pad - k) / stride + 1,
        );
        let mut y = vec![0f32; cout * ho * wo];
        for o in 0..cout {
            for oy in 0..ho {
                for ox in 0..wo {
                    let mut acc = b[o] as f64;
                    for i in 0..cin {
                        for ky in 0..k {
                            for kx in 0..k {
                                let iy = (oy * stride + ky) as isize - pad as isize;
                                let ix = (ox * stride + kx) as isize - pad as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                    continue;
                                }
                                acc += wt[((o * cin + i) * k + ky) * k + kx] as f64
                                    * x[(i * h + iy as usize) * w + ix as usize] as f64;
                            }
                        }
                    }
                    y[(o * ho + oy) * wo + ox] = acc as f32;
                }
            }
        }
        (y, ho, wo)
    }
    let relu = |v: Vec<f32>| v.into_iter().map(|a| a.max(0.0)).collect::<Vec<_>>();
    let add = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<_>>();
    let (w, w2, s) = (c.width, c.width * 2, c.image_size);
    let (x, h, ww) = conv(
        x,
        (3, s, s),
        (&p["stem.weight"], &p["stem.bias"]),
        w,
        (4, 4, 0),
    );
    let x = relu(x);
    let (y, _, _) = conv(
        &x,
        (w, h, ww),
        (&p["res1.0.weight"], &p["res1.0.bias"]),
        w,
        (3, 1, 1),
    );
    let (y, _, _) = conv(
        &relu(y),
        (w, h, ww),
        (&p["res1.1.weight"], &p["res1.1.bias"]),
        w,
        (3, 1, 1),
    );
    let x = relu(add(&y, &x));
    let (x, h, ww) = conv(
        &x,
        (w, h, ww),
        (&p["down.weight"], &p["down.bias"]),
        w2,
        (2, 2, 0),
    );
    let x = relu(x);
    let (y, _, _) = conv(
        &x,
        (w2, h, ww),
        (&p["res2.0.weight"], &p["res2.0.bias"]),
        w2,
        (3, 1, 1),
    );
    let (y, _, _) = conv(
        &relu(y),
        (w2, h, ww),
        (&p["res2.1.weight"], &p["res2.1.bias"]),
        w2,
        (3, 1, 1),
    );
    let x = relu(add(&y, &x));
    let pooled: Vec<f32> = (0..w2)
        .map(|ch| x[ch * h * ww..(ch + 1) * h * ww].iter().sum::<f32>() / (h * ww) as f32)
        .collect();
    (0..c.classes)
        .map(|k| {
            p["head.bias"][k]
                + (0..w2)
                    .map(|i| p["head.weight"][k * w2 + i] * pooled[i])
                    .sum::<f32>()
        })
        .collect()
}

#[test]
fn matches_a_direct_convolution_reference() {
    let dev = Cpu::default();
    let c = ModelConfig {
        image_size: 24,
        classes: 6,
        width: 4,
    };
    let m = ImageClassifier::from_seed(&dev, c, 11).unwrap();
    let params = seeded_params(&c, 11);
    let x = image(5, 3 * 24 * 24);
    let got = &m.forward_flat(x.clone(), 1)[0];
    let want = naive(&c, &params, &x);
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "got {got:?}\nwant {want:?}"
        );
    }
}
