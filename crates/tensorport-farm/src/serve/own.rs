//! A model of the library user's own, served by the same server: the producers, batching,
//! slot hand-back and fault handling are the server's; the model sees a batch of images in host
//! memory and answers one row of scores per image.

use tensorport_dfdx::dfdx::prelude::{Cpu, HasShape};
use tensorport_dfdx::{Classify, Tensor4};

/// A batch the server gathered for a model on the CPU: `rows` images of `shape` (`[C, H, W]`,
/// NCHW, normalised `f32`), one after another in `pixels`.
#[derive(Debug, Clone, Copy)]
pub struct HostBatch<'a> {
    pub pixels: &'a [f32],
    pub rows: usize,
    pub shape: [usize; 3],
}

impl<'a> HostBatch<'a> {
    /// Image `i`'s `C * H * W` values.
    pub fn image(&self, i: usize) -> &'a [f32] {
        let n = self.shape.iter().product::<usize>();
        &self.pixels[i * n..(i + 1) * n]
    }
}

/// A network the server runs on the CPU: a batch in, one row of scores per image out, row `i`
/// for image `i` (its argmax becomes the line's `class`). Each model worker
/// (`ServeConfig::workers`) has its own, made by the function given to [`run_with`](super::run_with)
/// on the worker's thread. An error fails that batch's requests with its message, and so does
/// a panic; the server goes on.
pub trait HostModel: Send {
    fn run(&mut self, batch: HostBatch<'_>) -> Result<Vec<Vec<f32>>, String>;
}

/// A [`HostModel`] as the batch loop's model.
pub(super) struct Own(pub(super) Box<dyn HostModel>);

impl Classify<Cpu> for Own {
    fn classify(&mut self, x: Tensor4<Cpu>) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        let &(rows, c, h, w) = x.shape();
        let pixels = x.as_vec();
        let batch = HostBatch {
            pixels: &pixels,
            rows,
            shape: [c, h, w],
        };
        // The model is the caller's: a panic in it fails this batch, not the server.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.run(batch)));
        let scores = match ran {
            Ok(r) => r.map_err(tensorport_dfdx::Error::Model)?,
            Err(p) => {
                let why = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                return Err(tensorport_dfdx::Error::Model(format!("it panicked: {why}")));
            }
        };
        if scores.len() != rows {
            return Err(tensorport_dfdx::Error::Model(format!(
                "the model answered {} rows for a batch of {rows}",
                scores.len()
            )));
        }
        Ok(scores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorport_dfdx::dfdx::prelude::TensorFromVec;

    /// Scores each image with its first value; panics on a batch of three, errs on four.
    struct Picky;
    impl HostModel for Picky {
        fn run(&mut self, b: HostBatch<'_>) -> Result<Vec<Vec<f32>>, String> {
            match b.rows {
                3 => panic!("three is too many"),
                4 => Err("four is wrong".into()),
                5 => Ok(vec![vec![0.0]]),
                _ => Ok((0..b.rows).map(|i| vec![b.image(i)[0]]).collect()),
            }
        }
    }

    #[test]
    fn a_models_error_or_panic_fails_its_batch_only() {
        let dev = Cpu::default();
        let mut m = Own(Box::new(Picky));
        let batch = |rows: usize| {
            let data: Vec<f32> = (0..rows * 2 * 2 * 3).map(|v| v as f32).collect();
            dev.tensor_from_vec(data, (rows, 3, 2, 2))
        };
        assert_eq!(m.classify(batch(2)).unwrap(), vec![vec![0.0], vec![12.0]]);
        let e = m.classify(batch(3)).unwrap_err().to_string();
        assert!(e.contains("panicked: three is too many"), "{e}");
        let e = m.classify(batch(4)).unwrap_err().to_string();
        assert!(e.contains("four is wrong"), "{e}");
        let e = m.classify(batch(5)).unwrap_err().to_string();
        assert!(e.contains("1 rows for a batch of 5"), "{e}");
        // And it goes on.
        assert_eq!(m.classify(batch(1)).unwrap(), vec![vec![0.0]]);
    }
}
