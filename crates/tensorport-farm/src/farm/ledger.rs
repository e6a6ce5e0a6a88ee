//! The input ledger: which inputs have their result, and which were given to a second producer
//! at the end of the queue. An input's first result is the one kept.

use std::collections::HashSet;

pub(super) struct Ledger {
    done: Vec<bool>,
    done_count: u64,
    /// Inputs given to a second producer once the queue ran out.
    hedged: HashSet<u64>,
}

impl Ledger {
    pub(super) fn new(n: u64) -> Ledger {
        Ledger {
            done: vec![false; n as usize],
            done_count: 0,
            hedged: HashSet::new(),
        }
    }

    /// Inputs known (their results or not).
    pub(super) fn len(&self) -> u64 {
        self.done.len() as u64
    }

    /// One more input, at the end.
    pub(super) fn push(&mut self) {
        self.done.push(false);
    }

    pub(super) fn is_done(&self, i: u64) -> bool {
        self.done.get(i as usize).copied().unwrap_or(false)
    }

    /// Inputs with their result.
    pub(super) fn done_count(&self) -> u64 {
        self.done_count
    }

    /// Input `i`'s result came: whether it is its first (the one kept), and whether a second
    /// producer holds it too (to be withdrawn there). An index out of range is nobody's.
    pub(super) fn result(&mut self, i: u64) -> (bool, bool) {
        match self.done.get_mut(i as usize) {
            Some(d) if !*d => {
                *d = true;
                self.done_count += 1;
                (true, self.hedged.remove(&i))
            }
            _ => (false, false),
        }
    }

    pub(super) fn is_hedged(&self, i: u64) -> bool {
        self.hedged.contains(&i)
    }

    /// Input `i` was given to a second producer.
    pub(super) fn hedge(&mut self, i: u64) {
        self.hedged.insert(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_result_counts_and_a_hedged_copy_is_withdrawn_once() {
        let mut l = Ledger::new(3);
        l.hedge(1);
        assert_eq!(l.result(1), (true, true));
        assert_eq!(l.result(1), (false, false));
        assert_eq!(l.result(0), (true, false));
        assert_eq!(l.result(7), (false, false));
        assert_eq!(l.done_count(), 2);
        assert!(l.is_done(1) && !l.is_done(2) && !l.is_done(9));
        l.push();
        assert_eq!(l.len(), 4);
    }
}
