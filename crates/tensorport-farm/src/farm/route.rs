//! Which producer takes which input when a farm has both kinds. Plain JPEGs (8-bit sequential,
//! one or three components) go to the GPU producers, whose JPEG engines decode them; the rest —
//! progressive or 12-bit JPEGs, PNGs, synthetic images — to the CPU producers, which would
//! otherwise leave the GPU producers preparing them on the CPU. Large plain JPEGs suit either:
//! whoever has room takes them. GPU producers take CPU inputs once their own run out. CPU
//! producers take small plain JPEGs when no GPU producer runs, and, with
//! [`Routing::Shared`](crate::config::Routing), those the GPU producers have no room for once
//! each of them has returned a result (before that, CPU producers ready seconds earlier than the
//! GPU producers' CUDA contexts would take a whole folder of them at a fraction of the GPU's
//! rate).

use std::collections::VecDeque;

use crate::config::Routing;

/// A GPU producer, as the router sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GpuState {
    /// Not started yet, or waiting to be restarted.
    Starting,
    /// Running: whether it has returned a result since it started, and whether it holds all
    /// the inputs it may.
    Running { warm: bool, full: bool },
    /// Given up on.
    GaveUp,
}

/// Whether CPU producers may take plain JPEGs now: when no GPU producer is left, and with
/// [`Routing::Shared`] when every GPU producer left is warm and full.
pub(super) fn cpu_takes_plain(routing: Routing, gpus: impl IntoIterator<Item = GpuState>) -> bool {
    let mut any = false;
    let mut all_busy = true;
    for g in gpus {
        match g {
            GpuState::GaveUp => {}
            GpuState::Running {
                warm: true,
                full: true,
            } => any = true,
            _ => {
                any = true;
                all_busy = false;
            }
        }
    }
    !any || (routing == Routing::Shared && all_busy)
}

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
    /// only when `cpu_takes_plain`.
    fn order(self, cpu_takes_plain: bool) -> &'static [Side] {
        match (self, cpu_takes_plain) {
            (Side::Gpu, _) => &[Side::Gpu, Side::Either, Side::Cpu],
            (_, false) => &[Side::Cpu, Side::Either],
            (_, true) => &[Side::Cpu, Side::Either, Side::Gpu],
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
    /// Whether every input has been handed out (some may come back).
    pub(super) fn is_empty(&self) -> bool {
        self.unsorted.is_empty() && self.sides.iter().all(VecDeque::is_empty)
    }

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
        cpu_takes_plain: bool,
        sort: impl Fn(u64) -> Side,
    ) -> Option<u64> {
        if !self.routing {
            return self.unsorted.pop_front();
        }
        let order = taker.order(cpu_takes_plain);
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
        assert_eq!(q.next(Side::Cpu, false, by_three), Some(1));
        assert_eq!(q.next(Side::Gpu, false, by_three), Some(0));
        assert_eq!(q.next(Side::Cpu, false, by_three), Some(4));
        // The CPU's are gone: it takes what suits either.
        assert_eq!(q.next(Side::Cpu, false, by_three), Some(2));
        // Not the GPU's while a GPU producer runs.
        assert_eq!(q.next(Side::Gpu, false, by_three), Some(3));
        assert_eq!(q.next(Side::Cpu, false, by_three), Some(5));
        assert_eq!(q.next(Side::Cpu, false, by_three), None);
        assert_eq!(q.next(Side::Gpu, false, by_three), None);
    }

    #[test]
    fn gpu_producers_take_the_cpus_inputs_and_cpus_the_gpus_only_when_allowed() {
        let mut q = Queue::new(3, true);
        assert_eq!(q.next(Side::Gpu, false, |_| Side::Cpu), Some(0));
        let mut q = Queue::new(3, true);
        assert_eq!(q.next(Side::Cpu, false, |_| Side::Gpu), None);
        assert_eq!(q.next(Side::Cpu, true, |_| Side::Gpu), Some(0));
    }

    #[test]
    fn cpu_producers_share_plain_jpegs_only_with_warm_full_gpu_producers() {
        use GpuState::*;
        let busy = Running {
            warm: true,
            full: true,
        };
        // No GPU producer left: the CPU producers take everything, whatever the routing.
        for r in [Routing::ByKind, Routing::Shared] {
            assert!(cpu_takes_plain(r, []));
            assert!(cpu_takes_plain(r, [GaveUp, GaveUp]));
        }
        // By kind: never while a GPU producer runs or starts.
        assert!(!cpu_takes_plain(Routing::ByKind, [busy, busy]));
        assert!(!cpu_takes_plain(Routing::ByKind, [Starting]));
        // Shared: once every GPU producer left is warm and full.
        assert!(cpu_takes_plain(Routing::Shared, [busy, busy]));
        assert!(cpu_takes_plain(Routing::Shared, [busy, GaveUp]));
        assert!(!cpu_takes_plain(Routing::Shared, [busy, Starting]));
        let cold = Running {
            warm: false,
            full: true,
        };
        let room = Running {
            warm: true,
            full: false,
        };
        assert!(!cpu_takes_plain(Routing::Shared, [busy, cold]));
        assert!(!cpu_takes_plain(Routing::Shared, [room, busy]));
    }

    #[test]
    fn inputs_put_back_come_first_on_their_side() {
        let mut q = Queue::new(4, true);
        let a = q.next(Side::Gpu, false, by_three).unwrap();
        let b = q.next(Side::Cpu, false, by_three).unwrap();
        q.push_front(b);
        q.push_front(a);
        assert_eq!(q.next(Side::Cpu, false, by_three), Some(b));
        assert_eq!(q.next(Side::Gpu, false, by_three), Some(a));
    }

    #[test]
    fn without_routing_it_is_one_queue_and_sorts_nothing() {
        let mut q = Queue::new(3, false);
        let never = |_: u64| -> Side { panic!("sorted") };
        assert_eq!(q.next(Side::Cpu, false, never), Some(0));
        q.push_front(0);
        assert_eq!(q.next(Side::Gpu, false, never), Some(0));
        assert_eq!(q.next(Side::Gpu, false, never), Some(1));
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
                .next(taker, false, sort)
                .or_else(|| q.next(Side::Gpu, false, sort))
            else {
                break;
            };
            assert!(!seen[i as usize], "{i} twice");
            seen[i as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
