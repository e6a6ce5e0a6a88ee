//! A progressive JPEG without its AC refinement scans. A progressive file sends each block's AC
//! coefficients first with their low bits left out (successive approximation), then refines
//! them bit by bit in later scans, which hold most of the file's bytes and cost libjpeg-turbo
//! most of its entropy decoding. A photo shrunk several times over by the transform's
//! antialiasing resize keeps little of what those bits add; dropping the scans (and nothing
//! else: the tables, the frame, every first scan and the DC refinement stay, in order) gives a
//! valid progressive JPEG that libjpeg decodes with the AC coefficients it has.
//!
//! The walk trusts nothing in the file: every length is checked against the bytes there, it
//! gives up past [`MAX_SEGMENTS`] markers, and a file it cannot walk to its end is left whole.

/// Markers walked before giving up (a progressive file has a few dozen).
const MAX_SEGMENTS: usize = 1024;

/// The most entropy-decoding work a JPEG may ask for, in passes over its blocks: the sum over
/// its scans of the blocks each scan covers, over the blocks of its frame. A baseline file
/// makes one pass; libjpeg's progressive scripts make 4.7 (4:4:4) to 6 (greyscale); a crafted
/// file with hundreds of refinement scans makes hundreds, each costing a full pass.
pub const MAX_WORK_PASSES: u64 = 16;

/// The coefficient memory any JPEG may have its decoder hold, in bytes: a progressive (or
/// multi-scan) file is decoded through a buffer of every block's 64 coefficients (128 bytes a
/// block) for the whole frame, whatever part of the image the transform keeps. Up to this much
/// whatever the file's size: every frame to 44 megapixels at 4:2:0, 22 at 4:4:4 (a camera's
/// photo, however well it compresses).
pub const COEFFICIENT_FLOOR: u64 = 128 << 20;

/// Beyond [`COEFFICIENT_FLOOR`], a file may ask for this many bytes of coefficients per byte of
/// itself: a photo holds at least one byte for every 256 coefficient bytes of its frame (0.1
/// bits per pixel at 4:2:0, 0.2 at 4:4:4), while a crafted file of a few hundred bytes that
/// declares a 64-megapixel progressive frame asks for 384 MB.
pub const COEFFICIENT_BYTES_PER_FILE_BYTE: u64 = 256;

/// Writes into `out` the JPEG `jpeg` without its AC refinement scans (those with a spectral
/// start above 0 and a successive-approximation high bit above 0). Returns how many scans were
/// left out: 0, with `out` empty, where there were none or the file's markers do not walk from
/// its start to its end marker — the caller then decodes `jpeg` itself.
pub(crate) fn without_ac_refinement(jpeg: &[u8], out: &mut Vec<u8>) -> usize {
    out.clear();
    match walk(jpeg, out) {
        Some(dropped) if dropped > 0 => dropped,
        _ => {
            out.clear();
            0
        }
    }
}

fn walk(jpeg: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    let mut segments = Segments::new(jpeg)?;
    out.reserve(jpeg.len());
    out.extend_from_slice(&jpeg[..2]);
    let mut dropped = 0;
    for seg in segments.by_ref() {
        match seg.scan() {
            Some(scan) if scan.ss > 0 && scan.ah > 0 => dropped += 1,
            _ => out.extend_from_slice(&jpeg[seg.start..seg.end]),
        }
    }
    let eoi = segments.eoi?;
    out.extend_from_slice(&jpeg[eoi]);
    Some(dropped)
}

/// Checks that decoding `jpeg` asks for at most [`MAX_WORK_PASSES`] passes over its blocks
/// (see there), counting scan by scan, so a file is refused at the first scan past the bound
/// even if it is cut short after it; and that a file decoded through a whole-frame coefficient
/// buffer (progressive, or a second scan) asks for at most [`COEFFICIENT_FLOOR`] or
/// [`COEFFICIENT_BYTES_PER_FILE_BYTE`] times its size, whichever is more. A file whose markers
/// do not walk is checked as far as they do; the decoder says what else is wrong with it.
pub(crate) fn check_work(jpeg: &[u8]) -> Result<(), String> {
    let Some(segments) = Segments::new(jpeg) else {
        return Ok(());
    };
    // Each component's id and blocks; the frame's blocks.
    let mut comps: Vec<(u8, u64)> = Vec::new();
    let mut frame_blocks = 0u64;
    let mut work = 0u64;
    let mut scans = 0u32;
    let mut progressive = false;
    let memory_bound =
        COEFFICIENT_FLOOR.max(COEFFICIENT_BYTES_PER_FILE_BYTE.saturating_mul(jpeg.len() as u64));
    let check_memory = |frame_blocks: u64| {
        let bytes = frame_blocks.saturating_mul(128);
        if bytes > memory_bound {
            return Err(format!(
                "decoding it needs {} MiB of coefficients ({frame_blocks} blocks) for a file \
                 of {} bytes (at most {} MiB): refused as a memory bomb",
                bytes >> 20,
                jpeg.len(),
                memory_bound >> 20
            ));
        }
        Ok(())
    };
    for seg in segments {
        if is_frame(seg.code) {
            (comps, frame_blocks) = frame_blocks_of(seg.header).unwrap_or_default();
            progressive = is_progressive(seg.code);
            if progressive {
                check_memory(frame_blocks)?;
            }
            continue;
        }
        let Some(scan) = seg.scan() else { continue };
        scans += 1;
        // A sequential file buffers its frame from its second scan on (a progressive one is
        // checked at its frame).
        if scans == 2 && !progressive {
            check_memory(frame_blocks)?;
        }
        for id in scan.components {
            work += comps.iter().find(|c| c.0 == *id).map_or(0, |c| c.1);
        }
        if frame_blocks > 0 && work > MAX_WORK_PASSES * frame_blocks {
            return Err(format!(
                "its scans ask for over {MAX_WORK_PASSES} passes over its {frame_blocks} \
                 blocks (an ordinary file makes 1 to 6): refused as a decoding-work bomb"
            ));
        }
    }
    Ok(())
}

/// A start-of-frame marker (SOF0–SOF15 but DHT, JPG and DAC, which share the range).
fn is_frame(code: u8) -> bool {
    matches!(code, 0xC0..=0xCF) && !matches!(code, 0xC4 | 0xC8 | 0xCC)
}

/// A progressive frame (SOF2, SOF6, SOF10, SOF14).
fn is_progressive(code: u8) -> bool {
    matches!(code, 0xC2 | 0xC6 | 0xCA | 0xCE)
}

/// A frame header's components (id, 8×8 blocks) and their total, or `None` if it is malformed.
fn frame_blocks_of(header: &[u8]) -> Option<(Vec<(u8, u64)>, u64)> {
    let h = u64::from(u16::from_be_bytes([*header.get(1)?, *header.get(2)?]));
    let w = u64::from(u16::from_be_bytes([*header.get(3)?, *header.get(4)?]));
    let n = usize::from(*header.get(5)?);
    let specs = header.get(6..6 + 3 * n)?;
    let sampling = |k: usize| {
        (
            u64::from(specs[3 * k + 1] >> 4),
            u64::from(specs[3 * k + 1] & 15),
        )
    };
    let hmax = (0..n).map(|k| sampling(k).0).max()?.max(1);
    let vmax = (0..n).map(|k| sampling(k).1).max()?.max(1);
    let comps: Vec<(u8, u64)> = (0..n)
        .map(|k| {
            let (hs, vs) = sampling(k);
            let cw = (w * hs).div_ceil(hmax);
            let ch = (h * vs).div_ceil(vmax);
            (specs[3 * k], cw.div_ceil(8) * ch.div_ceil(8))
        })
        .collect();
    let total = comps.iter().map(|c| c.1).sum();
    Some((comps, total))
}

/// A marker segment: where it starts, its code, its header (the bytes its length covers, less
/// the length itself) and where it ends (for a scan, after its entropy-coded data).
struct Segment<'a> {
    start: usize,
    code: u8,
    header: &'a [u8],
    end: usize,
}

/// A scan header's parts this module reads.
struct Scan<'a> {
    /// The component ids it covers.
    components: Vec<&'a u8>,
    /// Spectral selection start.
    ss: u8,
    /// Successive approximation, high bit.
    ah: u8,
}

impl<'a> Segment<'a> {
    /// The scan header, for a start-of-scan segment (its size was checked by the walk).
    fn scan(&self) -> Option<Scan<'a>> {
        if self.code != 0xDA {
            return None;
        }
        let ns = usize::from(self.header[0]);
        Some(Scan {
            components: self.header[1..1 + 2 * ns].iter().step_by(2).collect(),
            ss: self.header[1 + 2 * ns],
            ah: self.header[3 + 2 * ns] >> 4,
        })
    }
}

/// The marker segments of a JPEG file after its start marker, in order, each length checked
/// against the bytes there. The walk ends at the end marker (`eoi` then holds its bytes), or
/// at the first thing it cannot walk (a stray marker, a length past the end, a scan header of
/// the wrong size, [`MAX_SEGMENTS`] markers), with `eoi` left `None`.
struct Segments<'a> {
    jpeg: &'a [u8],
    at: usize,
    walked: usize,
    done: bool,
    eoi: Option<std::ops::Range<usize>>,
}

impl<'a> Segments<'a> {
    fn new(jpeg: &'a [u8]) -> Option<Segments<'a>> {
        (jpeg.get(..2)? == [0xFF, 0xD8]).then_some(Segments {
            jpeg,
            at: 2,
            walked: 0,
            done: false,
            eoi: None,
        })
    }

    fn step(&mut self) -> Option<Segment<'a>> {
        let jpeg = self.jpeg;
        let at = self.at;
        if self.walked >= MAX_SEGMENTS {
            return None;
        }
        self.walked += 1;
        // A marker: 0xFF, fill bytes (more 0xFF), its code.
        if *jpeg.get(at)? != 0xFF {
            return None;
        }
        let mut code_at = at + 1;
        while *jpeg.get(code_at)? == 0xFF {
            code_at += 1;
        }
        let code = jpeg[code_at];
        match code {
            // End of image: done.
            0xD9 => {
                self.eoi = Some(at..code_at + 1);
                return None;
            }
            // No other marker stands alone here (restarts live inside a scan's data).
            0x00 | 0x01 | 0xD0..=0xD8 => return None,
            _ => {}
        }
        let len_at = code_at + 1;
        let len = usize::from(u16::from_be_bytes([
            *jpeg.get(len_at)?,
            *jpeg.get(len_at + 1)?,
        ]));
        if len < 2 {
            return None;
        }
        let end = len_at.checked_add(len)?;
        let header = jpeg.get(len_at + 2..end)?;
        if code != 0xDA {
            self.at = end;
            return Some(Segment {
                start: at,
                code,
                header,
                end,
            });
        }
        // A scan: its header (Ns, Ns component selectors and tables, Ss, Se, Ah|Al), then its
        // entropy-coded data up to the next marker (0xFF followed by neither a stuffed 0x00
        // nor a restart marker), or to the end of a file cut short (the walk ends there).
        let ns = usize::from(*header.first()?);
        if header.len() != 1 + 2 * ns + 3 {
            return None;
        }
        let mut next = end;
        loop {
            let Some(ff) = memchr::memchr(0xFF, jpeg.get(next..)?) else {
                next = jpeg.len();
                break;
            };
            next += ff;
            match jpeg.get(next + 1) {
                Some(0x00 | 0xD0..=0xD7) => next += 2,
                Some(_) => break,
                None => {
                    next = jpeg.len();
                    break;
                }
            }
        }
        self.at = next;
        Some(Segment {
            start: at,
            code,
            header,
            end: next,
        })
    }
}

impl<'a> Iterator for Segments<'a> {
    type Item = Segment<'a>;

    fn next(&mut self) -> Option<Segment<'a>> {
        if self.done {
            return None;
        }
        let seg = self.step();
        self.done = seg.is_none();
        seg
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A marker segment: the marker, its length, its body.
    fn seg(code: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![0xFF, code];
        v.extend_from_slice(&((body.len() + 2) as u16).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    /// A one-component scan with spectral start `ss`, high bit `ah`, and `data` after it.
    fn scan(ss: u8, se: u8, ah: u8, al: u8, data: &[u8]) -> Vec<u8> {
        let mut v = seg(0xDA, &[1, 1, 0x00, ss, se, (ah << 4) | al]);
        v.extend_from_slice(data);
        v
    }

    fn file(parts: &[Vec<u8>]) -> Vec<u8> {
        let mut v = vec![0xFF, 0xD8];
        for p in parts {
            v.extend_from_slice(p);
        }
        v.extend_from_slice(&[0xFF, 0xD9]);
        v
    }

    #[test]
    fn leaves_out_the_ac_refinement_scans_and_keeps_the_rest_in_order() {
        let tables = seg(0xC4, &[0, 1, 2, 3]);
        let frame = seg(0xC2, &[8, 0, 16, 0, 16, 1, 1, 0x11, 0]);
        // Entropy data with a stuffed 0xFF00 and a restart marker inside.
        let dc_first = scan(0, 0, 0, 1, &[0x12, 0xFF, 0x00, 0x34, 0xFF, 0xD0, 0x56]);
        let ac_first = scan(1, 63, 0, 2, &[0x78, 0x9A]);
        let ac_refine = scan(1, 63, 2, 1, &[0xBC, 0xFF, 0x00, 0xDE]);
        let dc_refine = scan(0, 0, 1, 0, &[0xF0]);
        let ac_last = scan(1, 63, 1, 0, &[0x0F, 0xFF, 0xD3, 0x11]);
        let jpeg = file(&[
            tables.clone(),
            frame.clone(),
            dc_first.clone(),
            ac_first.clone(),
            ac_refine,
            tables.clone(),
            dc_refine.clone(),
            ac_last,
        ]);
        let mut out = Vec::new();
        assert_eq!(without_ac_refinement(&jpeg, &mut out), 2);
        assert_eq!(
            out,
            file(&[tables.clone(), frame, dc_first, ac_first, tables, dc_refine])
        );
    }

    #[test]
    fn a_file_with_nothing_to_leave_out_or_that_does_not_walk_is_left_whole() {
        let frame = seg(0xC2, &[8, 0, 16, 0, 16, 1, 1, 0x11, 0]);
        let first = scan(0, 0, 0, 0, &[0x12, 0x34]);
        let refine = scan(1, 63, 1, 0, &[0x56]);
        let mut out = vec![7];
        // Nothing to leave out.
        let plain = file(&[frame.clone(), first.clone()]);
        assert_eq!(without_ac_refinement(&plain, &mut out), 0);
        assert!(out.is_empty());
        let good = file(&[frame.clone(), first.clone(), refine.clone()]);
        assert_eq!(without_ac_refinement(&good, &mut out), 1);
        // Every way of cutting it short, and lies in its lengths, leave it whole.
        for cut in 0..good.len() - 1 {
            assert_eq!(
                without_ac_refinement(&good[..cut], &mut out),
                0,
                "cut {cut}"
            );
            assert!(out.is_empty());
        }
        let mut lying = good.clone();
        let sos = lying.windows(2).rposition(|w| w == [0xFF, 0xDA]).unwrap();
        for len in [0u16, 1, 3, 200, u16::MAX] {
            lying[sos + 2..sos + 4].copy_from_slice(&len.to_be_bytes());
            assert_eq!(without_ac_refinement(&lying, &mut out), 0, "length {len}");
        }
        // Not a JPEG; a stray marker; a scan header naming more components than it holds.
        assert_eq!(without_ac_refinement(b"\x89PNG\r\n", &mut out), 0);
        let stray = file(&[
            frame.clone(),
            vec![0xFF, 0xD4],
            first.clone(),
            refine.clone(),
        ]);
        assert_eq!(without_ac_refinement(&stray, &mut out), 0);
        let mut wide = seg(0xDA, &[3, 1, 0, 0, 63, 0x10]);
        wide.push(0x55);
        assert_eq!(without_ac_refinement(&file(&[frame, wide]), &mut out), 0);
    }

    #[test]
    fn endless_markers_are_given_up_on() {
        let mut jpeg = vec![0xFF, 0xD8];
        for _ in 0..MAX_SEGMENTS + 1 {
            jpeg.extend_from_slice(&seg(0xFE, b"x"));
        }
        jpeg.extend_from_slice(&scan(1, 63, 1, 0, &[1]));
        jpeg.extend_from_slice(&[0xFF, 0xD9]);
        assert_eq!(without_ac_refinement(&jpeg, &mut Vec::new()), 0);
    }

    #[test]
    fn decoding_work_is_bounded_by_passes_over_the_frame() {
        // A 4:2:0 frame of 64×64: Y 8×8 blocks, Cb and Cr 4×4 each (96 blocks).
        let frame = seg(
            0xC2,
            &[8, 0, 64, 0, 64, 3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1],
        );
        assert_eq!(
            frame_blocks_of(&frame[4..]),
            Some((vec![(1, 64), (2, 16), (3, 16)], 96))
        );
        let dc = {
            let mut v = seg(0xDA, &[3, 1, 0, 2, 0, 3, 0, 0, 0, 0x01]);
            v.push(0x12);
            v
        };
        let y_refine = scan(1, 63, 1, 0, &[0x34]);
        // libjpeg's script's shape: a handful of passes.
        let mut parts = vec![frame.clone(), dc.clone()];
        parts.extend(std::iter::repeat_n(y_refine.clone(), 4));
        assert_eq!(check_work(&file(&parts)), Ok(()));
        // Y alone 64 blocks a scan: 96 + 64k over 16 × 96 once k > 22.
        let mut parts = vec![frame.clone(), dc.clone()];
        parts.extend(std::iter::repeat_n(y_refine.clone(), 22));
        assert_eq!(check_work(&file(&parts)), Ok(()));
        parts.push(y_refine.clone());
        let why = check_work(&file(&parts)).unwrap_err();
        assert!(why.contains("over 16 passes over its 96 blocks"), "{why}");
        // Cut short after the scan past the bound: still refused.
        let whole = file(&parts);
        assert!(check_work(&whole[..whole.len() - 3]).is_err());
        // A baseline file, something that is not a JPEG, and a frame that lies about its
        // components' count are not refused here.
        assert_eq!(check_work(&file(&[frame.clone(), dc])), Ok(()));
        assert_eq!(check_work(b"\x89PNG\r\n"), Ok(()));
        let short_frame = seg(0xC0, &[8, 0, 64, 0, 64, 3, 1, 0x22]);
        assert_eq!(check_work(&file(&[short_frame, y_refine])), Ok(()));
    }

    #[test]
    fn coefficient_memory_is_bounded_by_the_files_size() {
        // 8000×8000 at 4:4:4: 3 × 1000 × 1000 blocks, 384 MB of coefficients.
        let frame = |code| {
            seg(
                code,
                &[
                    8, 0x1F, 0x40, 0x1F, 0x40, 3, 1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1,
                ],
            )
        };
        let dc = {
            let mut v = seg(0xDA, &[3, 1, 0, 2, 0, 3, 0, 0, 0, 0x01]);
            v.push(0x12);
            v
        };
        // Progressive and a few hundred bytes: refused at its frame.
        let tiny = file(&[frame(0xC2), dc.clone()]);
        let why = check_work(&tiny).unwrap_err();
        assert!(
            why.contains("366 MiB of coefficients") && why.contains("at most 128 MiB"),
            "{why}"
        );
        // The same frame in a file of 6 MB (as a photo of that size is): decoded.
        let mut big = file(&[frame(0xC2), dc.clone()]);
        let end = big.split_off(big.len() - 2);
        big.resize(6_100_000, 0x00);
        big.extend_from_slice(&end);
        assert_eq!(check_work(&big), Ok(()));
        // Baseline, one scan: no whole-frame buffer, nothing to bound here (the pixel limit
        // applies); a second scan makes libjpeg buffer the frame.
        assert_eq!(check_work(&file(&[frame(0xC0), dc.clone()])), Ok(()));
        let two = file(&[frame(0xC0), dc.clone(), dc.clone()]);
        assert!(check_work(&two).unwrap_err().contains("memory bomb"));
        // A 12-megapixel photo at 4:4:4 (4000×3000: 562,500 blocks, 69 MiB) that compresses to
        // 900 KB (0.6 bits a pixel), as photos of a camera at quality 60 do: decoded.
        let photo = seg(
            0xC2,
            &[
                8, 0x0B, 0xB8, 0x0F, 0xA0, 3, 1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1,
            ],
        );
        let mut photo = file(&[photo, dc.clone()]);
        let end = photo.split_off(photo.len() - 2);
        photo.resize(900_000, 0x00);
        photo.extend_from_slice(&end);
        assert_eq!(check_work(&photo), Ok(()));
        // 1000×1000 progressive in a tiny file: under the floor.
        let small = seg(
            0xC2,
            &[
                8, 0x03, 0xE8, 0x03, 0xE8, 3, 1, 0x11, 0, 2, 0x11, 1, 3, 0x11, 1,
            ],
        );
        assert_eq!(check_work(&file(&[small, dc])), Ok(()));
    }
}
