//! How many of a batch's 4:4:4 files go to the hybrid decoder: as many as keep its host threads
//! finishing no later than the JPEG engines, from each side's measured cost per megapixel (the
//! hybrid threads' time, the engines' batched calls' time), learnt batch by batch. A GPU
//! producer whose host threads are slow (busy cores, large files) gives the engines more; one
//! whose engines are the bottleneck gives the threads more.

use crate::route::Route;

/// The measured costs, in milliseconds per megapixel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Costs {
    /// One hybrid thread's time per megapixel decoded.
    pub hybrid: f64,
    /// The engines' batched calls' time per megapixel decoded.
    pub engines: f64,
}

/// Weight of the newest batch in the learnt costs.
const LEARN: f64 = 0.25;

impl Default for Costs {
    /// Before anything is measured: a core's Huffman decoding against the engines' rate on
    /// ImageNet-sized files, both rough; the first batches correct them.
    fn default() -> Costs {
        Costs {
            hybrid: 4.0,
            engines: 0.5,
        }
    }
}

impl Costs {
    /// Sends back to `fallback` the hybrid jobs of `routes` that would keep the hybrid
    /// decoder's `threads` busy past the engines, in batch order; `mpx[i]` is job `i`'s size
    /// in megapixels. At least one job stays with the threads, so their cost keeps being
    /// measured.
    pub(crate) fn share(&self, routes: &mut [Route], mpx: &[f64], threads: usize, fallback: Route) {
        let threads = threads.max(1) as f64;
        let mut engines: f64 = routes
            .iter()
            .zip(mpx)
            .filter(|(r, _)| **r != Route::Hybrid)
            .map(|(_, p)| p * self.engines)
            .sum();
        let mut hybrid = 0.0;
        let mut kept = 0;
        for (r, p) in routes.iter_mut().zip(mpx) {
            if *r != Route::Hybrid {
                continue;
            }
            let on_threads = (hybrid + p * self.hybrid) / threads;
            if kept == 0 || on_threads <= engines + p * self.engines {
                hybrid += p * self.hybrid;
                kept += 1;
            } else {
                *r = fallback;
                engines += p * self.engines;
            }
        }
    }

    /// Learns from a batch: the hybrid threads' summed time and megapixels, the engines'
    /// batched calls' time and megapixels (a side with nothing decoded teaches nothing).
    pub(crate) fn learn(&mut self, hybrid: (f64, f64), engines: (f64, f64)) {
        for ((ms, mp), cost) in [(hybrid, &mut self.hybrid), (engines, &mut self.engines)] {
            if mp > 0.0 && ms.is_finite() && ms >= 0.0 {
                *cost += LEARN * (ms / mp - *cost);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Route::*;

    #[test]
    fn the_threads_get_what_they_finish_before_the_engines() {
        // The threads 8 times slower per megapixel than the engines, 4 of them: half a
        // megapixel on each side of 1 MP of subsampled files takes the engines 1 ms.
        let c = Costs {
            hybrid: 8.0,
            engines: 1.0,
        };
        let mut routes = [Batched, Hybrid, Hybrid, Hybrid, Hybrid];
        c.share(&mut routes, &[1.0, 0.25, 0.25, 0.25, 0.25], 4, BatchedPlain);
        // Each file goes where it finishes sooner: two on the threads take (2 + 2) / 4 = 1 ms;
        // a third would end at 1.5 ms there against 1.25 on the engines, so the engines take it;
        // the fourth ends at 1.5 ms either way and stays on the threads.
        assert_eq!(routes, [Batched, Hybrid, Hybrid, BatchedPlain, Hybrid]);
    }

    #[test]
    fn at_least_one_stays_on_the_threads_and_fast_threads_take_all() {
        let slow = Costs {
            hybrid: 1000.0,
            engines: 1.0,
        };
        let mut routes = [Hybrid, Hybrid];
        slow.share(&mut routes, &[0.5, 0.5], 2, BatchedPlain);
        assert_eq!(routes, [Hybrid, BatchedPlain]);
        let fast = Costs {
            hybrid: 0.1,
            engines: 1.0,
        };
        let mut routes = [Batched, Hybrid, Hybrid, Hybrid];
        fast.share(&mut routes, &[0.2, 0.5, 0.5, 0.5], 8, BatchedPlain);
        assert_eq!(routes, [Batched, Hybrid, Hybrid, Hybrid]);
    }

    #[test]
    fn costs_move_toward_what_a_batch_measured() {
        let mut c = Costs::default();
        c.learn((40.0, 2.0), (0.0, 0.0));
        assert_eq!(c.engines, Costs::default().engines);
        assert!((c.hybrid - (4.0 + LEARN * (20.0 - 4.0))).abs() < 1e-9);
        for _ in 0..50 {
            c.learn((40.0, 2.0), (3.0, 2.0));
        }
        assert!((c.hybrid - 20.0).abs() < 0.01 && (c.engines - 1.5).abs() < 0.01);
        // Nonsense teaches nothing.
        let before = c;
        c.learn((f64::NAN, 1.0), (-1.0, 1.0));
        assert_eq!(c, before);
    }
}
