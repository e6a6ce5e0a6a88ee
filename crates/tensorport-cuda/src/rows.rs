//! A batch of requests gathered into rows of device memory, under [`crate::RowBatcher`]:
//! [`Gatherer::gather_rows`] copies each request — a host slot by DMA, a producer's device
//! tensor after its fence — into its [`Place`], waits for the copies (letting no producer that
//! never signals stall the stream), and only then gives the batch back, so a slot or buffer is
//! released only after the copies that read it have run. If the stream does not drain, the
//! requests are held for good ([`crate::quarantine`]) instead of released, and the error says
//! the rows' memory must be held too. [`Rows`] borrow what owns the memory
//! ([`crate::DeviceMemoryMut`]), so nothing else touches it while they live.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use tensorport::{DeviceTensor, Request};

use crate::{DeviceBuffer, DeviceMemoryMut, DevicePtr, Error, Gatherer, Gpu, Result, Stream};

/// Device memory a batch is gathered into: `len` bytes at `addr` in a GPU's context, which
/// nothing else uses while the `Rows` lives (it borrows what owns the memory).
#[derive(Debug)]
pub(crate) struct Rows<'a> {
    gpu: Arc<Gpu>,
    addr: DevicePtr,
    len: usize,
    _owner: PhantomData<&'a mut ()>,
}

impl<'a> Rows<'a> {
    /// The memory of `owner`, which only its owner uses ([`DeviceMemoryMut`]), borrowed for
    /// as long as the rows live.
    pub(crate) fn owned<T: DeviceMemoryMut>(gpu: &Arc<Gpu>, owner: &'a mut T) -> Rows<'a> {
        let region = owner.device_memory();
        Rows {
            gpu: gpu.clone(),
            addr: region.addr,
            len: region.len,
            _owner: PhantomData,
        }
    }

    /// A buffer of this crate that only the borrower uses meanwhile (a batcher's staging
    /// buffer, behind its `&mut self`).
    pub(crate) fn of_buffer(buf: &'a DeviceBuffer) -> Rows<'a> {
        Rows {
            gpu: buf.gpu().clone(),
            addr: buf.ptr(),
            len: buf.len(),
            _owner: PhantomData,
        }
    }

    /// The device address of the first byte.
    pub(crate) fn addr(&self) -> DevicePtr {
        self.addr
    }

    /// The size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// Where one request of a batch goes: the first `len` bytes of the request are copied to
/// `offset..offset + len` of `rows`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Place<'a> {
    /// The destination memory.
    pub rows: &'a Rows<'a>,
    /// Byte offset into `rows`.
    pub offset: usize,
    /// Bytes to copy: a host request must have at least this many, a device tensor exactly.
    pub len: usize,
}

/// What [`Gatherer::gather_rows`] did with a batch, by index into the batch.
#[derive(Debug, Default)]
pub(crate) struct Gathered {
    /// Device tensors whose producers did not signal them ready within the fence timeout:
    /// their places hold zeros; fail their requests and end their sessions
    /// (`Request::fail_and_end_session` with `ErrorCode::FenceTimeout`).
    pub late: Vec<usize>,
    /// Requests not copied because they do not fit their place, and why; their places are
    /// left as they were.
    pub misfits: Vec<(usize, String)>,
}

/// Why [`Gatherer::gather_rows`] gave up on a batch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum RowsError {
    /// A place outside its rows, or rows or a stream of another GPU: nothing was copied.
    #[error("{0}")]
    Misplaced(String),
    /// The copies failed and the stream ran dry: the batch is the caller's to fail.
    #[error("{0}")]
    Failed(Error),
    /// The stream did not drain: the batch's requests are held until the process ends (never
    /// released: a copy may still read them), the batch given back empty, and the rows' memory
    /// must be held as well; the stream takes no more batches.
    #[error(
        "{0}; the copy stream did not drain, so the batch is quarantined (held, never reused)"
    )]
    Stalled(Error),
}

impl Gatherer {
    /// Copies request `i` of `batch` into `places[i]` (`None`: left out) on `stream`, runs
    /// `then` on the stream (kernels that read the rows: a normalisation), and waits for all of
    /// it, at most `fence_timeout` per producer that does not signal (see
    /// [`Gatherer::synchronize`]). When it returns `Ok` or [`RowsError::Failed`], no copy reads
    /// the requests any more: answer or fail them. With [`RowsError::Stalled`] they are gone
    /// from `batch` (held for good).
    pub(crate) fn gather_rows(
        &self,
        stream: &Stream,
        batch: &mut Vec<Request>,
        places: &[Option<Place<'_>>],
        fence_timeout: Duration,
        then: impl FnOnce(&Stream) -> Result<()>,
    ) -> std::result::Result<Gathered, RowsError> {
        if places.len() != batch.len() {
            return Err(RowsError::Misplaced(format!(
                "{} places for a batch of {}",
                places.len(),
                batch.len()
            )));
        }
        if !Arc::ptr_eq(stream.gpu(), &self.gpu) {
            return Err(RowsError::Misplaced(
                "the stream belongs to another GPU than the gatherer".into(),
            ));
        }
        let mut gathered = Gathered::default();
        // The copies, and each device tensor's place as (address, length, index in the batch).
        let (outcome, device_places) = {
            let mut host: Vec<(&[u8], DevicePtr)> = Vec::new();
            let mut device: Vec<(&DeviceTensor, DevicePtr)> = Vec::new();
            let mut device_places = Vec::new();
            for (i, (r, place)) in batch.iter().zip(places).enumerate() {
                let Some(p) = place else { continue };
                if !Arc::ptr_eq(&p.rows.gpu, &self.gpu) {
                    return Err(RowsError::Misplaced(format!(
                        "request {i}'s place is memory of another GPU"
                    )));
                }
                if p.offset
                    .checked_add(p.len)
                    .is_none_or(|end| end > p.rows.len)
                {
                    return Err(RowsError::Misplaced(format!(
                        "request {i}'s place ({} bytes at {}) is outside its {} bytes of rows",
                        p.len, p.offset, p.rows.len
                    )));
                }
                let dst = p.rows.addr.offset(p.offset);
                match r.device() {
                    None if r.bytes().len() < p.len => gathered.misfits.push((
                        i,
                        format!("{} bytes for a row of {}", r.bytes().len(), p.len),
                    )),
                    None => host.push((&r.bytes()[..p.len], dst)),
                    Some(t) if t.len() as usize != p.len => gathered.misfits.push((
                        i,
                        format!(
                            "a device tensor of {} bytes for a row of {}",
                            t.len(),
                            p.len
                        ),
                    )),
                    Some(t) => {
                        device.push((t, dst));
                        device_places.push((dst, p.len, i));
                    }
                }
            }
            let enqueued = (|| -> Result<()> {
                for (bytes, dst) in &host {
                    // SAFETY: `dst..dst + len` lies inside its `Rows` (checked above), memory
                    // of this context that nothing else uses meanwhile (`Rows` borrow its owner); the
                    // slot is a request of `batch`, which is given back only after the stream
                    // has run (below) or held for good.
                    unsafe { stream.copy_host_to_device_async(*dst, bytes)? };
                }
                // SAFETY: as above for the destinations (each tensor's length is its place's);
                // the buffers were bounds-checked against their registrations at import, and
                // the gather orders the copies after their producers' writes.
                unsafe { self.gather(stream, &device)? };
                then(stream)
            })();
            let tensors: Vec<&DeviceTensor> = device.iter().map(|d| d.0).collect();
            let synced = self.synchronize(stream, &tensors, fence_timeout);
            let outcome = match (enqueued, synced) {
                (Ok(()), Ok(late)) => Ok(late),
                (Err(e), _) | (Ok(()), Err(e)) => Err(e),
            };
            (outcome, device_places)
        };
        let late = match outcome {
            Ok(late) => late,
            Err(e) => return Err(self.give_up(stream, batch, e)),
        };
        if late.is_empty() {
            return Ok(gathered);
        }
        // A late tensor's place holds whatever its buffer held: zeros instead.
        let zeros = vec![0u8; late.iter().map(|&j| device_places[j].1).max().unwrap_or(0)];
        for &j in &late {
            let (dst, len, i) = device_places[j];
            // SAFETY: its place, inside its rows as checked; the stream has run dry, and is
            // synchronised right after (before `zeros` is dropped).
            if let Err(e) = unsafe { stream.copy_host_to_device_async(dst, &zeros[..len]) } {
                tracing::warn!("zeroing a late device tensor's row failed: {e}");
            }
            gathered.late.push(i);
        }
        if let Err(e) = stream.synchronize() {
            return Err(self.give_up(stream, batch, e));
        }
        Ok(gathered)
    }

    /// After a failure: the batch is the caller's if the stream has run dry, else held for
    /// good.
    fn give_up(&self, stream: &Stream, batch: &mut Vec<Request>, e: Error) -> RowsError {
        if stream.is_idle().unwrap_or(false) {
            return RowsError::Failed(e);
        }
        crate::quarantine(std::mem::take(batch));
        RowsError::Stalled(e)
    }
}
