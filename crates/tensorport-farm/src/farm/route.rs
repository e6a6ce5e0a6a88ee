//! Which producer takes which input when a farm has both kinds: plain JPEGs (8-bit sequential,
//! one or three components) go to the GPU producers, whose JPEG engines decode them; the rest —
//! progressive or 12-bit JPEGs, PNGs, synthetic images — to the CPU producers, which would
//! otherwise leave the GPU producers preparing them on the CPU. Either side takes the other's
//! inputs once its own run out, so neither idles while work is left.

use std::collections::VecDeque;

/// The kind of producer an input suits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Gpu,
    Cpu,
}

impl Side {
    fn at(self) -> usize {
        match self {
            Side::Gpu => 0,
            Side::Cpu => 1,
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
    sides: [VecDeque<u64>; 2],
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
            sides: [VecDeque::new(), VecDeque::new()],
            side: vec![None; if routing { n as usize } else { 0 }],
            routing,
        }
    }

    /// The next input for a producer of `side`: its own side's first (sorting up to
    /// [`LOOKAHEAD`] more inputs with `sort` to find one), else the other side's.
    pub(super) fn next(&mut self, side: Side, sort: impl Fn(u64) -> Side) -> Option<u64> {
        if !self.routing {
            return self.unsorted.pop_front();
        }
        if let Some(i) = self.sides[side.at()].pop_front() {
            return Some(i);
        }
        let mut sorted = 0;
        while sorted < LOOKAHEAD {
            let Some(i) = self.unsorted.pop_front() else {
                break;
            };
            let s = sort(i);
            self.side[i as usize] = Some(s);
            if s == side {
                return Some(i);
            }
            self.sides[s.at()].push_back(i);
            sorted += 1;
        }
        let other = match side {
            Side::Gpu => Side::Cpu,
            Side::Cpu => Side::Gpu,
        };
        self.sides[other.at()]
            .pop_front()
            .or_else(|| self.unsorted.pop_front())
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

    /// Odd inputs suit the CPU.
    fn odd_cpu(i: u64) -> Side {
        if i % 2 == 1 {
            Side::Cpu
        } else {
            Side::Gpu
        }
    }

    #[test]
    fn each_side_gets_its_own_then_the_others() {
        let mut q = Queue::new(6, true);
        assert_eq!(q.next(Side::Cpu, odd_cpu), Some(1));
        assert_eq!(q.next(Side::Gpu, odd_cpu), Some(0));
        assert_eq!(q.next(Side::Cpu, odd_cpu), Some(3));
        assert_eq!(q.next(Side::Cpu, odd_cpu), Some(5));
        // The CPU's are gone: the GPU's go to the CPU producer.
        assert_eq!(q.next(Side::Cpu, odd_cpu), Some(2));
        assert_eq!(q.next(Side::Gpu, odd_cpu), Some(4));
        assert_eq!(q.next(Side::Gpu, odd_cpu), None);
        assert_eq!(q.next(Side::Cpu, odd_cpu), None);
    }

    #[test]
    fn inputs_put_back_come_first_on_their_side() {
        let mut q = Queue::new(4, true);
        let a = q.next(Side::Gpu, odd_cpu).unwrap();
        let b = q.next(Side::Cpu, odd_cpu).unwrap();
        q.push_front(b);
        q.push_front(a);
        assert_eq!(q.next(Side::Cpu, odd_cpu), Some(b));
        assert_eq!(q.next(Side::Gpu, odd_cpu), Some(a));
    }

    #[test]
    fn without_routing_it_is_one_queue_and_sorts_nothing() {
        let mut q = Queue::new(3, false);
        let never = |_: u64| -> Side { panic!("sorted") };
        assert_eq!(q.next(Side::Cpu, never), Some(0));
        q.push_front(0);
        assert_eq!(q.next(Side::Gpu, never), Some(0));
        assert_eq!(q.next(Side::Gpu, never), Some(1));
    }

    #[test]
    fn every_input_comes_out_once_whatever_the_order_of_asking() {
        let mut q = Queue::new(1000, true);
        let mut seen = vec![false; 1000];
        let mut k = 0u64;
        while let Some(i) = q.next(
            if k.is_multiple_of(3) {
                Side::Gpu
            } else {
                Side::Cpu
            },
            |i| {
                if i % 7 < 2 {
                    Side::Cpu
                } else {
                    Side::Gpu
                }
            },
        ) {
            assert!(!seen[i as usize], "{i} twice");
            seen[i as usize] = true;
            k += 1;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
