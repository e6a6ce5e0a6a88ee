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
    if jpeg.get(..2)? != [0xFF, 0xD8] {
        return None;
    }
    out.reserve(jpeg.len());
    out.extend_from_slice(&jpeg[..2]);
    let mut at = 2;
    let mut dropped = 0;
    for _ in 0..MAX_SEGMENTS {
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
                out.extend_from_slice(&jpeg[at..=code_at]);
                return Some(dropped);
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
            out.extend_from_slice(&jpeg[at..end]);
            at = end;
            continue;
        }
        // A scan: its header (Ns, Ns component selectors and tables, Ss, Se, Ah|Al), then its
        // entropy-coded data up to the next marker (0xFF followed by neither a stuffed 0x00
        // nor a restart marker).
        let ns = usize::from(*header.first()?);
        if header.len() != 1 + 2 * ns + 3 {
            return None;
        }
        let ss = header[1 + 2 * ns];
        let ah = header[3 + 2 * ns] >> 4;
        let mut next = end;
        loop {
            next += jpeg.get(next..)?.iter().position(|&b| b == 0xFF)?;
            match *jpeg.get(next + 1)? {
                0x00 | 0xD0..=0xD7 => next += 2,
                _ => break,
            }
        }
        if ss > 0 && ah > 0 {
            dropped += 1;
        } else {
            out.extend_from_slice(&jpeg[at..next]);
        }
        at = next;
    }
    None
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
}
