//! Handing a tensor over: checked here first, then on the queue or the socket.

use tensorport_shm::ring::SqEntry;
use tensorport_wire::{
    validate_view, ClientMsg, PoolBounds, RawLocation, RawTensorDesc, RawTensorView, SlotRef,
};

use crate::SubmitError;

/// What a submission comes to.
type Submitted = Result<(), SubmitError>;

use super::{Producer, TensorSpec};

/// What a request in flight holds until the server gives it back.
#[derive(Debug, Clone, Copy)]
pub(super) enum Held {
    Host(SlotRef),
    Device(u32),
}

impl Producer {
    pub(super) fn submit_slot(
        &mut self,
        slot: SlotRef,
        request_id: u64,
        spec: &TensorSpec,
    ) -> Submitted {
        self.slots.warm.submitted(slot.slot);
        if self.link.ring.is_some() {
            return self.submit_on_ring(
                RawLocation::HostSlot(slot),
                request_id,
                spec,
                None,
                Held::Host(slot),
            );
        }
        let raw = spec.to_raw(RawLocation::HostSlot(slot))?;
        self.check_and_send(request_id, raw, Held::Host(slot))
    }

    /// The hot path: the descriptor goes into the submission queue (no system call unless the
    /// server sleeps, no allocation), checked here first with the server's own rules.
    pub(super) fn submit_on_ring(
        &mut self,
        location: RawLocation,
        request_id: u64,
        spec: &TensorSpec,
        timeline: Option<u64>,
        held: Held,
    ) -> Submitted {
        let len = spec.byte_len()?;
        let fence = timeline.map(|value| tensorport_wire::RawFence::Timeline {
            semaphore: 0,
            value,
        });
        self.check(
            request_id,
            &RawTensorView {
                dtype: spec.dtype as u8,
                shape: &spec.shape,
                strides: spec.strides.as_deref(),
                offset: spec.offset,
                len,
                location: &location,
                fence: fence.as_ref(),
            },
        )?;
        let (slot, device) = match location {
            RawLocation::HostSlot(s) => (s, false),
            RawLocation::DeviceBuffer(s) => (s, true),
        };
        // Checked: at most MAX_DIMS dimensions, and as many strides if any.
        let rank = spec.shape.len();
        let mut e = SqEntry {
            request_id,
            slot: slot.slot,
            generation: slot.generation,
            dtype: spec.dtype as u8,
            rank: rank as u8,
            has_strides: spec.strides.is_some(),
            device,
            timeline,
            offset: spec.offset,
            len,
            ..SqEntry::default()
        };
        e.shape[..rank].copy_from_slice(&spec.shape);
        if let Some(st) = &spec.strides {
            e.strides[..rank].copy_from_slice(st);
        }
        let ring = self.link.ring.as_mut().expect("checked by the caller");
        let queued = ring.submit(&e).map_err(SubmitError::broken)?;
        if !queued {
            // The queue is full (the server is behind): the socket carries this one.
            let mut tensor = spec.to_raw(location)?;
            tensor.fence = fence;
            self.link
                .writer
                .send(&ClientMsg::Submit { request_id, tensor }, &[])
                .map_err(SubmitError::broken)?;
        }
        self.requests.in_flight.insert(request_id, held);
        Ok(())
    }

    /// Checks a submission locally with the server's own rules, so a bad spec fails here,
    /// clearly.
    pub(super) fn check(&self, request_id: u64, tensor: &RawTensorView<'_>) -> Submitted {
        let devices = &self.requests.devices;
        validate_view(
            tensor,
            &PoolBounds {
                slot_count: self.slots.layout.slot_count,
                slot_size: self.slots.layout.slot_size,
            },
            &|b| devices.get(&b).map(|d| d.len),
        )
        .map_err(SubmitError::InvalidTensor)?;
        if self.requests.in_flight.contains_key(&request_id) {
            return Err(SubmitError::DuplicateRequest(request_id));
        }
        Ok(())
    }

    pub(super) fn check_and_send(
        &mut self,
        request_id: u64,
        raw: RawTensorDesc,
        held: Held,
    ) -> Submitted {
        self.check(request_id, &raw.view())?;
        self.link
            .writer
            .send(
                &ClientMsg::Submit {
                    request_id,
                    tensor: raw,
                },
                &[],
            )
            .map_err(SubmitError::broken)?;
        self.requests.in_flight.insert(request_id, held);
        Ok(())
    }
}
