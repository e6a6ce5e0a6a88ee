//! Which producer takes which input when a farm has both kinds. Plain JPEGs (8-bit sequential,
//! one or three components) go to the GPU producers, whose JPEG engines decode them; the rest —
//! progressive or 12-bit JPEGs, PNGs, synthetic images — to the CPU producers, which would
//! otherwise leave the GPU producers preparing them on the CPU. Large plain JPEGs suit either:
//! whoever has room takes them. GPU producers take CPU inputs once their own run out; CPU
//! producers take small plain JPEGs only when no GPU producer runs (a GPU producer does those
//! several times faster than the whole CPU farm, and host tensors in its batches slow the
//! server's device batches).

use std::collections::VecDeque;

/// The kind of producer an input suits (or that asks for one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Gpu,
    Cpu,
    /// Either kind (only for inputs).
    Either,
}

impl Side {
    fn at(self) -> usize {
        match self {
            Side::Gpu => 0,
            Side::Cpu => 1,
            Side::Either => 2,
        }
    }

    /// The queues a producer of this kind takes from, in order; CPU producers take the GPU's
    /// only when `gpu_running` is false.
    fn order(self, gpu_running: bool) -> &'static [Side] {
        match (self, gpu_running) {
            (Side::Gpu, _) => &[Side::Gpu, Side::Either, Side::Cpu],
            (_, true) => &[Side::Cpu, Side::Either],
            (_, false) => &[Side::Cpu, Side::Either, Side::Gpu],
        }
    }
}

/// Inputs sorted ahead of a producer's request at most: a set with none of one side's inputs
/// is not read through looking for one.
const LOOKAHEAD: usize = 256;

/// The inputs not handed out yet.
pub(super) struct Queue {
    /// Not sorted yet, in order.
    unsorted: VecDeque<u64>,
    /// Sorted, by side.
    sides: [VecDeque<u64>; 3],
    /// Each input's side, once sorted.
    side: Vec<Option<Side>>,
    /// Whether to sort at all (only a farm with both kinds of producers does).
    routing: bool,
}

impl Queue {
    /// Inputs `0..n`, in order; sorted by side only if `routing`.
    pub(super) fn new(n: u64, routing: bool) -> Queue {
        Queue {
            unsorted: (0..n).collect(),
            sides: [VecDeque::new(), VecDeque::new(), VecDeque::new()],
            side: vec![None; if routing { n as usize } else { 0 }],
            routing,
        }
    }

    /// The next input for a producer of kind `taker` (`Gpu` or `Cpu`): from the first of its
    /// queues ([`Side::order`]) that has one, sorting up to [`LOOKAHEAD`] more inputs with
    /// `sort` to find one for its first.
    pub(super) fn next(
        &mut self,
        taker: Side,
        gpu_running: bool,
        sort: impl Fn(u64) -> Side,
    ) -> Option<u64> {
        if !self.routing {
            return self.unsorted.pop_front();
        }
        let order = taker.order(gpu_running);
        if let Some(i) = self.sides[order[0].at()].pop_front() {
            return Some(i);
        }
        let mut sorted = 0;
        while sorted < LOOKAHEAD {
            let Some(i) = self.unsorted.pop_front() else {
                break;
            };
            let s = sort(i);
            self.side[i as usize] = Some(s);
            if s == order[0] {
                return Some(i);
            }
            self.sides[s.at()].push_back(i);
            sorted += 1;
        }
        for s in &order[1..] {
            if let Some(i) = self.sides[s.at()].pop_front() {
                return Some(i);
            }
        }
        // Beyond the lookahead: unsorted inputs, if this taker may have them whatever they are.
        if order.len() == 3 {
            return self.unsorted.pop_front();
        }
        None
    }

    /// Adds input `i`, new (one more than the last), at the back.
    pub(super) fn push_new(&mut self, i: u64) {
        if self.routing {
            self.side.resize(i as usize + 1, None);
        }
        self.unsorted.push_back(i);
    }

    /// Puts `i` back, to be handed out first.
    pub(super) fn push_front(&mut self, i: u64) {
        match self.side.get(i as usize).copied().flatten() {
            Some(s) => self.sides[s.at()].push_front(i),
            None => self.unsorted.push_front(i),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs 1, 4, 7, … suit the CPU; 2, 5, 8, … either; the rest the GPU.
    fn by_three(i: u64) -> Side {
        match i % 3 {
            0 => Side::Gpu,
            1 => Side::Cpu,
            _ => Side::Either,
        }
    }

    #[test]
    fn each_kind_gets_its_own_then_what_suits_either_then_the_others() {
        let mut q = Queue::new(6, true);
        assert_eq!(q.next(Side::Cpu, true, by_three), Some(1));
        assert_eq!(q.next(Side::Gpu, true, by_three), Some(0));
        assert_eq!(q.next(Side::Cpu, true, by_three), Some(4));
        // The CPU's are gone: it takes what suits either.
        assert_eq!(q.next(Side::Cpu, true, by_three), Some(2));
        // Not the GPU's while a GPU producer runs.
        assert_eq!(q.next(Side::Gpu, true, by_three), Some(3));
        assert_eq!(q.next(Side::Cpu, true, by_three), Some(5));
        assert_eq!(q.next(Side::Cpu, true, by_three), None);
        assert_eq!(q.next(Side::Gpu, true, by_three), None);
    }

    #[test]
    fn gpu_producers_take_the_cpus_inputs_and_cpus_the_gpus_only_without_gpu_producers() {
        let mut q = Queue::new(3, true);
        assert_eq!(q.next(Side::Gpu, true, |_| Side::Cpu), Some(0));
        let mut q = Queue::new(3, true);
        assert_eq!(q.next(Side::Cpu, true, |_| Side::Gpu), None);
        assert_eq!(q.next(Side::Cpu, false, |_| Side::Gpu), Some(0));
    }

    #[test]
    fn inputs_put_back_come_first_on_their_side() {
        let mut q = Queue::new(4, true);
        let a = q.next(Side::Gpu, true, by_three).unwrap();
        let b = q.next(Side::Cpu, true, by_three).unwrap();
        q.push_front(b);
        q.push_front(a);
        assert_eq!(q.next(Side::Cpu, true, by_three), Some(b));
        assert_eq!(q.next(Side::Gpu, true, by_three), Some(a));
    }

    #[test]
    fn without_routing_it_is_one_queue_and_sorts_nothing() {
        let mut q = Queue::new(3, false);
        let never = |_: u64| -> Side { panic!("sorted") };
        assert_eq!(q.next(Side::Cpu, true, never), Some(0));
        q.push_front(0);
        assert_eq!(q.next(Side::Gpu, true, never), Some(0));
        assert_eq!(q.next(Side::Gpu, true, never), Some(1));
    }

    #[test]
    fn every_input_comes_out_once_whatever_the_order_of_asking() {
        let mut q = Queue::new(1000, true);
        let mut seen = vec![false; 1000];
        let sort = |i: u64| match i % 7 {
            0 | 1 => Side::Cpu,
            2 => Side::Either,
            _ => Side::Gpu,
        };
        for k in 0u64.. {
            let taker = if k.is_multiple_of(3) {
                Side::Gpu
            } else {
                Side::Cpu
            };
            // A CPU producer finding nothing leaves the rest to the GPU producers.
            let Some(i) = q
                .next(taker, true, sort)
                .or_else(|| q.next(Side::Gpu, true, sort))
            else {
                break;
            };
            assert!(!seen[i as usize], "{i} twice");
            seen[i as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
