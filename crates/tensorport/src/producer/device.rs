//! Device buffers a producer registers, and tensors in them.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use tensorport_wire::{ClientMsg, RawDeviceHandle, RawLocation, SlotRef};

use crate::SubmitError;
use crate::{Error, Result};

use super::{Held, Producer, TensorSpec};

/// A device buffer this producer registered.
#[derive(Debug, Clone)]
pub(super) struct DeviceState {
    pub(super) len: u64,
    pub(super) generation: u32,
    pub(super) in_flight: bool,
}

impl Producer {
    /// Shares a device buffer of `len` bytes with the server (once per buffer number), and
    /// returns the handle of the server's "released" event (see `tensorport_cuda::GpuProducer`,
    /// which does all of this).
    /// `fd` is attached for a `VmmPosixFd` handle (and must be `None` otherwise).
    pub fn register_device(
        &mut self,
        buffer: u32,
        len: u64,
        handle: RawDeviceHandle,
        fd: Option<BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.requests.registered = None;
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        self.link.writer.send(
            &ClientMsg::RegisterDevice {
                buffer,
                len,
                handle,
            },
            &fds,
        )?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((b, ev)) = self.requests.registered.take() {
                if b == buffer {
                    self.requests.devices.insert(
                        buffer,
                        DeviceState {
                            len,
                            generation: 0,
                            in_flight: false,
                        },
                    );
                    return Ok(ev);
                }
            }
            if !self.pump(Some(deadline))? && Instant::now() >= deadline {
                return Err(Error::Timeout(
                    timeout,
                    "the server to open a device buffer",
                ));
            }
        }
    }

    /// Whether a registered device buffer is ours to write (not in flight).
    pub fn device_free(&self, buffer: u32) -> bool {
        self.requests
            .devices
            .get(&buffer)
            .is_some_and(|d| !d.in_flight)
    }

    /// Waits until the server releases device `buffer` and the session is below its in-flight
    /// limit (the caller must then make its stream wait on the server's "released" event before
    /// writing the buffer).
    pub fn wait_device(&mut self, buffer: u32, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.requests.devices.get(&buffer) {
                None => return Err(Error::UnknownDevice(buffer)),
                Some(d)
                    if !d.in_flight
                        && self.requests.in_flight.len() < self.requests.max_in_flight as usize =>
                {
                    return Ok(())
                }
                Some(_) => {}
            }
            if !self.pump(Some(deadline))? && Instant::now() >= deadline {
                return Err(Error::Timeout(
                    timeout,
                    "the server to release a device buffer",
                ));
            }
        }
    }

    /// Submits the tensor `spec` in device `buffer`, which the caller has written and fenced:
    /// recorded its "ready" event after the writes (`timeline: None`), or written `timeline`'s
    /// value to its "ready" semaphore (a timeline buffer). Returns the request id.
    pub fn submit_device(
        &mut self,
        buffer: u32,
        spec: &TensorSpec,
        timeline: Option<u64>,
    ) -> std::result::Result<u64, SubmitError> {
        let id = self.requests.next_id;
        self.requests.next_id += 1;
        self.submit_device_as(buffer, id, spec, timeline)?;
        Ok(id)
    }

    /// Like [`Producer::submit_device`] with a request id of the caller's choosing (unique among
    /// its requests in flight).
    pub fn submit_device_as(
        &mut self,
        buffer: u32,
        request_id: u64,
        spec: &TensorSpec,
        timeline: Option<u64>,
    ) -> std::result::Result<(), SubmitError> {
        let id = request_id;
        let d = self
            .requests
            .devices
            .get(&buffer)
            .cloned()
            .ok_or(SubmitError::UnknownDevice(buffer))?;
        if d.in_flight {
            return Err(SubmitError::DeviceInFlight(buffer));
        }
        let location = RawLocation::DeviceBuffer(SlotRef {
            slot: buffer,
            generation: d.generation,
        });
        if self.link.ring.is_some() && self.link.version >= tensorport_wire::DEVICE_QUEUES_VERSION {
            // Protocol 3: device hand-offs take the queue too.
            self.submit_on_ring(location, id, spec, timeline, Held::Device(buffer))?;
        } else {
            let mut raw = spec.to_raw(location)?;
            raw.fence = timeline.map(|value| tensorport_wire::RawFence::Timeline {
                semaphore: 0,
                value,
            });
            self.check_and_send(id, raw, Held::Device(buffer))?;
        }
        if let Some(d) = self.requests.devices.get_mut(&buffer) {
            d.in_flight = true;
        }
        Ok(())
    }
}
