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
/// on the worker's thread. An error fails that batch's requests with its message; the server
/// goes on.
pub trait HostModel: Send {
    fn run(&mut self, batch: HostBatch<'_>) -> Result<Vec<Vec<f32>>, String>;
}

/// A [`HostModel`] as the batch loop's model.
pub(super) struct Own(pub(super) Box<dyn HostModel>);

impl Classify<Cpu> for Own {
    fn classify(&mut self, x: Tensor4<Cpu>) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        let &(rows, c, h, w) = x.shape();
        let pixels = x.as_vec();
        let scores = self
            .0
            .run(HostBatch {
                pixels: &pixels,
                rows,
                shape: [c, h, w],
            })
            .map_err(tensorport_dfdx::Error::Model)?;
        if scores.len() != rows {
            return Err(tensorport_dfdx::Error::Model(format!(
                "the model answered {} rows for a batch of {rows}",
                scores.len()
            )));
        }
        Ok(scores)
    }
}
