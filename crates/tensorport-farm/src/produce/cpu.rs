//! The CPU producer: each image is decoded, resized, cropped and normalised straight into a slot
//! of this producer's pool (no copy), then submitted; up to `in_flight` requests are
//! outstanding at once.

use std::time::{Duration, Instant};

use tensorport::{Producer, ProducerConfig, TensorSpec};
use tensorport_vision::Source;

use super::{refuse_again, submitted, Outstanding};
use crate::config::ProduceConfig;
use crate::error::{ConfigError, Result};
use crate::feed::{Feed, Input, Next};
use crate::record::{ms, LineWriter, StageTimes};

pub(super) fn run(cfg: &ProduceConfig, feed: &Feed, lines: &mut LineWriter) -> Result<()> {
    let size = cfg.image_size;
    let pixels = cfg.prep.pixels;
    let image_bytes = (3 * size * size * pixels.bytes()) as u64;
    let mut pc = ProducerConfig::new(cfg.name.clone());
    pc.slots = cfg.in_flight.max(1);
    pc.slot_size = image_bytes;
    pc.spin = cfg.spin;
    let mut p = super::connect_when_listening(
        cfg.wait_for_server,
        || Producer::connect(&cfg.socket, pc.clone()),
        |e| matches!(e, tensorport::ConnectError::NoServer { .. }),
    )?;
    if p.slot_size() < image_bytes {
        return Err(ConfigError::SlotTooSmall {
            given: p.slot_size(),
            needed: image_bytes,
            size,
        }
        .into());
    }
    let spec = TensorSpec::new(pixels.dtype(), &[3, size as u64, size as u64]);
    let mut prep = cfg.prep.preprocessor(size as u32)?;
    let ready: Option<Vec<u8>> = if cfg.ready {
        // Bytes, as f32 or u8 (a Vec<f32>'s buffer keeps the f32 view aligned).
        let mut px = vec![0f32; 3 * size * size];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut px);
        let bytes = &mut bytes[..image_bytes as usize];
        prep.prepare_into(&Source::Synthetic(0), pixels.planes(bytes)?)?;
        Some(bytes.to_vec())
    } else {
        None
    };
    let timeout = cfg.timeout.max(Duration::from_secs(1));
    let depth = (cfg.in_flight.max(1) as usize).min(p.max_in_flight() as usize);
    let mut out = Outstanding::new(timeout);
    let mut eof = false;
    loop {
        // Keep the pipeline full.
        while !eof && out.len() < depth {
            let wait = if out.is_empty() {
                Duration::from_millis(200)
            } else {
                Duration::ZERO
            };
            let mut input = match feed.next(wait) {
                Next::Input(it) => it,
                Next::Wait => break,
                Next::Done => {
                    eof = true;
                    break;
                }
            };
            let held = out.holds(input.index);
            if refuse_again(&mut input, held, feed, lines)? {
                continue;
            }
            let Input {
                index,
                source,
                bytes,
            } = input;
            let t0 = Instant::now();
            let mut lease = p.lease(timeout)?;
            let slot = &mut lease.bytes_mut()[..image_bytes as usize];
            let mut st = StageTimes {
                lease_ms: ms(t0.elapsed()),
                ..StageTimes::default()
            };
            let prepared = match (&ready, bytes, &source) {
                (Some(px), _, _) => {
                    slot.copy_from_slice(px);
                    Ok(())
                }
                (None, Some((Ok(buf), read)), Source::File(path)) => {
                    st.read_ms = ms(read);
                    let r = prep.prepare_encoded_into(&buf, path, pixels.planes(slot)?);
                    feed.reuse(buf);
                    r
                }
                (None, Some((Err(e), _)), _) => Err(e),
                (None, _, _) => prep.prepare_into(&source, pixels.planes(slot)?),
            };
            if ready.is_none() {
                let s = prep.last_stages();
                st.decode_ms = ms(s.decode);
                st.resize_ms = ms(s.resize);
                st.normalise_ms = ms(s.normalise);
            }
            if let Err(e) = prepared {
                drop(lease);
                lines.failed(index, &source, e.to_string(), Some(t0), Some(st))?;
                continue;
            }
            let before_submit = Instant::now();
            lease.submit_as(index, &spec)?;
            st.submit_ms = ms(before_submit.elapsed());
            out.insert(submitted(index, &source, t0, st));
        }
        if out.is_empty() {
            if eof {
                break;
            }
            continue;
        }
        // With room in the pipeline, wait for a result only briefly before looking for new
        // input again: an input that arrives while we wait must not sit idle for a whole
        // result's round trip (that starved busy producers).
        let c = if !eof && out.len() < depth {
            match p.recv_result(Duration::from_millis(1)) {
                Ok(c) => c,
                Err(tensorport::RecvError::Timeout(..)) => {
                    out.check_overdue()?;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            p.recv_result(timeout)?
        };
        out.answer(c, lines)?;
    }
    let _ = p.close();
    Ok(())
}
