//! How many of a batch's candidate files go to the hybrid decoders: as many as keep their host
//! threads finishing no later than the JPEG engines, from each side's measured cost per
//! megasample (the hybrid threads' time — apart for files Huffman-decoded on the CPU and on the
//! GPU —, the engines' batched calls' time), learnt batch by batch. A GPU producer whose host
//! threads are slow (busy cores, large files) gives the engines more; one whose engines are the
//! bottleneck gives the threads more.
//!
//! Sizes are in megasamples — pixels times the samples each carries (3 for 4:4:4, 2 for 4:2:2,
//! 1.5 for 4:2:0, 1 for gray) — since both decoders' work follows the coefficients to decode.

use crate::hybrid::{Huffman, Spent};
use crate::route::Route;
use tensorport_vision::sniff::Chroma;

/// The measured costs, in milliseconds per megasample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Costs {
    /// One hybrid thread's time per megasample decoded, by [`Huffman`] kind.
    pub hybrid: [f64; 2],
    /// The engines' batched calls' time per megasample decoded.
    pub engines: f64,
}

/// Weight of the newest batch in the learnt costs.
const LEARN: f64 = 0.25;

/// A file of a batch as the sharing sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Weighed {
    /// Its size in megasamples ([`megasamples`]).
    pub size: f64,
    /// Offered to the threads before the others (4:4:4, the engines' slow case).
    pub first: bool,
    /// Its decoder when the threads do not take it.
    pub fallback: Route,
    /// Where the threads would Huffman-decode it.
    pub huffman: Huffman,
}

/// The megasamples of a `width` × `height` image whose chroma is `chroma`.
pub(crate) fn megasamples(width: u32, height: u32, chroma: Chroma) -> f64 {
    let per_pixel = match chroma {
        Chroma::Gray => 1.0,
        Chroma::Quarter => 1.5,
        Chroma::HalfWidth => 2.0,
        Chroma::Full | Chroma::Other => 3.0,
    };
    f64::from(width) * f64::from(height) * per_pixel / 1e6
}

impl Default for Costs {
    /// Before anything is measured: a core's Huffman decoding, the GPU's, and the engines'
    /// rate, all rough; the first batches correct them.
    fn default() -> Costs {
        Costs {
            hybrid: [8.0, 1.0],
            engines: 0.3,
        }
    }
}

impl Costs {
    /// Sends back to their fallback the hybrid jobs of `routes` that would keep the hybrid
    /// decoder's `threads` busy past the engines: the `first` ones are offered before the
    /// others, each group in batch order. At least one job stays with the threads, so their
    /// cost keeps being measured.
    pub(crate) fn share(&self, routes: &mut [Route], jobs: &[Weighed], threads: usize) {
        let threads = threads.max(1) as f64;
        let mut engines: f64 = routes
            .iter()
            .zip(jobs)
            .filter(|(r, _)| **r != Route::Hybrid)
            .map(|(_, j)| j.size * self.engines)
            .sum();
        let mut hybrid = 0.0;
        let mut kept = 0;
        let offered = (0..routes.len())
            .filter(|&i| jobs[i].first)
            .chain((0..routes.len()).filter(|&i| !jobs[i].first));
        for i in offered {
            if routes[i] != Route::Hybrid {
                continue;
            }
            let p = jobs[i].size;
            let cost = p * self.hybrid[jobs[i].huffman as usize];
            let on_threads = (hybrid + cost) / threads;
            if kept == 0 || on_threads <= engines + p * self.engines {
                hybrid += cost;
                kept += 1;
            } else {
                routes[i] = jobs[i].fallback;
                engines += p * self.engines;
            }
        }
    }

    /// Learns from a batch: the hybrid threads' summed time and megasamples by kind, the
    /// engines' batched calls' time and megasamples (a side with nothing decoded teaches
    /// nothing).
    pub(crate) fn learn(&mut self, hybrid: Spent, engines: (f64, f64)) {
        let [cpu, gpu] = &mut self.hybrid;
        for ((ms, mp), cost) in [
            (hybrid[0], cpu),
            (hybrid[1], gpu),
            (engines, &mut self.engines),
        ] {
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

    /// 4:4:4 files of these sizes, in batch order.
    fn plain(sizes: &[f64]) -> Vec<Weighed> {
        sizes
            .iter()
            .map(|&size| Weighed {
                size,
                first: true,
                fallback: BatchedPlain,
                huffman: Huffman::Cpu,
            })
            .collect()
    }

    #[test]
    fn the_threads_get_what_they_finish_before_the_engines() {
        // The threads 8 times slower per megapixel than the engines, 4 of them: half a
        // megapixel on each side of 1 MP of subsampled files takes the engines 1 ms.
        let c = Costs {
            hybrid: [8.0, 8.0],
            engines: 1.0,
        };
        let mut routes = [Batched, Hybrid, Hybrid, Hybrid, Hybrid];
        c.share(&mut routes, &plain(&[1.0, 0.25, 0.25, 0.25, 0.25]), 4);
        // Each file goes where it finishes sooner: two on the threads take (2 + 2) / 4 = 1 ms;
        // a third would end at 1.5 ms there against 1.25 on the engines, so the engines take it;
        // the fourth ends at 1.5 ms either way and stays on the threads.
        assert_eq!(routes, [Batched, Hybrid, Hybrid, BatchedPlain, Hybrid]);
    }

    #[test]
    fn at_least_one_stays_on_the_threads_and_fast_threads_take_all() {
        let slow = Costs {
            hybrid: [1000.0, 1000.0],
            engines: 1.0,
        };
        let mut routes = [Hybrid, Hybrid];
        slow.share(&mut routes, &plain(&[0.5, 0.5]), 2);
        assert_eq!(routes, [Hybrid, BatchedPlain]);
        let fast = Costs {
            hybrid: [0.1, 0.1],
            engines: 1.0,
        };
        let mut routes = [Batched, Hybrid, Hybrid, Hybrid];
        fast.share(&mut routes, &plain(&[0.2, 0.5, 0.5, 0.5]), 8);
        assert_eq!(routes, [Batched, Hybrid, Hybrid, Hybrid]);
    }

    #[test]
    fn full_chroma_files_are_offered_first_and_each_falls_back_to_its_own_decoder() {
        let c = Costs {
            hybrid: [4.0, 4.0],
            engines: 1.0,
        };
        // Two subsampled files (1 Ms each) before one 4:4:4 file (1 Ms); two threads. The
        // 4:4:4 file is offered first: (0 + 4) / 2 = 2 ms against the engines' 0 → kept (the
        // first always is). The next: (4 + 4) / 2 = 4 ms against 0 + 1 → engines; the last:
        // 4 ms against 1 + 1 → engines.
        let jobs = [
            Weighed {
                size: 1.0,
                first: false,
                fallback: Batched,
                huffman: Huffman::Cpu,
            },
            Weighed {
                size: 1.0,
                first: false,
                fallback: Batched,
                huffman: Huffman::Cpu,
            },
            Weighed {
                size: 1.0,
                first: true,
                fallback: BatchedPlain,
                huffman: Huffman::Cpu,
            },
        ];
        let mut routes = [Hybrid, Hybrid, Hybrid];
        c.share(&mut routes, &jobs, 2);
        assert_eq!(routes, [Batched, Batched, Hybrid]);
        // With eight fast threads every file stays on them.
        let fast = Costs {
            hybrid: [0.5, 0.5],
            engines: 1.0,
        };
        let mut routes = [Hybrid, Hybrid, Hybrid];
        fast.share(&mut routes, &jobs, 8);
        assert_eq!(routes, [Hybrid, Hybrid, Hybrid]);
    }

    #[test]
    fn sizes_count_the_samples_of_each_chroma() {
        assert_eq!(megasamples(1000, 1000, Chroma::Full), 3.0);
        assert_eq!(megasamples(1000, 1000, Chroma::HalfWidth), 2.0);
        assert_eq!(megasamples(1000, 1000, Chroma::Quarter), 1.5);
        assert_eq!(megasamples(1000, 1000, Chroma::Gray), 1.0);
    }

    #[test]
    fn each_kind_of_hybrid_job_costs_what_its_own_kind_measured() {
        // Huffman decoding on the CPU 10 ms per megasample, on the GPU 1; the engines 1. One
        // thread. A large file (GPU Huffman) is offered after a small one (CPU Huffman).
        let c = Costs {
            hybrid: [10.0, 1.0],
            engines: 1.0,
        };
        let job = |size, huffman| Weighed {
            size,
            first: false,
            fallback: Batched,
            huffman,
        };
        let jobs = [
            job(0.5, Huffman::Cpu),
            job(0.5, Huffman::Cpu),
            job(3.0, Huffman::Gpu),
            job(3.0, Huffman::Gpu),
        ];
        let mut routes = [Hybrid; 4];
        c.share(&mut routes, &jobs, 1);
        // The first small one stays (5 ms); the second would end at 10 ms against 0.5 → the
        // engines; the first large one at 8 against 0.5 + 3 → engines (3.5); the second at 8
        // against 3.5 + 3 = 6.5 → engines.
        assert_eq!(routes, [Hybrid, Batched, Batched, Batched]);
        // With cheap CPU Huffman and two threads the small ones stay and a large one fits
        // beside them ((1 + 3) / 2 = 2 ms against 3); the other would end at 3.5 against 3.
        let c = Costs {
            hybrid: [1.0, 1.0],
            engines: 1.0,
        };
        let mut routes = [Hybrid; 4];
        c.share(&mut routes, &jobs, 2);
        assert_eq!(routes, [Hybrid, Hybrid, Hybrid, Batched]);
    }

    #[test]
    fn costs_move_toward_what_a_batch_measured() {
        let mut c = Costs::default();
        c.learn([(40.0, 2.0), (0.0, 0.0)], (0.0, 0.0));
        assert_eq!(c.engines, Costs::default().engines);
        assert_eq!(c.hybrid[1], Costs::default().hybrid[1]);
        let start = Costs::default().hybrid[0];
        assert!((c.hybrid[0] - (start + LEARN * (20.0 - start))).abs() < 1e-9);
        for _ in 0..50 {
            c.learn([(40.0, 2.0), (6.0, 3.0)], (3.0, 2.0));
        }
        assert!((c.hybrid[0] - 20.0).abs() < 0.01);
        assert!((c.hybrid[1] - 2.0).abs() < 0.01 && (c.engines - 1.5).abs() < 0.01);
        // Nonsense teaches nothing.
        let before = c;
        c.learn([(f64::NAN, 1.0), (-1.0, 1.0)], (-1.0, 1.0));
        assert_eq!(c, before);
    }
}
