//! Batches on the GPU without a CPU copy: each request's bytes go straight into its row of the
//! model input — a DMA from its (registered, pinned) host slot, or a device-to-device copy from
//! a GPU producer's buffer after waiting on its fence. Needs the build-time dfdx patch that
//! exposes a tensor's device address (`scripts/build-gpu.sh`).

use dfdx::prelude::*;
use tensorport::{DType, Request};
use tensorport_cuda::{Gatherer, GpuNormaliser, Stream};

use crate::{check_shape, Error, Stacked, Tensor4};

thread_local! {
    /// Batch inputs a stream that never drained may still write (see `gather_on_device`).
    static QUARANTINE: std::cell::RefCell<Vec<Tensor4<Cuda>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Builds the `[B, C, H, W]` model input on `dev` from `reqs`, copying on `stream` (which must
/// belong to the same device and primary context), and waits for the copies, so the requests'
/// slots and buffers may be released as soon as this returns. `u8` images are copied into
/// `norm`'s staging buffer and normalised into their rows by its kernel. Device tensors of GPU
/// producers are moved together by `gatherer` (one batched wait, one copy launch, one batched
/// release). Requests that do not fit the model are listed in `rejected`; so is a device
/// tensor whose producer did not signal it ready within `fence_timeout`
/// ([`Error::FenceTimeout`]: its row is zeroed, and its producer's session should end).
pub fn gather_on_device(
    dev: &Cuda,
    stream: &Stream,
    norm: &mut GpuNormaliser,
    gatherer: &Gatherer,
    reqs: &[Request],
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
    // Device tensors' rows (`k`) and requests (`i`), for those whose fences ran late.
    let mut device_rows: Vec<(usize, usize)> = Vec::new();
    let copied = (|| -> Result<Vec<usize>, Error> {
        // The zeros are written on dfdx's stream; our copies must come after them.
        dev.try_synchronize()
            .map_err(|e| device_err(format!("{e:?}")))?;
        let base = input.tensorport_device_ptr();
        // 8-bit images land in the staging buffer at their row's place, and each run of
        // consecutive 8-bit rows is normalised into the batch by one kernel launch (usually one
        // per batch: producers hand over one kind).
        let staging = if dtypes.contains(&DType::U8) {
            norm.staging(used.len() * row_u8)
                .map_err(|e| device_err(e.to_string()))?
                .ptr()
        } else {
            0
        };
        let mut from_devices = Vec::new();
        for (k, (&i, &dtype)) in used.iter().zip(&dtypes).enumerate() {
            let dst = base + (k * row) as u64;
            let r = &reqs[i];
            let (to, len) = match dtype {
                DType::U8 => (staging + (k * row_u8) as u64, row_u8),
                _ => (dst, row),
            };
            match r.device() {
                // SAFETY: `to` is row k of `input` (which we own alone) or our own staging
                // space for it; the slot stays submitted (unreleased) until the stream is
                // synchronised below.
                None => unsafe { stream.copy_host_to_device_async(to, &r.bytes()[..len]) }
                    .map_err(|e| device_err(e.to_string()))?,
                // Checked shape, dtype and contiguity make its length the row's; the gather
                // copies the tensor's length, so a mismatch must not reach it.
                Some(dt) if dt.len() as usize != len => {
                    return Err(device_err(format!(
                        "a device tensor of {} bytes for a row of {len}",
                        dt.len()
                    )))
                }
                Some(dt) => {
                    device_rows.push((k, i));
                    from_devices.push((dt, to));
                }
            }
        }
        // SAFETY: each destination is its request's row of `input` (ours alone) or our staging
        // space for it, `len` bytes as checked; the buffers were bounds-checked against their
        // registrations, and the gather orders the copies after the producers' writes. The
        // requests stay unreleased until the stream is synchronised below.
        unsafe { gatherer.gather(stream, &from_devices) }.map_err(|e| device_err(e.to_string()))?;
        let mut k = 0;
        while k < dtypes.len() {
            if dtypes[k] != DType::U8 {
                k += 1;
                continue;
            }
            let run = dtypes[k..].iter().take_while(|&&d| d == DType::U8).count();
            // SAFETY: rows k..k+run of the staging buffer hold those images' bytes (copied
            // above, on the same stream), and rows k..k+run of `input` are theirs.
            unsafe {
                norm.normalise(
                    staging + (k * row_u8) as u64,
                    base + (k * row) as u64,
                    plane,
                    run,
                    stream,
                )
            }
            .map_err(|e| device_err(e.to_string()))?;
            k += run;
        }
        // A producer that never signals must not stall this stream (nor the batch's others).
        let tensors: Vec<_> = from_devices.iter().map(|c| c.0).collect();
        gatherer
            .synchronize(stream, &tensors, fence_timeout)
            .map_err(|e| device_err(e.to_string()))
    })();
    match copied {
        Ok(late) if late.is_empty() => Stacked {
            input: Some(input),
            used,
            rejected,
        },
        Ok(late) => {
            // Their rows hold whatever the buffers held: zeroed, and their requests failed.
            let late: Vec<(usize, usize)> = late.iter().map(|&j| device_rows[j]).collect();
            let zero = vec![0u8; row];
            for &(k, _) in &late {
                // SAFETY: row k of `input` (ours alone), `row` bytes; the stream is synchronised
                // right after.
                let _ = unsafe {
                    stream.copy_host_to_device_async(
                        input.tensorport_device_ptr() + (k * row) as u64,
                        &zero,
                    )
                };
            }
            let _ = stream.synchronize();
            for &(_, i) in &late {
                rejected.push((
                    i,
                    Error::FenceTimeout {
                        request_id: reqs[i].request_id(),
                        producer: reqs[i].producer().to_string(),
                        timeout: fence_timeout,
                    },
                ));
            }
            // Their rows stay in the input (zeroed), so `used` still lines up row by row.
            Stacked {
                input: Some(input),
                used,
                rejected,
            }
        }
        Err(e) => {
            let mut msg = e.to_string();
            if !stream.is_idle().unwrap_or(false) {
                // Copies may still write `input`: it is never freed or reused (held by this
                // thread, as dfdx's CUDA tensors cannot leave it).
                QUARANTINE.with(|q| q.borrow_mut().push(input));
                msg.push_str("; the copy stream did not drain: the batch's input is quarantined");
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
