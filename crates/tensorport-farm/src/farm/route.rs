//! Which producer takes which input when a farm has both kinds. Plain JPEGs (8-bit sequential,
//! one or three components) go to the GPU producers, whose JPEG engines decode them; the rest —
//! progressive or 12-bit JPEGs, PNGs, synthetic images — to the CPU producers, which would
//! otherwise leave the GPU producers preparing them on the CPU. Large plain JPEGs suit either:
//! whoever has room takes them. GPU producers take CPU inputs once their own run out. CPU
//! producers take small plain JPEGs when no GPU producer runs, and, with
//! [`Routing::Shared`](crate::config::Routing), those the GPU producers have no room for once
//! each of them has returned a result (before that, CPU producers ready seconds earlier than the
//! GPU producers' CUDA contexts would take a whole folder of them at a fraction of the GPU's
//! rate). With [`Routing::Measured`](crate::config::Routing) CPU producers take plain JPEGs,
//! large or small, only while the GPU producers are the slower side ([`super::bound`]).

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

/// Which plain JPEGs CPU producers may take now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CpuTakes {
    /// Large ones ([`Side::Either`]).
    pub large: bool,
    /// Small ones too ([`Side::Gpu`]).
    pub small: bool,
}

impl CpuTakes {
    /// Only the CPU producers' own inputs.
    pub(super) const OWN: CpuTakes = CpuTakes {
        large: false,
        small: false,
    };
    /// Every input.
    #[cfg(test)]
    pub(super) const ALL: CpuTakes = CpuTakes {
        large: true,
        small: true,
    };
}

/// What CPU producers may take now: everything when no GPU producer is left. Otherwise, by
/// `routing`: [`Routing::ByKind`], large plain JPEGs; [`Routing::Shared`], small ones too once
/// every GPU producer left is warm and full; [`Routing::Measured`], as `Shared` but only while
/// `gpu_bound` (the GPU producers would finish what is left for them after the CPU producers
/// finish theirs), neither otherwise.
pub(super) fn cpu_takes(
    routing: Routing,
    gpus: impl IntoIterator<Item = GpuState>,
    gpu_bound: bool,
) -> CpuTakes {
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
    if !any {
        return CpuTakes {
            large: true,
            small: true,
        };
    }
    match routing {
        Routing::ByKind => CpuTakes {
            large: true,
            small: false,
        },
        Routing::Shared => CpuTakes {
            large: true,
            small: all_busy,
        },
        Routing::Measured => CpuTakes {
            large: gpu_bound,
            small: gpu_bound && all_busy,
        },
    }
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
    /// as `cpu` allows.
    fn order(self, cpu: CpuTakes) -> &'static [Side] {
        match (self, cpu.large, cpu.small) {
            (Side::Gpu, _, _) => &[Side::Gpu, Side::Either, Side::Cpu],
            (_, true, true) => &[Side::Cpu, Side::Either, Side::Gpu],
            (_, true, false) => &[Side::Cpu, Side::Either],
            (_, false, true) => &[Side::Cpu, Side::Gpu],
            (_, false, false) => &[Side::Cpu],
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
    /// Inputs sorted to each side so far (for the share of the unsorted each kind will get).
    sorted: [u64; 3],
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
            sorted: [0; 3],
            routing,
        }
    }

    /// The next input for a producer of kind `taker` (`Gpu` or `Cpu`): from the first of its
    /// queues ([`Side::order`]) that has one, sorting up to [`LOOKAHEAD`] more inputs with
    /// `sort` to find one for its first.
    pub(super) fn next(
        &mut self,
        taker: Side,
        cpu: CpuTakes,
        sort: impl Fn(u64) -> Side,
    ) -> Option<u64> {
        if !self.routing {
            return self.unsorted.pop_front();
        }
        let order = taker.order(cpu);
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
            self.sorted[s.at()] += 1;
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

    /// The inputs waiting for each kind of producer, `(gpu, cpu)`: those sorted to its side
    /// (both kinds' plain JPEGs counted as the GPU producers'), and the unsorted shared as the
    /// sorted have been so far (to the GPU producers while none is sorted).
    pub(super) fn waiting(&self) -> (f64, f64) {
        let [g, c, e] = [Side::Gpu, Side::Cpu, Side::Either].map(|s| self.sides[s.at()].len());
        let total: u64 = self.sorted.iter().sum();
        let cpu_share = match total {
            0 => 0.0,
            t => self.sorted[Side::Cpu.at()] as f64 / t as f64,
        };
        let unsorted = self.unsorted.len() as f64;
        (
            (g + e) as f64 + unsorted * (1.0 - cpu_share),
            c as f64 + unsorted * cpu_share,
        )
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

    /// CPU producers taking large plain JPEGs, not small ones.
    const LARGE: CpuTakes = CpuTakes {
        large: true,
        small: false,
    };

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
        assert_eq!(q.next(Side::Cpu, LARGE, by_three), Some(1));
        assert_eq!(q.next(Side::Gpu, LARGE, by_three), Some(0));
        assert_eq!(q.next(Side::Cpu, LARGE, by_three), Some(4));
        // The CPU's are gone: it takes what suits either.
        assert_eq!(q.next(Side::Cpu, LARGE, by_three), Some(2));
        // Not the GPU's while a GPU producer runs.
        assert_eq!(q.next(Side::Gpu, LARGE, by_three), Some(3));
        assert_eq!(q.next(Side::Cpu, LARGE, by_three), Some(5));
        assert_eq!(q.next(Side::Cpu, LARGE, by_three), None);
        assert_eq!(q.next(Side::Gpu, LARGE, by_three), None);
    }

    #[test]
    fn gpu_producers_take_the_cpus_inputs_and_cpus_the_gpus_only_when_allowed() {
        let mut q = Queue::new(3, true);
        assert_eq!(q.next(Side::Gpu, LARGE, |_| Side::Cpu), Some(0));
        let mut q = Queue::new(3, true);
        assert_eq!(q.next(Side::Cpu, LARGE, |_| Side::Gpu), None);
        assert_eq!(q.next(Side::Cpu, CpuTakes::ALL, |_| Side::Gpu), Some(0));
    }

    #[test]
    fn what_cpu_producers_take_by_routing() {
        use GpuState::*;
        let busy = Running {
            warm: true,
            full: true,
        };
        let cold = Running {
            warm: false,
            full: true,
        };
        let room = Running {
            warm: true,
            full: false,
        };
        // No GPU producer left: the CPU producers take everything, whatever the routing.
        for r in [Routing::ByKind, Routing::Shared, Routing::Measured] {
            for bound in [true, false] {
                assert_eq!(cpu_takes(r, [], bound), CpuTakes::ALL);
                assert_eq!(cpu_takes(r, [GaveUp, GaveUp], bound), CpuTakes::ALL);
            }
        }
        for bound in [true, false] {
            // By kind: large ones, never small ones while a GPU producer runs or starts.
            assert_eq!(cpu_takes(Routing::ByKind, [busy, busy], bound), LARGE);
            assert_eq!(cpu_takes(Routing::ByKind, [Starting], bound), LARGE);
            // Shared: small ones too once every GPU producer left is warm and full.
            let shared = |g: [GpuState; 2]| cpu_takes(Routing::Shared, g, bound);
            assert_eq!(shared([busy, busy]), CpuTakes::ALL);
            assert_eq!(shared([busy, GaveUp]), CpuTakes::ALL);
            assert_eq!(shared([busy, Starting]), LARGE);
            assert_eq!(shared([busy, cold]), LARGE);
            assert_eq!(shared([room, busy]), LARGE);
        }
        // Measured: as shared while the GPU producers are the bound, their own otherwise.
        let measured = |g: [GpuState; 2], bound| cpu_takes(Routing::Measured, g, bound);
        assert_eq!(measured([busy, busy], true), CpuTakes::ALL);
        assert_eq!(measured([busy, cold], true), LARGE);
        assert_eq!(measured([busy, busy], false), CpuTakes::OWN);
        assert_eq!(measured([room, Starting], false), CpuTakes::OWN);
    }

    #[test]
    fn cpu_producers_held_to_their_own_leave_the_plain_jpegs() {
        let mut q = Queue::new(6, true);
        assert_eq!(q.next(Side::Cpu, CpuTakes::OWN, by_three), Some(1));
        assert_eq!(q.next(Side::Cpu, CpuTakes::OWN, by_three), Some(4));
        assert_eq!(q.next(Side::Cpu, CpuTakes::OWN, by_three), None);
        // The GPU producers get the rest, their own first.
        assert_eq!(q.next(Side::Gpu, CpuTakes::OWN, by_three), Some(0));
        assert_eq!(q.next(Side::Gpu, CpuTakes::OWN, by_three), Some(3));
        assert_eq!(q.next(Side::Gpu, CpuTakes::OWN, by_three), Some(2));
        assert_eq!(q.next(Side::Gpu, CpuTakes::OWN, by_three), Some(5));
        assert!(q.is_empty());
    }

    #[test]
    fn what_waits_for_each_kind_counts_the_unsorted_as_the_sorted_went() {
        // Nothing sorted yet: all of it counted as the GPU producers'.
        let mut q = Queue::new(30, true);
        assert_eq!(q.waiting(), (30.0, 0.0));
        // A CPU producer looks ahead to its first input, the 21st: 20 plain JPEGs sorted, one
        // of its own; the 9 unsorted are shared as those 21 were.
        let only_20 = |i: u64| if i == 20 { Side::Cpu } else { Side::Gpu };
        assert_eq!(q.next(Side::Cpu, CpuTakes::OWN, only_20), Some(20));
        let (g, c) = q.waiting();
        assert!((g - (20.0 + 9.0 * 20.0 / 21.0)).abs() < 1e-9, "{g}");
        assert!((c - 9.0 / 21.0).abs() < 1e-9, "{c}");
        // Everything sorted: the counts themselves.
        let mut q = Queue::new(9, true);
        let every_third = |i: u64| if i % 3 == 1 { Side::Cpu } else { Side::Gpu };
        assert_eq!(q.next(Side::Cpu, CpuTakes::OWN, every_third), Some(1));
        assert_eq!(q.next(Side::Gpu, CpuTakes::OWN, every_third), Some(0));
        // Two sorted, one of each: the 7 unsorted counted half to each kind.
        assert_eq!(q.waiting(), (3.5, 3.5));
        while q.next(Side::Cpu, CpuTakes::OWN, every_third).is_some() {}
        assert_eq!(q.waiting(), (5.0, 0.0));
    }

    #[test]
    fn inputs_put_back_come_first_on_their_side() {
        let mut q = Queue::new(4, true);
        let a = q.next(Side::Gpu, LARGE, by_three).unwrap();
        let b = q.next(Side::Cpu, LARGE, by_three).unwrap();
        q.push_front(b);
        q.push_front(a);
        assert_eq!(q.next(Side::Cpu, LARGE, by_three), Some(b));
        assert_eq!(q.next(Side::Gpu, LARGE, by_three), Some(a));
    }

    #[test]
    fn without_routing_it_is_one_queue_and_sorts_nothing() {
        let mut q = Queue::new(3, false);
        let never = |_: u64| -> Side { panic!("sorted") };
        assert_eq!(q.next(Side::Cpu, LARGE, never), Some(0));
        q.push_front(0);
        assert_eq!(q.next(Side::Gpu, LARGE, never), Some(0));
        assert_eq!(q.next(Side::Gpu, LARGE, never), Some(1));
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
                .next(taker, LARGE, sort)
                .or_else(|| q.next(Side::Gpu, LARGE, sort))
            else {
                break;
            };
            assert!(!seen[i as usize], "{i} twice");
            seen[i as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
