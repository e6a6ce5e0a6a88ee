//! Chroma upsampling and colour conversion on the GPU, as libjpeg-turbo's default decode does
//! them: the JPEG engines decode a file's Y, Cb and Cr planes as they are stored (subsampled
//! chroma stays subsampled), and one kernel upsamples the chroma ("fancy" upsampling: a
//! triangle filter, 3/4 of the nearer sample and 1/4 of the farther, with libjpeg's rounding)
//! and converts YCbCr to RGB with libjpeg's fixed-point arithmetic, writing the planar RGB that
//! the resize kernel reads. The engines decode every file the same way then, in one batched
//! call, without `NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION` (which makes them several times
//! slower on files that are not 4:2:0).

/// The kernel: one grid layer per image; rows strided over the grid's y, columns over its x.
pub(crate) const KERNEL: &str = r#"
struct Ycc {
    const unsigned char* y;
    const unsigned char* cb;
    const unsigned char* cr;
    unsigned char* dst;
    int w, h, cw, ch, mode, pad;
};

// The chroma sample of output pixel (x, y) from a plane of cw x ch samples.
// mode 0: full resolution; 1: 2x1 fancy (4:2:2); 2: 2x2 fancy (4:2:0);
// 3: 2x1 replicated; 4: 2x2 replicated (libjpeg replicates where the plane is 2 samples wide or less);
// 5: grayscale (no chroma: the gray in all three planes, as libjpeg's gray to RGB).
__device__ __forceinline__ int chroma(const unsigned char* c, int cw, int ch, int x, int y, int mode) {
    const int odd = x & 1;
    const int i = x >> 1;
    if (mode == 0) return c[(long long)y * cw + x];
    if (mode == 3) return c[(long long)y * cw + i];
    if (mode == 4) return c[(long long)(y >> 1) * cw + i];
    const int k = odd ? min(i + 1, cw - 1) : max(i - 1, 0);
    if (mode == 1) {
        const unsigned char* r = c + (long long)y * cw;
        return (3 * r[i] + r[k] + (odd ? 2 : 1)) >> 2;
    }
    const int j = y >> 1;
    const int jn = (y & 1) ? min(j + 1, ch - 1) : max(j - 1, 0);
    const unsigned char* r0 = c + (long long)j * cw;
    const unsigned char* r1 = c + (long long)jn * cw;
    const int here = 3 * r0[i] + r1[i];
    const int there = 3 * r0[k] + r1[k];
    return (3 * here + there + (odd ? 7 : 8)) >> 4;
}

__device__ __forceinline__ unsigned char clamp8(int v) {
    return (unsigned char)min(max(v, 0), 255);
}

extern "C" __global__ void tp_ycc_rgb(const Ycc* jobs) {
    const Ycc j = jobs[blockIdx.z];
    const long long plane = (long long)j.w * j.h;
    for (int y = blockIdx.y; y < j.h; y += gridDim.y) {
        for (int x = blockIdx.x * blockDim.x + threadIdx.x; x < j.w; x += gridDim.x * blockDim.x) {
            const long long at = (long long)y * j.w + x;
            const int l = j.y[at];
            if (j.mode == 5) {
                j.dst[at] = j.dst[plane + at] = j.dst[2 * plane + at] = (unsigned char)l;
                continue;
            }
            const int cb = chroma(j.cb, j.cw, j.ch, x, y, j.mode) - 128;
            const int cr = chroma(j.cr, j.cw, j.ch, x, y, j.mode) - 128;
            // libjpeg's YCbCr -> RGB: FIX(1.402) = 91881, FIX(0.34414) = 22554,
            // FIX(0.71414) = 46802, FIX(1.772) = 116130, ONE_HALF = 32768, 16 fraction bits.
            j.dst[at] = clamp8(l + ((91881 * cr + 32768) >> 16));
            j.dst[plane + at] = clamp8(l + ((32768 - 22554 * cb - 46802 * cr) >> 16));
            j.dst[2 * plane + at] = clamp8(l + ((116130 * cb + 32768) >> 16));
        }
    }
}
"#;

/// One image's job, as the kernel reads it (`struct Ycc` above).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct YccJob {
    pub y: u64,
    pub cb: u64,
    pub cr: u64,
    pub dst: u64,
    pub w: i32,
    pub h: i32,
    pub cw: i32,
    pub ch: i32,
    pub mode: i32,
    pub pad: i32,
}

impl YccJob {
    /// The job's bytes, as the kernel's table holds them.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: YccJob is plain old data (`repr(C)`: four 8-byte fields then six 4-byte
        // ones, 56 bytes, no padding), so its bytes may be read.
        unsafe {
            std::slice::from_raw_parts((self as *const YccJob).cast(), std::mem::size_of::<Self>())
        }
    }
}

/// How an image's chroma planes relate to its luma, where the kernel converts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chroma {
    /// The kernel's `mode`.
    pub mode: i32,
    /// Each chroma plane's width and height.
    pub size: (u32, u32),
}

impl Chroma {
    /// A grayscale image of `w`×`h`: its gray in all three planes. Room is laid out for two
    /// more planes of its size, which the kernel does not read (whichever output format the
    /// engines give, they write inside the image's room).
    pub fn gray((w, h): (u32, u32)) -> Chroma {
        Chroma {
            mode: 5,
            size: (w, h),
        }
    }

    /// The layout for a `w`×`h` image whose chroma planes are `cw`×`ch` with nvJPEG's
    /// subsampling `css` (0 4:4:4, 1 4:2:2, 2 4:2:0), if the kernel converts it: the planes
    /// must be the sizes that subsampling gives (libjpeg's rounding up).
    pub fn of(css: i32, (w, h): (u32, u32), (cw, ch): (u32, u32)) -> Option<Chroma> {
        let (fx, fy) = match css {
            0 => (1, 1),
            1 => (2, 1),
            2 => (2, 2),
            _ => return None,
        };
        if (cw, ch) != (w.div_ceil(fx), h.div_ceil(fy)) {
            return None;
        }
        let mode = match (fx, fy, cw > 2) {
            (1, _, _) => 0,
            (2, 1, true) => 1,
            (2, 2, true) => 2,
            (2, 1, false) => 3,
            _ => 4,
        };
        Some(Chroma {
            mode,
            size: (cw, ch),
        })
    }
}

/// Markers read before giving up on a header.
const MAX_SEGMENTS: usize = 256;

/// Whether a three-component JPEG stores YCbCr (as libjpeg decides by default: a JFIF marker
/// says so; else an Adobe marker's transform flag, 0 meaning RGB; else component ids 'R', 'G',
/// 'B' mean RGB), from the markers before its first scan. `None` when the header cannot be
/// read that far.
pub(crate) fn stores_ycc(data: &[u8]) -> Option<bool> {
    if data.get(..2)? != [0xFF, 0xD8] {
        return None;
    }
    let (mut jfif, mut adobe, mut ids) = (false, None, None);
    let mut at = 2;
    for _ in 0..MAX_SEGMENTS {
        while *data.get(at)? == 0xFF && *data.get(at + 1)? == 0xFF {
            at += 1;
        }
        if *data.get(at)? != 0xFF {
            return None;
        }
        let marker = *data.get(at + 1)?;
        if marker == 0xDA || marker == 0xD9 {
            break;
        }
        let len = usize::from(u16::from_be_bytes([*data.get(at + 2)?, *data.get(at + 3)?]));
        let body = data.get(at + 4..at + 2 + len.max(2))?;
        match marker {
            0xE0 if body.starts_with(b"JFIF\0") => jfif = true,
            0xEE if body.starts_with(b"Adobe") && body.len() >= 12 => adobe = Some(body[11]),
            // A frame header: precision, height, width, components, then (id, sampling,
            // table) each.
            0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) && body.get(5) == Some(&3) => {
                ids = Some([*body.get(6)?, *body.get(9)?, *body.get(12)?]);
            }
            _ => {}
        }
        at += 2 + len;
    }
    Some(if jfif {
        true
    } else if let Some(t) = adobe {
        t != 0
    } else {
        ids != Some([b'R', b'G', b'B'])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A JPEG header: SOI, the given segments, a 3-component SOF0 with `ids`, SOS.
    fn header(segments: &[(u8, &[u8])], ids: [u8; 3]) -> Vec<u8> {
        let mut v = vec![0xFF, 0xD8];
        let sof = [
            8, 0, 16, 0, 16, 3, ids[0], 0x22, 0, ids[1], 0x11, 1, ids[2], 0x11, 1,
        ];
        for (m, body) in segments.iter().copied().chain([(0xC0, &sof[..])]) {
            v.extend([0xFF, m]);
            v.extend(((body.len() + 2) as u16).to_be_bytes());
            v.extend(body);
        }
        v.extend([0xFF, 0xDA, 0, 2]);
        v
    }

    #[test]
    fn tells_ycbcr_from_rgb_as_libjpeg_does() {
        let jfif: &[u8] = b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0";
        let adobe = |t: u8| {
            let mut b = b"Adobe\0\x64\0\0\0\0".to_vec();
            b.push(t);
            b
        };
        assert_eq!(stores_ycc(&header(&[], [1, 2, 3])), Some(true));
        assert_eq!(stores_ycc(&header(&[(0xE0, jfif)], [1, 2, 3])), Some(true));
        assert_eq!(stores_ycc(&header(&[], *b"RGB")), Some(false));
        // JFIF wins over the ids; an Adobe marker's flag over the ids.
        assert_eq!(stores_ycc(&header(&[(0xE0, jfif)], *b"RGB")), Some(true));
        assert_eq!(
            stores_ycc(&header(&[(0xEE, &adobe(0))], [1, 2, 3])),
            Some(false)
        );
        assert_eq!(
            stores_ycc(&header(&[(0xEE, &adobe(1))], *b"RGB")),
            Some(true)
        );
    }

    #[test]
    fn a_broken_header_is_none_never_a_panic() {
        let good = header(&[(0xE0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0")], [1, 2, 3]);
        for cut in 0..good.len() - 4 {
            // Cut before the scan: no answer, or (cut inside a segment) no panic.
            let _ = stores_ycc(&good[..cut]);
        }
        assert_eq!(stores_ycc(&good[..3]), None);
        assert_eq!(stores_ycc(b"\x89PNG\r\n"), None);
        // A length running past the end.
        assert_eq!(stores_ycc(&[0xFF, 0xD8, 0xFF, 0xE0, 0xFF, 0xFF, 0]), None);
        // A zero length does not loop.
        let mut zero = vec![0xFF, 0xD8];
        for _ in 0..300 {
            zero.extend([0xFF, 0xE1, 0, 0]);
        }
        let _ = stores_ycc(&zero);
    }

    #[test]
    fn chroma_layouts_follow_libjpegs_rounding() {
        assert_eq!(Chroma::of(0, (5, 3), (5, 3)).map(|c| c.mode), Some(0));
        assert_eq!(Chroma::of(1, (5, 3), (3, 3)).map(|c| c.mode), Some(1));
        assert_eq!(Chroma::of(2, (5, 3), (3, 2)).map(|c| c.mode), Some(2));
        // Planes two samples wide or less are replicated, as libjpeg does.
        assert_eq!(Chroma::of(1, (4, 3), (2, 3)).map(|c| c.mode), Some(3));
        assert_eq!(Chroma::of(2, (3, 3), (2, 2)).map(|c| c.mode), Some(4));
        // Sizes that do not match the subsampling, and other subsamplings: not converted.
        assert_eq!(Chroma::of(2, (5, 3), (2, 2)), None);
        assert_eq!(Chroma::of(3, (4, 4), (4, 2)), None);
        assert_eq!(Chroma::of(6, (4, 4), (0, 0)), None);
    }

    #[test]
    fn gray_images_have_a_mode_of_their_own() {
        assert_eq!(
            Chroma::gray((7, 5)),
            Chroma {
                mode: 5,
                size: (7, 5)
            }
        );
    }

    #[test]
    fn the_job_table_matches_the_kernels_struct() {
        assert_eq!(std::mem::size_of::<YccJob>(), 56);
        let j = YccJob {
            y: 1,
            cb: 2,
            cr: 3,
            dst: 4,
            w: 5,
            h: 6,
            cw: 7,
            ch: 8,
            mode: 9,
            pad: 0,
        };
        let b = j.bytes();
        assert_eq!(&b[24..32], &4u64.to_ne_bytes());
        assert_eq!(&b[32..36], &5i32.to_ne_bytes());
        assert_eq!(&b[48..52], &9i32.to_ne_bytes());
    }
}
