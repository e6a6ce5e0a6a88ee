//! What the caller of `Server::recv_*` holds: a [`Request`] (a zero-copy view of a submitted
//! tensor) and, once its bytes are released, a [`Responder`]. Either answers exactly once;
//! dropping one unanswered answers with a failure.

use std::sync::Arc;

use tensorport_wire::{ErrorCode, SlotRef, TensorDesc};

use crate::device::DeviceTensor;
use crate::server::session::{Answer, Session};
use crate::Result;

/// A tensor a producer submitted: a zero-copy view into its pool, valid until released.
///
/// Dropping a `Request` releases its slot (the producer may reuse it) and, if no result was
/// sent, sends the producer a `HandlerFailed` result, so every request gets exactly one answer.
pub struct Request {
    pub(crate) desc: TensorDesc,
    /// Boxed: device tensors are the rarer kind, and every request of either kind is moved
    /// between the server's vectors (a host request carries 8 bytes for this, not 48).
    pub(crate) device: Option<Box<DeviceTensor>>,
    pub(crate) responder: Option<Responder>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("desc", &self.desc).finish()
    }
}

impl Request {
    pub(crate) fn session(&self) -> &Arc<Session> {
        &self
            .responder
            .as_ref()
            .expect("responder present until drop")
            .session
    }

    /// The checked descriptor.
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }

    /// The producer's id for this request.
    pub fn request_id(&self) -> u64 {
        self.responder.as_ref().map(|r| r.request_id).unwrap_or(0)
    }

    /// The session it came from.
    pub fn session_id(&self) -> u64 {
        self.session().id
    }

    /// The producer's name (from its `Hello`).
    pub fn producer(&self) -> &str {
        &self.session().name
    }

    /// For a tensor in a producer's device buffer (`desc().is_device()`): where it is, and the
    /// events that order the GPU work around it.
    pub fn device(&self) -> Option<&DeviceTensor> {
        self.device.as_deref()
    }

    /// The tensor's bytes, in place in the producer's pool (no copy was made). Empty for a
    /// device tensor (see [`Request::device`]).
    pub fn bytes(&self) -> &[u8] {
        if self.desc.is_device() {
            return &[];
        }
        let s = self.session();
        let slot = self.desc.slot();
        // SAFETY: the slot is in state Submitted in the session's table until this request
        // releases it (in `release` or `drop`), so the honest producer does not write it; the
        // descriptor was validated against this pool's bounds; the `Arc<HostPool>` held through
        // the session keeps the mapping alive for the borrow of `self`.
        unsafe {
            s.pool
                .slot_bytes(slot.slot, self.desc.offset(), self.desc.byte_len())
        }
        .expect("validated descriptor lies inside the pool")
    }

    /// The producer's pool the tensor is in (`None` for a device tensor). Holding it keeps the
    /// pool mapped in this process even after the request is answered (for bindings whose views
    /// of [`Request::bytes`] may outlive it); what the bytes then hold is the producer's again.
    pub fn mapping(&self) -> Option<Arc<tensorport_shm::HostPool>> {
        (!self.desc.is_device()).then(|| self.session().pool.clone())
    }

    /// The tensor's elements as `T`, if it is contiguous and `T` has the dtype's size.
    pub fn as_slice<T: bytemuck::Pod>(&self) -> Option<&[T]> {
        if self.desc.is_device()
            || !self.desc.is_contiguous()
            || std::mem::size_of::<T>() as u64 != self.desc.dtype().size()
        {
            return None;
        }
        let bytes = &self.bytes()[..(self.desc.numel() * self.desc.dtype().size()) as usize];
        bytemuck::try_cast_slice(bytes).ok()
    }

    /// Releases the slot now (the producer gets it back) and returns what answers the request.
    pub fn release(mut self) -> Responder {
        let r = self.responder.take().expect("responder present until drop");
        r.session.give_back(&self.desc);
        r
    }

    /// Releases the slot and sends `payload` as the result. On the shared-memory queues a
    /// result of up to 232 bytes travels in one completion with the slot's grant (no system
    /// call, no allocation); longer results go on the socket.
    pub fn respond(mut self, payload: &[u8]) -> Result<()> {
        self.settle(Answer::Ok(payload))
    }

    /// Releases the slot and sends a failure as the result.
    pub fn fail(mut self, message: impl Into<String>) -> Result<()> {
        self.settle(Answer::Failed(ErrorCode::HandlerFailed, message.into()))
    }

    /// Fails the request with `code` and ends its producer's session, telling it why (a fatal
    /// error): for a producer that broke its side of the contract in a way only the consumer
    /// sees, such as a device tensor whose "ready" fence never came
    /// ([`ErrorCode::FenceTimeout`], see `tensorport_cuda::Gatherer::synchronize`). The
    /// session is reclaimed as after a crash; other producers are not touched.
    pub fn fail_and_end_session(self, code: ErrorCode, message: impl Into<String>) -> Result<()> {
        self.release().fail_and_end_session(code, message)
    }

    /// For [`crate::Server::respond_all`], a host tensor's request only: takes the answering
    /// over (this request's drop then does nothing) and says what to answer and give back.
    pub(crate) fn hand_over(&mut self) -> (u64, Option<SlotRef>) {
        let r = self
            .responder
            .as_mut()
            .expect("responder present until drop");
        debug_assert!(!self.desc.is_device() && !r.answered);
        // Kept (answered) until the request is dropped: its references go after the batch's
        // completions are published, not between them.
        r.answered = true;
        (r.request_id, Some(self.desc.slot()))
    }

    /// The session that answers this request, while it is not answered.
    pub(crate) fn answering_session(&self) -> Option<&Arc<Session>> {
        self.responder
            .as_ref()
            .filter(|r| !r.answered)
            .map(|r| &r.session)
    }

    /// Gives the bytes back and answers, once.
    pub(crate) fn settle(&mut self, answer: Answer<'_>) -> Result<()> {
        let mut r = self.responder.take().expect("responder present until drop");
        r.answered = true;
        let slot = if self.desc.is_device() {
            r.session.release_device(self.desc.slot());
            None
        } else {
            Some(self.desc.slot())
        };
        r.session.answer(r.request_id, answer, slot)
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // (Answered through `Server::respond_all`: its bytes were given back then.)
        if let Some(r) = self.responder.take().filter(|r| !r.answered) {
            r.session.give_back(&self.desc);
        }
    }
}

/// Answers one request, after its slot was released. Dropping it unanswered sends a failure.
pub struct Responder {
    pub(crate) session: Arc<Session>,
    pub(crate) request_id: u64,
    pub(crate) answered: bool,
}

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Responder")
            .field("session", &self.session.id)
            .field("request_id", &self.request_id)
            .finish()
    }
}

impl Responder {
    /// The producer's id for this request.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// The session it came from.
    pub fn session_id(&self) -> u64 {
        self.session.id
    }

    /// Whether the producer is still connected.
    pub fn is_alive(&self) -> bool {
        self.session.is_alive()
    }

    /// Sends the answer, once; the slot was released before.
    fn settle(&mut self, answer: Answer<'_>) -> Result<()> {
        self.answered = true;
        self.session.answer(self.request_id, answer, None)
    }

    /// Sends `payload` as the result. Fails with [`crate::Error::SessionGone`] if the producer left.
    pub fn respond(mut self, payload: &[u8]) -> Result<()> {
        self.settle(Answer::Ok(payload))
    }

    /// Sends a failure as the result.
    pub fn fail(mut self, message: impl Into<String>) -> Result<()> {
        self.settle(Answer::Failed(ErrorCode::HandlerFailed, message.into()))
    }

    /// Fails the request with `code` and ends its producer's session, as
    /// [`Request::fail_and_end_session`] does.
    pub fn fail_and_end_session(
        mut self,
        code: ErrorCode,
        message: impl Into<String>,
    ) -> Result<()> {
        let message = message.into();
        let answered = self.settle(Answer::Failed(code, message.clone()));
        self.session.close_with(code, message);
        answered
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if !self.answered {
            let _ = self.settle(Answer::Failed(
                ErrorCode::HandlerFailed,
                "the server dropped the request without a result".into(),
            ));
        }
    }
}
