//! The remote producer's preparing thread: inputs become Arrow batches of tensors, written in
//! place into the batch's (aligned) buffer.

use std::path::PathBuf;

use arrow_array::RecordBatch;
use arrow_buffer::MutableBuffer;
use tensorport_bridge::schema::TensorLayout;
use tensorport_vision::{list_images, Planes, Preprocessor, Source, Transform};
use tokio::sync::mpsc;

use tensorport_farm::config::Pixels;

use super::{CliError, CliResult};

/// What to prepare.
pub struct Plan {
    pub inputs: Vec<(u64, Source)>,
    pub layout: TensorLayout,
    pub transform: Transform,
    pub pixels: Pixels,
    /// Prepare the first input once and send copies (or zeros of `layout`'s shape if `raw`).
    pub ready: bool,
    /// The tensors are not images: `ready` copies of zeros.
    pub raw: bool,
    /// With `ready`: each batch names its inputs and shares one copy of the ready tensor
    /// ([`Prepared::Ready`]) instead of carrying a copy per input (a NIXL producer's slots hold
    /// the tensor already).
    pub shared_ready: bool,
    pub batch: usize,
}

/// One step of the preparing thread's output.
pub enum Prepared {
    /// Tensors ready to send, with each one's index and input.
    Batch {
        batch: RecordBatch,
        items: Vec<(u64, String)>,
    },
    /// Inputs whose tensor is the one ready tensor ([`Plan::shared_ready`]).
    Ready {
        items: Vec<(u64, String)>,
        tensor: std::sync::Arc<Vec<u8>>,
    },
    /// An input that could not be prepared.
    Failed {
        index: u64,
        input: String,
        error: String,
    },
}

impl Plan {
    /// The inputs: a folder's images, or N generated ones.
    pub fn inputs(dir: Option<&PathBuf>, synthetic: Option<u64>) -> CliResult<Vec<(u64, Source)>> {
        Ok(match (dir, synthetic) {
            (Some(d), _) => list_images(d)?
                .into_iter()
                .enumerate()
                .map(|(i, p)| (i as u64, Source::File(p)))
                .collect(),
            (None, Some(n)) => (0..n).map(|i| (i, Source::Synthetic(i))).collect(),
            (None, None) => {
                return Err(CliError::usage(
                    "say what to send: --input DIR or --synthetic N",
                ))
            }
        })
    }

    /// Starts the thread; batches arrive on the channel, at most `queue` ahead.
    pub fn start(self, queue: usize) -> mpsc::Receiver<Prepared> {
        let (tx, rx) = mpsc::channel(queue.max(1));
        std::thread::Builder::new()
            .name("tp-bridge-prepare".into())
            .spawn(move || self.run(tx))
            .expect("spawn the preparing thread");
        rx
    }

    fn planes<'a>(&self, out: &'a mut [u8]) -> Planes<'a> {
        match self.pixels {
            Pixels::U8 => Planes::U8(out),
            // The batch buffer is 64-byte aligned and every tensor a multiple of 4 bytes long.
            Pixels::F32 => Planes::F32(bytemuck::cast_slice_mut(out)),
        }
    }

    fn run(self, tx: mpsc::Sender<Prepared>) {
        if self.ready && self.shared_ready {
            return self.run_shared(tx);
        }
        let bytes = self.layout.bytes();
        let mut prep = Preprocessor::new(self.transform);
        let mut ready: Option<Vec<u8>> = None;
        let batch = self.batch.max(1);
        for chunk in self.inputs.chunks(batch) {
            let mut buf = MutableBuffer::from_len_zeroed(chunk.len() * bytes);
            let mut items = Vec::with_capacity(chunk.len());
            for (index, source) in chunk {
                let k = items.len();
                let out = &mut buf.as_slice_mut()[k * bytes..(k + 1) * bytes];
                let r = match (&ready, self.ready) {
                    (Some(px), _) => {
                        out.copy_from_slice(px);
                        Ok(())
                    }
                    (None, true) if self.raw => {
                        ready = Some(out.to_vec());
                        Ok(())
                    }
                    (None, is_ready) => {
                        let r = prep.prepare_into(source, self.planes(out));
                        if is_ready && r.is_ok() {
                            ready = Some(out.to_vec());
                        }
                        r
                    }
                };
                match r {
                    Ok(()) => items.push((*index, source.to_string())),
                    Err(e) => {
                        if !send_failed(&tx, *index, source, &e) {
                            return;
                        }
                    }
                }
            }
            if items.is_empty() {
                continue;
            }
            buf.truncate(items.len() * bytes);
            let ids: Vec<u64> = items.iter().map(|(i, _)| *i).collect();
            let batch = self
                .layout
                .batch(&ids, buf.into())
                .expect("a batch of whole tensors of the layout");
            if tx.blocking_send(Prepared::Batch { batch, items }).is_err() {
                return;
            }
        }
    }

    /// [`Plan::run`] for [`Plan::shared_ready`]: the first input that prepares (or zeros, if
    /// `raw`) is the tensor of every input.
    fn run_shared(self, tx: mpsc::Sender<Prepared>) {
        let bytes = self.layout.bytes();
        let mut ready = self.raw.then(|| std::sync::Arc::new(vec![0u8; bytes]));
        let mut prep = Preprocessor::new(self.transform);
        for chunk in self.inputs.chunks(self.batch.max(1)) {
            let mut items = Vec::with_capacity(chunk.len());
            for (index, source) in chunk {
                if ready.is_none() {
                    // f32 storage: the planes are cast from it, so it must be 4-byte aligned.
                    let mut store = vec![0f32; bytes.div_ceil(4)];
                    let out = &mut bytemuck::cast_slice_mut::<f32, u8>(&mut store)[..bytes];
                    if let Err(e) = prep.prepare_into(source, self.planes(out)) {
                        if !send_failed(&tx, *index, source, &e) {
                            return;
                        }
                        continue;
                    }
                    ready = Some(std::sync::Arc::new(out.to_vec()));
                }
                items.push((*index, source.to_string()));
            }
            let Some(tensor) = ready.clone().filter(|_| !items.is_empty()) else {
                continue;
            };
            if tx.blocking_send(Prepared::Ready { items, tensor }).is_err() {
                return;
            }
        }
    }
}

/// Sends the line of an input that could not be prepared; false once nobody receives.
fn send_failed(
    tx: &mpsc::Sender<Prepared>,
    index: u64,
    source: &Source,
    e: &dyn std::fmt::Display,
) -> bool {
    let failed = Prepared::Failed {
        index,
        input: source.to_string(),
        error: e.to_string(),
    };
    tx.blocking_send(failed).is_ok()
}
