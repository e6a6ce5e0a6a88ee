//! A model of a farm's hand-out, in simulated milliseconds: GPU and CPU producers with fixed
//! costs per kind of input take from one [`Queue`] as the supervisor gives (GPU producers
//! first, to their depth; then CPU producers, as [`cpu_takes`] allows, with
//! [`gpu_bound`](super::bound::gpu_bound) from their rates), so the routings can be compared on
//! a folder where the CPU producers are the bound and on one where the GPU producers are.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::bound::{gpu_bound, Left, Pace};
use super::route::{cpu_takes, CpuTakes, GpuState, Queue, Side};
use crate::config::Routing;

/// Inputs a GPU producer and a CPU producer may hold (the farm's defaults).
const GPU_DEPTH: usize = 256;
const CPU_DEPTH: usize = 16;

struct Producer {
    gpu: bool,
    /// When it can start work (a GPU producer's CUDA start).
    ready_at: u64,
    held: VecDeque<u64>,
    /// The input it works on and when that is done.
    working: Option<(u64, u64)>,
    warm: bool,
}

/// What a run of the model gave: when the last input was done, and how many large plain
/// JPEGs the CPU producers prepared.
#[derive(Debug)]
pub(super) struct Outcome {
    pub ms: u64,
    pub large_on_cpu: u64,
}

/// Runs `n` inputs of sides `side(i)` through `gpus` GPU and `cpus` CPU producers under
/// `routing`; `cost(gpu, side)` is a producer's time for one input in ms.
pub(super) fn run(
    routing: Routing,
    n: u64,
    side: impl Fn(u64) -> Side,
    (gpus, cpus): (usize, usize),
    cost: impl Fn(bool, Side) -> u64,
    gpu_start_ms: u64,
) -> Outcome {
    let t0 = Instant::now();
    let mut q = Queue::new(n, true);
    let mut ps: Vec<Producer> = (0..gpus + cpus)
        .map(|k| Producer {
            gpu: k < gpus,
            ready_at: if k < gpus { gpu_start_ms } else { 0 },
            held: VecDeque::new(),
            working: None,
            warm: false,
        })
        .collect();
    let mut pace = [Pace::default(); 2];
    let (mut done, mut large_on_cpu) = (0u64, 0u64);
    for t in 0.. {
        let now = t0 + Duration::from_millis(t);
        for p in ps.iter_mut() {
            if let Some((i, end)) = p.working {
                if end <= t {
                    p.working = None;
                    p.warm = true;
                    done += 1;
                    pace[usize::from(!p.gpu)].result(now);
                    if !p.gpu && side(i) == Side::Either {
                        large_on_cpu += 1;
                    }
                }
            }
        }
        if done == n {
            return Outcome {
                ms: t,
                large_on_cpu,
            };
        }
        // The supervisor's hand-out: GPU producers first, then the CPU producers.
        for p in ps.iter_mut().filter(|p| p.gpu && p.ready_at <= t) {
            while p.held.len() + usize::from(p.working.is_some()) < GPU_DEPTH {
                let Some(i) = q.next(Side::Gpu, CpuTakes::OWN, &side) else {
                    break;
                };
                p.held.push_back(i);
            }
        }
        let held = |gpu: bool| -> u64 {
            ps.iter()
                .filter(|p| p.gpu == gpu)
                .map(|p| (p.held.len() + usize::from(p.working.is_some())) as u64)
                .sum()
        };
        let (gw, cw) = q.waiting();
        let bound = gpu_bound(
            (
                Left {
                    held: held(true),
                    queued: gw,
                },
                pace[0].rate(now),
            ),
            (
                Left {
                    held: held(false),
                    queued: cw,
                },
                pace[1].rate(now),
            ),
        );
        let states: Vec<GpuState> = ps
            .iter()
            .filter(|p| p.gpu)
            .map(|p| match p.ready_at <= t {
                true => GpuState::Running {
                    warm: p.warm,
                    full: p.held.len() + usize::from(p.working.is_some()) >= GPU_DEPTH,
                },
                false => GpuState::Starting,
            })
            .collect();
        let cpu = cpu_takes(routing, states, routing == Routing::Measured && bound);
        for p in ps.iter_mut().filter(|p| !p.gpu) {
            while p.held.len() + usize::from(p.working.is_some()) < CPU_DEPTH {
                let Some(i) = q.next(Side::Cpu, cpu, &side) else {
                    break;
                };
                p.held.push_back(i);
            }
        }
        for p in ps
            .iter_mut()
            .filter(|p| p.ready_at <= t && p.working.is_none())
        {
            if let Some(i) = p.held.pop_front() {
                p.working = Some((i, t + cost(p.gpu, side(i)).max(1)));
            }
        }
    }
    unreachable!()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Costs in ms for one producer, as measured on the H100 machine's varied photos
    /// (docs/benchmarks.md): a large plain JPEG 60 on a CPU producer and 3 on a GPU producer's
    /// engines; a progressive one 40 on a CPU producer and a quarter of that on a GPU
    /// producer's four threads.
    fn cost(gpu: bool, side: Side) -> u64 {
        match (gpu, side) {
            (false, Side::Cpu) => 40,
            (false, Side::Either) => 60,
            (false, _) => 5,
            (true, Side::Cpu) => 10,
            (true, Side::Either) => 3,
            (true, _) => 1,
        }
    }

    /// In every 40 inputs, `cpu` for the CPU producers, then `large` large plain JPEGs, then
    /// small ones.
    fn folder(cpu: u64, large: u64) -> impl Fn(u64) -> Side + Copy {
        move |i| match i % 40 {
            k if k < cpu => Side::Cpu,
            k if k < cpu + large => Side::Either,
            _ => Side::Gpu,
        }
    }

    fn both(f: impl Fn(u64) -> Side + Copy) -> (Outcome, Outcome) {
        let run = |r| run(r, 4000, f, (2, 12), cost, 1000);
        (run(Routing::Shared), run(Routing::Measured))
    }

    #[test]
    fn measured_routing_stops_cpu_producers_taking_large_jpegs_they_would_finish_last() {
        // The shares of the varied photo set (bench/make_sets.sh): 18% progressive or gray
        // (the CPU producers'), 33% large baseline files. The CPU producers run out of their
        // own now and then and take large plain JPEGs, which the GPU producers would have
        // finished sooner.
        let (shared, measured) = both(folder(7, 13));
        assert!(shared.large_on_cpu > 0, "{shared:?}");
        assert!(
            measured.large_on_cpu < shared.large_on_cpu,
            "{shared:?} {measured:?}"
        );
        assert!(measured.ms < shared.ms, "{shared:?} {measured:?}");
    }

    #[test]
    fn measured_routing_lets_cpu_producers_help_where_the_gpu_producers_are_the_bound() {
        // Baseline photos, half of them large: the engines are behind throughout.
        let (shared, measured) = both(folder(0, 20));
        assert!(measured.large_on_cpu > 0, "{measured:?}");
        assert!(measured.ms <= shared.ms, "{shared:?} {measured:?}");
    }

    #[test]
    fn measured_routing_is_never_slower_in_the_model() {
        for (cpu, large) in [
            (7, 13),
            (12, 10),
            (4, 26),
            (0, 20),
            (0, 0),
            (20, 20),
            (40, 0),
        ] {
            let (shared, measured) = both(folder(cpu, large));
            assert!(
                measured.ms <= shared.ms,
                "{cpu}/{large}: {shared:?} {measured:?}"
            );
        }
    }
}
