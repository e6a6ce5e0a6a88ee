//! A server's batches on the GPU, built and settled in one place: [`RowBatcher::gather`]
//! copies each request into its row of device memory the caller owns — a host slot by DMA, a
//! producer's device tensor after its fence — normalises 8-bit images into their rows with the
//! producers' table, waits for it all, and says what became of each request. The farm's model
//! workers and the Python `Loader`'s server both build their GPU batches with it.
//!
//! What can go wrong with a gathered batch, and what happens then, is decided here:
//! - a request that does not fit its row is a [`Fault::Misfit`]: failed, its row left as it was;
//! - a device tensor whose fence does not come within the timeout is a [`Fault::Late`]: its row
//!   holds zeros, its request is failed and its producer's session ends ([`Fault::answer`]);
//! - copies that fail on a stream that ran dry fail the batch ([`BatchError::Failed`]);
//! - a copy stream that does not drain quarantines the batch: its requests and its memory are
//!   held until the process ends (a copy may still read or write them), and the batcher takes
//!   no more batches ([`BatchError::Stalled`], then [`BatchError::Quarantined`]).

use std::sync::Arc;
use std::time::Duration;

use tensorport::wire::ErrorCode;
use tensorport::{DeviceTensor, Request, Responder};

use crate::rows::{Place, Rows, RowsError};
use crate::{DeviceMemoryMut, Gatherer, Gpu, GpuNormaliser, Result, Stream};

/// How a request's bytes become its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowKind {
    /// Copied as they are (a row's worth of bytes: `f32` images).
    Bytes,
    /// 8-bit planes, a quarter of the row's bytes, normalised into the row's `f32` values
    /// with the batcher's table.
    U8,
}

/// Why a request of a gathered batch got no row of its own, and how it is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// It does not fit its row: failed.
    Misfit(String),
    /// Its device tensor was not signalled ready within the fence timeout: its row holds
    /// zeros; the request is failed and its producer's session ends (it broke the hand-off).
    Late {
        /// The producer's id for the request.
        request_id: u64,
        /// The producer's name.
        producer: String,
        /// The fence timeout it missed.
        timeout: Duration,
    },
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Misfit(why) => f.write_str(why),
            Fault::Late {
                request_id,
                producer,
                timeout,
            } => write!(
                f,
                "request {request_id} from {producer}: its device tensor was not signalled ready within {timeout:?}; its session ends"
            ),
        }
    }
}

impl Fault {
    /// Answers the request `r` (released from its batch) as this fault asks.
    pub fn answer(&self, r: Responder) -> tensorport::Result<()> {
        match self {
            Fault::Misfit(_) => r.fail(self.to_string()),
            Fault::Late { .. } => r.fail_and_end_session(ErrorCode::FenceTimeout, self.to_string()),
        }
    }
}

/// A gathered batch: the memory the rows were written into, and the requests that got no row
/// of their own (by index into the batch).
#[derive(Debug)]
pub struct Filled<T> {
    /// The rows, written and waited for.
    pub memory: T,
    /// The requests to answer with their fault ([`Fault::answer`]).
    pub faults: Vec<(usize, Fault)>,
}

/// Why [`RowBatcher::gather`] took no batch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// The rows do not fit the memory, or the memory is not this GPU's: nothing was copied;
    /// the requests are the caller's to fail.
    #[error("{0}")]
    Refused(String),
    /// The copies failed and the stream ran dry: the requests are the caller's to fail.
    #[error("{0}")]
    Failed(String),
    /// The copy stream did not drain: the requests are gone from the batch and, with the
    /// memory, held until the process ends; the batcher takes no more batches.
    #[error("{0}")]
    Stalled(String),
    /// An earlier batch's copy stream did not drain: this batcher takes no more batches.
    #[error("the copy stream stalled on an earlier batch, which is quarantined: this batcher takes no more GPU batches")]
    Quarantined,
}

/// One consumer's GPU batcher: its copy stream, a stream for releases, its normaliser (for
/// 8-bit images) and its share of the server's [`Gatherer`].
pub struct RowBatcher {
    gpu: Arc<Gpu>,
    stream: Stream,
    /// A stream of its own for [`RowBatcher::release_unread`] (nothing else queues behind it).
    releases: Stream,
    gatherer: Arc<Gatherer>,
    /// `None` without a table; taken (and held for good) when the stream stalls.
    norm: Option<GpuNormaliser>,
    fence_timeout: Duration,
    stalled: bool,
}

impl std::fmt::Debug for RowBatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowBatcher")
            .field("gpu", &self.gpu.ordinal())
            .field("fence_timeout", &self.fence_timeout)
            .field("stalled", &self.stalled)
            .finish_non_exhaustive()
    }
}

impl RowBatcher {
    /// A batcher on `gpu` (the context the server's importer opens producers' buffers in) with
    /// the server's `gatherer`, waiting at most `fence_timeout` for a producer's fence; 8-bit
    /// images are normalised with `table` (`table[c][v]`: byte `v` of channel `c`), and
    /// refused without one.
    pub fn new(
        gpu: &Arc<Gpu>,
        gatherer: Arc<Gatherer>,
        fence_timeout: Duration,
        table: Option<&[[f32; 256]; 3]>,
    ) -> Result<RowBatcher> {
        Ok(RowBatcher {
            gpu: gpu.clone(),
            stream: Stream::new(gpu)?,
            releases: Stream::new(gpu)?,
            norm: table.map(|t| GpuNormaliser::new(gpu, t)).transpose()?,
            gatherer,
            fence_timeout,
            stalled: false,
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The copy stream: work another library enqueued on the rows' memory can be put before
    /// the copies with [`Stream::wait_for_raw`].
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// How long a producer's fence is waited for.
    pub fn fence_timeout(&self) -> Duration {
        self.fence_timeout
    }

    /// Whether a batch is quarantined, so that no more are taken.
    pub fn is_quarantined(&self) -> bool {
        self.stalled
    }

    /// Copies request `i` of `reqs` into row `k` of `memory` (rows of `row` bytes), where
    /// `rows[i]` is `Some` and `k` counts the `Some`s before it; `None` leaves a request out.
    /// Returns once the copies (and normalisations) have run, so the requests' slots and
    /// buffers may be released. With [`BatchError::Stalled`] the requests are gone from
    /// `reqs`.
    pub fn gather<T: DeviceMemoryMut>(
        &mut self,
        mut memory: T,
        reqs: &mut Vec<Request>,
        rows: &[Option<RowKind>],
        row: usize,
    ) -> std::result::Result<Filled<T>, BatchError> {
        if self.stalled {
            return Err(BatchError::Quarantined);
        }
        let refused = |why: String| BatchError::Refused(why);
        if rows.len() != reqs.len() {
            return Err(refused(format!(
                "{} row kinds for a batch of {}",
                rows.len(),
                reqs.len()
            )));
        }
        let count = rows.iter().flatten().count();
        let region = memory.device_memory();
        if count.checked_mul(row).is_none_or(|n| n > region.len) {
            return Err(refused(format!(
                "{count} rows of {row} bytes do not fit {} bytes of device memory",
                region.len
            )));
        }
        self.gpu
            .check_region(region)
            .map_err(|e| refused(e.to_string()))?;
        let row_u8 = row / 4;
        let u8_rows = rows.contains(&Some(RowKind::U8));
        if u8_rows && (!row.is_multiple_of(4) || !row_u8.is_multiple_of(3)) {
            return Err(refused(format!(
                "rows of {row} bytes are not 3 planes of f32 values: 8-bit images cannot be normalised into them"
            )));
        }
        // The memory is the caller's alone (`DeviceMemoryMut`), owned by this call until it
        // returns or, should the stream stall, for good.
        let dst = Rows::owned(&self.gpu, &mut memory);
        // 8-bit images land in the normaliser's staging buffer at their row's place, and each
        // run of consecutive 8-bit rows is normalised into the memory by one kernel launch.
        if u8_rows {
            let Some(norm) = self.norm.as_mut() else {
                return Err(refused(
                    "8-bit images, and this batcher has no table to normalise them".into(),
                ));
            };
            norm.reserve_staging(count * row_u8)
                .map_err(|e| BatchError::Failed(e.to_string()))?;
        }
        let norm = self.norm.as_ref();
        let staging = norm.filter(|_| u8_rows).and_then(GpuNormaliser::staging);
        let mut places = vec![None; reqs.len()];
        let mut kinds = Vec::with_capacity(count);
        for (i, kind) in rows.iter().enumerate() {
            let Some(kind) = *kind else { continue };
            let k = kinds.len();
            kinds.push(kind);
            places[i] = Some(match (kind, &staging) {
                (RowKind::U8, Some(s)) => Place {
                    rows: s,
                    offset: k * row_u8,
                    len: row_u8,
                },
                _ => Place {
                    rows: &dst,
                    offset: k * row,
                    len: row,
                },
            });
        }
        let normalise = |stream: &Stream| -> Result<()> {
            let (Some(s), Some(norm)) = (&staging, norm) else {
                return Ok(());
            };
            let mut k = 0;
            while k < kinds.len() {
                if kinds[k] != RowKind::U8 {
                    k += 1;
                    continue;
                }
                let run = kinds[k..].iter().take_while(|&&d| d == RowKind::U8).count();
                // SAFETY: rows k..k+run of the staging buffer hold those images' bytes (copied
                // just before, on the same stream) and rows k..k+run of the memory are theirs;
                // `gather_rows` waits for the stream before it returns, or holds both for good
                // (below).
                unsafe {
                    norm.normalise_rows(s, k * row_u8, &dst, k * row, row_u8 / 3, run, stream)?
                };
                k += run;
            }
            Ok(())
        };
        let gathered =
            self.gatherer
                .gather_rows(&self.stream, reqs, &places, self.fence_timeout, normalise);
        drop(places);
        drop(staging);
        drop(dst);
        match gathered {
            Ok(g) => {
                let mut faults: Vec<(usize, Fault)> = g
                    .late
                    .into_iter()
                    .map(|i| {
                        let late = Fault::Late {
                            request_id: reqs[i].request_id(),
                            producer: reqs[i].producer().to_string(),
                            timeout: self.fence_timeout,
                        };
                        (i, late)
                    })
                    .collect();
                faults.extend(g.misfits.into_iter().map(|(i, m)| (i, Fault::Misfit(m))));
                Ok(Filled { memory, faults })
            }
            Err(RowsError::Stalled(e)) => {
                // Copies may still write the memory and the staging buffer: never freed or
                // reused; the requests were held by the gatherer.
                self.stalled = true;
                std::mem::forget(memory);
                if let Some(norm) = self.norm.take() {
                    crate::quarantine(norm);
                }
                Err(BatchError::Stalled(format!(
                    "{}; this batcher takes no more GPU batches",
                    RowsError::Stalled(e)
                )))
            }
            Err(RowsError::Misplaced(e)) => Err(BatchError::Refused(e)),
            Err(RowsError::Failed(e)) => Err(BatchError::Failed(e.to_string())),
        }
    }

    /// Signals "released" for the device tensors among `reqs`, which the caller answers
    /// without reading them (each producer's next write of its buffer waits for that signal
    /// on its GPU, so skipping it would stall every GPU producer once its buffers were used).
    pub fn release_unread(&self, reqs: &[Request]) -> Result<()> {
        let tensors: Vec<&DeviceTensor> = reqs.iter().filter_map(|r| r.device()).collect();
        if tensors.is_empty() {
            return Ok(());
        }
        // SAFETY: the stream is of the gatherer's GPU (both made on `self.gpu`; `release_all`
        // also refuses another's), where the server's importer opened its producers'
        // buffers; the releases read nothing.
        unsafe { self.gatherer.release_all(&self.releases, &tensors) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Python package holds a batch's tensor for good when an error says "quarantined":
    /// both errors that mean the memory may still be written must say it.
    #[test]
    fn errors_after_a_stall_say_quarantined() {
        let stalled = RowsError::Stalled(crate::Error::Stalled(Duration::from_secs(1)));
        assert!(stalled.to_string().contains("quarantined"), "{stalled}");
        let later = BatchError::Quarantined.to_string();
        assert!(later.contains("quarantined"), "{later}");
        let failed = BatchError::Failed("copy failed".into()).to_string();
        assert!(!failed.contains("quarantined"), "{failed}");
    }

    #[test]
    fn a_late_tensor_is_named_with_its_producer_and_timeout() {
        let late = Fault::Late {
            request_id: 7,
            producer: "cam-2".into(),
            timeout: Duration::from_millis(1500),
        };
        let text = late.to_string();
        assert!(text.contains("request 7 from cam-2"), "{text}");
        assert!(
            text.contains("1.5s") && text.contains("session ends"),
            "{text}"
        );
        assert_eq!(
            Fault::Misfit("3 bytes for a row of 4".into()).to_string(),
            "3 bytes for a row of 4"
        );
    }
}
