//! Slots lent to the caller: a lease borrows the producer, a loan stands alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport_shm::HostPool;
use tensorport_wire::SlotRef;

use crate::{LeaseError, SubmitError};

use super::{Producer, TensorSpec};

impl Producer {
    /// A free slot to write, waiting up to `timeout` for one (backpressure: all slots are in
    /// flight, or the session has its maximum of requests in flight).
    pub fn lease(&mut self, timeout: Duration) -> std::result::Result<SlotLease<'_>, LeaseError> {
        let slot = self.take_slot(timeout)?;
        Ok(SlotLease {
            producer: self,
            slot: Some(slot),
        })
    }

    /// A free slot to write that does not borrow the producer: hold several at once, write
    /// them on other threads, and submit each with [`Producer::submit_loan`] (as iceoryx2's
    /// loans). Waits up to `timeout` as [`Producer::lease`] does; loans out count against the
    /// in-flight limit.
    pub fn loan(&mut self, timeout: Duration) -> std::result::Result<Loan, LeaseError> {
        let slot = self.take_slot(timeout)?;
        self.slots.loaned += 1;
        Ok(Loan {
            slot,
            pool: self.slots.pool.clone(),
            home: self.slots.home.clone(),
            submitted: false,
        })
    }

    /// Hands a loaned slot to the server as the tensor `spec`; returns the request id.
    pub fn submit_loan(
        &mut self,
        loan: Loan,
        spec: &TensorSpec,
    ) -> std::result::Result<u64, SubmitError> {
        let id = self.requests.next_id;
        self.requests.next_id += 1;
        self.submit_loan_as(loan, id, spec)?;
        Ok(id)
    }

    /// [`Producer::submit_loan`] with a request id of the caller's choosing.
    pub fn submit_loan_as(
        &mut self,
        mut loan: Loan,
        request_id: u64,
        spec: &TensorSpec,
    ) -> std::result::Result<(), SubmitError> {
        if !Arc::ptr_eq(&loan.home, &self.slots.home) {
            return Err(SubmitError::ForeignLoan);
        }
        loan.submitted = true;
        self.slots.loaned -= 1;
        let slot = loan.slot;
        self.submit_slot(slot, request_id, spec).inspect_err(|_| {
            self.slots.free.push_back(slot);
        })
    }

    /// Slots of loans dropped unsubmitted go back to the free list.
    pub(super) fn reclaim_loans(&mut self) {
        let back = std::mem::take(&mut *crate::lock(&self.slots.home.returned));
        self.slots.loaned -= back.len();
        self.slots.free.extend(back);
    }

    /// A free slot, within the in-flight limit, waiting up to `timeout`.
    pub(super) fn take_slot(&mut self, timeout: Duration) -> Result<SlotRef, LeaseError> {
        // The clock is read only if no slot is free at once.
        let mut deadline = None;
        loop {
            if self.draining {
                return Err(LeaseError::Draining);
            }
            if self.slots.loaned > 0 {
                self.reclaim_loans();
            }
            if self.requests.in_flight.len() + self.slots.loaned
                < self.requests.max_in_flight as usize
                && !self.slots.free.is_empty()
            {
                self.await_warm_slot().map_err(LeaseError::broken)?;
                // The slot given back last (or the warm one): its pages are the likeliest to be
                // in cache.
                if let Some(slot) = self.slots.free.pop_back() {
                    if self.slots.warm.on() {
                        self.slots.warm.leased(Instant::now());
                    }
                    return Ok(slot);
                }
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + timeout);
            let news = self.pump(Some(deadline)).map_err(LeaseError::broken)?;
            if !news && Instant::now() >= deadline {
                return Err(LeaseError::Timeout(timeout));
            }
        }
    }

    /// With large slots: when the slot submitted last is still with the server, polls for it
    /// to come back (as long as [`super::warm::WarmLease::plan`] allows), and puts it at the
    /// back of the free list, where the next lease takes it (see [`super::warm`]).
    fn await_warm_slot(&mut self) -> crate::Result<()> {
        if !self.slots.warm.on() {
            return Ok(());
        }
        let Some((warm, until)) = self.slots.warm.plan(Instant::now()) else {
            return Ok(());
        };
        let pos = loop {
            if let Some(pos) = self.slots.free.iter().rposition(|s| s.slot == warm) {
                break pos;
            }
            if Instant::now() >= until {
                self.slots.warm.missed();
                return Ok(());
            }
            for _ in 0..super::SPINS_PER_LOOK {
                std::hint::spin_loop();
            }
            self.poll()?;
        };
        if let Some(s) = self.slots.free.remove(pos) {
            self.slots.free.push_back(s);
        }
        Ok(())
    }
}

/// Where loans dropped unsubmitted leave their slots, for the producer to take back.
#[derive(Debug, Default)]
pub(super) struct LoanHome {
    returned: std::sync::Mutex<Vec<SlotRef>>,
}

/// A slot of the pool lent by [`Producer::loan`]: ours to write until it is submitted with
/// [`Producer::submit_loan`]. It does not borrow the producer, so several can be out at once
/// and be written on other threads. Dropped unsubmitted, its slot goes back to the producer.
pub struct Loan {
    slot: SlotRef,
    pool: Arc<HostPool>,
    home: Arc<LoanHome>,
    submitted: bool,
}

impl std::fmt::Debug for Loan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loan").field("slot", &self.slot).finish()
    }
}

impl Loan {
    /// The slot's bytes, to write in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the server granted this slot to us and it is not submitted; the producer took
        // it off its free list for this loan alone, so no other loan, lease or (honest) server
        // code touches it, and `&mut self` makes this the only view of it in this process. The
        // `Arc<HostPool>` keeps the mapping alive for the borrow.
        unsafe { self.pool.slot_bytes_mut(self.slot.slot) }.expect("granted slot is in the pool")
    }

    /// Bytes in the slot.
    pub fn len(&self) -> usize {
        self.pool.slot_size() as usize
    }

    /// Whether the slot has no bytes (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Which slot (and generation) this is.
    pub fn slot(&self) -> SlotRef {
        self.slot
    }

    /// The pool the slot is in. Holding it keeps the pool mapped in this process (for
    /// bindings whose views of the slot may outlive the loan); writing the slot after it was
    /// submitted tears the submitted tensor, as for any shared memory.
    pub fn mapping(&self) -> Arc<HostPool> {
        self.pool.clone()
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        if !self.submitted {
            crate::lock(&self.home.returned).push(self.slot);
        }
    }
}

/// A slot of the pool, ours to write until [`SlotLease::submit`]. Dropped unsubmitted, it goes
/// back to the producer's free list.
pub struct SlotLease<'p> {
    producer: &'p mut Producer,
    slot: Option<SlotRef>,
}

impl std::fmt::Debug for SlotLease<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotLease")
            .field("slot", &self.slot)
            .finish()
    }
}

impl SlotLease<'_> {
    /// The slot's bytes, to write in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let slot = self.slot.expect("slot present until submit");
        // SAFETY: the server granted this slot to us and we have not submitted it, so no one
        // else (honest) reads or writes it; `&mut self` makes this the only view in this process.
        unsafe { self.producer.slots.pool.slot_bytes_mut(slot.slot) }
            .expect("granted slot is in the pool")
    }

    /// Bytes in the slot.
    pub fn len(&self) -> usize {
        self.producer.slots.layout.slot_size as usize
    }

    /// Whether the slot has no bytes (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Which slot (and generation) this is.
    pub fn slot(&self) -> SlotRef {
        self.slot.expect("slot present until submit")
    }

    /// Copies `data` into the slot at byte `offset`. Panics if it does not fit.
    pub fn write_pod<T: bytemuck::Pod>(&mut self, offset: usize, data: &[T]) {
        let src: &[u8] = bytemuck::cast_slice(data);
        self.bytes_mut()[offset..offset + src.len()].copy_from_slice(src);
    }

    /// Hands the slot to the server as the tensor `spec`; returns the request id.
    pub fn submit(self, spec: &TensorSpec) -> std::result::Result<u64, SubmitError> {
        let id = self.producer.requests.next_id;
        self.producer.requests.next_id += 1;
        self.submit_as(id, spec)?;
        Ok(id)
    }

    /// Like [`SlotLease::submit`] with a request id of the caller's choosing (unique among its
    /// requests in flight).
    pub fn submit_as(
        mut self,
        request_id: u64,
        spec: &TensorSpec,
    ) -> std::result::Result<(), SubmitError> {
        let slot = self.slot.take().expect("slot present until submit");
        match self.producer.submit_slot(slot, request_id, spec) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.producer.slots.free.push_back(slot);
                Err(e)
            }
        }
    }
}

impl Drop for SlotLease<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.producer.slots.free.push_back(slot);
        }
    }
}
