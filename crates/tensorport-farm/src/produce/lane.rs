//! The GPU producer's CPU lane: inputs the GPU's decoder does not take (progressive JPEGs on
//! the hardware engines, PNGs, a batch nvJPEG refused) are prepared on threads of their own,
//! each with its own preprocessor, while the producer goes on decoding its next batches on the
//! GPU. Each input travels with a page-locked slot that its thread writes the pixels into; back
//! on the producer's thread it is copied into a device buffer by DMA (the slot waits for that
//! copy before it is written again) and submitted. At most `capacity` inputs are in the lane at
//! once: a producer with a full lane takes what it has finished before it takes more inputs.

use std::collections::HashSet;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tensorport_cuda::PinnedBuffer;
use tensorport_vision::{Preprocessor, Source};

use crate::config::Pixels;
use crate::record::{ms, StageTimes};

/// An input on its way through the lane.
pub(super) struct Job {
    pub index: u64,
    pub source: Source,
    pub bytes: Option<Vec<u8>>,
    pub st: StageTimes,
    /// Where its pixels go: at least `image_bytes`.
    pub slot: PinnedBuffer,
}

/// An input back from the lane: its pixels are in its slot, or it could not be prepared.
pub(super) struct Done {
    pub job: Job,
    pub prepared: std::result::Result<(), String>,
}

pub(super) struct Lane {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Done>,
    threads: Vec<JoinHandle<()>>,
    /// Indices of the inputs in the lane.
    inside: HashSet<u64>,
    capacity: usize,
}

impl Lane {
    /// Starts one thread per preprocessor, each preparing `image_bytes` of `pixels` per input.
    pub fn start(
        preps: Vec<Preprocessor>,
        pixels: Pixels,
        image_bytes: usize,
    ) -> std::io::Result<Lane> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let (tx, done) = mpsc::channel();
        let capacity = 2 * preps.len().max(1);
        let threads = preps
            .into_iter()
            .enumerate()
            .map(|(k, mut prep)| {
                let (rx, tx) = (rx.clone(), tx.clone());
                std::thread::Builder::new()
                    .name(format!("cpu-lane-{k}"))
                    .spawn(move || loop {
                        let next = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok(mut job) = next else { break };
                        let prepared = prepare(&mut prep, pixels, image_bytes, &mut job);
                        if tx.send(Done { job, prepared }).is_err() {
                            break;
                        }
                    })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Lane {
            jobs: Some(jobs),
            done,
            threads,
            inside: HashSet::new(),
            capacity,
        })
    }

    /// Inputs in the lane.
    pub fn len(&self) -> usize {
        self.inside.len()
    }

    /// How many inputs the lane holds at most (the slots its producer needs).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn is_full(&self) -> bool {
        self.inside.len() >= self.capacity
    }

    /// Whether input `index` is in the lane.
    pub fn holds(&self, index: u64) -> bool {
        self.inside.contains(&index)
    }

    pub fn send(&mut self, job: Job) {
        self.inside.insert(job.index);
        let jobs = self.jobs.as_ref().expect("the lane is open until dropped");
        // The threads only end when `jobs` is dropped (or a send of theirs fails, which needs
        // `done` dropped): both live as long as the lane.
        let _ = jobs.send(job);
    }

    /// What the lane has finished: everything there now, after waiting up to `wait` for the
    /// first if nothing is.
    pub fn finished(&mut self, wait: Duration) -> Vec<Done> {
        let mut out = Vec::new();
        let first = match wait.is_zero() {
            true => self.done.try_recv().ok(),
            false => self.done.recv_timeout(wait).ok(),
        };
        out.extend(first);
        out.extend(self.done.try_iter());
        for d in &out {
            self.inside.remove(&d.job.index);
        }
        out
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Prepares `job` into the first `image_bytes` of its slot, timing the steps into `job.st`.
fn prepare(
    prep: &mut Preprocessor,
    pixels: Pixels,
    image_bytes: usize,
    job: &mut Job,
) -> std::result::Result<(), String> {
    let px = job
        .slot
        .as_mut_slice()
        .get_mut(..image_bytes)
        .ok_or("the lane's slot is smaller than an image")?;
    let planes = pixels.planes(px).map_err(|e| e.to_string())?;
    let r = match (&job.bytes, &job.source) {
        (Some(b), Source::File(path)) => prep.prepare_encoded_into(b, path, planes),
        _ => prep.prepare_into(&job.source, planes),
    };
    let s = prep.last_stages();
    job.st.decode_ms = ms(s.decode);
    job.st.resize_ms = ms(s.resize);
    job.st.normalise_ms = ms(s.normalise);
    r.map_err(|e| e.to_string())
}
