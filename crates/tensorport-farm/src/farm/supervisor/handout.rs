//! Handing inputs out: each producer up to its depth, the kind of input that suits it first;
//! at the end of the queue, second copies of inputs another producer still holds (hedging).

use super::*;
use crate::config::Routing;
use crate::farm::bound::{gpu_bound, Left};

impl Supervisor {
    /// Gives each running producer inputs up to its depth, on its worklist (stdin): the GPU
    /// producers first, so that CPU producers sharing plain JPEGs take only what the GPU
    /// producers have no room for.
    pub(in crate::farm) fn hand_out(&mut self) {
        if self.stopping.is_some() {
            return;
        }
        let gpu_depth = 2 * self.farm.cfg.gpu_in_flight as usize;
        // GPU producers first (what CPU producers may take matters only to them).
        for slot in 0..self.workers.len() {
            if self.workers[slot].gpu {
                self.give(slot, gpu_depth, CpuTakes::OWN);
            }
        }
        let gpus = self
            .workers
            .iter()
            .filter(|w| w.gpu)
            .map(|w| match w.state {
                State::Running { .. } => GpuState::Running {
                    warm: w.warm,
                    full: w.assigned.len() >= gpu_depth,
                },
                State::GaveUp => GpuState::GaveUp,
                _ => GpuState::Starting,
            });
        let routing = self.farm.cfg.run.routing;
        let gpu_bound = routing == Routing::Measured && self.gpu_bound();
        let cpu = cpu_takes(routing, gpus, gpu_bound);
        for slot in 0..self.workers.len() {
            if !self.workers[slot].gpu {
                self.give(slot, self.depth, cpu);
            }
        }
        if self.queue.is_empty() {
            self.hedge(gpu_depth);
        }
    }

    /// Whether the GPU producers bound the run now ([`super::super::bound::gpu_bound`]): the
    /// inputs each kind's producers hold and those waiting for it, over the kind's rate.
    fn gpu_bound(&self) -> bool {
        let now = Instant::now();
        let held = |gpu: bool| -> u64 {
            self.workers
                .iter()
                .filter(|w| w.gpu == gpu)
                .map(|w| w.assigned.len() as u64)
                .sum()
        };
        let (gpu_waiting, cpu_waiting) = self.queue.waiting();
        let left = |gpu: bool, queued: f64| Left {
            held: held(gpu),
            queued,
        };
        gpu_bound(
            (left(true, gpu_waiting), self.pace[0].rate(now)),
            (left(false, cpu_waiting), self.pace[1].rate(now)),
        )
    }

    /// Once every input is handed out, a producer with nothing to do also takes inputs that
    /// another holds and has likely not started (the last it was given, from the one holding
    /// the most), so the end of a run never waits on a slow or stopped producer while another
    /// idles. Each input is given a second time at most; its first result counts, and the
    /// other producer is told to leave it out ([`crate::record::withdraw_record`]).
    pub(super) fn hedge(&mut self, gpu_depth: usize) {
        for slot in 0..self.workers.len() {
            let w = &self.workers[slot];
            let idle = matches!(w.state, State::Running { stdin: Some(_), .. })
                && w.warm
                && w.assigned.is_empty();
            if !idle {
                continue;
            }
            let room = if w.gpu { gpu_depth } else { self.depth };
            let ledger = &self.ledger;
            let unhedged = |d: usize| {
                self.workers[d]
                    .assigned
                    .iter()
                    .rev()
                    .filter(|&&i| !ledger.is_hedged(i) && !ledger.is_done(i))
            };
            let Some(donor) = (0..self.workers.len())
                .filter(|&d| d != slot)
                .map(|d| (unhedged(d).count(), d))
                .filter(|&(n, _)| n > 0)
                .max()
                .map(|(_, d)| d)
            else {
                return;
            };
            let take: Vec<u64> = unhedged(donor).take(room).copied().collect();
            let mut batch = Vec::new();
            for &i in &take {
                batch.extend(crate::record::work_record(i, &self.inputs[i as usize]));
            }
            let w = &mut self.workers[slot];
            let State::Running {
                stdin: Some(stdin), ..
            } = &mut w.state
            else {
                continue;
            };
            if stdin.write_all(&batch).and_then(|_| stdin.flush()).is_ok() {
                w.assigned.extend(take.iter().copied());
                for i in take {
                    self.ledger.hedge(i);
                }
            }
        }
    }

    /// Gives producer `slot`, if it runs, inputs up to `depth` held.
    pub(super) fn give(&mut self, slot: usize, depth: usize, cpu: CpuTakes) {
        let w = &mut self.workers[slot];
        let State::Running {
            stdin: Some(stdin), ..
        } = &mut w.state
        else {
            return;
        };
        let mut batch = Vec::new();
        let mut given = Vec::new();
        let side = if w.gpu { Side::Gpu } else { Side::Cpu };
        while w.assigned.len() + given.len() < depth {
            let next = self
                .queue
                .next(side, cpu, |i| suits(&self.inputs[i as usize]));
            let Some(i) = next else {
                break;
            };
            if self.ledger.is_done(i) {
                continue;
            }
            batch.extend(crate::record::work_record(i, &self.inputs[i as usize]));
            given.push(i);
        }
        if given.is_empty() {
            return;
        }
        if stdin.write_all(&batch).and_then(|_| stdin.flush()).is_ok() {
            w.assigned.extend(given);
        } else {
            // It is dying; its EOF will come. Keep the inputs for someone else.
            for i in given.into_iter().rev() {
                self.queue.push_front(i);
            }
        }
    }
}

/// Plain JPEGs of this many pixels or more suit either kind of producer.
const EITHER_PIXELS: u64 = 2_000_000;

/// The kind of producer that prepares `source` best: GPU producers decode plain JPEGs on the
/// GPU's engines and anything else on the CPU; large plain JPEGs suit either
/// ([`Side::Either`]): a CPU producer with room takes them (with [`Routing::Measured`] only
/// while the GPU producers are the slower side: `route::cpu_takes`).
pub(super) fn suits(source: &Source) -> Side {
    let Source::File(p) = source else {
        return Side::Cpu;
    };
    match tensorport_vision::sniff::jpeg_file_frame(p) {
        Some(f) if f.is_plain() => {
            if u64::from(f.width) * u64::from(f.height) >= EITHER_PIXELS {
                Side::Either
            } else {
                Side::Gpu
            }
        }
        _ => Side::Cpu,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `w`×`h` image of a few colours, written as `name` in `dir` (its format from the
    /// name), its bytes returned.
    fn write(dir: &std::path::Path, name: &str, w: u32, h: u32, gray: bool) -> Vec<u8> {
        let rgb = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x * 7) as u8, (y * 5) as u8, ((x + y) * 3) as u8])
        });
        let img = match gray {
            true => image::DynamicImage::ImageLuma8(image::DynamicImage::ImageRgb8(rgb).to_luma8()),
            false => image::DynamicImage::ImageRgb8(rgb),
        };
        let path = dir.join(name);
        img.save(&path).unwrap();
        std::fs::read(&path).unwrap()
    }

    #[test]
    fn real_files_go_to_the_producers_that_decode_them() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| Source::File(dir.path().join(name));
        write(dir.path(), "small.jpg", 64, 48, false);
        // 2.16 megapixels: either kind of producer.
        write(dir.path(), "large.jpg", 1800, 1200, false);
        write(dir.path(), "gray.jpg", 64, 48, true);
        write(dir.path(), "image.png", 64, 48, false);
        // A real baseline file whose frame header says progressive (SOF2): what the engines
        // do not take.
        let mut progressive = write(dir.path(), "base.jpg", 64, 48, false);
        let sof = progressive
            .windows(2)
            .position(|w| w == [0xFF, 0xC0])
            .expect("a baseline frame header");
        progressive[sof + 1] = 0xC2;
        std::fs::write(dir.path().join("progressive.jpg"), &progressive).unwrap();
        std::fs::write(dir.path().join("broken.jpg"), b"\xFF\xD8 not a JPEG").unwrap();
        assert_eq!(suits(&at("small.jpg")), Side::Gpu);
        assert_eq!(suits(&at("base.jpg")), Side::Gpu);
        assert_eq!(suits(&at("large.jpg")), Side::Either);
        assert_eq!(suits(&at("gray.jpg")), Side::Cpu, "grayscale: the CPU's");
        assert_eq!(suits(&at("progressive.jpg")), Side::Cpu);
        assert_eq!(suits(&at("image.png")), Side::Cpu);
        assert_eq!(suits(&at("broken.jpg")), Side::Cpu);
        assert_eq!(suits(&at("missing.jpg")), Side::Cpu);
        assert_eq!(suits(&Source::Synthetic(3)), Side::Cpu);
    }
}
