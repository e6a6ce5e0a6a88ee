//! A model of the library user's own, served by the same server: the producers, batching,
//! slot hand-back and fault handling are the server's; the model sees a batch of images in host
//! memory (the rows the batcher wrote, no copy) and answers one row of scores per image.

use super::engine::{Engine, EngineError, HostInput, Input, Submitted};

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

/// A [`HostModel`] as the server's engine: host rows, one allocation reused.
pub(super) struct Own {
    pub(super) model: Box<dyn HostModel>,
    pub(super) shape: [usize; 3],
    pub(super) rows: Vec<f32>,
}

impl Own {
    pub(super) fn new(model: Box<dyn HostModel>, shape: [usize; 3]) -> Own {
        Own {
            model,
            shape,
            rows: Vec::new(),
        }
    }

    fn run(&mut self, h: &HostInput) -> Result<Vec<Vec<f32>>, EngineError> {
        let batch = HostBatch {
            pixels: h.pixels(),
            rows: h.rows(),
            shape: h.shape(),
        };
        // The model is the caller's: a panic in it fails this batch, not the server.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.model.run(batch)));
        let scores = match ran {
            Ok(r) => r.map_err(EngineError::Model)?,
            Err(p) => {
                let why = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                return Err(EngineError::Model(format!("it panicked: {why}")));
            }
        };
        if scores.len() != h.rows() {
            return Err(EngineError::Model(format!(
                "the model answered {} rows for a batch of {}",
                scores.len(),
                h.rows()
            )));
        }
        Ok(scores)
    }
}

impl Engine for Own {
    fn max_batch(&self) -> usize {
        crate::MAX_BATCH
    }

    fn lend(&mut self, rows: usize) -> Result<Input, EngineError> {
        let buffer = std::mem::take(&mut self.rows);
        Ok(Input::Host(HostInput::new(buffer, rows, self.shape)))
    }

    fn submit(&mut self, input: Input) -> Result<Submitted, EngineError> {
        let h = input.into_host("a model on the CPU")?;
        if !h.is_full() {
            return Err(EngineError::Failed(
                "a batch with rows left unwritten".into(),
            ));
        }
        let r = self.run(&h);
        self.rows = h.into_pixels();
        r.map(Submitted::Ready)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorport_vision::request::Pixels;

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

    fn run(m: &mut Own, rows: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let Ok(mut h) = m.lend(rows).unwrap().into_host("a test") else {
            panic!("host rows")
        };
        for i in 0..rows {
            let image: Vec<f32> = (0..12).map(|v| (i * 12 + v) as f32).collect();
            h.push(Pixels::F32(&image)).unwrap();
        }
        match m.submit(Input::Host(h))? {
            Submitted::Ready(s) => Ok(s),
            Submitted::InFlight => panic!("a model of one's own answers at once"),
        }
    }

    #[test]
    fn a_models_error_or_panic_fails_its_batch_only() {
        let mut m = Own::new(Box::new(Picky), [3, 2, 2]);
        assert_eq!(run(&mut m, 2).unwrap(), vec![vec![0.0], vec![12.0]]);
        let e = run(&mut m, 3).unwrap_err();
        assert!(matches!(e, EngineError::Model(_)));
        assert!(e.to_string().contains("panicked: three is too many"), "{e}");
        let e = run(&mut m, 4).unwrap_err().to_string();
        assert!(e.contains("four is wrong"), "{e}");
        let e = run(&mut m, 5).unwrap_err().to_string();
        assert!(e.contains("1 rows for a batch of 5"), "{e}");
        // And it goes on, its rows reused.
        assert_eq!(run(&mut m, 1).unwrap(), vec![vec![0.0]]);
        assert!(m.rows.capacity() >= 5 * 12);
    }

    #[test]
    fn a_gpu_batch_or_a_short_one_is_refused() {
        let mut m = Own::new(Box::new(Picky), [3, 2, 2]);
        let Ok(h) = m.lend(2).unwrap().into_host("a test") else {
            panic!("host rows")
        };
        let e = m.submit(Input::Host(h)).unwrap_err();
        assert!(e.to_string().contains("unwritten"), "{e}");
    }
}
