//! What kind of image a file holds, from its first markers only (a few small reads, whatever the
//! file's size): enough to send a file to the decoder that takes it — a GPU's JPEG engines take
//! 8-bit baseline JPEGs with one or three components; progressive, 12-bit or CMYK JPEGs and
//! other formats go to the CPU.

use std::io::{Read, Seek, SeekFrom};

/// How a JPEG's frame is coded (its SOF marker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    /// Sequential Huffman (SOF0 baseline, SOF1 extended).
    Sequential,
    /// Progressive Huffman (SOF2).
    Progressive,
    /// Lossless, arithmetic or hierarchical coding.
    Other,
}

/// A JPEG's frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JpegFrame {
    /// How the frame is coded.
    pub coding: Coding,
    /// Bits per sample (8 or 12).
    pub precision: u8,
    /// Colour components (1 grey, 3 YCbCr or RGB, 4 CMYK).
    pub components: u8,
    /// Width in pixels.
    pub width: u16,
    /// Height in pixels (0: given later, in a DNL marker).
    pub height: u16,
    /// How its chroma is subsampled, from the components' sampling factors.
    pub chroma: Chroma,
}

/// How a colour JPEG's chroma is subsampled against its luma (the components' sampling
/// factors in the frame header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chroma {
    /// One component: nothing but luma.
    Gray,
    /// Chroma at full resolution (nothing to upsample).
    Full,
    /// Chroma at half the width (4:2:2).
    HalfWidth,
    /// Chroma at half the width and height (4:2:0).
    Quarter,
    /// Any other layout (4:4:0, 4:1:1, components sampled unlike each other, four components).
    Other,
}

impl Chroma {
    /// The layout of components sampled `(horizontal, vertical)` as `factors` says (luma first).
    pub fn from_factors(factors: &[(u8, u8)]) -> Chroma {
        match factors {
            [_] => Chroma::Gray,
            [y, cb, cr] if cb == cr && cb.0 > 0 && cb.1 > 0 => {
                match (y.0 % cb.0, y.1 % cb.1, y.0 / cb.0, y.1 / cb.1) {
                    (0, 0, 1, 1) => Chroma::Full,
                    (0, 0, 2, 1) => Chroma::HalfWidth,
                    (0, 0, 2, 2) => Chroma::Quarter,
                    _ => Chroma::Other,
                }
            }
            _ => Chroma::Other,
        }
    }

    /// The name reports use (`4:4:4`, `4:2:2`, `4:2:0`, `gray`, `other`).
    pub fn name(self) -> &'static str {
        match self {
            Chroma::Gray => "gray",
            Chroma::Full => "4:4:4",
            Chroma::HalfWidth => "4:2:2",
            Chroma::Quarter => "4:2:0",
            Chroma::Other => "other",
        }
    }
}

impl JpegFrame {
    /// 8-bit sequential colour (three components): what the GPU producers decode on the JPEG
    /// engines. Grayscale is not plain: nvJPEG's batched decode into RGB planes does not give
    /// the image's gray in all three, so the CPU prepares those.
    pub fn is_plain(&self) -> bool {
        self.coding == Coding::Sequential && self.precision == 8 && self.components == 3
    }
}

/// Markers read before giving up on finding the frame header.
const MAX_SEGMENTS: usize = 256;

/// The frame header of the JPEG in `r`, or `None` if it is not a JPEG or its markers end (or
/// run on too long) before one. Reads only marker headers, seeking over segments.
pub fn jpeg_frame(mut r: impl Read + Seek) -> Option<JpegFrame> {
    let mut two = [0u8; 2];
    r.read_exact(&mut two).ok()?;
    if two != [0xFF, 0xD8] {
        return None;
    }
    for _ in 0..MAX_SEGMENTS {
        // A marker: 0xFF (fill bytes may repeat it), then its code.
        let mut b = [0u8; 1];
        r.read_exact(&mut b).ok()?;
        if b[0] != 0xFF {
            return None;
        }
        let mut code = 0xFF;
        while code == 0xFF {
            r.read_exact(&mut b).ok()?;
            code = b[0];
        }
        match code {
            // Standalone markers: no length.
            0x01 | 0xD0..=0xD7 => continue,
            // Scan data or the end before any frame header.
            0xD9 | 0xDA => return None,
            _ => {}
        }
        r.read_exact(&mut two).ok()?;
        let len = u16::from_be_bytes(two);
        if len < 2 {
            return None;
        }
        let coding = match code {
            0xC0 | 0xC1 => Some(Coding::Sequential),
            0xC2 => Some(Coding::Progressive),
            0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF => Some(Coding::Other),
            _ => None,
        };
        let Some(coding) = coding else {
            r.seek(SeekFrom::Current(i64::from(len) - 2)).ok()?;
            continue;
        };
        let mut h = [0u8; 6];
        if len < 8 {
            return None;
        }
        r.read_exact(&mut h).ok()?;
        let components = h[5];
        // Each component's id, sampling factors and table: read for up to four components
        // (what a JPEG may have in one scan), bounded by the segment's own length.
        let listed = usize::from(components).min(4);
        let mut factors = Vec::with_capacity(listed);
        if usize::from(len) >= 8 + 3 * listed {
            let mut c = [0u8; 3];
            for _ in 0..listed {
                r.read_exact(&mut c).ok()?;
                factors.push((c[1] >> 4, c[1] & 0x0F));
            }
        }
        let chroma = if factors.len() == usize::from(components) {
            Chroma::from_factors(&factors)
        } else {
            Chroma::Other
        };
        return Some(JpegFrame {
            coding,
            precision: h[0],
            height: u16::from_be_bytes([h[1], h[2]]),
            width: u16::from_be_bytes([h[3], h[4]]),
            components,
            chroma,
        });
    }
    None
}

/// The frame header of the JPEG file at `path` (`None`: not a JPEG, unreadable, or not a
/// regular file). Opened without blocking, so a FIFO or a device named as an input cannot stall
/// the caller.
pub fn jpeg_file_frame(path: &std::path::Path) -> Option<JpegFrame> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    jpeg_frame(std::io::BufReader::with_capacity(512, f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn jpeg(segments: &[(u8, &[u8])]) -> Vec<u8> {
        let mut v = vec![0xFF, 0xD8];
        for (code, body) in segments {
            v.extend([0xFF, *code]);
            v.extend(((body.len() + 2) as u16).to_be_bytes());
            v.extend(*body);
        }
        v.extend([0xFF, 0xDA, 0, 2]);
        v
    }

    // 8-bit, 288 high, 640 wide, 3 components: luma 2×2, chroma 1×1 (4:2:0).
    const SOF: [u8; 15] = [
        8, 0x01, 0x20, 0x02, 0x80, 3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1,
    ];

    #[test]
    fn reads_the_frame_past_other_segments() {
        // An APP1 segment (EXIF) of 60,000 bytes before the frame header.
        let app1 = vec![0u8; 60_000];
        let app1: &[u8] = &app1;
        let f = jpeg_frame(Cursor::new(jpeg(&[
            (0xE0, b"JFIF\0"),
            (0xE1, app1),
            (0xC0, &SOF),
        ])))
        .unwrap();
        assert_eq!(
            f,
            JpegFrame {
                coding: Coding::Sequential,
                precision: 8,
                components: 3,
                width: 640,
                height: 288,
                chroma: Chroma::Quarter,
            }
        );
        assert!(f.is_plain());
    }

    #[test]
    fn tells_progressive_twelve_bit_and_cmyk_apart() {
        let p = jpeg_frame(Cursor::new(jpeg(&[(0xC2, &SOF)]))).unwrap();
        assert_eq!(p.coding, Coding::Progressive);
        assert!(!p.is_plain());
        let mut twelve = SOF;
        twelve[0] = 12;
        assert!(!jpeg_frame(Cursor::new(jpeg(&[(0xC1, &twelve)])))
            .unwrap()
            .is_plain());
        let mut cmyk = SOF;
        cmyk[5] = 4;
        assert!(!jpeg_frame(Cursor::new(jpeg(&[(0xC0, &cmyk)])))
            .unwrap()
            .is_plain());
        let mut gray = SOF[..9].to_vec();
        gray[5] = 1;
        let g = jpeg_frame(Cursor::new(jpeg(&[(0xC0, &gray)]))).unwrap();
        assert_eq!(g.components, 1);
        assert_eq!(g.chroma, Chroma::Gray);
        assert!(!g.is_plain());
        assert_eq!(
            jpeg_frame(Cursor::new(jpeg(&[(0xC3, &SOF)])))
                .unwrap()
                .coding,
            Coding::Other
        );
    }

    #[test]
    fn chroma_is_read_from_the_sampling_factors() {
        let with = |y: u8, cb: u8, cr: u8| {
            let mut sof = SOF;
            (sof[7], sof[10], sof[13]) = (y, cb, cr);
            jpeg_frame(Cursor::new(jpeg(&[(0xC0, &sof)])))
                .unwrap()
                .chroma
        };
        assert_eq!(with(0x11, 0x11, 0x11), Chroma::Full);
        assert_eq!(with(0x22, 0x22, 0x22), Chroma::Full);
        assert_eq!(with(0x21, 0x11, 0x11), Chroma::HalfWidth);
        assert_eq!(with(0x22, 0x11, 0x11), Chroma::Quarter);
        assert_eq!(with(0x12, 0x11, 0x11), Chroma::Other);
        assert_eq!(with(0x41, 0x11, 0x11), Chroma::Other);
        assert_eq!(with(0x22, 0x11, 0x21), Chroma::Other);
        assert_eq!(with(0x22, 0x00, 0x00), Chroma::Other);
        // A frame header cut short of its component list: the frame is read, its chroma unknown.
        let short = jpeg_frame(Cursor::new(jpeg(&[(0xC0, &SOF[..6])]))).unwrap();
        assert_eq!((short.components, short.chroma), (3, Chroma::Other));
    }

    #[test]
    fn a_fifo_is_not_waited_on() {
        let dir = std::env::temp_dir().join(format!("tp-sniff-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("f.jpg");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(
            made.is_ok_and(|s| s.success()),
            "mkfifo (coreutils) is needed"
        );
        // No writer will ever come: a blocking open would hang, so a watchdog waits for it.
        let (tx, rx) = std::sync::mpsc::channel();
        let (f, d) = (fifo.clone(), dir.clone());
        std::thread::spawn(move || {
            let _ = tx.send((jpeg_file_frame(&f), jpeg_file_frame(&d)));
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("reading a FIFO's header hung");
        assert_eq!(got, (None, None));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn refuses_what_is_not_a_jpeg_or_ends_early() {
        assert_eq!(jpeg_frame(Cursor::new(b"\x89PNG\r\n\x1a\n".to_vec())), None);
        assert_eq!(jpeg_frame(Cursor::new(vec![0xFF, 0xD8])), None);
        assert_eq!(jpeg_frame(Cursor::new(jpeg(&[(0xE0, b"JFIF\0")]))), None);
        // A segment whose length runs past the end.
        assert_eq!(
            jpeg_frame(Cursor::new(vec![0xFF, 0xD8, 0xFF, 0xE0, 0xFF, 0xFF, 0])),
            None
        );
        // A length below its own two bytes.
        assert_eq!(
            jpeg_frame(Cursor::new(vec![0xFF, 0xD8, 0xFF, 0xE0, 0, 1])),
            None
        );
        // Garbage where a marker should be.
        assert_eq!(jpeg_frame(Cursor::new(vec![0xFF, 0xD8, 0x00, 0x00])), None);
    }
}
