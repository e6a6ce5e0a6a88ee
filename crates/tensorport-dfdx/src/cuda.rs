//! Batches on the GPU without a CPU copy: each request's bytes go straight into its row of the
//! model input — a DMA from its (registered, pinned) host slot, or a device-to-device copy from
//! a GPU producer's buffer after waiting on its fence. Needs the build-time dfdx patch that
//! exposes a tensor's device address (`scripts/build-gpu.sh`).

use dfdx::prelude::*;
use tensorport::{DType, Request};
use tensorport_cuda::{Gatherer, GpuNormaliser, Place, Stream};

use crate::{check_shape, Error, Stacked, Tensor4};

thread_local! {
    /// Batch inputs a stream that never drained may still write (see `gather_on_device`).
    static QUARANTINE: std::cell::RefCell<Vec<Tensor4<Cuda>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Builds the `[B, C, H, W]` model input on `dev` from `reqs`, copying on `stream` (which must
/// belong to the same device and primary context) with `gatherer`'s
/// [`Gatherer::gather_rows`], and waits for the copies, so the requests' slots and buffers may
/// be released as soon as this returns. `u8` images are copied into `norm`'s staging buffer
/// and normalised into their rows by its kernel. Requests that do not fit the model are listed
/// in `rejected`; so is a device tensor whose producer did not signal it ready within
/// `fence_timeout` ([`Error::FenceTimeout`]: its row is zeroed, and its producer's session
/// should end). If the copy stream does not drain, `reqs` is emptied (the requests are held
/// for good) and so is the input.
pub fn gather_on_device(
    dev: &Cuda,
    stream: &Stream,
    norm: &mut GpuNormaliser,
    gatherer: &Gatherer,
    reqs: &mut Vec<Request>,
    shape: [usize; 3],
    fence_timeout: std::time::Duration,
) -> Stacked<Cuda> {
    let mut used = Vec::with_capacity(reqs.len());
    let mut dtypes = Vec::with_capacity(reqs.len());
    let mut rejected = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        match check_shape(r, shape) {
            Ok(dtype) => {
                used.push(i);
                dtypes.push(dtype);
            }
            Err(e) => rejected.push((i, e)),
        }
    }
    if QUARANTINE.with(|q| !q.borrow().is_empty()) {
        // Its copies may still run: the stream, the staging buffer and the normaliser are
        // never used again.
        let msg = "this model worker's copy stream stalled on an earlier batch; it takes no more GPU batches (restart the server)";
        rejected.extend(used.drain(..).map(|i| (i, Error::Device(msg.into()))));
    }
    if used.is_empty() {
        return Stacked {
            input: None,
            used,
            rejected,
        };
    }
    let plane = shape[1] * shape[2];
    let row = shape.iter().product::<usize>() * 4;
    let row_u8 = row / 4;
    let input: Tensor4<Cuda> = dev.zeros_like(&(used.len(), shape[0], shape[1], shape[2]));
    let device_err = |e: String| Error::Device(e);
    // The batch's error, and whether the stream stalled (the input must then be held).
    let gathered = (|| -> Result<_, (String, bool)> {
        let failed = |e: String| (e, false);
        // The zeros are written on dfdx's stream; our copies must come after them.
        dev.try_synchronize()
            .map_err(|e| failed(format!("{e:?}")))?;
        let gpu = stream.gpu();
        // SAFETY: `input` is ours alone, `used.len()` rows of `row` bytes, and is never freed
        // should the stream stall (quarantined below).
        let rows = unsafe {
            tensorport_cuda::Rows::from_raw(gpu, input.tensorport_device_ptr(), used.len() * row)
        };
        // 8-bit images land in the staging buffer at their row's place, and each run of
        // consecutive 8-bit rows is normalised into the batch by one kernel launch (usually one
        // per batch: producers hand over one kind).
        let staging = match dtypes.contains(&DType::U8) {
            true => {
                let buf = norm
                    .staging(used.len() * row_u8)
                    .map_err(|e| failed(e.to_string()))?;
                // SAFETY: the normaliser's staging buffer, which only this worker's batches
                // use, one at a time; a stalled stream ends this worker's GPU batches (its
                // normaliser is never used again).
                Some(unsafe { tensorport_cuda::Rows::from_raw(gpu, buf.ptr(), buf.len()) })
            }
            false => None,
        };
        let mut places = vec![None; reqs.len()];
        for (k, (&i, &dtype)) in used.iter().zip(&dtypes).enumerate() {
            places[i] = Some(match (dtype, &staging) {
                (DType::U8, Some(s)) => Place {
                    rows: s,
                    offset: k * row_u8,
                    len: row_u8,
                },
                _ => Place {
                    rows: &rows,
                    offset: k * row,
                    len: row,
                },
            });
        }
        let normalise = |stream: &Stream| -> tensorport_cuda::Result<()> {
            let Some(s) = &staging else { return Ok(()) };
            let mut k = 0;
            while k < dtypes.len() {
                if dtypes[k] != DType::U8 {
                    k += 1;
                    continue;
                }
                let run = dtypes[k..].iter().take_while(|&&d| d == DType::U8).count();
                // SAFETY: rows k..k+run of the staging buffer hold those images' bytes (copied
                // just before, on the same stream), and rows k..k+run of `input` are theirs.
                unsafe {
                    norm.normalise(
                        s.addr() + (k * row_u8) as u64,
                        rows.addr() + (k * row) as u64,
                        plane,
                        run,
                        stream,
                    )?
                };
                k += run;
            }
            Ok(())
        };
        gatherer
            .gather_rows(stream, reqs, &places, fence_timeout, normalise)
            .map_err(|e| {
                let stalled = matches!(e, tensorport_cuda::RowsError::Stalled(_));
                (e.to_string(), stalled)
            })
    })();
    match gathered {
        Ok(g) => {
            // A late tensor's row stays in the input (zeroed), so `used` still lines up row by
            // row; its request is failed.
            for i in g.late {
                rejected.push((
                    i,
                    Error::FenceTimeout {
                        request_id: reqs[i].request_id(),
                        producer: reqs[i].producer().to_string(),
                        timeout: fence_timeout,
                    },
                ));
            }
            rejected.extend(g.misfits.into_iter().map(|(i, m)| (i, device_err(m))));
            Stacked {
                input: Some(input),
                used,
                rejected,
            }
        }
        Err((msg, stalled)) => {
            if stalled {
                // Copies may still write `input`: it is never freed or reused (held by this
                // thread, as dfdx's CUDA tensors cannot leave it).
                QUARANTINE.with(|q| q.borrow_mut().push(input));
            }
            rejected.extend(used.drain(..).map(|i| (i, Error::Device(msg.clone()))));
            Stacked {
                input: None,
                used,
                rejected,
            }
        }
    }
}

/// Signals "released" on `stream` for the device tensors among `reqs`, which a sink answers
/// without reading them: each producer's next write of its buffer waits for that signal on its
/// GPU, so a sink that skipped it would stall every GPU producer once its buffers were used.
/// `stream` must belong to `gatherer`'s GPU (checked), the one the server's importer opened the
/// tensors in.
pub fn release_unread(
    stream: &Stream,
    gatherer: &Gatherer,
    reqs: &[Request],
) -> std::result::Result<(), String> {
    let tensors: Vec<&tensorport::DeviceTensor> = reqs.iter().filter_map(|r| r.device()).collect();
    if tensors.is_empty() {
        return Ok(());
    }
    // SAFETY: `stream` is of the gatherer's GPU (`release_all` refuses another's), where the
    // server's importer opened its producers' buffers; the releases read nothing.
    unsafe { gatherer.release_all(stream, &tensors) }.map_err(|e| e.to_string())
}
