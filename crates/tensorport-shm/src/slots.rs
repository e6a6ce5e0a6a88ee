//! Server-side slot bookkeeping: who holds each slot, under which generation.
//!
//! A slot moves `Free → Granted → Submitted → Free`, and its generation grows by one each time
//! the server takes it back (release or return). A client's reference is valid only for the
//! state and generation it was granted under, so a stale or forged reference is refused.

use thiserror::Error;

/// Where a slot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// With the server, not granted.
    Free,
    /// With the client, to write.
    Granted,
    /// Submitted; the server's consumer holds it until release.
    Submitted,
}

/// Why a slot operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SlotError {
    /// No such slot.
    #[error("slot {slot} does not exist (pool has {count})")]
    OutOfRange {
        /// Slot asked for.
        slot: u32,
        /// Slots in the pool.
        count: u32,
    },
    /// Wrong state for the operation.
    #[error("slot {slot} is {state:?}, not {expected:?}")]
    WrongState {
        /// Slot asked for.
        slot: u32,
        /// Its state.
        state: SlotState,
        /// The state the operation needs.
        expected: SlotState,
    },
    /// Generation does not match.
    #[error("slot {slot} is at generation {current}, not {given}")]
    StaleGeneration {
        /// Slot asked for.
        slot: u32,
        /// Its generation.
        current: u32,
        /// The generation given.
        given: u32,
    },
}

/// Slot states and generations of one pool.
#[derive(Debug, Clone)]
pub struct SlotTable {
    states: Vec<(SlotState, u32)>,
}

impl SlotTable {
    /// `count` free slots at generation 0.
    pub fn new(count: u32) -> SlotTable {
        SlotTable {
            states: vec![(SlotState::Free, 0); count as usize],
        }
    }

    /// Number of slots.
    pub fn len(&self) -> u32 {
        self.states.len() as u32
    }

    /// Whether the table has no slots.
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// Number of slots in `state`.
    pub fn count(&self, state: SlotState) -> u32 {
        self.states.iter().filter(|(s, _)| *s == state).count() as u32
    }

    /// State and generation of `slot`.
    pub fn get(&self, slot: u32) -> Option<(SlotState, u32)> {
        self.states.get(slot as usize).copied()
    }

    fn check(
        &mut self,
        slot: u32,
        generation: u32,
        expected: SlotState,
    ) -> Result<&mut (SlotState, u32), SlotError> {
        let count = self.len();
        let e = self
            .states
            .get_mut(slot as usize)
            .ok_or(SlotError::OutOfRange { slot, count })?;
        if e.0 != expected {
            return Err(SlotError::WrongState {
                slot,
                state: e.0,
                expected,
            });
        }
        if e.1 != generation {
            return Err(SlotError::StaleGeneration {
                slot,
                current: e.1,
                given: generation,
            });
        }
        Ok(e)
    }

    /// Grants every free slot; returns `(slot, generation)` of each.
    pub fn grant_free(&mut self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for (i, e) in self.states.iter_mut().enumerate() {
            if e.0 == SlotState::Free {
                e.0 = SlotState::Granted;
                out.push((i as u32, e.1));
            }
        }
        out
    }

    /// A granted slot is submitted by its client.
    pub fn submit(&mut self, slot: u32, generation: u32) -> Result<(), SlotError> {
        self.check(slot, generation, SlotState::Granted)?.0 = SlotState::Submitted;
        Ok(())
    }

    /// The server is done with a submitted slot: it becomes free under the next generation.
    /// Returns that generation.
    pub fn release(&mut self, slot: u32, generation: u32) -> Result<u32, SlotError> {
        let e = self.check(slot, generation, SlotState::Submitted)?;
        e.0 = SlotState::Free;
        e.1 = e.1.wrapping_add(1);
        Ok(e.1)
    }

    /// A client gives a granted slot back unused: free under the next generation.
    pub fn give_back(&mut self, slot: u32, generation: u32) -> Result<u32, SlotError> {
        let e = self.check(slot, generation, SlotState::Granted)?;
        e.0 = SlotState::Free;
        e.1 = e.1.wrapping_add(1);
        Ok(e.1)
    }

    /// Grants one free slot again (after release); returns its generation.
    pub fn grant(&mut self, slot: u32) -> Result<u32, SlotError> {
        let count = self.len();
        let e = self
            .states
            .get_mut(slot as usize)
            .ok_or(SlotError::OutOfRange { slot, count })?;
        if e.0 != SlotState::Free {
            return Err(SlotError::WrongState {
                slot,
                state: e.0,
                expected: SlotState::Free,
            });
        }
        e.0 = SlotState::Granted;
        Ok(e.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_and_stale_refs() {
        let mut t = SlotTable::new(2);
        assert_eq!(t.grant_free(), vec![(0, 0), (1, 0)]);
        t.submit(0, 0).unwrap();
        // Submitting twice, or a slot not granted, is refused.
        assert!(matches!(t.submit(0, 0), Err(SlotError::WrongState { .. })));
        assert!(matches!(t.submit(7, 0), Err(SlotError::OutOfRange { .. })));
        assert_eq!(t.release(0, 0).unwrap(), 1);
        // Releasing again is refused.
        assert!(t.release(0, 0).is_err());
        assert_eq!(t.grant(0).unwrap(), 1);
        // The old generation is stale now.
        assert!(matches!(
            t.submit(0, 0),
            Err(SlotError::StaleGeneration { .. })
        ));
        t.submit(0, 1).unwrap();
        assert_eq!(t.give_back(1, 0).unwrap(), 1);
        assert!(t.give_back(1, 1).is_err());
        assert_eq!(t.count(SlotState::Submitted), 1);
        assert_eq!(t.count(SlotState::Free), 1);
    }
}
